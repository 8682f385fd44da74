"""Models on demand under a shifting, skewed load: throughput, loads per minute, cold starts.

Serves ``--models`` served names that are aliases of one embedded model
(distinct names, so distinct runners and loads; aliases share KV by their
weights), in two configurations, one server at a time:

``on_demand``
    the first name loaded at start, the others registered with
    ``load=on_demand``, ``--max-loaded-models`` of them loaded at most (the
    budget: fewer than the names);
``static``
    every name loaded at start (where memory allows: the comparison point).

Each runs the same workload: ``--phases`` phases of ``--phase-seconds``, in
each a Zipf(``--alpha``) popularity over the names whose order rotates every
phase (the hot set shifts), ``--clients`` concurrent clients sending short
greedy completions. Reported per configuration: completed requests and
output tokens per second, failed requests, request latency p50/p99, loads per
minute and unloads by reason (from ``/metrics``). Then, on the on-demand
server, the first-request latency of a cold model (each on-demand name
unloaded with ``DELETE /models/{name}``, back to ``registered``, then asked
once) against the same request warm. There is no "cold with KV on disk" row:
an unloaded model's KV goes to the disk tier only when no loaded model shares
it, and here every name is an alias of the first, which stays loaded (its KV
stays in memory for the next load of any alias).

    .venv/bin/python -m bench.bench_on_demand [--models 5 --max-loaded 3 --phases 4]

Prints a table and writes ``bench/results/on_demand-<time>.json`` and a PNG beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.bench_serving import RESULTS_DIR
from bench.server_process import ServerProcess, launch_radixmux

PROMPT = "Write one sentence about the sea, the wind and a small boat. Request {i}:"
MAX_TOKENS = 16


@dataclasses.dataclass
class ConfigResult:
    """One configuration's run of the workload."""

    config: str
    seconds: float
    completed: int
    failed: int
    output_tokens: int
    latencies_ms: list[float]
    loads: dict[str, float]
    unloads: dict[str, float]

    def row(self) -> dict[str, float | str]:
        lat = sorted(self.latencies_ms) or [float("nan")]
        minutes = self.seconds / 60
        return {
            "config": self.config,
            "req/s": self.completed / self.seconds,
            "out tok/s": self.output_tokens / self.seconds,
            "failed": self.failed,
            "p50 ms": statistics.median(lat),
            "p99 ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "loads/min": sum(self.loads.values()) / minutes,
            "unloads": ", ".join(f"{k} {v:.0f}" for k, v in sorted(self.unloads.items())) or "-",
        }


def popularity(names: Sequence[str], phase: int, alpha: float) -> list[float]:
    """Zipf weights over ``names``, rotated by ``phase`` (the hot model shifts)."""
    n = len(names)
    ranks = [(i - phase) % n for i in range(n)]
    return [1.0 / (r + 1) ** alpha for r in ranks]


