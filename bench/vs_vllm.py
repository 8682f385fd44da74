"""radixmux against vLLM CPU, measured by vLLM's own benchmark client on vLLM's datasets.

The client is ``vllm bench serve`` (vLLM 0.32, from the peer venv that
``bench/peers.py`` installs), so the load, the prompts and the figures are
vLLM's, not ours. It drives, one server at a time:

``radixmux``
    ``launch.py --model smollm2 --dtype bfloat16`` (plus ``--server-args``),
    started, warmed up and stopped by ``compare.py``'s helpers;
``vllm``
    vLLM's OpenAI server on the same HF folder, bfloat16, prefix caching on,
    started and stopped by ``peers.py``.

Both get the same KV bytes (``--kv-bytes``). Each server is warmed up once
(bench_serving's short unrelated prompts) and then serves every run of the
grid: vLLM's ``prefix_repetition`` dataset (4 random prefixes of 1,000 tokens,
each request adding 100 random tokens, 32 output tokens) and its ``random``
dataset (512 random input tokens, 32 output tokens), at concurrency 1, 4 and
16, always ``--ignore-eos`` and greedy (``--temperature 0``). A run's seed
depends on its dataset and concurrency only: both engines get the same
prompts, and no run reuses an earlier run's prefixes on the same server.

Prints one table (req/s, output tok/s, TTFT p50, TPOT p50 per engine and the
radixmux/vLLM ratios), checks the goal per row (radixmux output throughput >=
1.2x vLLM's on prefix_repetition and >= 1.0x on random, TPOT p50 <= vLLM's,
TTFT p50 lower) and writes a JSON and a PNG under ``bench/results/`` (vLLM's
own result files and every log beside them, in ``<stem>-logs/``).

    .venv/bin/python -m bench.vs_vllm [--quick]
    .venv/bin/python -m bench.vs_vllm --engines radixmux --server-args "--chunked-prefill-size 256"
    .venv/bin/python -m bench.vs_vllm --server-args "" --server-args "--max-running-requests 32"

``--sweep N`` runs, instead of the grid, N shapes drawn from ``--sweep-seed``
over the issue's ranges (concurrency 1-64, prompts 128-4,000 tokens, outputs
16-512, both datasets; the rules in ``bench/vs_vllm_sweep.py``), each a row
of its own, judged against the sweep's goals (>= 1.5x vLLM's output tok/s on
prefix_repetition, >= 1.2x on random, TPOT and TTFT p50 not above vLLM's),
and reports the worst row per ratio besides the table; the JSON's ``sweep``
holds the drawn shapes and the worst rows, the PNG each row's ratios:

    .venv/bin/python -m bench.vs_vllm --sweep 16 --sweep-seed 1 --interleave 1

``--server-args`` may be repeated: each string is one radixmux configuration
(a lone flag without a value needs the ``=`` form: ``--server-args=--disable-radix-cache``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import compare, peers
from bench.bench_disk_tier import kv_bytes_per_token
from bench.bench_serving import (
    RESULTS_DIR,
    BenchConfig,
    Snapshot,
    resolve_tokenizer,
    run_sessions,
    scrape_servers,
    vocabulary_words,
    warmup_sessions,
    write_json,
)
from bench.server_process import ServerFailed, free_port
from bench.verdicts import verdict_line, verdict_of
from bench.vs_vllm_sweep import (
    ShapeLimits,
    SweepShape,
    draw_shapes,
    format_sweep,
    plot_ratios,
    worst_rows,
)

ROOT = Path(__file__).resolve().parents[1]

CONCURRENCIES = (1, 4, 16)
CLIENT_TIMEOUT_S = 1800.0
# Nothing may reach a model hub: the tokenizer and weights are local folders.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# aiohttp (vLLM's client) honours proxy variables; localhost must never go through one.
NO_PROXY_ENV = {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


# ---- the grid -------------------------------------------------------------------------
@dataclass(frozen=True)
class Dataset:
    """One of vLLM's datasets, its client parameters and the issue's throughput goal on it."""

    name: str  # the row's name (also --dataset-name unless ``client_name`` says otherwise)
    params: dict[str, float]  # client flags without "--", e.g. {"random-input-len": 512}
    throughput_goal: float  # radixmux output tok/s over vLLM's, at least
    # Prompts per concurrency: each full run takes about a minute on 2 cores
    # (estimates; vLLM's JSON records each run's duration to re-size them).
    prompts: dict[int, int]
    quick_prompts: dict[int, int]
    client_name: str = ""  # vLLM's --dataset-name when it differs from ``name``
    # The run seed's dataset digit (``run_seed``): a sweep shape's own; None: the
    # dataset's place in DATASETS.
    seed_slot: int | None = None

    @property
    def args(self) -> list[str]:
        return [
            "--dataset-name",
            self.client_name or self.name,
            *(a for k, v in self.params.items() for a in (f"--{k}", str(v))),
        ]

    @property
    def slot(self) -> int:
        """This dataset's part of ``run_seed``: distinct for every dataset of a run."""
        return list(DATASETS).index(self.name) if self.seed_slot is None else self.seed_slot

    def num_prompts(self, concurrency: int, quick: bool) -> int:
        """Prompts of one run: the table's, or 4 per client (1 when quick) off the table."""
        table = self.quick_prompts if quick else self.prompts
        return table.get(concurrency, concurrency * (1 if quick else 4))


