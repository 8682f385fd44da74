"""Serving benchmark: drive any OpenAI-compatible server over HTTP and measure it.

Sends the workloads of ``bench/workloads.py`` as streaming requests (so time to
first token and inter-token gaps are seen), with Poisson arrivals
(``--request-rate``; ``inf`` sends everything at once) and/or a cap on sessions
in flight (``--concurrency``). Every request asks for a fixed output length
(``max_tokens``, ``ignore_eos``, ``temperature 0``); token counts come from the
server's ``usage``. The cache hit rate is the change of the server's
``/metrics`` token counters over the run (radixmux, or vLLM's prefix-cache
counters), else the share of prompt tokens the server reported as cached in
``usage``, else n/a.

    .venv/bin/python -m bench.bench_serving --base-url http://127.0.0.1:30000 \\
        --model smollm2 --workload generated-shared-prefix --request-rate inf

Importable: ``await run_benchmark(BenchConfig(...)) -> BenchResult``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.sse import SSE_DONE, event_text, sse_message
from bench.workloads import (
    WORKLOADS,
    GSPParams,
    MultiTurnParams,
    Session,
    ShiftParams,
    TenantParams,
    generated_shared_prefix,
    multi_model_shift,
    multi_tenant,
    multi_turn,
    resolve_tokenizer,
    vocabulary_words,
    warmup_sessions,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# (tokens looked up, tokens matched) counter names per server family; per-model
# labels are summed over the models of the run when present.
HIT_COUNTERS = (
    ("radixmux_cache_tokens_queried_total", "radixmux_cache_tokens_saved_total"),
    ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
)
# radixmux counters whose growth over a run says where its time went.
SERVER_COUNTERS = (
    "radixmux_model_steps",
    "radixmux_runner_busy_seconds",
    "radixmux_prompt_tokens_computed",
)


@dataclass
class BenchConfig:
    """One benchmark run against one server."""

    base_url: str
    models: list[str]
    workload: str = "generated-shared-prefix"
    tokenizer: str = "smollm2"
    num_prompts: int | None = None  # None: the workload's own size
    request_rate: float = math.inf
    concurrency: int | None = None
    seed: int = 0
    api: str = "completions"  # or "chat"
    gsp: GSPParams = field(default_factory=GSPParams)
    multi_turn: MultiTurnParams = field(default_factory=MultiTurnParams)
    shift: ShiftParams = field(default_factory=ShiftParams)
    tenant: TenantParams = field(default_factory=TenantParams)
    warmup_requests: int = 0
    timeout_s: float = 600.0
    api_key: str | None = None
    progress: bool = True
    label: str = ""
    # Model -> base URL where models live on separate servers (e.g. one vLLM
    # per model); a model not listed goes to ``base_url``.
    model_urls: dict[str, str] = field(default_factory=dict)
    # Fields added to every request body (e.g. a response_format).
    extra_body: dict[str, Any] = field(default_factory=dict)

    def url_for(self, model: str) -> str:
        """The base URL serving ``model``."""
        return self.model_urls.get(model, self.base_url)

    def server_urls(self, models: Sequence[str]) -> list[str]:
        """Each distinct server behind ``models``, in order."""
        return list(dict.fromkeys(self.url_for(m) for m in models))


@dataclass
class RequestRecord:
    """What one request saw, in seconds from the run's start."""

    model: str
    session: int
    turn: int
    ok: bool
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    usage_reported: bool = False
    text: str = ""


@dataclass
class Percentiles:
    """Milliseconds."""

    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Percentiles:
        if not seconds:
            return cls(None, None, None, None)  # None, not NaN: results stay valid JSON
        ms = np.asarray(seconds) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(float(p50), float(p90), float(p99), float(ms.mean()))


@dataclass
class ModelFigures:
    """Per served model, for multi-model runs."""

    requests: int
    output_throughput: float
    hit_rate: float | None


