"""First-request latency with and without a warm-up (``POST /cache/warmup``).

One server (``--model smollm2`` by default). A system prompt of about
``--system-tokens`` tokens; each repetition flushes the cache, then either
sends the first chat-shaped request straight away (cold) or warms the system
prompt first (``messages``, as a deployment's ``--warmup FILE`` would) and
then sends it (warm). The request's prompt is the chat template of
[system, user] as token ids, streamed, greedy, 8 tokens; its time to first
token is what a user waits for.

::

    .venv/bin/python -m bench.bench_warmup [--model smollm2] [--reps 3]

Prints a table, writes ``bench/results/warmup-<time>.json`` (``--out``) and a
plot next to it (``--plot docs/warmup-ttft.png``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.bench_disk_tier import log, serving, stream_completion
from bench.bench_serving import write_json

ROOT = Path(__file__).resolve().parents[1]

SENTENCE = (
    "You are a meticulous support assistant for a company that sells garden tools; "
    "answer in two sentences, cite the manual section, and never invent prices. "
)


def tokenize(base_url: str, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    body = {"messages": messages, "add_generation_prompt": generation_prompt}
    r = httpx.post(f"{base_url}/tokenize", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def system_prompt(base_url: str, target: int) -> tuple[str, int]:
    """A system prompt of about ``target`` tokens, and its templated length."""
    one = len(tokenize(base_url, [{"role": "system", "content": SENTENCE * 10}], False)) / 10
    text = SENTENCE * max(1, round(target / one))
    return text, len(tokenize(base_url, [{"role": "system", "content": text}], False))


def first_request(
    base_url: str, model: str, system: str, question: str, warm: bool
) -> dict[str, Any]:
    """Flush, optionally warm the system prompt, then time the first request."""
    httpx.post(f"{base_url}/flush_cache", timeout=60).raise_for_status()
    row: dict[str, Any] = {"warm": warm}
    if warm:
        t0 = time.perf_counter()
        body = {"model": model, "messages": [{"role": "system", "content": system}]}
        r = httpx.post(f"{base_url}/cache/warmup", json=body, timeout=600)
        r.raise_for_status()
        row["warmup_s"] = time.perf_counter() - t0
        row["warmed_tokens"] = r.json()["cached_tokens"]
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    ids = tokenize(base_url, msgs, True)
    out = stream_completion(base_url, model, ids, 8)
    row.update(ttft_s=out["ttft_s"], prompt_tokens=out["prompt_tokens"])
    row["cached_tokens"] = out["cached_tokens"]
    return row


def summary(rows: list[dict[str, Any]], warm: bool) -> dict[str, Any]:
    mine = [r for r in rows if r["warm"] == warm]
    out = {
        "ttft_median_s": statistics.median(r["ttft_s"] for r in mine),
        "ttft_s": [r["ttft_s"] for r in mine],
        "cached_tokens": [r["cached_tokens"] for r in mine],
    }
    if warm:
        out["warmup_median_s"] = statistics.median(r["warmup_s"] for r in mine)
    return out


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Two bars: cold and warmed first-request TTFT (medians, every run as a dot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return None
    cold, warm = report["cold"], report["warm"]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    labels = ["no warm-up", "after warm-up"]
    medians = [cold["ttft_median_s"], warm["ttft_median_s"]]
    ax.bar(labels, medians, color=["#c44e52", "#55a868"], width=0.55)
    for i, runs in enumerate((cold["ttft_s"], warm["ttft_s"])):
        ax.scatter([i] * len(runs), runs, color="black", s=12, zorder=3)
        ax.text(i, medians[i], f"{medians[i] * 1000:.0f} ms", ha="center", va="bottom")
    meta = report["meta"]
    ax.set_ylabel("first request TTFT (s)")
    ax.set_title(
        f"{meta['model']}: {meta['system_tokens']}-token system prompt, first request",
        fontsize=9,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the title is long: keep it whole
    plt.close(fig)
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="--model string (one model)")
    p.add_argument("--system-tokens", type=int, default=1500, help="system prompt size")
    p.add_argument("--reps", type=int, default=3, help="runs of each mode")
    p.add_argument("--out", type=Path, default=None, help="JSON path")
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: next to --out)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    with serving("warmup", model=[args.model]) as server:
        url = server.base_url
        name = server.engine.models[0]
        system, n_system = system_prompt(url, args.system_tokens)
        log(f"system prompt: {n_system} tokens")
        first_request(url, name, system, "Warm the runner up.", warm=False)  # not measured
        for i in range(args.reps):
            for warm in (False, True):
                row = first_request(url, name, system, f"Question {i}: is the rake in stock?", warm)
                log(f"run {i} warm={warm}: {row}")
                rows.append(row)
    report = {
        "meta": {
            "model": args.model,
            "system_tokens": n_system,
            "reps": args.reps,
            "cpus": os.cpu_count(),
            "when": time.strftime("%Y%m%dT%H%M%S"),
        },
        "cold": summary(rows, False),
        "warm": summary(rows, True),
        "runs": rows,
    }
    cold, warm = report["cold"], report["warm"]
    report["speedup"] = cold["ttft_median_s"] / warm["ttft_median_s"]
    out = write_json(report, args.out, "warmup")
    png = plot(report, args.plot or out.with_suffix(".png"))
    print(f"\nfirst request, {n_system}-token system prompt ({args.model}, {args.reps} runs each)")
    print(
        f"  no warm-up : TTFT median {cold['ttft_median_s'] * 1000:8.0f} ms, cached "
        f"{cold['cached_tokens']}"
    )
    print(
        f"  warmed     : TTFT median {warm['ttft_median_s'] * 1000:8.0f} ms, cached "
        f"{warm['cached_tokens']} (warm-up call {warm['warmup_median_s'] * 1000:.0f} ms)"
    )
    print(f"  speed-up   : {report['speedup']:.1f}x")
    print(f"\nwrote {out}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