DATASETS: dict[str, Dataset] = {
    d.name: d
    for d in (
        Dataset(
            "prefix_repetition",
            {
                "prefix-repetition-prefix-len": 1000,
                "prefix-repetition-suffix-len": 100,
                "prefix-repetition-num-prefixes": 4,
                "prefix-repetition-output-len": 32,
            },
            1.2,
            # Multiples of the 4 prefixes: vLLM sends num_prompts // 4 per prefix.
            {1: 64, 4: 128, 16: 256},
            {1: 4, 4: 8, 16: 16},
        ),
        Dataset(
            "random",
            {"random-input-len": 512, "random-output-len": 32},
            1.0,
            {1: 48, 4: 96, 16: 160},
            {1: 2, 4: 8, 16: 16},
        ),
        # Shapes beyond the grid (``--datasets``; not run by default), so a
        # change is also seen on loads nobody tuned for: decode-heavy (short
        # prompts, long answers of varied length) and prefill-heavy (long prompts,
        # short answers), vLLM's random dataset both.
        Dataset(
            "random_long_out",
            {"random-input-len": 128, "random-output-len": 256, "random-range-ratio": 0.5},
            1.0,
            {1: 12, 4: 32, 16: 64},
            {1: 1, 4: 4, 16: 16},
            client_name="random",
        ),
        Dataset(
            "random_long_in",
            {"random-input-len": 2000, "random-output-len": 16, "random-range-ratio": 0.25},
            1.0,
            {1: 24, 4: 32, 16: 48},
            {1: 1, 4: 4, 16: 16},
            client_name="random",
        ),
    )
}
# The grid: what a plain run measures and judges.
DEFAULT_DATASETS = ("prefix_repetition", "random")


@dataclass(frozen=True)
class Engine:
    """One server configuration: radixmux with some flags, or vLLM."""

    kind: str  # "radixmux" or "vllm"
    server_args: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return " ".join([self.kind, *self.server_args])


def run_seed(base: int, dataset: Dataset, concurrency: int, round_: int = 0) -> int:
    """The client's seed of one run: the same for every engine, different for every run
    (and every round of ``--interleave``, so no round reuses another's prefixes)."""
    return base + 100_000 * round_ + 1000 * dataset.slot + concurrency


# Sweep shapes take the seed slots after DATASETS', below the next round's seeds.
MAX_SWEEP = 100 - len(DATASETS)


def sweep_dataset(shape: SweepShape) -> Dataset:
    """One drawn shape as a dataset of its own, run at the shape's concurrency."""
    if shape.dataset == "prefix_repetition":
        params = {
            "prefix-repetition-prefix-len": shape.prefix_len,
            "prefix-repetition-suffix-len": shape.suffix_len,
            "prefix-repetition-num-prefixes": shape.num_prefixes,
            "prefix-repetition-output-len": shape.output_len,
        }
    else:
        params = {"random-input-len": shape.prompt_len, "random-output-len": shape.output_len}
    return Dataset(
        shape.name,
        params,
        shape.throughput_goal,
        {shape.concurrency: shape.num_prompts},
        {shape.concurrency: shape.quick_prompts},
        client_name=shape.dataset,
        seed_slot=len(DATASETS) + shape.index,
    )