@dataclass
class BenchResult:
    """A run's figures (throughputs per second of wall time from first send to last reply)."""

    label: str
    workload: str
    base_url: str
    models: list[str]
    num_requests: int
    completed: int
    errors: int
    error_samples: list[str]
    duration_s: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    short_outputs: int  # requests that got fewer tokens than asked (a peer ignoring ignore_eos)
    ttft_ms: Percentiles
    itl_ms: Percentiles
    tpot_ms: Percentiles
    e2e_ms: Percentiles
    cache_hit_rate: float | None
    hit_rate_source: str  # "metrics", "usage" or "n/a"
    per_model: dict[str, ModelFigures]
    config: dict[str, Any]
    # Growth of radixmux's work counters over the run (empty for peers).
    server_counters: dict[str, float] = field(default_factory=dict)

    @property
    def runner_busy(self) -> float | None:
        """Runner-seconds of compute per second of wall time (radixmux only)."""
        busy = self.server_counters.get("radixmux_runner_busy_seconds")
        return None if busy is None or self.duration_s <= 0 else busy / self.duration_s

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- workloads ------------------------------------------------------------------------
def build_sessions(config: BenchConfig, words: Sequence[str]) -> list[Session]:
    """The run's sessions; ``num_prompts`` caps gsp/shift requests or multi-turn chats."""
    model = config.models[0]
    if config.workload == "generated-shared-prefix":
        sessions = generated_shared_prefix(words, model, config.gsp, config.seed)
    elif config.workload == "multi-turn":
        p = config.multi_turn
        if config.num_prompts is not None:
            p = dataclasses.replace(p, num_conversations=config.num_prompts)
        return multi_turn(words, model, p, config.seed)
    elif config.workload == "multi-model-shift":
        p = config.shift
        if config.num_prompts is not None:
            p = dataclasses.replace(p, num_requests=config.num_prompts)
        return multi_model_shift(words, config.models[:2], p, config.seed)
    elif config.workload == "multi-tenant":
        t = config.tenant
        if config.num_prompts is not None:
            t = dataclasses.replace(t, num_requests=config.num_prompts)
        return multi_tenant(words, config.models, t, config.seed)
    else:
        raise ValueError(f"workload must be one of {WORKLOADS}, not {config.workload!r}")
    return sessions if config.num_prompts is None else sessions[: config.num_prompts]


def completion_prompt(system: str, turns: Sequence[str], replies: Sequence[str]) -> str:
    """The conversation so far as one text (for servers or models without a chat template)."""
    parts = [system] if system else []
    for user, reply in zip(turns, [*replies, ""], strict=False):
        parts.append(f"User: {user}\nAssistant:{reply}")
    return "\n\n".join(parts)


def chat_messages(system: str, turns: Sequence[str], replies: Sequence[str]) -> list[dict]:
    """The conversation so far as OpenAI chat messages."""
    msgs = [{"role": "system", "content": system}] if system else []
    for i, user in enumerate(turns):
        msgs.append({"role": "user", "content": user})
        if i < len(replies):
            msgs.append({"role": "assistant", "content": replies[i]})
    return msgs


