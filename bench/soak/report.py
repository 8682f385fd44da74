"""The soak's report: the JSON summary, the plot and the printed verdict."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.soak.end import EndState
from bench.soak.monitor import by_status, info_models
from bench.soak.records import CheckResult, RunState
from bench.verdicts import verdict_line


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def per_minute(run: RunState) -> list[dict[str, Any]]:
    """Requests by status and TTFT p50/p99 (streams that got a token) per minute of load."""
    last = math.ceil(run.config.load_s / 60.0)  # later records are the end phase's
    minutes = sorted({r.minute for r in run.records if 0 <= r.minute < last})
    rows = []
    for m in minutes:
        recs = [r for r in run.records if r.minute == m]
        ttft = [r.ttft for r in recs if r.ttft is not None]
        row = {"minute": m, "requests": by_status(recs), "ttft_n": len(ttft)}
        row["ttft_p50_ms"] = None if not ttft else round(1000 * percentile(ttft, 0.5), 1)
        row["ttft_p99_ms"] = None if not ttft else round(1000 * percentile(ttft, 0.99), 1)
        rows.append(row)
    return rows


def report(
    run: RunState, end: EndState, checks: list[CheckResult], rss_detail: dict[str, Any]
) -> dict[str, Any]:
    """The JSON report: config, checks, summaries, and every record."""
    return {
        "passed": all(c.passed for c in checks),
        "checks": [dataclasses.asdict(c) for c in checks],
        "config": {
            **{k: v for k, v in dataclasses.asdict(run.config).items() if k != "out"},
            "out": str(run.config.out),
        },
        "server_cmd": run.server.cmd,
        "models": {n: dataclasses.asdict(f) for n, f in run.facts.items()},
        "load_s": run.config.load_s,
        "requests_by_status": by_status(run.records),
        "requests_by_kind": dict(Counter(r.kind for r in run.records)),
        "kills": [dataclasses.asdict(k) for k in run.kills],
        "restarts": {n: m.get("restarts") for n, m in info_models(end.sched).items()},
        "per_minute": per_minute(run),
        "rss": rss_detail,
        "rss_series": [dataclasses.asdict(s) for s in run.rss.values()],
        "probes": [dataclasses.asdict(p) for p in run.probes],
        "health": [dataclasses.asdict(h) for h in run.health],
        "scheduler_idle": end.sched,
        "scheduler_after_flush": end.flushed,
        "metrics": end.metrics,
        "records": [dataclasses.asdict(r) for r in run.records],
    }


def plot(data: dict[str, Any], path: Path) -> None:
    """Requests by status and TTFT per minute, RSS per process over time, kill markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["per_minute"]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 11), sharex=True)
    minutes = [r["minute"] for r in rows]
    labels = sorted({k for r in rows for k in r["requests"]})
    bottom = [0] * len(rows)
    for label in labels:
        counts = [r["requests"].get(label, 0) for r in rows]
        # Minute m spans [m, m + 1) on the shared time axis.
        ax1.bar([m + 0.5 for m in minutes], counts, bottom=bottom, label=label, width=0.9)
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax1.set_ylabel("requests")
    ax1.set_title("requests by status per minute")
    ax1.legend(fontsize=7, ncol=4)
    for key, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "s--")):
        pts = [(r["minute"] + 0.5, r[key]) for r in rows if r[key] is not None]
        if pts:
            ax2.plot(*zip(*pts, strict=True), style, label=key.replace("_ms", "").replace("_", " "))
    ax2.set_yscale("log")
    ax2.set_ylabel("ms")
    ax2.set_title("time to first token per minute (streams)")
    ax2.legend(fontsize=8)
    for s in data["rss_series"]:
        ax3.plot(
            [t / 60 for t in s["t"]],
            [k / 1024 for k in s["rss_kib"]],
            label=f"{s['role']} ({s['pid']})",
        )
    ax3.set_ylabel("RSS (MiB)")
    ax3.set_xlabel("minute")
    ax3.set_title("resident memory per process")
    ax3.legend(fontsize=7, ncol=3)
    for k in data["kills"]:
        for ax in (ax1, ax2, ax3):
            ax.axvline(k["t_kill"] / 60, color="red", linestyle=":", linewidth=1)
    for ax in (ax1, ax2, ax3):
        ax.axvline(data["load_s"] / 60, color="gray", linestyle="--", linewidth=1)
    ax1.text(
        0.01,
        0.95,
        "red dotted: runner SIGKILL; gray dashed: load stopped",
        transform=ax1.transAxes,
        fontsize=7,
        va="top",
        color="red",
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_summary(data: dict[str, Any], checks: Sequence[CheckResult]) -> None:
    print("\n== soak summary")
    print(f"requests by status: {data['requests_by_status']}")
    print(f"requests by kind:   {data['requests_by_kind']}")
    print(f"kills: {len(data['kills'])}, restarts: {data['restarts']}")
    for row in data["per_minute"]:
        print(
            f"  minute {row['minute']:>3}: TTFT p50 {row['ttft_p50_ms']} ms, "
            f"p99 {row['ttft_p99_ms']} ms, {row['requests']}"
        )
    print("\n== checks")
    for c in checks:
        print(verdict_line(c.passed, f"{c.name}: {c.detail}", miss="FAIL"))
    failed = [c.name for c in checks if not c.passed]
    verdict = "PASS" if not failed else f"FAIL ({len(failed)} of {len(checks)}: {failed})"
    print(f"\nsoak: {verdict}", flush=True)