# ---- results --------------------------------------------------------------------------
@dataclass
class RunResult:
    """One client run against one engine, from vLLM's result JSON (or why it has none)."""

    dataset: str
    concurrency: int
    engine: str
    num_prompts: int
    completed: int = 0
    failed: int = 0
    duration_s: float = 0.0
    request_throughput: float = 0.0
    output_throughput: float = 0.0
    total_input_tokens: int = 0
    total_output_tokens: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    e2el_p50_ms: float | None = None
    hit_rate: float | None = None  # prompt tokens served from cache, from /metrics
    error_samples: list[str] = field(default_factory=list)
    result_file: str = ""
    unavailable: str | None = None
    round: int = 0  # --interleave round; -1 for the median over rounds

    @property
    def ok(self) -> bool:
        """Measured, and every request succeeded (a figure with failures proves nothing)."""
        return self.unavailable is None and self.failed == 0 and self.completed > 0

    @classmethod
    def from_vllm(
        cls, data: dict[str, Any], dataset: str, concurrency: int, engine: str
    ) -> RunResult:
        """Read what ``vllm bench serve --save-result`` wrote."""
        errors = [e for e in data.get("errors") or [] if e]

        def ms(key: str) -> float | None:
            value = data.get(key)
            return None if value is None else float(value)

        return cls(
            dataset=dataset,
            concurrency=concurrency,
            engine=engine,
            num_prompts=int(data.get("num_prompts") or 0),
            completed=int(data.get("completed") or 0),
            failed=int(data.get("failed") or 0),
            duration_s=float(data.get("duration") or 0.0),
            request_throughput=float(data.get("request_throughput") or 0.0),
            output_throughput=float(data.get("output_throughput") or 0.0),
            total_input_tokens=int(data.get("total_input_tokens") or 0),
            total_output_tokens=int(data.get("total_output_tokens") or 0),
            ttft_p50_ms=ms("median_ttft_ms"),
            ttft_p99_ms=ms("p99_ttft_ms"),
            tpot_p50_ms=ms("median_tpot_ms"),
            tpot_p99_ms=ms("p99_tpot_ms"),
            itl_p50_ms=ms("median_itl_ms"),
            e2el_p50_ms=ms("median_e2el_ms"),
            # The same error for many requests is one finding.
            error_samples=sorted({e.strip()[-400:] for e in errors})[:5],
        )


@dataclass
class Verdict:
    """One radixmux configuration against vLLM on one (dataset, concurrency)."""

    dataset: str
    concurrency: int
    engine: str
    throughput_ratio: float  # radixmux / vLLM output tok/s
    request_ratio: float  # radixmux / vLLM req/s
    ttft_ratio: float  # radixmux / vLLM TTFT p50 (below 1 is better)
    tpot_ratio: float  # radixmux / vLLM TPOT p50 (at most 1 is the goal)
    throughput_goal: float
    passed: bool | None  # None: a side did not run cleanly
    misses: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return verdict_of(self.passed)

    def to_json(self) -> dict[str, Any]:
        """As a dict, a ratio that could not be taken as None (NaN is not JSON)."""
        out = dataclasses.asdict(self)
        for k, v in out.items():
            if isinstance(v, float) and math.isnan(v):
                out[k] = None
        return out | {"verdict": self.verdict}


def _ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or b <= 0:
        return math.nan
    return a / b


def judge(ours: RunResult, vllm: RunResult, goal: float) -> Verdict:
    """The issue's goal on one row: throughput >= ``goal`` x vLLM, TPOT p50 <= vLLM's,
    TTFT p50 below vLLM's."""
    # A run that never happened has no figures to divide (its zeros are not data).
    both = ours.unavailable is None and vllm.unavailable is None

    def ratio(key: str) -> float:
        return _ratio(getattr(ours, key), getattr(vllm, key)) if both else math.nan

    v = Verdict(
        dataset=ours.dataset,
        concurrency=ours.concurrency,
        engine=ours.engine,
        throughput_ratio=ratio("output_throughput"),
        request_ratio=ratio("request_throughput"),
        ttft_ratio=ratio("ttft_p50_ms"),
        tpot_ratio=ratio("tpot_p50_ms"),
        throughput_goal=goal,
        passed=None,
    )
    if not (ours.ok and vllm.ok):
        bad = [r for r in (ours, vllm) if not r.ok]
        v.misses = [f"{r.engine}: {r.unavailable or f'{r.failed} failed requests'}" for r in bad]
        return v
    if not v.throughput_ratio >= goal:
        v.misses.append(f"out tok/s {v.throughput_ratio:.2f}x < {goal:.1f}x")
    if not v.tpot_ratio <= 1.0:
        v.misses.append(f"TPOT p50 {v.tpot_ratio:.2f}x vLLM's")
    if not v.ttft_ratio < 1.0:
        v.misses.append(f"TTFT p50 {v.ttft_ratio:.2f}x vLLM's (not lower)")
    v.passed = not v.misses
    return v


_MEDIAN_FIELDS = (
    "duration_s",
    "request_throughput",
    "output_throughput",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "itl_p50_ms",
    "e2el_p50_ms",
    "hit_rate",
)