# ---- one request ----------------------------------------------------------------------
async def send_request(
    client: httpx.AsyncClient,
    config: BenchConfig,
    session: Session,
    turn: int,
    replies: Sequence[str],
    t0: float,
    index: int,
) -> RequestRecord:
    """Stream one turn and time it; never raises (errors are recorded)."""
    turns = session.turns[: turn + 1]
    body: dict[str, Any] = {
        "model": session.model,
        "max_tokens": session.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **config.extra_body,
    }
    if config.api == "chat":
        path = "/v1/chat/completions"
        body["messages"] = chat_messages(session.system, turns, replies)
    else:
        path = "/v1/completions"
        body["prompt"] = completion_prompt(session.system, turns, replies)
    rec = RequestRecord(session.model, index, turn, ok=False)
    start = time.perf_counter()
    rec.start = start - t0
    chunks: list[str] = []
    last = start
    try:
        async with client.stream("POST", config.url_for(session.model) + path, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                rec.error = f"HTTP {resp.status_code}: {detail}"
                rec.e2e = time.perf_counter() - start
                return rec
            async for line in resp.aiter_lines():
                msg = sse_message(line)
                if msg is None:
                    continue
                if msg is SSE_DONE:
                    break
                if "error" in msg:
                    rec.error = str(msg["error"])[:300]
                    break
                text = event_text(msg)
                if text:
                    now = time.perf_counter()
                    if not chunks:
                        rec.ttft = now - start
                    else:
                        rec.itls.append(now - last)
                    last = now
                    chunks.append(text)
                if msg.get("usage"):
                    _read_usage(rec, msg["usage"])
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    rec.e2e = time.perf_counter() - start
    rec.text = "".join(chunks)
    if not rec.usage_reported:
        rec.completion_tokens = len(chunks)  # best effort: one token per chunk
    rec.ok = not rec.error and bool(chunks)
    if not rec.error and not chunks:
        rec.error = "empty response"
    return rec


def _read_usage(rec: RequestRecord, usage: dict[str, Any]) -> None:
    rec.usage_reported = True
    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])


# ---- metrics --------------------------------------------------------------------------
async def scrape_samples(
    client: httpx.AsyncClient, base_url: str
) -> dict[str, dict[str, float]] | None:
    """``/metrics`` as {sample name: {model label or "*": value}}; None if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = await client.get(base_url + "/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    samples: dict[str, dict[str, float]] = {}
    try:
        for fam in text_string_to_metric_families(resp.text):
            for s in fam.samples:
                name = s.labels.get("model") or s.labels.get("model_name") or "*"
                samples.setdefault(s.name, {})
                samples[s.name][name] = samples[s.name].get(name, 0.0) + s.value
    except ValueError:
        return None
    return samples


def hit_counters(
    samples: dict[str, dict[str, float]], models: Sequence[str]
) -> dict[str, tuple[float, float]] | None:
    """Per model (queried, matched) prompt-token counters, from the first known pair."""
    for queried, matched in HIT_COUNTERS:
        if queried in samples and matched in samples:
            q, m = samples[queried], samples[matched]
            keys = [k for k in q if k in models] or list(q)
            return {k: (q.get(k, 0.0), m.get(k, 0.0)) for k in keys}
    return None


def server_counters(samples: dict[str, dict[str, float]]) -> dict[str, float]:
    """radixmux's work counters (:data:`SERVER_COUNTERS`), summed over models."""
    out = {}
    for name in SERVER_COUNTERS:
        values = samples.get(name + "_total", samples.get(name))
        if values is not None:
            out[name] = sum(values.values())
    return out


async def scrape_hit_counters(
    client: httpx.AsyncClient, base_url: str, models: Sequence[str]
) -> dict[str, tuple[float, float]] | None:
    """Per model (queried, matched) prompt-token counters from ``/metrics``; None if absent."""
    samples = await scrape_samples(client, base_url)
    return None if samples is None else hit_counters(samples, models)


@dataclass
class Snapshot:
    """Counters of every server at one moment: hit counters (None if a server
    lacks them) and radixmux's work counters."""

    hits: dict[str, tuple[float, float]] | None
    work: dict[str, float]


async def scrape_servers(
    client: httpx.AsyncClient, urls: Sequence[str], models: Sequence[str]
) -> Snapshot:
    """Every server's ``/metrics``, merged."""
    hits: dict[str, tuple[float, float]] | None = {}
    work: dict[str, float] = {}
    for url in urls:
        samples = await scrape_samples(client, url)
        one = None if samples is None else hit_counters(samples, models)
        hits = None if one is None or hits is None else {**hits, **one}
        for name, value in server_counters(samples or {}).items():
            work[name] = work.get(name, 0.0) + value
    return Snapshot(hits, work)


