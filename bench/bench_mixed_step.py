"""Where one mixed step goes: prompt chunks beside running decodes, op by op.

Under load a server's steps mix prompt chunks with the running requests' decodes
(``bench.step_log`` reads their shapes from a ``--log-level debug`` log: random
prompts at c=64 are ~1,000 prompt tokens beside ~44 decodes a step). This runs
one such shape through radixmux's ``ModelRunner`` over a ``KVArena``, as the
server's runner does (the lean stack where the model allows it), times it (the
20th-percentile step of ``--steps``), then profiles ``--profile-steps`` more with
torch's profiler and prints each op's CPU time per step, largest first, with its
share of the step. K/V values are whatever the arena holds: attention's cost
depends on how many rows it reads, not on their values.

Shapes: ``--chunks`` takes ``NEW@CACHED`` or ``KxNEW@CACHED`` (K chunks of NEW
prompt tokens, each after CACHED tokens of its own cached prefix, or with
``--shared-prefix`` one prefix for all), ``--decodes`` ``DxCONTEXT``.

    .venv/bin/python -m bench.bench_mixed_step --chunks 4x100@1000 --decodes 9x1100
    .venv/bin/python -m bench.bench_mixed_step --chunks 4x242@0 --decodes 44x525
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from radixmux.bench.bench_step import BLOCK_BYTES
from radixmux.memory.arena import KVArena
from radixmux.memory.layout import BlockGeometry
from radixmux.model_runners.loader import LoadedModel, load_model
from radixmux.model_runners.model_runner import ModelRunner
from radixmux.protocol import ForwardBatch, SeqInput, pack_ids

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class StepShape:
    """One mixed step: prompt chunks (new tokens, cached before them) and decodes."""

    chunks: tuple[tuple[int, int], ...]
    decodes: int
    context: int  # each decode's context, its new token included
    shared_prefix: bool = False

    def describe(self) -> str:
        chunks = " + ".join(f"{n}@{c}" for n, c in self.chunks) or "no chunk"
        prefix = " (one shared prefix)" if self.shared_prefix else ""
        return f"{chunks}{prefix} beside {self.decodes} decodes over {self.context} keys"


def parse_chunks(specs: Sequence[str]) -> tuple[tuple[int, int], ...]:
    """``["4x100@1000", "512@0"]`` -> four (100, 1000) chunks and one (512, 0)."""
    out: list[tuple[int, int]] = []
    for spec in specs:
        m = re.fullmatch(r"(?:(\d+)x)?(\d+)@(\d+)", spec)
        if not m or int(m.group(2)) < 1:
            raise ValueError(f"a chunk is NEW@CACHED or KxNEW@CACHED with NEW >= 1, not {spec!r}")
        out += [(int(m.group(2)), int(m.group(3)))] * int(m.group(1) or 1)
    return tuple(out)


def parse_decodes(spec: str) -> tuple[int, int]:
    """``"44x525"`` -> 44 decodes over 525-token contexts (``"0x0"``: none)."""
    m = re.fullmatch(r"(\d+)x(\d+)", spec)
    if not m or (int(m.group(1)) and int(m.group(2)) < 1):
        raise ValueError(f"decodes are DxCONTEXT with CONTEXT >= 1, not {spec!r}")
    return int(m.group(1)), int(m.group(2))


class MixedBatches:
    """The same step's batch again and again, on slots laid out once.

    Every step rewrites the same slots (each decode's last one, each chunk's
    new ones): writing a token's K/V again costs what the first write did.
    """

    def __init__(self, shape: StepShape, vocab: int, seed: int = 0) -> None:
        self.shape = shape
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)
        nxt = 0

        def take(n: int) -> list[int]:
            nonlocal nxt
            nxt += n
            return list(range(nxt - n, nxt))

        self.decode_slots = [take(shape.context) for _ in range(shape.decodes)]
        shared = take(max((c for _, c in shape.chunks), default=0)) if shape.shared_prefix else []
        self.chunk_slots = [
            (shared[:cached] if shape.shared_prefix else take(cached)) + take(new)
            for new, cached in shape.chunks
        ]
        self.slots_used = nxt

    def _ids(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab, n).tolist()

    def batch(self) -> ForwardBatch:
        seqs = [
            SeqInput(f"d{i}", pack_ids(self._ids(1)), pack_ids(slots))
            for i, slots in enumerate(self.decode_slots)
        ]
        chunks = zip(self.shape.chunks, self.chunk_slots, strict=True)
        seqs += [
            SeqInput(f"c{i}", pack_ids(self._ids(new)), pack_ids(slots))
            for i, ((new, _), slots) in enumerate(chunks)
        ]
        return ForwardBatch(0, seqs)


@dataclass
class OpTime:
    name: str
    calls_per_step: float
    ms_per_step: float


@dataclass
class MixedStepFigures:
    shape: str
    kernel: bool  # attention through the C++ kernels (else gather + SDPA)
    step_ms: float  # 20th percentile, unprofiled
    median_ms: float
    profiled_ms: float  # the profiled steps' CPU time in ops, per step
    ops: list[OpTime]


def measure(
    runner: ModelRunner, batches: MixedBatches, steps: int, profile_steps: int, warmup: int = 2
) -> MixedStepFigures:
    """Time ``steps`` unprofiled steps, then profile ``profile_steps`` more."""
    from torch.profiler import ProfilerActivity, profile

    def step() -> float:
        t0 = time.perf_counter()
        res = runner.forward(batches.batch())
        spent = time.perf_counter() - t0
        if res.error is not None:
            raise RuntimeError(res.error)
        return spent

    for _ in range(warmup):
        step()
    times = [step() for _ in range(steps)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(profile_steps):
            step()
    ops = [
        OpTime(e.key, e.count / profile_steps, e.self_cpu_time_total / 1e3 / profile_steps)
        for e in prof.key_averages()
    ]
    ops.sort(key=lambda o: o.ms_per_step, reverse=True)
    return MixedStepFigures(
        shape=batches.shape.describe(),
        kernel=runner.use_kernel,
        step_ms=float(np.percentile(times, 20)) * 1e3,
        median_ms=float(np.median(times)) * 1e3,
        profiled_ms=sum(o.ms_per_step for o in ops),
        ops=ops,
    )


def format_table(fig: MixedStepFigures, top: int) -> str:
    attention = "C++ kernels" if fig.kernel else "gather + SDPA"
    lines = [
        f"{fig.shape}: step {fig.step_ms:.1f} ms (p20; median {fig.median_ms:.1f}), "
        f"{fig.profiled_ms:.1f} ms a step in ops while profiled; attention: {attention}",
        f"{'op':<40} {'calls':>7} {'ms/step':>9} {'share':>6}",
    ]
    for o in fig.ops[:top]:
        share = 100 * o.ms_per_step / fig.profiled_ms if fig.profiled_ms else 0.0
        lines.append(f"{o.name:<40} {o.calls_per_step:>7.0f} {o.ms_per_step:>9.2f} {share:>5.1f}%")
    return "\n".join(lines)


def run(loaded: LoadedModel, shape: StepShape, args: argparse.Namespace) -> MixedStepFigures:
    """One shape on an arena of its own, sized for it."""
    batches = MixedBatches(shape, loaded.info.vocab_size)
    geometry = BlockGeometry(loaded.info.layout, BLOCK_BYTES, 1)
    blocks = max(1, -(-batches.slots_used // geometry.slots_per_block))
    with KVArena.create(blocks, BLOCK_BYTES) as arena:
        arena.populate()  # as the server's runner does: no page faults on K/V writes
        runner = ModelRunner(loaded, arena.view(geometry), args.attention_backend)
        return measure(runner, batches, args.steps, args.profile_steps)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--chunks", nargs="*", default=["512@0"], help="NEW@CACHED or KxNEW@CACHED")
    p.add_argument("--decodes", default="14x530", help="DxCONTEXT (0x0: none)")
    p.add_argument("--shared-prefix", action="store_true", help="the chunks share one prefix")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--profile-steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "cpp", "torch"])
    p.add_argument("--top", type=int, default=20, help="ops in the table")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        decodes, context = parse_decodes(args.decodes)
        shape = StepShape(parse_chunks(args.chunks), decodes, context, args.shared_prefix)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not shape.chunks and not shape.decodes:
        print("error: a step needs a chunk or a decode", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"[bench_mixed_step] loading {args.model} ({args.dtype})", file=sys.stderr, flush=True)
    loaded = load_model(args.model, args.dtype)
    fig = run(loaded, shape, args)
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} thread(s)")
    print(format_table(fig, args.top))
    out = args.out or RESULTS_DIR / f"mixed_step-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, **asdict(fig)}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
