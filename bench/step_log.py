"""Where a server's forward time went, from its ``--log-level debug`` step lines.

The scheduler logs one line per finished batch (``radixmux.scheduler.results.describe_step``):
how many decodes, their total context, the prefill chunks (``tokens@cached``)
and the runner's forward time. This script reads one or more server logs (for
example the two runs of ``compare.py --modes 3 --server-args "--log-level
debug"``, lpm and fcfs) and prints, per log, the steps grouped by kind
(decode only, prefill only, mixed) with their count, forward time, batch
composition and prefill throughput, so two policies can be compared step for
step.

    .venv/bin/python -m bench.step_log bench/results/compare-*-logs/mode3_*.log
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

STEP_RE = re.compile(
    r"step runner=(?P<runner>\S+) batch=\d+ decodes=(?P<decodes>\d+) "
    r"decode_context=(?P<context>\d+) shared_rows=(?P<shared>\d+) "
    r"prefill=\[(?P<prefill>[^\]]*)\] forward_ms=(?P<forward>[\d.]+)"
)
KINDS = ("decode", "prefill", "mixed")


@dataclass(frozen=True)
class Step:
    """One forward pass as the scheduler logged it."""

    decodes: int
    decode_context: int
    shared_rows: int
    chunks: tuple[tuple[int, int], ...]  # (new tokens, cached tokens before them)
    forward_ms: float

    @property
    def kind(self) -> str:
        if self.chunks and self.decodes:
            return "mixed"
        return "prefill" if self.chunks else "decode"

    @property
    def prefill_tokens(self) -> int:
        return sum(n for n, _ in self.chunks)


def parse_steps(lines: Iterable[str]) -> list[Step]:
    """Every step line of a log, in order."""
    steps = []
    for line in lines:
        m = STEP_RE.search(line)
        if m is None:
            continue
        chunks = tuple(
            (int(n), int(c))
            for n, c in (part.split("@") for part in m["prefill"].split(",") if part)
        )
        steps.append(
            Step(
                decodes=int(m["decodes"]),
                decode_context=int(m["context"]),
                shared_rows=int(m["shared"]),
                chunks=chunks,
                forward_ms=float(m["forward"]),
            )
        )
    return steps


@dataclass
class KindSummary:
    """Totals of one kind of step."""

    steps: int = 0
    forward_ms: float = 0.0
    decodes: int = 0
    decode_context: int = 0
    shared_rows: int = 0
    chunks: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0

    def add(self, s: Step) -> None:
        self.steps += 1
        self.forward_ms += s.forward_ms
        self.decodes += s.decodes
        self.decode_context += s.decode_context
        self.shared_rows += s.shared_rows
        self.chunks += len(s.chunks)
        self.prefill_tokens += s.prefill_tokens
        self.cached_tokens += sum(c for _, c in s.chunks)

    def row(self, name: str) -> str:
        n = max(self.steps, 1)
        tok_s = self.prefill_tokens / (self.forward_ms / 1e3) if self.forward_ms else 0.0
        return (
            f"{name:8} {self.steps:6d} {self.forward_ms / 1e3:8.2f} {self.forward_ms / n:8.1f} "
            f"{self.decodes / n:7.1f} {self.decode_context / n:8.0f} {self.chunks / n:7.2f} "
            f"{self.prefill_tokens / n:8.0f} {self.cached_tokens / max(self.chunks, 1):8.0f} "
            f"{tok_s:9.0f}"
        )


def summarize(steps: Sequence[Step]) -> dict[str, KindSummary]:
    """Steps grouped by kind, plus ``all``."""
    out = {k: KindSummary() for k in (*KINDS, "all")}
    for s in steps:
        out[s.kind].add(s)
        out["all"].add(s)
    return out


HEADER = (
    f"{'kind':8} {'steps':>6} {'fwd s':>8} {'ms/step':>8} {'decodes':>7} {'context':>8} "
    f"{'chunks':>7} {'pf tok':>8} {'cached':>8} {'pf tok/s':>9}"
)


def report(path: Path) -> str:
    steps = parse_steps(path.read_text(errors="replace").splitlines())
    if not steps:
        return f"{path}: no step lines (was the server run with --log-level debug?)"
    summary = summarize(steps)
    lines = [f"{path} ({len(steps)} steps)", HEADER]
    lines += [summary[k].row(k) for k in (*KINDS, "all") if summary[k].steps]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("logs", nargs="+", type=Path)
    args = p.parse_args(argv)
    print(
        "per kind: steps, forward seconds, ms per step; per step: decodes, their context "
        "tokens, prefill chunks, prefill tokens; cached tokens before a chunk; prefill tok/s"
    )
    for path in args.logs:
        print()
        print(report(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