def _rate(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    queried = after[0] - before[0]
    return (after[1] - before[1]) / queried if queried > 0 else 0.0


# ---- the run --------------------------------------------------------------------------
async def run_sessions(
    client: httpx.AsyncClient, config: BenchConfig, sessions: Sequence[Session], show: bool
) -> tuple[list[RequestRecord], float]:
    """Send every session (arrivals by rate, capped by concurrency); records and wall time."""
    from tqdm import tqdm

    total = sum(len(s.turns) for s in sessions)
    bar = tqdm(
        total=total,
        desc=config.label or config.workload,
        file=sys.stderr,
        disable=not show,
        unit="req",
        leave=False,
    )
    sem = asyncio.Semaphore(config.concurrency) if config.concurrency else None
    records: list[RequestRecord] = []
    t0 = time.perf_counter()

    async def one(index: int, session: Session) -> None:
        async def turns() -> None:
            replies: list[str] = []
            for turn in range(len(session.turns)):
                rec = await send_request(client, config, session, turn, replies, t0, index)
                records.append(rec)
                bar.update(1)
                bar.set_postfix(errors=sum(not r.ok for r in records))
                if not rec.ok:
                    return  # a broken conversation stops; its later turns are not sent
                replies.append(rec.text)

        if sem is None:
            await turns()
        else:
            async with sem:
                await turns()

    gaps = random.Random(config.seed + 104729)
    tasks = []
    for index, session in enumerate(sessions):
        tasks.append(asyncio.create_task(one(index, session)))
        if math.isfinite(config.request_rate) and index + 1 < len(sessions):
            await asyncio.sleep(gaps.expovariate(config.request_rate))
    await asyncio.gather(*tasks)
    bar.close()
    return records, time.perf_counter() - t0


async def run_benchmark(config: BenchConfig) -> BenchResult:
    """Warm up, snapshot ``/metrics``, send the workload, snapshot again, summarise."""
    words = vocabulary_words(str(resolve_tokenizer(config.tokenizer)))
    sessions = build_sessions(config, words)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    # trust_env=False: a proxy from the environment must never sit between us and localhost.
    async with httpx.AsyncClient(
        headers=headers, limits=limits, timeout=timeout, trust_env=False
    ) as client:
        if config.warmup_requests:
            models = sorted({s.model for s in sessions})
            warm = warmup_sessions(words, models, config.warmup_requests, config.seed)
            await run_sessions(client, dataclasses.replace(config, concurrency=None), warm, False)
        models = sorted({s.model for s in sessions})
        before = await scrape_servers(client, config.server_urls(models), models)
        records, wall = await run_sessions(client, config, sessions, config.progress)
        after = await scrape_servers(client, config.server_urls(models), models)
    return summarise(config, sessions, records, wall, before, after)


def summarise(
    config: BenchConfig,
    sessions: Sequence[Session],
    records: Sequence[RequestRecord],
    wall: float,
    before: Snapshot,
    after: Snapshot,
) -> BenchResult:
    """Figures of one run from its request records and the two metric snapshots."""
    ok = [r for r in records if r.ok]
    bad = [r for r in records if not r.ok]
    in_tok = sum(r.prompt_tokens for r in ok)
    out_tok = sum(r.completion_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    max_tokens = {(i, s.model): s.max_tokens for i, s in enumerate(sessions)}
    short = sum(r.completion_tokens < max_tokens.get((r.session, r.model), 0) for r in ok)
    models = sorted({s.model for s in sessions})

    rate, source = None, "n/a"
    per_rate: dict[str, float | None] = dict.fromkeys(models)
    hits_b, hits_a = before.hits, after.hits
    if hits_b is not None and hits_a is not None:
        source = "metrics"
        zero = (0.0, 0.0)
        tot_b = tuple(sum(v[i] for v in hits_b.values()) for i in (0, 1))
        tot_a = tuple(sum(v[i] for v in hits_a.values()) for i in (0, 1))
        rate = _rate(tot_b, tot_a)  # type: ignore[arg-type]
        for m in models:
            if m in hits_a:
                per_rate[m] = _rate(hits_b.get(m, zero), hits_a[m])
    elif ok and all(r.cached_tokens is not None for r in ok) and in_tok:
        source = "usage"
        rate = sum(r.cached_tokens or 0 for r in ok) / in_tok
        for m in models:
            mine = [r for r in ok if r.model == m]
            p = sum(r.prompt_tokens for r in mine)
            per_rate[m] = sum(r.cached_tokens or 0 for r in mine) / p if p else None

    per_model = {
        m: ModelFigures(
            requests=sum(r.model == m for r in ok),
            output_throughput=sum(r.completion_tokens for r in ok if r.model == m) / wall,
            hit_rate=per_rate[m],
        )
        for m in models
    }
    return BenchResult(
        label=config.label or config.workload,
        workload=config.workload,
        base_url=config.base_url,
        models=list(config.models),
        num_requests=len(records),
        completed=len(ok),
        errors=len(bad),
        error_samples=sorted({r.error for r in bad})[:5],
        duration_s=wall,
        request_throughput=len(ok) / wall,
        input_throughput=in_tok / wall,
        output_throughput=out_tok / wall,
        total_input_tokens=in_tok,
        total_output_tokens=out_tok,
        short_outputs=short,
        ttft_ms=Percentiles.of([r.ttft for r in ok]),
        itl_ms=Percentiles.of([g for r in ok for g in r.itls]),
        tpot_ms=Percentiles.of(tpots),
        e2e_ms=Percentiles.of([r.e2e for r in ok]),
        cache_hit_rate=rate,
        hit_rate_source=source,
        per_model=per_model,
        config=_config_json(config),
        server_counters={k: v - before.work.get(k, 0.0) for k, v in after.work.items()},
    )


def _config_json(config: BenchConfig) -> dict[str, Any]:
    out = dataclasses.asdict(config)
    out.pop("api_key", None)  # never write a secret into results
    out["request_rate"] = "inf" if math.isinf(config.request_rate) else config.request_rate
    return out


# ---- output ---------------------------------------------------------------------------
def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_table(results: Sequence[BenchResult]) -> str:
    """One row per result: throughput, latency percentiles, hit rate, errors."""
    head = (
        f"{'configuration':<28} {'req/s':>6} {'in tok/s':>9} {'out tok/s':>9} "
        f"{'TTFT p50/p90/p99 ms':>22} {'ITL p50/p90/p99 ms':>20} "
        f"{'E2E p50/p90/p99 ms':>22} {'hit':>6} {'busy':>5} {'err':>4}"
    )
    rows = [head, "-" * len(head)]
    for r in results:

        def trio(p: Percentiles) -> str:
            return f"{_fmt(p.p50, '.0f')}/{_fmt(p.p90, '.0f')}/{_fmt(p.p99, '.0f')}"

        hit = "n/a" if r.cache_hit_rate is None else f"{r.cache_hit_rate:.1%}"
        busy = "n/a" if r.runner_busy is None else f"{r.runner_busy:.2f}"
        rows.append(
            f"{r.label[:28]:<28} {r.request_throughput:>6.2f} {r.input_throughput:>9.1f} "
            f"{r.output_throughput:>9.1f} {trio(r.ttft_ms):>22} {trio(r.itl_ms):>20} "
            f"{trio(r.e2e_ms):>22} {hit:>6} {busy:>5} {r.errors:>4}"
        )
    return "\n".join(rows)


def write_json(data: Any, out: Path | None, stem: str) -> Path:
    """Write ``data`` to ``out`` (default: a timestamped file under bench/results/)."""
    if out is None:
        out = RESULTS_DIR / f"{stem}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, allow_nan=True) + "\n")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (no /v1)")
    p.add_argument(
        "--model",
        nargs="+",
        default=["smollm2"],
        help="served model name(s); multi-model-shift takes two",
    )
    p.add_argument(
        "--tokenizer",
        default="smollm2",
        help="tokenizer folder or embedded short name (source of the word list)",
    )
    p.add_argument("--workload", choices=WORKLOADS, default="generated-shared-prefix")
    p.add_argument("--api", choices=("completions", "chat"), default="completions")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="cap on requests (multi-turn: conversations); default the workload's size",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second; inf sends all at once",
    )
    p.add_argument("--concurrency", type=int, default=None, help="most sessions in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=2)
    g = GSPParams()
    p.add_argument("--gsp-num-groups", type=int, default=g.num_groups)
    p.add_argument("--gsp-prompts-per-group", type=int, default=g.prompts_per_group)
    p.add_argument("--gsp-system-prompt-len", type=int, default=g.system_prompt_len)
    p.add_argument("--gsp-question-len", type=int, default=g.question_len)
    p.add_argument("--gsp-output-len", type=int, default=g.output_len)
    p.add_argument("--gsp-distribution", choices=("uniform", "zipf"), default=g.distribution)
    p.add_argument("--gsp-zipf-alpha", type=float, default=g.zipf_alpha)
    p.add_argument("--gsp-shuffle", action="store_true", help="send requests in random order")
    t = MultiTurnParams()
    p.add_argument("--mt-turns", type=int, default=t.turns)
    p.add_argument("--mt-groups", type=int, default=t.num_groups)
    p.add_argument("--mt-system-prompt-len", type=int, default=t.system_prompt_len)
    p.add_argument("--mt-question-len", type=int, default=t.question_len)
    p.add_argument("--mt-output-len", type=int, default=t.output_len)
    s = ShiftParams()
    p.add_argument(
        "--shift-shares",
        default=",".join(str(x) for x in s.shares),
        help="first model's share per phase, e.g. 0.8,0.2",
    )
    p.add_argument("--shift-groups", type=int, default=s.groups_per_model)
    p.add_argument("--shift-system-prompt-len", type=int, default=s.system_prompt_len)
    p.add_argument("--shift-question-len", type=int, default=s.question_len)
    p.add_argument("--shift-output-len", type=int, default=s.output_len)
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/)")
    return p.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    """The CLI's flags as a :class:`BenchConfig`."""
    return BenchConfig(
        base_url=a.base_url.rstrip("/"),
        models=list(a.model),
        workload=a.workload,
        tokenizer=a.tokenizer,
        num_prompts=a.num_prompts,
        request_rate=a.request_rate,
        concurrency=a.concurrency,
        seed=a.seed,
        api=a.api,
        gsp=GSPParams(
            a.gsp_num_groups,
            a.gsp_prompts_per_group,
            a.gsp_system_prompt_len,
            a.gsp_question_len,
            a.gsp_output_len,
            a.gsp_distribution,
            a.gsp_zipf_alpha,
            a.gsp_shuffle,
        ),
        multi_turn=MultiTurnParams(
            num_conversations=MultiTurnParams().num_conversations,
            turns=a.mt_turns,
            num_groups=a.mt_groups,
            system_prompt_len=a.mt_system_prompt_len,
            question_len=a.mt_question_len,
            output_len=a.mt_output_len,
        ),
        shift=ShiftParams(
            num_requests=ShiftParams().num_requests,
            shares=tuple(float(x) for x in a.shift_shares.split(",")),
            groups_per_model=a.shift_groups,
            system_prompt_len=a.shift_system_prompt_len,
            question_len=a.shift_question_len,
            output_len=a.shift_output_len,
        ),
        warmup_requests=a.warmup_requests,
        timeout_s=a.timeout,
        api_key=a.api_key,
        progress=not a.no_progress,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    config = config_from_args(args)
    result = asyncio.run(run_benchmark(config))
    print(format_table([result]))
    if result.error_samples:
        print("errors: " + "; ".join(result.error_samples), file=sys.stderr)
    path = write_json(result.to_json(), args.out, f"serving-{config.workload}")
    print(f"wrote {path}")
    return 0 if result.errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