def median_over_rounds(results: Sequence[RunResult]) -> list[RunResult]:
    """One RunResult per (dataset, concurrency, engine): each figure the median of its
    rounds (``round = -1``); unavailable if any round was (a partial median proves little)."""
    groups: dict[tuple[str, int, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.dataset, r.concurrency, r.engine), []).append(r)
    out = []
    for (ds, c, eng), runs in groups.items():
        agg = RunResult(ds, c, eng, sum(r.num_prompts for r in runs), round=-1)
        bad = [r for r in runs if r.unavailable is not None]
        if bad:
            agg.unavailable = bad[0].unavailable
            out.append(agg)
            continue
        agg.completed = sum(r.completed for r in runs)
        agg.failed = sum(r.failed for r in runs)
        agg.total_input_tokens = sum(r.total_input_tokens for r in runs)
        agg.total_output_tokens = sum(r.total_output_tokens for r in runs)
        agg.error_samples = sorted({e for r in runs for e in r.error_samples})[:5]
        for name in _MEDIAN_FIELDS:
            values = [getattr(r, name) for r in runs if getattr(r, name) is not None]
            setattr(agg, name, float(statistics.median(values)) if values else None)
        out.append(agg)
    return out


def judge_all(
    results: Sequence[RunResult], datasets: Mapping[str, Dataset] = DATASETS
) -> list[Verdict]:
    """A verdict for every radixmux run that has a vLLM run of the same row
    (``datasets`` holds each row's dataset and goal)."""
    vllm = {(r.dataset, r.concurrency): r for r in results if r.engine == "vllm"}
    out = []
    for r in results:
        peer = vllm.get((r.dataset, r.concurrency))
        if r.engine.startswith("radixmux") and peer is not None:
            out.append(judge(r, peer, datasets[r.dataset].throughput_goal))
    return out


