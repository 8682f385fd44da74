"""A decode step's memory roofline: the machine's streaming bandwidth, measured, and the
bytes one step must move at least (``bench_step.py`` puts the two beside each step time).

Bandwidth (``stream_bandwidth``): torch on a float32 array of ``array_bytes``
(default 512 MiB, 16x this machine's 32 MiB L3), at the thread count the step
runs with, best of ``reps`` repetitions each of

* ``read``: ``torch.sum`` over the array (bytes: the array once);
* ``copy``: ``dst.copy_(src)`` (bytes: read + written, counted as STREAM does,
  without the write-allocate read a cache may add).

The limit a step is held to is the higher of the two.

Bytes of one decode step (``step_bytes``), each counted where it lives in memory:

* weights: every parameter the step reads, as the runner holds it. A linear
  layer (a ``PackedLinear`` after ``load_model``) is counted once, in the copy
  its call at the step's row count reads: the small-batch kernel's tiles
  where the row count is within the layer's kernel limit, a float32 layer's
  compact copy (bfloat16 or a grid) where it is widened per call, else oneDNN's
  packed copy (a layer holding both is counted in the one it reads;
  ``WeightBytes.held`` counts every copy). The output projection counts in
  full (it multiplies every sampled row). The input embedding counts only the
  rows the batch looks up; norms and other small parameters in full.
* K/V read: per sequence, its context tokens x ``KVLayout.bytes_per_token``,
  except in the ``cascade`` layout where the C++ kernel is in use: there the
  shared prefix is read once per step (the kernel's cascade path) and each
  sequence's own tokens per sequence. In ``shared`` every sequence's kernel
  call reads the prefix rows again (the same slots: likely from the cache, so
  its achieved GB/s may pass the limit).
* K/V written: one token per sequence.

Left out: activations and logits (``batch x vocab`` values, 6 MB at batch 64
for SmolLM2), intermediates that fit in the caches rather than operands that
must come from memory.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from radixmux.memory.layout import KVLayout
from radixmux.model_runners.packed_linear import PackedLinear

STREAM_BYTES = 512 << 20
STREAM_REPS = 5


@dataclass(frozen=True)
class Bandwidth:
    """Streaming bandwidth of this machine at one thread count, GB/s (1e9 bytes)."""

    read_gbs: float
    copy_gbs: float
    array_bytes: int
    threads: int
    reps: int

    @property
    def limit_gbs(self) -> float:
        """The fastest the machine was seen to stream: what a step is held to."""
        return max(self.read_gbs, self.copy_gbs)


def _best_seconds(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def stream_bandwidth(
    threads: int, array_bytes: int = STREAM_BYTES, reps: int = STREAM_REPS
) -> Bandwidth:
    """Measure read and copy bandwidth with ``threads`` torch threads (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(array_bytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)  # every page touched before timing
        read = _best_seconds(lambda: float(src.sum()), reps)
        copy = _best_seconds(lambda: dst.copy_(src), reps)
    finally:
        torch.set_num_threads(before)
    n = src.numel() * src.element_size()
    return Bandwidth(n / read / 1e9, 2 * n / copy / 1e9, n, threads, reps)


def _nbytes(t: torch.Tensor | None) -> int:
    # numel x itemsize: oneDNN's packed (opaque) tensors have no storage to ask.
    # A "meta" tensor (a tied embedding's weight once it reads the head's tiles,
    # tied_embedding.py) keeps a shape but holds nothing.
    return 0 if t is None or t.is_meta else t.numel() * t.element_size()


@dataclass(frozen=True)
class WeightBytes:
    """Weight bytes one step reads at a row count, and what the model holds in all."""

    read: int
    held: int
    copies: dict[str, int]  # linear layers by the copy counted: "kernel tiles", ...


def _linear_read(module: nn.Module, rows: int) -> tuple[str, int]:
    """The copy a linear layer's call at ``rows`` rows reads, and its bytes."""
    if isinstance(module, PackedLinear):
        bias = _nbytes(module.bias)
        if module.widen is not None:
            return f"{module.widen_kind} widened", _nbytes(module.widen) + bias
        if module.amx is not None and (rows <= module.amx_max_rows or module.packed is None):
            # Above the limit without a oneDNN copy, the tiles are unpacked per call.
            return "kernel tiles", _nbytes(module.amx) + bias
        return "oneDNN packed", _nbytes(module.packed) + bias
    return "plain", _nbytes(module.weight) + _nbytes(module.bias)


def weight_bytes(model: nn.Module, rows: int) -> WeightBytes:
    """Parameter bytes a step of ``rows`` rows reads (the module docstring's rule)."""
    read = held = 0
    copies: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, (PackedLinear, nn.Linear)):
            kind, n = _linear_read(module, rows)
            copies[kind] += 1
            read += n
            held += sum(
                _nbytes(getattr(module, a, None))
                for a in ("amx", "packed", "widen", "weight", "bias")
            )
        elif isinstance(module, nn.Embedding):
            # Only the looked-up rows (from the head's tiles where tied and packed).
            read += rows * module.embedding_dim * module.weight.dtype.itemsize
            held += _nbytes(module.weight)
        else:
            own = sum(_nbytes(p) for p in module.parameters(recurse=False))
            read += own
            held += own
    return WeightBytes(read, held, dict(copies))


@dataclass(frozen=True)
class StepBytes:
    """The bytes one decode step moves at least (the module docstring's rule)."""

    weights: int
    kv_read: int
    kv_written: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_read + self.kv_written


def step_bytes(
    weights: int, layout: KVLayout, batch: int, context: int, prefix_read_once: int
) -> StepBytes:
    """``batch`` sequences of ``context`` tokens each; the first ``prefix_read_once``
    of them shared and read once per step (0: every token read per sequence)."""
    per_token = layout.bytes_per_token
    tokens = prefix_read_once + batch * (context - prefix_read_once)
    return StepBytes(weights, tokens * per_token, batch * per_token)


@dataclass(frozen=True)
class Roofline:
    """One step against the limit: its bytes, the rate it reached, and the time at
    the measured bandwidth."""

    bytes: StepBytes
    achieved_gbs: float
    fraction: float  # achieved / the limit (1.0: at the limit)
    limit_ms: float  # the step's bytes at the limit

    @classmethod
    def of(cls, moved: StepBytes, step_ms: float, bandwidth: Bandwidth) -> Roofline:
        achieved = moved.total / (step_ms * 1e-3) / 1e9 if step_ms > 0 else 0.0
        return cls(
            moved,
            achieved,
            achieved / bandwidth.limit_gbs,
            moved.total / bandwidth.limit_gbs / 1e6,
        )
