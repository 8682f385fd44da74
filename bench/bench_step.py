"""Where one decode step of SmolLM2 goes: weight matmuls, paged attention, everything else.

Runs the real model (``load_model("smollm2", dtype="bfloat16")``, packed weights)
through radixmux's ``ModelRunner`` over a ``KVArena``, as the server's runner
does, and times decode steps at batch 1, 16 and 64 where every sequence has a
~1,100-token context, in three layouts:

``shared``
    every sequence's first 1,000 context slots are the *same* slot ids (one
    cached system prompt, as the radix cache hands out), then 100 of its own;
``cascade``
    the ``shared`` slots, with the batch's decodes sent as one prefix group
    sharing the 1,000-token prefix (``ForwardBatch.prefix_groups``, which the
    runner turns into ``PagedBatch.dec_groups``), so the C++ kernel's cascade
    path reads the prefix once per step instead of once per sequence (skipped
    where the runtime has no prefix groups; the same as ``shared`` where the
    C++ kernel is not in use);
``distinct``
    every sequence's 1,100 slots are its own.

Each step is split by timing hooks installed here only (monkeypatching, the
runtime is untouched):

* ``weights``: forward pre/post hooks on every linear layer of the decoder
  (packed or plain), i.e. the projection and MLP matmuls;
* ``logits``: the same hooks on the output embedding (``lm_head``), reported
  apart because it is a matmul that scales with the vocabulary, not the layers;
* ``attention``: a wrapper around ``paged_attention_forward`` re-registered
  under the runner's attention name (K/V write plus decode attention);
* ``other``: the rest of an *unhooked* step (Python, batch metadata, embedding,
  norms, rotary, sampling): unhooked step time minus the three above.

Hooked and unhooked steps alternate, so both see the same load from other
processes on shared cores; the hooks' own cost is shown as ``hook ovh``. Each
figure is the 20th-percentile step (a low percentile measures the machine; the
median mostly the neighbours). K/V values are whatever the arena holds
(zeros): attention's cost depends on how many rows it reads, not their values.

Every row is also held to the machine's memory roofline (``roofline.py``):
the streaming bandwidth is measured first (torch read and copy of a 512 MiB
array at ``--threads``, best of 5), and each row gets the bytes its step
must move at least (the weights as the runner holds them, in the copy the
step's row count reads; K/V read, the ``cascade`` layout's shared prefix once
per step where the C++ kernel runs it, every other layout's context per
sequence; K/V written), at the median context of the measured steps. The
table shows those MB, the GB/s the unhooked step reached (MB / step time),
that as a share of the measured bandwidth (``%bw``) and the step time at the
limit (``limit ms``); the JSON keeps the bandwidth figures and each row's bytes.

    .venv/bin/python -m bench.bench_step [--batches 1 16 64] [--steps 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bench.roofline import (
    STREAM_BYTES,
    Bandwidth,
    Roofline,
    WeightBytes,
    step_bytes,
    stream_bandwidth,
    weight_bytes,
)
from radixmux import protocol
from radixmux.common.server_args import ATTENTION_BACKENDS, KV_CACHE_DTYPES
from radixmux.memory.arena import KVArena
from radixmux.memory.layout import BlockGeometry, KVLayout
from radixmux.model_runners import paged_attention
from radixmux.model_runners.loader import LoadedModel, load_model
from radixmux.model_runners.model_runner import ModelRunner
from radixmux.model_runners.packed_linear import PackedLinear
from radixmux.protocol import (
    ForwardBatch,
    SeqInput,
    pack_ids,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
LAYOUTS = ("shared", "cascade", "distinct")
# 3 MiB blocks: a multiple of every K/V row size of the embedded models, so the
# store takes its fast whole-row path (as the server's default block size).
BLOCK_BYTES = 3 << 20


# ---- timing hooks ---------------------------------------------------------------------
@dataclass
class Buckets:
    """Seconds spent in each hooked part during the current step."""

    weights: float = 0.0
    logits: float = 0.0
    attention: float = 0.0

    def reset(self) -> None:
        self.weights = self.logits = self.attention = 0.0


class StepTimer:
    """Timing hooks on linear layers and the paged attention function.

    ``enabled`` switches the accounting (and the clock reads) off without
    removing anything, so hooked and unhooked steps can alternate.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.buckets = Buckets()
        self.enabled = False
        self._handles: list[Any] = []
        self._started: dict[int, float] = {}
        self._original = paged_attention.paged_attention_forward

    def _hook(self, module: nn.Module, bucket: str) -> None:
        def pre(mod: nn.Module, _args: object) -> None:
            if self.enabled:
                self._started[id(mod)] = time.perf_counter()

        def post(mod: nn.Module, _args: object, _out: object) -> None:
            if self.enabled:
                spent = time.perf_counter() - self._started.pop(id(mod))
                setattr(self.buckets, bucket, getattr(self.buckets, bucket) + spent)

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _timed_attention(self, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return self._original(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return self._original(*args, **kwargs)
        finally:
            self.buckets.attention += time.perf_counter() - t0

    @contextlib.contextmanager
    def installed(self) -> Iterator[StepTimer]:
        """Hook the linear layers and wrap the attention function; undo both after.

        transformers looks the attention function up by name on every layer
        call, so re-registering the runner's name is enough (the runtime
        module is not edited).
        """
        from transformers import AttentionInterface

        head = self.model.get_output_embeddings()
        for module in self.model.modules():
            if isinstance(module, (nn.Linear, PackedLinear)):
                self._hook(module, "logits" if module is head else "weights")
        AttentionInterface.register(paged_attention.ATTN_NAME, self._timed_attention)
        try:
            yield self
        finally:
            AttentionInterface.register(paged_attention.ATTN_NAME, self._original)
            for h in self._handles:
                h.remove()
            self._handles.clear()


# ---- workload -------------------------------------------------------------------------
@dataclass
class Decoding:
    """A batch of sequences being decoded, with their context slots."""

    slots: list[list[int]]
    next_slot: int
    tokens: list[int] = field(default_factory=list)
    # Leading slots every sequence shares, announced to the runner as one
    # prefix group (the cascade path); 0: no groups.
    group_prefix: int = 0

    def batch(self) -> ForwardBatch:
        """One decode step: each sequence adds its last token at a fresh slot."""
        seqs = []
        for i, ctx in enumerate(self.slots):
            ctx.append(self.next_slot)
            self.next_slot += 1
            seqs.append(SeqInput(f"r{i}", pack_ids(self.tokens[i : i + 1]), pack_ids(ctx)))
        if not self.group_prefix:
            return ForwardBatch(0, seqs)
        group = protocol.PrefixGroup(self.group_prefix, list(range(len(seqs))))
        return ForwardBatch(0, seqs, prefix_groups=[group])


def contexts(batch: int, layout: str, prefix: int, own: int, rng: np.random.Generator) -> Decoding:
    """``batch`` contexts of ``prefix + own`` slots; ``shared`` gives all the same prefix slots."""
    nxt = 0
    shared = list(range(prefix))
    if layout != "distinct":
        nxt = prefix
    slots = []
    for _ in range(batch):
        if layout != "distinct":
            ctx = shared + list(range(nxt, nxt + own))
            nxt += own
        else:
            ctx = list(range(nxt, nxt + prefix + own))
            nxt += prefix + own
        slots.append(ctx)
    group = prefix if layout == "cascade" else 0
    return Decoding(slots, nxt, rng.integers(100, 10_000, batch).tolist(), group)


def slots_needed(batches: Sequence[int], prefix: int, own: int, steps: int) -> int:
    """Arena slots for the largest configuration (the distinct layout) over ``steps``."""
    return max(batches) * (prefix + own + steps)


def cascade_available() -> bool:
    """Whether the runtime takes prefix groups (``ForwardBatch.prefix_groups``, which the
    runner turns into ``PagedBatch.dec_groups`` for the cascade kernel)."""
    return hasattr(protocol, "PrefixGroup") and "prefix_groups" in ForwardBatch.__struct_fields__


# ---- measuring ------------------------------------------------------------------------
@dataclass
class StepFigures:
    """One configuration's step, in milliseconds (20th percentile of each part)."""

    batch: int
    layout: str
    context: int
    total_ms: float  # unhooked step
    weights_ms: float
    logits_ms: float
    attention_ms: float
    other_ms: float
    hooked_ms: float  # hooked step (its excess over total_ms is the hooks' cost)
    steps: int
    kernel: bool  # decode attention in the C++ kernel (else gather + SDPA, which ignores groups)
    roofline: Roofline | None = None  # the unhooked step against the memory bandwidth

    @property
    def hook_overhead_ms(self) -> float:
        return self.hooked_ms - self.total_ms

    @property
    def median_context(self) -> int:
        """Context of the median measured step (``context`` is the last step's: each
        measured step pair adds two tokens)."""
        return self.context - self.steps


def _p20(xs: Sequence[float]) -> float:
    return float(np.percentile(xs, 20)) * 1e3


def measure(
    runner: ModelRunner,
    timer: StepTimer,
    decoding: Decoding,
    steps: int,
    warmup: int,
    layout: str,
) -> StepFigures:
    """Alternate hooked and unhooked decode steps; the 20th percentile of each part."""

    def step(hooked: bool) -> float:
        timer.enabled = hooked
        timer.buckets.reset()
        t0 = time.perf_counter()
        res = runner.forward(decoding.batch())
        spent = time.perf_counter() - t0
        assert res.error is None, res.error
        decoding.tokens = [o.token_id for o in res.outputs]
        assert min(decoding.tokens) >= 0, [getattr(o, "error", None) for o in res.outputs]
        return spent

    for _ in range(warmup):
        step(False)
        step(True)
    plain: list[float] = []
    hooked: list[float] = []
    parts: dict[str, list[float]] = {"weights": [], "logits": [], "attention": []}
    for _ in range(steps):
        plain.append(step(False))
        hooked.append(step(True))
        for name, xs in parts.items():
            xs.append(getattr(timer.buckets, name))
    timer.enabled = False
    total = _p20(plain)
    w, lg, at = (_p20(parts[k]) for k in ("weights", "logits", "attention"))
    return StepFigures(
        batch=len(decoding.slots),
        layout=layout,
        context=len(decoding.slots[0]),
        total_ms=total,
        weights_ms=w,
        logits_ms=lg,
        attention_ms=at,
        other_ms=total - w - lg - at,
        hooked_ms=_p20(hooked),
        steps=steps,
        kernel=runner.use_kernel,
    )


def format_table(rows: Sequence[StepFigures]) -> str:
    """One line per (batch, layout): the step and its parts, in ms and % of the step;
    ``attn/shared`` is the row's attention time over the shared layout's at its batch."""

    def part(ms: float, total: float) -> str:
        return f"{ms:8.1f} {100 * ms / total:3.0f}%" if total > 0 else f"{ms:8.1f}   -"

    shared = {r.batch: r.attention_ms for r in rows if r.layout == "shared"}

    def vs_shared(r: StepFigures) -> str:
        base = shared.get(r.batch)
        return "-" if r.layout == "shared" or not base else f"{r.attention_ms / base:.2f}x"

    def roof(r: StepFigures) -> str:
        f = r.roofline
        if f is None:
            return ""
        return (
            f" {f.bytes.total / 1e6:7.1f} {f.achieved_gbs:6.1f} {100 * f.fraction:4.0f}% "
            f"{f.limit_ms:8.1f}"
        )

    head = (
        f"{'batch':>5} {'layout':<9} {'ctx':>5} {'step ms':>8} {'tok/s':>7} "
        f"{'weights':>13} {'logits':>13} {'attention':>13} {'other':>13} "
        f"{'attn/shared':>11} {'hook ovh':>8}"
        f" {'MB/step':>7} {'GB/s':>6} {'%bw':>5} {'limit ms':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.batch:>5} {r.layout:<9} {r.context:>5} {r.total_ms:8.1f} "
            f"{1e3 * r.batch / r.total_ms:7.0f} "
            f"{part(r.weights_ms, r.total_ms):>13} {part(r.logits_ms, r.total_ms):>13} "
            f"{part(r.attention_ms, r.total_ms):>13} {part(r.other_ms, r.total_ms):>13} "
            f"{vs_shared(r):>11} {r.hook_overhead_ms:8.1f}{roof(r)}"
        )
    return "\n".join(lines)


def roofline_of(
    r: StepFigures,
    weights: WeightBytes,
    layout: KVLayout,
    prefix_once: int,
    bandwidth: Bandwidth,
) -> Roofline:
    """Row ``r``'s step against ``bandwidth``; ``prefix_once``: context tokens the
    kernel reads once per step for the whole batch (the cascade prefix), else 0."""
    moved = step_bytes(weights.read, layout, r.batch, r.median_context, prefix_once)
    return Roofline.of(moved, r.total_ms, bandwidth)


def run(
    loaded: LoadedModel,
    args: argparse.Namespace,
    progress: Callable[[str], None],
    bandwidth: Bandwidth,
) -> list[StepFigures]:
    """Every (batch, layout) configuration on one arena, each held to ``bandwidth``;
    returns their figures."""
    layout = loaded.info.layout
    # Every step, hooked or not, takes a fresh slot per sequence.
    need = slots_needed(args.batches, args.prefix, args.own, 2 * (args.steps + args.warmup))
    geometry = BlockGeometry(layout, BLOCK_BYTES, 1)
    num_blocks = -(-need // geometry.slots_per_block)
    rng = np.random.default_rng(0)
    rows: list[StepFigures] = []
    with KVArena.create(num_blocks, BLOCK_BYTES) as arena:
        arena.populate()  # as the server's runner does: no page faults on K/V writes
        # The lean stack skips the module calls the timing hooks ride on: with it
        # only the whole step is measured (the parts read 0, "other" the step).
        runner = ModelRunner(
            loaded,
            arena.view(geometry),
            args.attention_backend,
            lean=args.lean,
            deterministic=args.deterministic,
        )
        if "cascade" in args.layouts and not runner.use_kernel:
            progress("decode kernel not in use: the cascade layout runs as plain shared")
        timer = StepTimer(loaded.model)
        with timer.installed():
            for b in args.batches:
                for lay in args.layouts:
                    if lay == "cascade" and not cascade_available():
                        continue
                    dec = contexts(b, lay, args.prefix, args.own, rng)
                    r = measure(runner, timer, dec, args.steps, args.warmup, lay)
                    once = args.prefix if lay == "cascade" and runner.use_kernel else 0
                    weights = weight_bytes(loaded.model, b)
                    r.roofline = roofline_of(r, weights, layout, once, bandwidth)
                    rows.append(r)
                    progress(
                        f"batch {b:>3} {lay:<8}: step {r.total_ms:6.1f} ms "
                        f"(weights {r.weights_ms:.1f}, attention {r.attention_ms:.1f}; "
                        f"{100 * r.roofline.fraction:.0f}% of the bandwidth)"
                    )
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--prefix", type=int, default=1000, help="context slots shared in 'shared'")
    p.add_argument("--own", type=int, default=100, help="context slots of each sequence's own")
    p.add_argument("--steps", type=int, default=20, help="measured steps per kind (hooked/not)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads (default: every core, as one model's runner gets when alone)",
    )
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    p.add_argument(
        "--kv-cache-dtype",
        choices=tuple(KV_CACHE_DTYPES),
        default="auto",
        help="the arena's K/V dtype (fp8: float8 e4m3, docs/kernels.md#float8-kv-cache)",
    )
    p.add_argument(
        "--no-fused-ops",
        action="store_true",
        help="transformers' own RMSNorm / MLP / rotary code (the server's --disable-fused-ops)",
    )
    p.add_argument(
        "--lean",
        action="store_true",
        help="the server's lean Llama stack (lean_stack.py): whole step only, no parts",
    )
    p.add_argument(
        "--no-amx",
        action="store_true",
        help="oneDNN for every linear call (no small-batch kernel: AMX tiles or AVX512-BF16)",
    )
    p.add_argument(
        "--stream-mib",
        type=int,
        default=STREAM_BYTES >> 20,
        help="array size of the bandwidth measurement (well above the L3 cache)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="the server's --deterministic arithmetic (docs/kernels.md#deterministic-mode)",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/)")
    return p.parse_args(argv)


def weights_note(loaded: LoadedModel, batches: Sequence[int]) -> str:
    """Which weight copies each batch's step reads, and their bytes."""
    parts = []
    for b in batches:
        w = weight_bytes(loaded.model, b)
        copies = ", ".join(f"{n} {kind}" for kind, n in sorted(w.copies.items()))
        parts.append(f"batch {b}: {w.read / 1e6:.1f} MB (linear layers read from: {copies})")
    held = weight_bytes(loaded.model, 1).held
    return f"weights read per step: {'; '.join(parts)}; held in all: {held / 1e6:.1f} MB"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # Before the model and the arena: the arrays need a GiB for a moment.
    bandwidth = stream_bandwidth(args.threads, args.stream_mib << 20)
    print(
        f"[bench_step] streaming bandwidth, {args.threads} thread(s): "
        f"read {bandwidth.read_gbs:.1f} GB/s, copy {bandwidth.copy_gbs:.1f} GB/s",
        file=sys.stderr,
    )
    loaded = load_model(
        args.model,
        dtype=args.dtype,
        fuse_ops=not args.no_fused_ops,
        amx_linear=not args.no_amx,
        kv_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype],
        deterministic=args.deterministic,
    )
    if "cascade" in args.layouts and not cascade_available():
        print("note: no ForwardBatch.prefix_groups in this runtime: the cascade layout is skipped")
    t0 = time.monotonic()
    rows = run(loaded, args, lambda line: print(f"[bench_step] {line}", file=sys.stderr), bandwidth)
    print(
        f"\n{args.model} {args.dtype} (KV {loaded.info.layout.dtype}), {args.threads} thread(s), "
        f"fused ops {'off' if args.no_fused_ops else 'on'}, "
        f"AMX linear {'off' if args.no_amx or args.no_fused_ops else 'on'}, "
        f"{'lean stack (parts not measured)' if args.lean else 'transformers forward'}, "
        f"{'deterministic, ' if args.deterministic else ''}decode step at context "
        f"{args.prefix}+{args.own} (shared: first {args.prefix} slots identical); "
        f"20th-percentile of {args.steps} steps; other = step - weights - logits - attention"
    )
    print(
        f"roofline: streaming read {bandwidth.read_gbs:.1f} GB/s, copy "
        f"{bandwidth.copy_gbs:.1f} GB/s (best of {bandwidth.reps}, "
        f"{bandwidth.array_bytes >> 20} MiB); limit {bandwidth.limit_gbs:.1f} GB/s; "
        f"{weights_note(loaded, args.batches)}; MB/step = weights + K/V read + K/V written "
        "(bench/roofline.py), GB/s = MB/step / step ms"
    )
    print(format_table(rows))
    out = args.out or RESULTS_DIR / f"bench_step-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cascade": cascade_available(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "wall_s": time.monotonic() - t0,
        "bandwidth": {**dataclasses.asdict(bandwidth), "limit_gbs": bandwidth.limit_gbs},
        "weights": {b: dataclasses.asdict(weight_bytes(loaded.model, b)) for b in args.batches},
    }
    rows_json = [
        {
            **dataclasses.asdict(r),
            "hook_overhead_ms": r.hook_overhead_ms,
            "median_context": r.median_context,
            "bytes_total": r.roofline.bytes.total if r.roofline else None,
        }
        for r in rows
    ]
    out.write_text(json.dumps({"meta": meta, "rows": rows_json}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