# ---- output ---------------------------------------------------------------------------
def _num(x: float | None, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _x(x: float) -> str:
    return _num(x, ".2f") + "x" if not math.isnan(x) else "n/a"


def format_table(results: Sequence[RunResult], verdicts: Sequence[Verdict]) -> str:
    """Runs grouped by (dataset, concurrency), each group followed by its ratio rows."""
    head = (
        f"{'dataset':<17} {'conc':>4} {'engine':<30} {'req/s':>7} {'out tok/s':>9} "
        f"{'TTFT p50 ms':>11} {'TPOT p50 ms':>11} {'hit':>6} {'fail':>4}  goal"
    )
    lines = [head, "-" * len(head)]
    rows = list(dict.fromkeys((r.dataset, r.concurrency) for r in results))
    for ds, c in rows:
        for r in (r for r in results if (r.dataset, r.concurrency) == (ds, c)):
            if r.unavailable is not None:
                lines.append(f"{ds:<17} {c:>4} {r.engine[:30]:<30} unavailable: {r.unavailable}")
                continue
            hit = "n/a" if r.hit_rate is None else f"{r.hit_rate:.0%}"
            lines.append(
                f"{ds:<17} {c:>4} {r.engine[:30]:<30} {r.request_throughput:>7.2f} "
                f"{r.output_throughput:>9.1f} {_num(r.ttft_p50_ms, '.0f'):>11} "
                f"{_num(r.tpot_p50_ms, '.1f'):>11} {hit:>6} {r.failed:>4}"
            )
        for v in (v for v in verdicts if (v.dataset, v.concurrency) == (ds, c)):
            name = f"= {v.engine} / vllm"
            why = f" ({'; '.join(v.misses)})" if v.misses else ""
            lines.append(
                f"{'':<17} {'':>4} {name[:30]:<30} {_x(v.request_ratio):>7} "
                f"{_x(v.throughput_ratio):>9} {_x(v.ttft_ratio):>11} {_x(v.tpot_ratio):>11} "
                f"{'':>6} {'':>4}  {v.verdict}{why}"
            )
    return "\n".join(lines)


def format_goals(verdicts: Sequence[Verdict]) -> str:
    """One PASS/MISS line per compared row."""
    lines = []
    for v in verdicts:
        goal = f"out tok/s >= {v.throughput_goal:.1f}x, TPOT p50 <= 1x, TTFT p50 < 1x"
        measured = f"{_x(v.throughput_ratio)}, TPOT {_x(v.tpot_ratio)}, TTFT {_x(v.ttft_ratio)}"
        lines.append(
            verdict_line(v.passed, f"{v.dataset} c={v.concurrency} {v.engine}: {measured} ({goal})")
        )
    return "\n".join(lines)


def plot(results: Sequence[RunResult], path: Path) -> Path | None:
    """Per dataset (a row of panels): output tok/s, TTFT p50 and TPOT p50 by
    concurrency, one bar per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if r.unavailable is None and r.completed]
    if not ran:
        return None
    datasets = list(dict.fromkeys(r.dataset for r in ran))
    engines = list(dict.fromkeys(r.engine for r in ran))
    panels = (
        ("output tok/s", lambda r: r.output_throughput, False),
        ("TTFT p50 (ms, log)", lambda r: r.ttft_p50_ms or 0.0, True),
        ("TPOT p50 (ms)", lambda r: r.tpot_p50_ms or 0.0, False),
    )
    fig, axes = plt.subplots(
        len(datasets), len(panels), figsize=(13, 3.6 * len(datasets)), squeeze=False
    )
    width = 0.8 / len(engines)
    for i, ds in enumerate(datasets):
        concs = sorted({r.concurrency for r in ran if r.dataset == ds})
        for j, (title, value, log) in enumerate(panels):
            ax = axes[i][j]
            for k, eng in enumerate(engines):
                by_c = {r.concurrency: value(r) for r in ran if (r.dataset, r.engine) == (ds, eng)}
                xs = [n + (k - (len(engines) - 1) / 2) * width for n in range(len(concs))]
                ax.bar(xs, [by_c.get(c, 0.0) for c in concs], width=width, label=eng)
            ax.set_xticks(range(len(concs)), [f"c={c}" for c in concs])
            ax.set_title(f"{ds}: {title}", fontsize=10)
            if log:
                ax.set_yscale("log")  # queueing spreads TTFT over orders of magnitude
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- servers --------------------------------------------------------------------------
@dataclass(frozen=True)
class Endpoint:
    """A running server: where it answers and the model name it serves."""

    base_url: str
    served_model: str


@dataclass(frozen=True)
class Options:
    """What every run of one invocation shares."""

    model: str  # short name or HF folder
    dtype: str
    kv_bytes: int
    seed: int
    temperature: float
    quick: bool
    logs: Path
    vllm_args: tuple[str, ...] = ()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


@contextlib.contextmanager
def serving(engine: Engine, opts: Options) -> Iterator[Endpoint]:
    """Start ``engine``'s server, yield once it answers, stop it after.

    Raises ServerFailed or peers.PeerUnavailable when it cannot start.
    """
    name = peers.served_name(opts.model)
    if engine.kind == "radixmux":
        args = [
            "--model", opts.model,
            "--dtype", opts.dtype,
            "--kv-cache-bytes", str(opts.kv_bytes),
            *engine.server_args,
        ]  # fmt: skip
        with compare.radixmux(args, opts.logs / f"server-{_slug(engine.label)}.log") as server:
            yield Endpoint(server.base_url, name)
    elif engine.kind == "vllm":
        extra = [*opts.vllm_args, *engine.server_args]
        with peers.start_peer(
            "vllm", opts.model, free_port(), opts.dtype, opts.kv_bytes, extra_args=extra
        ) as server:
            yield Endpoint(server.base_url, server.served_model)
    else:
        raise ValueError(f"unknown engine {engine.kind!r}")


async def _warm_up(endpoint: Endpoint, tokenizer: str, requests: int, seed: int) -> None:
    # bench_serving's warm-up: short prompts of their own seed, all at once, so
    # first-call costs (allocations, kernel loads, batch shapes) are paid
    # before measuring, without caching anything a run will ask for.
    words = vocabulary_words(str(resolve_tokenizer(tokenizer)))
    cfg = BenchConfig(base_url=endpoint.base_url, models=[endpoint.served_model], progress=False)
    sessions = warmup_sessions(words, [endpoint.served_model], requests, seed)
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        records, _ = await run_sessions(client, cfg, sessions, False)
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise ServerFailed(f"warm-up requests failed: {failed[:3]}")


def warm_up(endpoint: Endpoint, tokenizer: str, requests: int, seed: int) -> None:
    """Send ``requests`` short unrelated requests at once; raise ServerFailed if any fails."""
    asyncio.run(_warm_up(endpoint, tokenizer, requests, seed))


async def _snapshot(endpoint: Endpoint) -> Snapshot:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        return await scrape_servers(client, [endpoint.base_url], [endpoint.served_model])


def hit_rate(before: Snapshot, after: Snapshot) -> float | None:
    """Prompt tokens served from cache over those looked up, between two /metrics snapshots."""
    if before.hits is None or after.hits is None:
        return None
    queried = sum(q for q, _ in after.hits.values()) - sum(q for q, _ in before.hits.values())
    matched = sum(m for _, m in after.hits.values()) - sum(m for _, m in before.hits.values())
    return matched / queried if queried > 0 else None


# ---- the client -----------------------------------------------------------------------
def client_args(
    endpoint: Endpoint,
    tokenizer: Path,
    dataset: Dataset,
    concurrency: int,
    num_prompts: int,
    seed: int,
    temperature: float,
    result: Path,
) -> list[str]:
    """``vllm bench serve``'s arguments for one run (vLLM 0.32's CLI)."""
    return [
        "bench", "serve",
        "--backend", "openai",
        "--endpoint", "/v1/completions",
        "--base-url", endpoint.base_url,
        "--model", endpoint.served_model,
        "--tokenizer", str(tokenizer),
        *dataset.args,
        "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency),
        "--request-rate", "inf",
        "--ignore-eos",
        # Since 0.11 the client sends no temperature unless asked (the server's
        # default then samples); greedy is what every other benchmark here runs.
        "--temperature", str(temperature),
        "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--save-result",
        # Keeps each request's error text, which is what tells why a run failed.
        "--save-detailed",
        "--result-dir", str(result.parent),
        "--result-filename", result.name,
        "--disable-tqdm",
    ]  # fmt: skip


def run_client(args: Sequence[str], result: Path, log: Path, timeout: float) -> dict[str, Any]:
    """Run vLLM's CLI with ``args``; return the JSON it saved at ``result``.

    Raises RuntimeError with the log's tail when it fails or saves nothing.
    """
    cmd = peers.vllm_cli_command(args)
    log.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    with log.open("w") as fh:
        fh.write(f"# {' '.join(cmd)}\n")
        fh.flush()
        try:
            rc = subprocess.run(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **OFFLINE_ENV, **NO_PROXY_ENV},
                cwd=str(ROOT),
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    if rc != 0 or not result.is_file():
        tail = " | ".join(log.read_text(errors="replace").splitlines()[-12:])
        raise RuntimeError(f"vllm bench serve exited {rc} (log {log}): {tail}")
    return json.loads(result.read_text())


def measure(
    engine: Engine,
    endpoint: Endpoint,
    dataset: Dataset,
    concurrency: int,
    opts: Options,
    num_prompts: int | None,
    round_: int = 0,
) -> RunResult:
    """One client run against a running server; failures are recorded, never raised."""
    n = num_prompts or dataset.num_prompts(concurrency, opts.quick)
    stem = _slug(
        f"{engine.label}-{dataset.name}-c{concurrency}" + (f"-r{round_}" if round_ else "")
    )
    result = opts.logs / f"{stem}.json"
    args = client_args(
        endpoint,
        peers.hf_folder(opts.model),
        dataset,
        concurrency,
        n,
        run_seed(opts.seed, dataset, concurrency, round_),
        opts.temperature,
        result,
    )
    before = asyncio.run(_snapshot(endpoint))
    try:
        data = run_client(args, result, opts.logs / f"{stem}.log", CLIENT_TIMEOUT_S)
    except (RuntimeError, peers.PeerUnavailable) as exc:
        return RunResult(dataset.name, concurrency, engine.label, n, unavailable=str(exc))
    out = RunResult.from_vllm(data, dataset.name, concurrency, engine.label)
    out.hit_rate = hit_rate(before, asyncio.run(_snapshot(endpoint)))
    out.result_file = str(result)
    out.round = round_
    return out


def progress_line(r: RunResult) -> str:
    """One line per run, for the terminal."""
    head = f"[vs_vllm] {r.engine} {r.dataset} c={r.concurrency} n={r.num_prompts}"
    if r.round > 0:
        head += f" round {r.round}"
    if r.unavailable is not None:
        return f"{head}: FAILED: {r.unavailable[:400]}"
    hit = "n/a" if r.hit_rate is None else f"{r.hit_rate:.0%}"
    errs = f"; errors: {r.error_samples[0][:200]!r}" if r.error_samples else ""
    return (
        f"{head}: {r.duration_s:.1f} s, {r.request_throughput:.2f} req/s, "
        f"{r.output_throughput:.1f} out tok/s, TTFT p50 {_num(r.ttft_p50_ms, '.0f')} ms, "
        f"TPOT p50 {_num(r.tpot_p50_ms, '.1f')} ms, hit {hit}, failed {r.failed}{errs}"
    )


# A row: one dataset at one concurrency (the grid's product, or one sweep shape).
Row = tuple[Dataset, int]


def grid_rows(datasets: Sequence[Dataset], concurrencies: Sequence[int]) -> list[Row]:
    """Every dataset at every concurrency, dataset by dataset."""
    return [(ds, c) for ds in datasets for c in concurrencies]


def _warm_up_requests(rows: Sequence[Row]) -> int:
    return 2 * max(c for _, c in rows)


def run_engine(
    engine: Engine, rows: Sequence[Row], opts: Options, num_prompts: int | None
) -> list[RunResult]:
    """Start one server, warm it up, run every row against it, stop it."""
    print(f"[vs_vllm] {engine.label}: starting", file=sys.stderr, flush=True)
    results: list[RunResult] = []
    try:
        with serving(engine, opts) as endpoint:
            warm_up(endpoint, opts.model, _warm_up_requests(rows), opts.seed)
            for ds, c in rows:
                r = measure(engine, endpoint, ds, c, opts, num_prompts)
                print(progress_line(r), file=sys.stderr, flush=True)
                results.append(r)
    except (ServerFailed, peers.PeerUnavailable) as exc:
        why = f"server did not start: {exc}"
        print(f"[vs_vllm] {engine.label}: {why[:600]}", file=sys.stderr, flush=True)
        done = {(r.dataset, r.concurrency) for r in results}
        results += [
            RunResult(ds.name, c, engine.label, 0, unavailable=why)
            for ds, c in rows
            if (ds.name, c) not in done
        ]
    return results


def run_interleaved(
    engines: Sequence[Engine],
    rows: Sequence[Row],
    opts: Options,
    num_prompts: int | None,
    rounds: int,
) -> list[RunResult]:
    """Every server up at once (an idle one only waits on its socket); each row
    runs on every engine back to back, the engine order turning each round, so
    that minutes-long swings of a shared machine's speed fall on every engine alike."""
    results: list[RunResult] = []
    with contextlib.ExitStack() as stack:
        endpoints: dict[Engine, Endpoint] = {}
        for engine in engines:
            print(f"[vs_vllm] {engine.label}: starting", file=sys.stderr, flush=True)
            try:
                endpoints[engine] = stack.enter_context(serving(engine, opts))
                warm_up(endpoints[engine], opts.model, _warm_up_requests(rows), opts.seed)
            except (ServerFailed, peers.PeerUnavailable) as exc:
                why = f"server did not start: {exc}"
                print(f"[vs_vllm] {engine.label}: {why[:600]}", file=sys.stderr, flush=True)
                results += [
                    RunResult(ds.name, c, engine.label, 0, unavailable=why, round=r)
                    for r in range(rounds)
                    for ds, c in rows
                ]
        live = [e for e in engines if e in endpoints]
        for r in range(rounds):
            order = live[r % len(live) :] + live[: r % len(live)] if live else []
            for ds, c in rows:
                for engine in order:
                    res = measure(engine, endpoints[engine], ds, c, opts, num_prompts, r)
                    print(progress_line(res), file=sys.stderr, flush=True)
                    results.append(res)
    return results