def counters(text: str, name: str) -> dict[str, float]:
    """``name``'s samples summed by their ``reason`` label."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                reason = s.labels.get("reason", "")
                out[reason] = out.get(reason, 0.0) + s.value
    return out


async def complete(
    client: httpx.AsyncClient, url: str, model: str, i: int
) -> tuple[bool, float, int]:
    """One greedy completion: (answered 200, latency ms, output tokens)."""
    body = {
        "model": model,
        "prompt": PROMPT.format(i=i),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", json=body)
    ms = (time.perf_counter() - t0) * 1e3
    if r.status_code != 200:
        return False, ms, 0
    return True, ms, int(r.json()["usage"]["completion_tokens"])


async def workload(url: str, names: Sequence[str], args: argparse.Namespace, config: str):
    """The shifting Zipf load on one server; returns its ConfigResult."""
    rng = random.Random(args.seed)
    done: list[tuple[bool, float, int]] = []
    counter = iter(range(10**9))
    async with httpx.AsyncClient(timeout=args.request_timeout, trust_env=False) as client:
        before = (await client.get(f"{url}/metrics")).text
        t0 = time.perf_counter()
        for phase in range(args.phases):
            weights = popularity(names, phase, args.alpha)
            end = time.perf_counter() + args.phase_seconds

            async def one_client(end: float, weights: list[float]) -> None:
                while time.perf_counter() < end:
                    model = rng.choices(names, weights)[0]
                    done.append(await complete(client, url, model, next(counter)))

            await asyncio.gather(*(one_client(end, weights) for _ in range(args.clients)))
            print(f"[on_demand] {config}: phase {phase + 1}/{args.phases}", file=sys.stderr)
        seconds = time.perf_counter() - t0
        after = (await client.get(f"{url}/metrics")).text

    def delta(metric: str) -> dict[str, float]:
        a, b = counters(after, metric), counters(before, metric)
        return {k: v - b.get(k, 0.0) for k, v in a.items() if v - b.get(k, 0.0) > 0}

    return ConfigResult(
        config,
        seconds,
        sum(ok for ok, _, _ in done),
        sum(not ok for ok, _, _ in done),
        sum(n for _, _, n in done),
        [ms for ok, ms, _ in done if ok],
        delta("radixmux_model_loads_total"),
        delta("radixmux_model_unloads_total"),
    )


async def cold_and_warm(url: str, names: Sequence[str], timeout: float) -> list[dict[str, float]]:
    """Per on-demand name: latency of a request after unloading it, then of a second one."""
    rows = []
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        for name in names:
            r = await client.delete(f"{url}/models/{name}")
            if r.status_code not in (200, 404):
                raise RuntimeError(f"DELETE /models/{name}: {r.status_code} {r.text}")
            ok_cold, cold, _ = await complete(client, url, name, 0)
            ok_warm, warm, _ = await complete(client, url, name, 0)
            if ok_cold and ok_warm:
                rows.append({"model": name, "cold_ms": cold, "warm_ms": warm})
    return rows


def serve(models: Sequence[str], flags: Sequence[str], log: Path) -> ServerProcess:
    """radixmux serving ``models`` in bfloat16, healthy."""
    args = ["--dtype", "bfloat16", *(a for m in models for a in ("--model", m)), *flags]
    return launch_radixmux(args, log, timeout=900)


def plot(results: Sequence[ConfigResult], cold: Sequence[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.bar([r.config for r in results], [r.output_tokens / r.seconds for r in results])
    a.set_ylabel("output tok/s")
    a.set_title("Shifting Zipf load")
    if cold:
        x = range(len(cold))
        b.bar([i - 0.2 for i in x], [c["cold_ms"] for c in cold], 0.4, label="cold (load)")
        b.bar([i + 0.2 for i in x], [c["warm_ms"] for c in cold], 0.4, label="warm")
        b.set_xticks(list(x), [c["model"] for c in cold])
        b.set_ylabel("first request ms")
        b.set_yscale("log")
        b.legend()
    b.set_title("A registered model's first request")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="embedded short name or HF folder")
    p.add_argument("--models", type=int, default=5, help="served names (aliases)")
    p.add_argument("--max-loaded", type=int, default=3, help="--max-loaded-models of on_demand")
    p.add_argument("--phases", type=int, default=4)
    p.add_argument("--phase-seconds", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent of popularity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--configs", nargs="+", choices=("on_demand", "static"), default=None)
    p.add_argument(
        "--server-args", default="", help='extra radixmux flags, one string: "--runner-start spawn"'
    )
    p.add_argument("--out", type=Path, default=None, help="JSON path; the PNG goes beside it")
    args = p.parse_args(argv)
    if not 1 <= args.max_loaded < args.models:
        p.error("--max-loaded must be at least 1 and below --models")
    names = [f"m{i}" for i in range(args.models)]
    out = args.out or RESULTS_DIR / f"on_demand-{time.strftime('%Y%m%dT%H%M%S')}.json"
    logs = out.with_name(out.stem + "-logs")
    flags = ("--kv-cache-bytes", str(1 << 30), *shlex.split(args.server_args))
    static = [f"{args.model},name={n}" for n in names]
    on_demand = [static[0], *(f"{args.model},name={n},load=on_demand" for n in names[1:])]
    results: list[ConfigResult] = []
    cold: list[dict[str, float]] = []
    for config in args.configs or ["on_demand", "static"]:
        print(f"[on_demand] {config}: starting", file=sys.stderr, flush=True)
        if config == "on_demand":
            extra = (*flags, "--max-loaded-models", str(args.max_loaded))
            server = serve(on_demand, extra, logs / "on_demand.log")
        else:
            server = serve(static, flags, logs / "static.log")
        try:
            results.append(asyncio.run(workload(server.base_url, names, args, config)))
            if config == "on_demand":
                cold = asyncio.run(cold_and_warm(server.base_url, names[1:], args.request_timeout))
        finally:
            server.stop()
    rows = [r.row() for r in results]
    head = list(rows[0])
    print("  ".join(f"{h:>12}" for h in head))
    for row in rows:
        print(
            "  ".join(f"{v:>12.1f}" if isinstance(v, float) else f"{v!s:>12}" for v in row.values())
        )
    if cold:
        c = statistics.median(x["cold_ms"] for x in cold)
        w = statistics.median(x["warm_ms"] for x in cold)
        print(f"cold first request (load + answer) median {c:.0f} ms, warm {w:.0f} ms")
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "cold": cold}
    data["runs"] = [dataclasses.asdict(r) for r in results]
    out.write_text(json.dumps(data, indent=1))
    plot(results, cold, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
