"""Deterministic inference (``--deterministic``): what it needs, checked when a model loads.

In the default mode the same greedy request can give different text with its
prompt cached or not: a chunk boundary, a one-token remainder taking the
decode path, or a batch large enough for another linear kernel changes how a
row's sums are rounded, and a last-bit difference can flip a close argmax.
Deterministic mode makes every operation give a row the same bits whatever
else shares its call, so output depends on the request alone:

* attention: the C++ kernel's batch-invariant arithmetic
  (``paged_decode.DETERMINISTIC``): one tiled path for decodes and prefill
  chunks, key tiles aligned to absolute positions, decodes never split, and a
  prefix group's members resuming its shared prefix's softmax state;
* linear layers: the small-batch kernel for every bfloat16 call, the
  widening kernel for every call of a float32 layer held compact (bfloat16 or
  a 4/8-bit grid: its per-row sums run in k order at any row count), oneDNN
  padded to at least two rows for the rest (``packed_linear.py``); since
  which kernel oneDNN picks is its own business, each layer shape is probed
  here at many row counts and a shape that varies is refused;
* norms, rotary, activations, sampling: per row or per element already
  (sampling draws from each request's own seed).

What this CPU or model cannot give is refused at load, naming the reason,
except prefix groups: where grouped decodes alone give other bits (the resume
path runs only on some instruction sets), the mode keeps its promise without
them (every decode reads its prefix itself) and the load says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from radixmux.model_runners import paged_decode

# Row counts each linear layer shape is probed at, against one call of
# PROBE_BATCH rows: both sides of every kernel switch and padding grain.
PROBE_ROWS = (1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 63, 64, 65, 127, 128, 129)
PROBE_BATCH = 150
PROBE_OFFSET = 7  # the probed rows also start mid-batch, not only at row 0


class DeterminismUnsupported(ValueError):
    """``--deterministic`` asked of a model or CPU that cannot give it."""


def check_deterministic(
    model: nn.Module,
    use_kernel: bool,
    head_dim: int,
    attention: Sequence[AttentionShape] = (),
) -> str | None:
    """Raise :class:`DeterminismUnsupported` unless ``model``'s forward can be
    batch-invariant here: the attention kernel with vector tiles for
    ``head_dim`` (and, for each of ``attention``, a token's result the same as
    a decode, in chunks and in a batch), and linear layers whose rows do not
    depend on the row count. Returns why decodes must not be grouped by
    shared prefix in the mode (a shape whose grouped decodes give other
    bits), or None where groups keep the bits."""
    if not use_kernel:
        raise DeterminismUnsupported(
            "--deterministic needs the C++ attention kernel (--attention-backend auto or cpp, "
            "a CPU arena, a C++ compiler): its batch-invariant arithmetic is the only one built"
        )
    if not paged_decode.has_tiled_path(head_dim):
        raise DeterminismUnsupported(
            f"--deterministic needs the attention kernel's vector tiles for head size {head_dim} "
            "(AVX2 + FMA or AVX-512, and a head size of 16, 32, 64, 80, 96, 128 or 256); this "
            "CPU or model has none"
        )
    no_groups = None
    for shape in attention:
        found = probe_attention(shape)
        if found.ungrouped is not None:
            raise DeterminismUnsupported(
                f"--deterministic: the attention kernel gives {shape} a different result "
                f"{found.ungrouped} on this CPU; serve without --deterministic"
            )
        if found.grouped is not None and no_groups is None:
            no_groups = f"the attention kernel gives {shape} a different result {found.grouped}"
    for name, layer in distinct_linears(model):
        rows = varying_rows(layer)
        if rows is not None:
            raise DeterminismUnsupported(
                f"--deterministic: linear layer {name} ({_shape(layer)}) rounds a row "
                f"differently in a call of {rows} rows than in one of {PROBE_BATCH} on this "
                "CPU; serve the model in bfloat16 on a CPU with AVX512-BF16 or AMX (the "
                "small-batch kernel), or without --deterministic"
            )
    return no_groups


@dataclass(frozen=True)
class AttentionShape:
    """One attention configuration of a model: heads, head size, window, the
    queries' dtype and the K/V's (``kv_dtype``, default the same)."""

    heads: int
    kv_heads: int
    head_dim: int
    window: int | None
    dtype: torch.dtype
    kv_dtype: torch.dtype | None = None


# A probe context crossing the kernel's 128-key tile alignment more than once.
PROBE_CONTEXT = 300


@dataclass(frozen=True)
class AttentionDifference:
    """Where :func:`probe_attention` found a token with other bits than in one
    whole prefill: ``ungrouped`` (in chunks, as a decode alone or in a batch)
    and, probed only where those agree, ``grouped`` (in groups sharing a
    prefix); None: nowhere."""

    ungrouped: str | None
    grouped: str | None = None


def attention_varies(shape: AttentionShape, deterministic: bool = True) -> str | None:
    """Where the kernel's attention (deterministic, or the default arithmetic)
    gives a token other bits than in one whole prefill: in chunks, as a decode
    alone, in a batch or in groups sharing a prefix (None: nowhere)."""
    found = probe_attention(shape, deterministic)
    return found.ungrouped or found.grouped


@torch.inference_mode()
def probe_attention(shape: AttentionShape, deterministic: bool = True) -> AttentionDifference:
    """:func:`attention_varies`, its grouped decodes told apart. Random
    queries and K/V over scattered slots; milliseconds."""
    n, d = PROBE_CONTEXT, shape.head_dim
    gen = torch.Generator().manual_seed(1)
    kv_dtype = shape.kv_dtype or shape.dtype
    k = torch.randn(n + 16, shape.kv_heads * d, generator=gen).to(kv_dtype)
    v = torch.randn(n + 16, shape.kv_heads * d, generator=gen).to(kv_dtype)
    addr = torch.randperm(n + 16, generator=gen)[:n]
    q = torch.randn(n, shape.heads, d, generator=gen).to(shape.dtype)
    scale, window = d**-0.5, shape.window

    def extend(start: int, end: int) -> torch.Tensor:
        return paged_decode.paged_extend(
            q[start:end].contiguous(),
            k,
            v,
            addr[:end].clone(),
            torch.tensor([0, end]),
            torch.tensor([0, end - start]),
            scale,
            None,
            window,
            deterministic,
        )

    def decode(
        positions: list[int], groups: Sequence[int] = (), prefixes: Sequence[int] = ()
    ) -> torch.Tensor:
        ctx = torch.cat([addr[: p + 1] for p in positions])
        offsets = torch.tensor([0] + [p + 1 for p in positions]).cumsum(0)
        args = (q[positions].contiguous(), k, v, ctx, offsets)
        if not groups:
            return paged_decode.paged_decode(*args, scale, None, window, deterministic)
        return paged_decode.paged_decode_cascade(
            *args, torch.tensor(groups), torch.tensor(prefixes), scale, None, window, deterministic
        )

    whole = extend(0, n)
    for chunk in (7, 100):
        pieces = torch.cat([extend(s, min(n, s + chunk)) for s in range(0, n, chunk)])
        if not torch.equal(pieces, whole):
            return AttentionDifference(f"in prefill chunks of {chunk}")
    batch = [3, 127, 128, n - 1]
    together = decode(batch)
    for i, p in enumerate(batch):
        if not torch.equal(decode([p])[0], whole[p]):
            return AttentionDifference(f"as a decode at position {p}")
        if not torch.equal(together[i], whole[p]):
            return AttentionDifference(f"as a decode at position {p} in a batch")
    # Groups: prefixes past one and two tile boundaries, one within the first
    # tile (nothing to share at a boundary), one that is all of a member's
    # context (128 keys: nothing after the shared state), and a loner.
    members = [n - 1, 260, 200, 140, 131, 90, 70, 127, 250, 50]
    got = decode(members, [0, 0, 0, 1, 1, 2, 2, 3, 3, -1], [199, 131, 60, 128])
    for i, p in enumerate(members):
        if not torch.equal(got[i], whole[p]):
            return AttentionDifference(
                None, f"as a decode at position {p} in a group sharing a prefix"
            )
    return AttentionDifference(None)


def distinct_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """One linear layer per distinct (type, shape, dtype, kernel settings): the
    layers a probe must cover, named as in ``model``."""
    seen: dict[tuple[object, ...], tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        if not hasattr(module, "in_features") or not hasattr(module, "out_features"):
            continue
        key = (
            type(module),
            module.in_features,
            module.out_features,
            _dtype(module),
            getattr(module, "amx_max_rows", None),
            getattr(module, "min_rows", None),
            getattr(module, "widen_kind", None),
        )
        seen.setdefault(key, (name, module))
    return list(seen.values())


@torch.inference_mode()
def varying_rows(layer: nn.Module) -> int | None:
    """The first probed row count at which ``layer`` gives a row other bits
    than a call of ``PROBE_BATCH`` rows does (None: none does)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_BATCH + PROBE_OFFSET, layer.in_features, generator=generator)
    x = x.to(_dtype(layer))
    full = layer(x)
    for n in PROBE_ROWS:
        for start in (0, PROBE_OFFSET):
            if not torch.equal(layer(x[start : start + n]), full[start : start + n]):
                return n
    return None


def _dtype(layer: nn.Module) -> torch.dtype:
    dtype = getattr(layer, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else layer.weight.dtype


def _shape(layer: nn.Module) -> str:
    return f"{layer.in_features} x {layer.out_features}, {_dtype(layer)}"
