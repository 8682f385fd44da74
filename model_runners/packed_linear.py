"""Linear layers with their weights pre-packed for oneDNN (CPU).

A plain ``F.linear`` on CPU hands oneDNN a row-major weight that it re-blocks
on every call; at decode sizes (a few to a few dozen rows) that re-blocking
costs as much as the multiply. Packing each weight once into oneDNN's own
layout (what torch.compile's CPU freezing pass does) measured 1.8-2.4x faster
at 1-16 rows and 1.1-1.3x at 64-512 rows here, with identical bfloat16
results. The packed copy replaces the module's weight; a weight the model
also uses elsewhere (an lm_head tied to the embeddings) stays in place and
costs its size again.

Where the CPU has AMX (bfloat16 tiles), bfloat16 layers keep their weight in
the tile layout of ``kernels/amx_linear.cpp`` instead, and calls of up to
``AMX_MAX_ROWS`` rows (every decode step, and prefill chunks of up to 2,048
tokens; 768 for a gated MLP's wide up projection, 160 beside a oneDNN copy) run there: oneDNN spends
~20 us per call at decode sizes whatever the matrix, the tile kernel 3.5-10 us
for SmolLM2's layers at 1-16 rows, with the same float accumulation and one
rounding (results equal oneDNN's but for rare last-bit differences). Larger
calls stay on oneDNN, whose deeper blocking wins there, and keep its results:
oneDNN multiplies the tiles unpacked into a row-major scratch weight for the
call (``unpack_tiles``; oneDNN gives a row-major weight's product the packed
copy's bits), so the tiles are the layer's only copy. A second, oneDNN-packed
copy (``onednn_copy``, ``--linear-onednn-copy``) saves that unpacking and
re-blocking (~10% of a 192-row call, ~1% of a 2,048-row one) for the
weights' size again. The output projection only ever multiplies the rows of
sampled sequences: it keeps the tile copy alone and takes the kernel for every
call (oneDNN is 10-35% ahead there from 33 to 64 rows, a fraction of a percent
of such a step); a tied input embedding reads its rows from those tiles too
(``tied_embedding.py``), so a vocabulary-sized matrix (335 MB for Gemma 3's)
is held once.

Without AMX but with AVX512-BF16, the same kernel runs the same layout with
dot-product instructions, to lower row limits (``DOT_LIMITS``).

Below AVX-512 (AVX2 + FMA), where models run in float32, a float32 layer whose
values fit a compact form keeps them in it and ``kernels/widen_linear.cpp``
widens them in registers for every call (``widen``): the same float32 values,
float32 products and sums, one copy, fewer bytes per step. The forms, first
that fits (``compact_copy``): a 4-bit or an 8-bit grid per 32 inputs (a model
de-quantised from GGUF, as the embedded ones are: 6 or 10 bits a weight read),
then bfloat16 (a model published in bfloat16: 16 bits). On a 2-core AMD EPYC
(AVX2, no AVX-512) SmolLM2's 30 layers took 6.6 / 8.6 / 10.2 ms (4-bit grid /
8-bit grid / bfloat16) at 1 row against 35 ms through torch's float32 product
(MKL takes a generic path on AMD), 24-32 vs 80-95 ms at 16 rows, 317-352 vs
452-459 ms at 256 (``bench/bench_linear.py --widen``, kernels.md).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from radixmux.model_runners.tied_embedding import BLOCK_N, embed_from_tiles

log = logging.getLogger("radixmux.runner")

_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN builds (and caches, up to 1,024) one primitive per input shape, each
# holding JIT code and buffers. A server's batches come in every row count up
# to chunked prefill + running requests, which would keep that cache churning
# and the process growing by hundreds of MB. Above this many rows a call is
# padded up to a multiple of it, so at most ROW_GRAIN + (max rows / ROW_GRAIN)
# shapes occur, and ``warm_up`` builds them all at start. (Cutting a call into
# a multiple plus a remainder instead, as before, cost a second call and a
# concatenation of the outputs: a 2,048-token prefill with 8 decodes took
# 795 ms against 459 ms for its two halves apart; padded, 491 ms.)
ROW_GRAIN = 64
# Row counts up to which the AMX tile kernel beats oneDNN (2 threads, oneDNN at
# its padded row count). Since the kernel splits large calls by rows (the
# activations then stay in the core that wrote them, amx_linear.cpp), it is
# ahead of oneDNN on SmolLM2's narrow shapes up to 2,048 rows in the model
# (whole steps, interleaved: 8 decodes + a 1,024-token chunk 308 -> 247 ms,
# 16 + 1,500 430 -> 395, 16 + 2,032 a tie); before that split it was behind
# from 1,024 rows and the limit was 768. A wide matrix (a gated MLP's merged
# gate and up projection, 5-6x as many outputs as inputs) up to 768 rows:
# without a oneDNN copy, oneDNN's calls first unpack the 3.5 MB of tiles (~0.3
# ms), and the 30 layers' weights cycled (as a step reads them) the kernel
# took 433 / 945 / 1,785 / 4,539 us at 192 / 512 / 1,024 / 2,048 rows against
# oneDNN's 776 / 1,176 / 1,664 / 2,792; whole steps alternating the two limits
# (a chunk beside decodes over 600 tokens): 250 + 8 decodes 90.1-93.1 ->
# 74.5-76.9 ms, 500 + 4 126.6-128.0 -> 116.7-118.7, 700 + 16 174.5-176.3 ->
# 167.2-168.2, 880 + 8 a tie, 1,000 + 20 behind. With a oneDNN copy (nothing
# to unpack) the limit stays where it was measured first, 160 rows (0.9-1.0x,
# then 1.1-1.3x from 192).
AMX_MAX_ROWS = 2048
AMX_MAX_ROWS_WIDE = 768
AMX_MAX_ROWS_WIDE_COPY = 160
# A layer that runs on the tile kernel at any row count and keeps no oneDNN copy.
AMX_ALL_ROWS = sys.maxsize
# Without AMX, the same kernel's AVX512-BF16 dot products (one weight pass per
# four rows) against oneDNN (bench/bench_linear.py, SmolLM2's shapes, 2 threads,
# a 2-core AMD EPYC with AVX512-BF16 and no AMX): 0.2-0.5x oneDNN's time at 1
# row, 0.5-0.8x at 16, 0.8-1.0x at 128; from 256 rows both run at the cores'
# bfloat16 peak and oneDNN is 0-24% ahead but on the wide gate_up (0.89x at
# 256). The output projection keeps the kernel's copy alone: 0.5-0.97x up to
# 128 rows, 0.95-1.13x above, where it rarely goes (one row per sampled
# sequence), for no vocabulary-sized second copy.
# Those limits hold against oneDNN's own packed copy (--linear-onednn-copy).
# Without it (the default: one copy of each weight), oneDNN multiplies the
# tiles unpacked for the call, and the kernel is ahead at every row count
# (same host, 2 threads, us per call, kernel / unpacked oneDNN:
# 576x576 at 256 rows 415 / 475, at 2,048 3,311 / 3,504; 576x3072 1,979 / 2,394
# and 16,013 / 19,391; 1536x576 1,091 / 1,605 and 8,822 / 8,850; a random
# 512-token workload at concurrency 4 on vLLM's client went 54 -> 67 output
# tok/s with every call on the kernel), so there calls of any size stay on it
# (pack_linear_weights).
DOT_MAX_ROWS = 128
DOT_MAX_ROWS_WIDE = 256
DOT_HEAD_ROWS = AMX_ALL_ROWS
# Deterministic mode (``--deterministic``) hands oneDNN at least this many
# rows: for one row it takes a matrix-vector kernel whose sums run in another
# order than its matrix kernel's (float32, K=1536, seen here), so a decode
# alone would round differently from the same row in a batch.
DETERMINISTIC_MIN_ROWS = 2
WIDEN_ENV = "RADIXMUX_WIDEN_LINEAR"


@dataclass(frozen=True)
class SmallKernelLimits:
    """Row counts up to which bfloat16 calls take the small-batch kernel
    (``kernels/amx_linear.cpp``) instead of oneDNN."""

    kind: str  # "AMX tiles" or "AVX512-BF16 dot products"
    rows: int
    rows_wide: int  # a gated MLP's merged gate and up projection
    head_rows: int  # the output projection (AMX_ALL_ROWS: no oneDNN copy)

    def for_layer(self, linear: nn.Linear, is_head: bool) -> int:
        """The limit of one layer."""
        if is_head:
            return self.head_rows
        return self.rows_wide if linear.out_features >= 4 * linear.in_features else self.rows


AMX_LIMITS = SmallKernelLimits("AMX tiles", AMX_MAX_ROWS, AMX_MAX_ROWS_WIDE, AMX_ALL_ROWS)
DOT_LIMITS = SmallKernelLimits(
    "AVX512-BF16 dot products", DOT_MAX_ROWS, DOT_MAX_ROWS_WIDE, DOT_HEAD_ROWS
)


class PackedLinear(nn.Module):
    """``nn.Linear`` whose weight lives in oneDNN's blocked layout, or (bfloat16,
    where the small-batch kernel runs) in the kernel's tiles, or (float32 with
    ``widen``) as bfloat16 widened per call."""

    def __init__(
        self,
        linear: nn.Linear,
        amx_max_rows: int = 0,
        onednn_copy: bool = True,
        min_rows: int = 1,
        widen: bool = False,
    ) -> None:
        super().__init__()
        # Float32 calls of any row count on the widening kernel (None: not used).
        self.widen: torch.Tensor | None = None
        self.widen_kind = ""
        if widen:
            copy = compact_copy(linear.weight) if linear.weight.dtype == torch.float32 else None
            if copy is None:
                raise ValueError(
                    "widen: the weight must be float32 holding bfloat16 values or a 4/8-bit grid"
                )
            self.widen_kind, self.widen = copy
        self.min_rows = min_rows  # oneDNN calls are padded to at least this many rows
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.dtype = weight.dtype
        # Calls of at most this many rows use the AMX tile copy (0: none kept).
        self.amx_max_rows = amx_max_rows if weight.dtype == torch.bfloat16 else 0
        self.amx = torch.ops.radixmux.amx_pack(weight) if self.amx_max_rows else None
        if self.widen is not None:
            self.packed = None
            return
        # Calls above the limit run on oneDNN: from its own packed copy, or
        # without one from the tiles unpacked for the call (same results).
        # The batch-size hint only picks the blocking; any row count works after.
        keep = self.amx is None or (onednn_copy and self.amx_max_rows != AMX_ALL_ROWS)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64) if keep else None

    @property
    def onednn_rows(self) -> bool:
        """Whether some calls (above ``amx_max_rows``) run on oneDNN."""
        return self.widen is None and (self.amx is None or self.amx_max_rows != AMX_ALL_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.widen is not None:
            return torch.ops.radixmux.widen_linear(x, self.widen, self.bias, self.out_features)
        rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
        if rows <= self.amx_max_rows and self.amx is not None:  # (0 rows, no copy: oneDNN)
            return torch.ops.radixmux.amx_linear(x, self.amx, self.bias, self.out_features)
        grain = max(padded_rows(rows), self.min_rows)
        if grain == rows:
            return self._linear(x)
        # The pad rows are zeros (not whatever memory held: denormals or NaNs
        # there would cost time, never the real rows' values).
        padded = x.new_zeros(grain, x.shape[-1])
        padded[:rows] = x.reshape(rows, x.shape[-1])
        return self._linear(padded)[:rows].reshape(*x.shape[:-1], self.out_features)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        # oneDNN on the row-major weight gives the packed copy's bits (tested),
        # re-blocking it per call: 0-3% at these sizes, plus the unpacking
        # (0.3 ms for a 576x3072 weight, 9% of a 192-row call, 1% at 2,048).
        weight = unpack_tiles(self.amx, self.out_features, self.in_features)
        return torch.nn.functional.linear(x, weight, self.bias)

    def extra_repr(self) -> str:
        amx = f", amx up to {self.amx_max_rows} rows" if self.amx_max_rows else ""
        copy = ", oneDNN copy" if self.packed is not None and self.amx is not None else ""
        if self.widen is not None:
            amx, copy = "", f", {self.widen_kind} widened per call"
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, packed{amx}{copy}"


class _Scratch:
    """One row-major weight at a time, for the call in progress (the runner
    makes one call at a time): sized to the largest weight unpacked so far."""

    buffer = torch.empty(0, dtype=torch.int32)


def unpack_tiles(tiles: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The ``[rows, cols]`` bfloat16 weight that ``amx_pack`` tiled into ``tiles``
    (``[N/16][K/2][16][2]``), in a scratch buffer valid until the next call.
    Each k pair is one 32-bit word: the unpacking is a transpose of words."""
    blocks, pairs = tiles.shape[0], tiles.shape[1]
    need = blocks * BLOCK_N * pairs
    if _Scratch.buffer.numel() < need:
        _Scratch.buffer = torch.empty(need, dtype=torch.int32)
    words = _Scratch.buffer[:need].view(blocks, BLOCK_N, pairs)
    words.copy_(tiles.view(torch.int32).view(blocks, pairs, BLOCK_N).transpose(1, 2))
    weight = words.view(blocks * BLOCK_N, pairs).view(torch.bfloat16)[:rows, :cols]
    return weight if weight.is_contiguous() else weight.contiguous()