# ---- CLI ------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--engines", nargs="+", choices=("radixmux", "vllm"), default=["radixmux", "vllm"]
    )
    p.add_argument("--datasets", nargs="+", choices=list(DATASETS), default=list(DEFAULT_DATASETS))
    p.add_argument("--concurrency", nargs="+", type=int, default=list(CONCURRENCIES))
    p.add_argument("--quick", action="store_true", help="a few prompts per run (smoke test)")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts of every run")
    p.add_argument("--model", default="smollm2", help="short name or HF folder")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument(
        "--kv-bytes", type=int, default=1 << 30, help="KV cache bytes of each engine (the same)"
    )
    p.add_argument(
        "--server-args",
        action="append",
        default=None,
        help='extra radixmux flags, one string; repeat for several configurations ("" = none)',
    )
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags, one string")
    p.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="start every server at once and run each row on every engine back to back, "
        "ROUNDS times (engine order turning); figures are medians over rounds",
    )
    p.add_argument(
        "--sweep",
        type=int,
        default=0,
        metavar="N",
        help="instead of the grid, N shapes drawn from --sweep-seed over the issue's ranges "
        f"(bench/vs_vllm_sweep.py; at most {MAX_SWEEP}); reports every row and the worst; "
        "--datasets and --concurrency do not apply, --num-prompts overrides the sweep's rule",
    )
    p.add_argument(
        "--sweep-seed", type=int, default=0, help="the seed the sweep's shapes are drawn from"
    )
    p.add_argument(
        "--sweep-rows",
        type=int,
        nargs="+",
        default=None,
        metavar="I",
        help="run only these of the drawn shapes (0-based), to rerun one row",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path; the PNG goes beside it")
    args = p.parse_args(argv)
    if not 0 <= args.sweep <= MAX_SWEEP:
        p.error(f"--sweep takes 1 to {MAX_SWEEP} shapes")
    if args.sweep_rows and not all(0 <= i < args.sweep for i in args.sweep_rows):
        p.error(f"--sweep-rows takes indices below --sweep ({args.sweep})")
    return args


def shape_limits(model: str, dtype: str, kv_bytes: int) -> ShapeLimits:
    """The model's context and the tokens ``kv_bytes`` hold, from its config.json."""
    folder = peers.hf_folder(model)
    config = json.loads((folder / "config.json").read_text())
    context = config.get("text_config", config)["max_position_embeddings"]
    return ShapeLimits(context, kv_bytes // kv_bytes_per_token(str(folder), dtype))


def engines_of(args: argparse.Namespace) -> list[Engine]:
    """radixmux once per ``--server-args`` string (once when none), then vLLM."""
    out = []
    if "radixmux" in args.engines:
        for flags in args.server_args or [""]:
            out.append(Engine("radixmux", tuple(flags.split())))
    if "vllm" in args.engines:
        out.append(Engine("vllm"))
    return out


def sweep_shapes(args: argparse.Namespace, limits: ShapeLimits) -> list[SweepShape]:
    """The sweep's drawn shapes, or those of them ``--sweep-rows`` names (a row
    rerun alone is the same shape, seed and prompts as in the whole sweep)."""
    shapes = draw_shapes(args.sweep, args.sweep_seed, limits)
    if args.sweep_rows is None:
        return shapes
    keep = set(args.sweep_rows)
    return [s for s in shapes if s.index in keep]


def sweep_json(
    shapes: Sequence[SweepShape],
    limits: ShapeLimits | None,
    seed: int,
    verdicts: Sequence[Verdict],
) -> dict[str, Any]:
    """The sweep's part of the JSON: what the shapes were drawn from, every shape, the
    worst rows (each row's figures are in ``runs`` and ``verdicts`` under its name)."""
    return {
        "seed": seed,
        "limits": dataclasses.asdict(limits) if limits else None,
        "shapes": [dataclasses.asdict(s) | {"name": s.name} for s in shapes],
        "worst": [
            {"metric": w.metric, "ratio": w.ratio, "engine": w.row.engine, "row": w.row.dataset}
            for w in worst_rows(shapes, verdicts)
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM (a job runner's stop) unwinds like Ctrl-C, through the code
    # that stops the servers; by default it would leave them running.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # Every process started from here (servers, client) stays off the hub.
    os.environ.update(OFFLINE_ENV)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    out = args.out or RESULTS_DIR / f"vs_vllm-{stamp}.json"
    opts = Options(
        model=args.model,
        dtype=args.dtype,
        kv_bytes=args.kv_bytes,
        seed=args.seed,
        temperature=args.temperature,
        quick=args.quick,
        logs=out.parent / f"{out.stem}-logs",
        vllm_args=tuple(args.vllm_args.split()),
    )
    try:
        # The client is vLLM's, so even a radixmux-only run needs the peer venv.
        peers.ensure_installed("vllm")
    except peers.PeerUnavailable as exc:
        print(f"vLLM's benchmark client is unavailable: {exc}", file=sys.stderr)
        return 2
    shapes: list[SweepShape] = []
    limits = None
    if args.sweep:
        limits = shape_limits(args.model, args.dtype, args.kv_bytes)
        shapes = sweep_shapes(args, limits)
        datasets = {s.name: sweep_dataset(s) for s in shapes}
        rows = [(datasets[s.name], s.concurrency) for s in shapes]
    else:
        datasets = {d: DATASETS[d] for d in args.datasets}
        rows = grid_rows(list(datasets.values()), args.concurrency)
    t0 = time.monotonic()
    runs: list[RunResult] = []
    if args.interleave:
        runs = run_interleaved(engines_of(args), rows, opts, args.num_prompts, args.interleave)
        results = median_over_rounds(runs)
    else:
        for engine in engines_of(args):
            runs += run_engine(engine, rows, opts, args.num_prompts)
        results = runs
    verdicts = judge_all(results, datasets)
    meta = {
        "model": args.model,
        "dtype": args.dtype,
        "kv_bytes": args.kv_bytes,
        "engines": [dataclasses.asdict(e) | {"label": e.label} for e in engines_of(args)],
        "datasets": {d.name: d.params for d in datasets.values()},
        "concurrency": [s.concurrency for s in shapes] if args.sweep else args.concurrency,
        "interleave_rounds": args.interleave,
        "quick": args.quick,
        "seed": args.seed,
        "temperature": args.temperature,
        "cpus": os.cpu_count(),
        "wall_s": time.monotonic() - t0,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "when": stamp,
    }
    report = {
        "meta": meta,
        "runs": [dataclasses.asdict(r) for r in runs],
        "medians": [dataclasses.asdict(r) for r in results] if args.interleave else [],
        "verdicts": [v.to_json() for v in verdicts],
    }
    if args.sweep:
        report["sweep"] = sweep_json(shapes, limits, args.sweep_seed, verdicts)
    write_json(report, out, "vs_vllm")
    # Per-row ratios need vLLM's runs; without them, each engine's own figures.
    png = plot_ratios(shapes, verdicts, out.with_suffix(".png")) if args.sweep else None
    png = png or plot(results, out.with_suffix(".png"))
    print(format_table(results, verdicts))
    if args.sweep:
        print("\n== sweep (ratios radixmux / vLLM)\n" + format_sweep(shapes, verdicts, args.quick))
    elif verdicts:
        print("\n== goals\n" + format_goals(verdicts))
    print(f"\nwrote {out}" + (f" and {png}" if png else ""))
    return 0 if all(r.ok for r in results if r.engine.startswith("radixmux")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
