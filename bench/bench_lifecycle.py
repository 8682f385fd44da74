"""What a model load costs the models already serving: their inter-token latency.

One server serves SmolLM2 (``a``); clients stream greedy completions from it
without pause. After a quiet phase, ``POST /models`` loads Gemma 3 270M (``b``)
into the same server; after the load, a quiet phase again. Every streamed
token's arrival is kept, so the inter-token latency (ITL) of ``a`` is known
before, during and after the load, and how long it stays raised. Then the
same again for an unload (``DELETE /models/b``).

    .venv/bin/python -m bench.bench_lifecycle [--clients 2] [--quiet-s 15]

Prints a table, saves ``bench/results/lifecycle.json`` and ``docs/lifecycle-itl.png``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.bench_disk_tier import serving
from bench.bench_serving import RESULTS_DIR, write_json
from bench.sse import SSE_DONE, sse_message

ROOT = Path(__file__).resolve().parents[1]

PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 4


def stream_forever(
    url: str, stop: threading.Event, arrivals: list[list[float]], fails: list[str]
) -> None:
    """Stream greedy completions from ``a`` until ``stop``; each request's
    token arrival times."""
    body = {
        "model": "a",
        "prompt": PROMPT,
        "max_tokens": 64,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    while not stop.is_set():
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                fails.append(f"HTTP {r.status_code}")
                continue
            times: list[float] = []
            arrivals.append(times)
            for line in r.iter_lines():
                msg = sse_message(line)
                if msg is SSE_DONE:
                    break
                if msg is not None and msg.get("choices"):
                    times.append(time.monotonic())


def token_gaps(arrivals: list[list[float]]) -> list[tuple[float, float]]:
    """(end time, gap) between consecutive tokens of one stream, all streams."""
    return [(b, b - a) for times in arrivals for a, b in itertools.pairwise(times)]


def itl(arrivals: list[list[float]], start: float, end: float) -> dict[str, float]:
    """ITL percentiles (ms) of the gaps within a stream that end in [start, end)."""
    gaps = [g for b, g in token_gaps(arrivals) if start <= b < end]
    if not gaps:
        return {"n": 0}
    q = statistics.quantiles(gaps, n=100, method="inclusive") if len(gaps) > 1 else [gaps[0]] * 99
    return {
        "n": len(gaps),
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "max_ms": max(gaps) * 1e3,
        "tok_per_s": len(gaps) / max(end - start, 1e-9),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--quiet-s", type=float, default=15.0)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    events: dict[str, float] = {}
    arrivals: list[list[float]] = []
    fails: list[str] = []
    with serving(
        "lifecycle", model=["smollm2,name=a"], dtype=args.dtype, kv_cache_bytes=512 << 20
    ) as server:
        url = server.base_url
        stop = threading.Event()
        threads = [
            threading.Thread(target=stream_forever, args=(url, stop, arrivals, fails))
            for _ in range(args.clients)
        ]
        for t in threads:
            t.start()
        time.sleep(args.quiet_s)
        events["load_start"] = time.monotonic()
        r = httpx.post(f"{url}/models", json={"source": "gemma3-270m", "name": "b"}, timeout=900)
        events["load_end"] = time.monotonic()
        assert r.status_code == 200, r.text
        time.sleep(args.quiet_s)
        events["unload_start"] = time.monotonic()
        r = httpx.delete(f"{url}/models/b", timeout=300)
        events["unload_end"] = time.monotonic()
        assert r.status_code == 200, r.text
        time.sleep(args.quiet_s)
        stop.set()
        for t in threads:
            t.join(timeout=300)
    t0 = min(times[0] for times in arrivals if times)
    e = events
    phases = {
        "before": itl(arrivals, t0 + 2, e["load_start"]),
        "during load": itl(arrivals, e["load_start"], e["load_end"]),
        "between": itl(arrivals, e["load_end"], e["unload_start"]),
        "during unload": itl(arrivals, e["unload_start"], e["unload_end"]),
        "after": itl(arrivals, e["unload_end"], max(max(t) for t in arrivals if t) + 1e-6),
    }
    print(
        f"\nITL of model a (SmolLM2, {args.clients} streaming clients) while b is loaded/unloaded"
    )
    print(
        f"load took {e['load_end'] - e['load_start']:.1f} s, "
        f"unload {e['unload_end'] - e['unload_start']:.1f} s; failed requests on a: {len(fails)}"
    )
    print(f"{'phase':15} {'gaps':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'tok/s':>7}")
    for name, p in phases.items():
        if p["n"]:
            print(
                f"{name:15} {p['n']:6d} {p['p50_ms']:8.1f} {p['p99_ms']:8.1f} "
                f"{p['max_ms']:8.1f} {p['tok_per_s']:7.1f}"
            )
    result: dict[str, Any] = {
        "clients": args.clients,
        "dtype": args.dtype,
        "failed_on_a": fails,
        "events_s": {k: v - t0 for k, v in events.items()},
        "phases": phases,
    }
    print(f"json: {write_json(result, RESULTS_DIR / 'lifecycle.json', 'lifecycle')}")
    plot(arrivals, events, t0)


def plot(arrivals: list[list[float]], events: dict[str, float], t0: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gaps = token_gaps(arrivals)
    xs = [b - t0 for b, _ in gaps]
    ys = [g * 1e3 for _, g in gaps]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.plot(xs, ys, ".", ms=2)
    for a, b, label, colour in (
        ("load_start", "load_end", "loading b", "tab:orange"),
        ("unload_start", "unload_end", "unloading b", "tab:green"),
    ):
        ax.axvspan(events[a] - t0, events[b] - t0, alpha=0.2, color=colour, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("seconds")
    ax.set_ylabel("inter-token latency of a (ms)")
    ax.set_title("Inter-token latency of a serving model while another is loaded and unloaded")
    ax.legend(loc="upper right")
    fig.tight_layout()
    out = ROOT / "docs" / "lifecycle-itl.png"
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