@functools.cache
def packing_works(dtype: torch.dtype) -> bool:
    """Whether this CPU and torch build pack and run ``dtype`` correctly."""
    try:
        lin = nn.Linear(32, 48).to(dtype)
        x = torch.randn(3, 32).to(dtype)
        got = PackedLinear(lin)(x)
        want = lin(x)
        return bool(torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2))
    except (RuntimeError, AttributeError):
        return False


def amx_available() -> bool:
    """Whether the kernel library is built and this process may use AMX tiles."""
    from radixmux.model_runners import paged_decode

    return paged_decode.load() and bool(torch.ops.radixmux.has_amx_linear())


def small_kernel_limits() -> SmallKernelLimits | None:
    """The small-batch kernel's limits on this CPU: AMX tiles, else AVX512-BF16
    dot products, else None (oneDNN for every call)."""
    from radixmux.model_runners import paged_decode

    if amx_available():
        return AMX_LIMITS
    if paged_decode.load() and bool(torch.ops.radixmux.has_dpbf16_linear()):
        return DOT_LIMITS
    return None


def padded_rows(rows: int) -> int:
    """The row count a ``PackedLinear`` call of ``rows`` rows hands oneDNN."""
    return rows if rows <= ROW_GRAIN else -(-rows // ROW_GRAIN) * ROW_GRAIN


def row_counts(max_rows: int) -> list[int]:
    """Every row count a ``PackedLinear`` call makes for inputs of up to ``max_rows`` rows."""
    small = range(1, min(max_rows, ROW_GRAIN) + 1)
    return [*small, *range(2 * ROW_GRAIN, padded_rows(max_rows) + 1, ROW_GRAIN)]


@torch.inference_mode()
def warm_up(model: nn.Module, max_rows: int, max_sequences: int | None = None) -> int:
    """Run every packed weight shape once at every row count a batch of up to
    ``max_rows`` tokens can make, so oneDNN builds its primitives now: memory
    is taken at start (not creeping up while serving) and no request waits for
    a kernel to be generated. The output projection only ever sees one row
    per sampled sequence, so it is warmed up to ``max_sequences`` rows (a
    vocabulary of 262k at 2,000 rows would cost minutes of start-up for shapes
    that never occur). Returns the calls made."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    shapes: dict[tuple[int, int, torch.dtype, bool], PackedLinear] = {}
    for module in model.modules():
        if isinstance(module, PackedLinear) and module.onednn_rows:
            key = (module.in_features, module.out_features, module.dtype, module is head)
            shapes.setdefault(key, module)
    calls = 0
    for (*_, is_head), module in shapes.items():
        limit = min(max_rows, max_sequences) if is_head and max_sequences else max_rows
        # Calls the small-batch kernel takes never reach oneDNN: no primitive for them.
        kernel_rows = module.amx_max_rows if module.amx is not None else 0
        for rows in row_counts(limit):
            if rows <= kernel_rows:
                continue
            module._linear(torch.zeros(rows, module.in_features, dtype=module.dtype))
            calls += 1
    return calls


def gated_activation(
    linear: nn.Module, act: tuple[int, torch.Tensor | None]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gated MLP's ``act(gate(x)) * up(x)`` from its merged gate/up projection
    ``linear`` and its activation ``act`` (kind, bf16 table: fused_ops.py).
    Where the projection keeps packed tiles (AMX, or AVX512-BF16 dot products),
    calls of up to ``AMX_MAX_ROWS`` rows (every call on dot products) take one
    pass that never writes the merged product (``amx_gate_up_act``: the bits
    of the tiles' projection then ``act_and_mul``); others the projection,
    then ``act_and_mul``."""
    kind, table = act
    project = linear.forward  # bound: no nn.Module.__call__ per call
    act_and_mul = torch.ops.radixmux.act_and_mul

    def unfused(x: torch.Tensor) -> torch.Tensor:
        return act_and_mul(project(x), kind, table)

    tiles = isinstance(linear, PackedLinear) and linear.amx is not None
    if table is None or not tiles or linear.out_features % 64 or small_kernel_limits() is None:
        return unfused
    fused = torch.ops.radixmux.amx_gate_up_act
    # Past the projection's own limit too: without the merged product to write
    # and act_and_mul to run, the tiles beat oneDNN's path (tiles unpacked,
    # then act_and_mul) at every row count to 2,048 (SmolLM2, the 30 layers
    # cycled: 1,024 rows 1,697 vs 1,930 us, 2,048 3,321 vs 3,561; whole steps,
    # 1,024 rows 259.8-293.9 -> 254.5-262.1 ms, 1,908 519-566 -> 483-536).
    # On dot products (AVX512-BF16, no AMX), every call: a 512-token prefill
    # step of SmolLM2 wrote and re-read the merged product for 8.7 of 172 ms
    # (act_and_mul, the Zen 5 host).
    limit = max(linear.amx_max_rows, AMX_MAX_ROWS)
    packed, bias, width = linear.amx, linear.bias, linear.out_features

    def gate_up_act(x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= limit * x.shape[-1]:
            return fused(x, packed, bias, width, table)
        return unfused(x)

    return gate_up_act


def packs_float32() -> bool:
    """Whether float32 weights go to oneDNN's packed layout here: only where
    torch runs AVX-512 code. Below it oneDNN's float32 kernels on a packed
    weight were slower than its plain product at every decode size (SmolLM2's
    30 layers, 2 threads, torch and oneDNN capped to AVX2: 1 row 35.5 against
    21.5 ms, 4 rows 46.0 / 38.2, 16 rows 64.2 / 52.5); with AVX-512 they win
    from 4 rows (1 row 33.1 / 22.8, 4 rows 35.5 / 40.2, 16 rows 48.2 / 54.0)."""
    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2")


def holds_bfloat16(weight: torch.Tensor) -> bool:
    """Whether every value of a float32 ``weight`` is a bfloat16 (its low 16 bits
    zero): true of a model published in bfloat16 and run in float32."""
    return not bool((weight.detach().view(torch.int32) & 0xFFFF).any())


def compact_copy(weight: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """A float32 ``weight`` in the smallest form of ``kernels/widen_linear.cpp``
    that gives back every value exactly, with its name: a 4-bit grid, an 8-bit
    grid (``grid_pack``: each run of 32 inputs holds ``fma(q, d, m)`` values),
    bfloat16 (``widen_pack``); None if it fits none (or the kernel is not built)."""
    from radixmux.model_runners import paged_decode

    if not (paged_decode.load() and torch.ops.radixmux.has_widen_linear()):
        return None
    w = weight.detach()
    for bits in (4, 8):
        packed = torch.ops.radixmux.grid_pack(w, bits)
        if packed.numel():
            return f"{bits}-bit grid", packed
    if holds_bfloat16(w):
        return "bfloat16", torch.ops.radixmux.widen_pack(w)
    return None


def widens_float32() -> bool:
    """Whether float32 layers whose values fit a compact form (``compact_copy``)
    take the widening kernel here: where oneDNN does not pack float32 (below AVX-512) and the kernel
    library has AVX2 + FMA (``RADIXMUX_WIDEN_LINEAR=0`` turns it off, to
    measure against)."""
    from radixmux.model_runners import paged_decode

    if os.environ.get(WIDEN_ENV, "1") == "0":
        return False
    return (
        not packs_float32() and paged_decode.load() and bool(torch.ops.radixmux.has_widen_linear())
    )


@torch.no_grad()
def pack_linear_weights(
    model: nn.Module, amx: bool = True, onednn_copy: bool = False, deterministic: bool = False
) -> int:
    """Swap every CPU float32/bfloat16 ``nn.Linear`` of ``model`` for a
    :class:`PackedLinear`; returns how many were swapped (0 where unsupported).
    ``amx``: bfloat16 weights go to the small-batch kernel (AMX tiles, else
    AVX512-BF16 dot products), where it runs: for every call, one copy of each
    weight, or with ``onednn_copy`` up to the kernel's row limits
    (``AMX_LIMITS``, ``DOT_LIMITS``) and to a second, oneDNN copy above them.
    An input embedding tied to the output projection then reads the
    projection's kernel copy (``tied_embedding.py``) and its own is freed.
    Float32 layers whose values fit a compact form (``compact_copy``) keep them
    in it for the widening kernel where :func:`widens_float32` (others stay
    plain there).
    ``deterministic``: one arithmetic per layer whatever the row count (the
    kernel for every bfloat16 call, and the widening kernel, whose per-row sums
    run in a fixed order; oneDNN padded to ``DETERMINISTIC_MIN_ROWS`` for the
    others); the runner checks it (``batch_invariance.py``)."""
    if not torch.backends.mkldnn.is_available():
        return 0
    limits = small_kernel_limits() if amx or deterministic else None
    if limits and (deterministic or (limits == DOT_LIMITS and not onednn_copy)):
        # Deterministic: one arithmetic at every row count. Dot products and no
        # oneDNN copy: oneDNN would multiply the tiles unpacked for each call,
        # which the kernel beats at every row count (see DOT_MAX_ROWS).
        limits = SmallKernelLimits(limits.kind, AMX_ALL_ROWS, AMX_ALL_ROWS, AMX_ALL_ROWS)
    elif limits == AMX_LIMITS and onednn_copy:
        limits = replace(limits, rows_wide=AMX_MAX_ROWS_WIDE_COPY)
    min_rows = DETERMINISTIC_MIN_ROWS if deterministic else 1
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = head is not None and getattr(embed, "weight", None) is getattr(head, "weight", False)
    ok: dict[torch.dtype, bool] = {}
    widen = widens_float32()
    swapped = 0
    widened: Counter[str] = Counter()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            dtype = child.weight.dtype
            if dtype not in _DTYPES:
                continue
            if widen and dtype == torch.float32:
                try:
                    packed = PackedLinear(child, widen=True)
                except ValueError:
                    continue  # (no compact form holds its values: stays plain)
                setattr(parent, name, packed)
                swapped += 1
                widened[packed.widen_kind] += 1
                continue
            if dtype not in ok and dtype == torch.float32 and not packs_float32():
                ok[dtype] = False
                log.info("float32 linear layers stay plain: oneDNN's packed layout is slower here")
            if dtype not in ok:
                ok[dtype] = packing_works(dtype)
                if not ok[dtype]:
                    log.info("oneDNN weight packing unavailable for %s; plain linear layers", dtype)
            if ok[dtype]:
                rows = limits.for_layer(child, child is head) if limits else 0
                setattr(parent, name, PackedLinear(child, rows, onednn_copy, min_rows))
                swapped += 1
    if widened:
        forms = ", ".join(f"{n} as {kind}" for kind, n in sorted(widened.items()))
        log.info("float32 linear layers held compact, widened per call: %s", forms)
    if limits and ok.get(torch.bfloat16):
        log.info(
            "small-batch kernel (%s) for bfloat16 linear calls of up to %d rows",
            limits.kind,
            limits.rows,
        )
    # A fused gated MLP (fused_ops.py: its radixmux_act) computes its projection
    # and activation as the lean stack does: in one pass where the tiles allow.
    for module in model.modules():
        act = getattr(module, "radixmux_act", None)
        if act is not None and isinstance(getattr(module, "gate_up_proj", None), PackedLinear):
            module.radixmux_gate_up_act = gated_activation(module.gate_up_proj, act)
    packed_head = model.get_output_embeddings() if tied else None
    if isinstance(packed_head, PackedLinear):
        copy = packed_head.amx if packed_head.amx is not None else packed_head.widen
        if copy is not None:
            embed_from_tiles(embed, copy)
    return swapped
