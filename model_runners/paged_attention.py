"""Paged attention over the shared KV arena, plugged into transformers' models.

The runner packs a ragged batch (prefill chunks and single-token decodes of
many sequences) into one row of ``T`` tokens with explicit position ids and
runs the unmodified transformers model with ``attn_implementation =
ATTN_NAME``. transformers then calls :func:`paged_attention_forward` once per
layer with the projected, rotary-embedded (and q/k-normed) states; it

1. scatters the new tokens' K/V into the arena at their slots, then
2. attends each sequence's queries over its whole context, gathered from the
   arena by slot id:

   * decodes (one new token) go to the C++ kernel of ``paged_decode``, which
     reads each context's K/V rows in place, and a prefix that several
     decodes share (``PagedBatch.dec_groups``) once for all of them; where the
     kernel is unavailable, one padded gather over ``[sequences, longest
     context]`` and one masked SDPA call per layer do the same (ignoring the
     groups: same results, more reads);
   * extends (prefill chunks) go to the kernel's ``paged_extend`` where it
     has vector tiles for the head size: all chunks in one call, each reading
     its cached prefix in place and computing only the causal half of its
     attention; otherwise one SDPA call per sequence per layer over its
     gathered context, with an explicit mask (their query lengths differ and
     padding them would waste quadratic work).

Because a custom implementation name has no mask function registered,
transformers builds no mask of its own; every mask (causal, padding, sliding
window) is made here from positions.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from radixmux.memory.allocator import distinct_sorted
from radixmux.model_runners.kv_store import KVStore
from radixmux.model_runners.paged_decode import (
    has_tiled_path,
    paged_decode,
    paged_decode_cascade,
    paged_extend,
)

ATTN_NAME = "radixmux_paged"


@dataclass
class ExtendSeq:
    """One sequence that adds ``n > 1`` tokens: rows ``start:end`` of the packed batch."""

    start: int
    end: int
    addr: torch.Tensor  # KVStore addresses of the L context slots (last axis)
    k_pos: torch.Tensor  # [L] position of each context token
    q_pos: torch.Tensor  # [n] positions of the new tokens
    masks: dict[int | None, tuple[int, torch.Tensor]] = field(default_factory=dict)

    def mask(self, window: int | None) -> tuple[int, torch.Tensor]:
        """(first context column to read, boolean ``[n, L - first]`` mask) for a window."""
        if window not in self.masks:
            first = 0
            if window is not None:
                # Keys older than the first query's window are never read.
                lowest = int(self.q_pos[0]) - window + 1
                first = int(torch.searchsorted(self.k_pos, lowest))
            k = self.k_pos[first:]
            m = k[None, :] <= self.q_pos[:, None]
            if window is not None:
                m &= k[None, :] > self.q_pos[:, None] - window
            self.masks[window] = (first, m)
        return self.masks[window]


# (packed rows or None, addr, offsets, q_offsets): every extend, as paged_extend takes them.
# Rows of the packed batch: a slice where they run in order (a view, no
# gather or scatter per layer), else their indices.
Rows = slice | torch.Tensor
ExtendArgs = tuple[Rows | None, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class DecodeGroups:
    """Decoding sequences that share a cached prefix: the cascade kernel reads it once.

    Indices are positions among the batch's decoding sequences (the order of
    ``PagedBatch.dec_rows`` / ``dec_offsets``), not rows of the packed batch.

    * ``group_of`` ``[Bd]`` int64: the group of each decoding sequence, ``-1``
      for none (it attends alone, as without groups).
    * ``prefix_len`` ``[G]`` int64: how many leading context tokens every
      member of group ``g`` shares. The members' first ``prefix_len[g]``
      context slots must be the *same slot ids* (as the radix tree hands out
      for a shared cached prefix; :meth:`check` verifies it), and
      ``prefix_len[g]`` may not exceed any member's context length (its
      cached tokens plus the one being decoded). A group may have a single
      member or none; ``prefix_len[g] = 0`` is allowed (no sharing).

    The attention result is the same with or without groups (up to float
    rounding); only the K/V bytes read per step shrink.
    """

    group_of: torch.Tensor
    prefix_len: torch.Tensor

    @classmethod
    def build(
        cls, num_decodes: int, members: Sequence[Sequence[int]], prefix_lens: Sequence[int]
    ) -> DecodeGroups:
        """Groups from member lists: ``members[g]`` (decode positions) share ``prefix_lens[g]``."""
        if len(members) != len(prefix_lens):
            raise ValueError(f"{len(members)} member lists for {len(prefix_lens)} prefixes")
        group_of = np.full(num_decodes, -1, dtype=np.int64)
        for g, ids in enumerate(members):
            idx = np.asarray(ids, dtype=np.int64)
            if idx.size and (idx.min() < 0 or idx.max() >= num_decodes):
                raise ValueError(f"group {g}: members outside [0, {num_decodes})")
            if (group_of[idx] >= 0).any() or len(distinct_sorted(idx)) != idx.size:
                raise ValueError(f"group {g}: a sequence is in more than one group")
            group_of[idx] = g
        return cls(torch.from_numpy(group_of), torch.tensor(list(prefix_lens), dtype=torch.int64))

    def check(self, dec_slots: torch.Tensor, dec_offsets: torch.Tensor) -> None:
        """Raise ValueError unless every group's members share the promised slots.

        One vectorised comparison of the shared slots (microseconds for
        thousands of them): cheap enough to run once per forward.
        """
        lens = dec_offsets[1:] - dec_offsets[:-1]
        if self.group_of.shape != lens.shape:
            raise ValueError(f"group_of has {self.group_of.numel()} entries for {lens.numel()}")
        if ((self.group_of < -1) | (self.group_of >= self.prefix_len.numel())).any():
            raise ValueError("group_of names a group that does not exist")
        member = torch.nonzero(self.group_of >= 0).flatten()
        if not member.numel():
            return
        prefix = self.prefix_len[self.group_of[member]]
        if (prefix < 0).any() or (prefix > lens[member]).any():
            raise ValueError("a group's prefix is longer than one of its members' contexts")
        # Each member's prefix slots against its group's first member's.
        first = torch.full((self.prefix_len.numel(),), -1, dtype=torch.int64)
        first.scatter_reduce_(0, self.group_of[member], member, "amin", include_self=False)
        leader = first[self.group_of[member]]
        col = torch.arange(int(prefix.max()))
        take = col[None, :] < prefix[:, None]
        mine = (dec_offsets[member][:, None] + col)[take]
        theirs = (dec_offsets[leader][:, None] + col)[take]
        if not torch.equal(dec_slots[mine], dec_slots[theirs]):
            raise ValueError("members of a decode group differ in their shared prefix slots")


@dataclass
class PagedBatch:
    """Per-forward metadata shared by every layer.

    The decoding sequences' contexts are kept ragged (concatenated slots plus
    offsets), which is what the C++ kernel reads; the torch fallback pads them
    into a ``[Bd, Lmax]`` grid on first use.
    """

    store: KVStore
    write_addr: torch.Tensor  # [T] where each new token's K/V go
    dec_rows: torch.Tensor  # [Bd] packed row of each decoding sequence
    dec_slots: torch.Tensor  # context slots of every decoding sequence, oldest first
    dec_offsets: torch.Tensor  # [Bd + 1]: sequence i owns dec_slots[off[i]:off[i + 1]]
    dec_q_pos: torch.Tensor  # [Bd]
    extends: list[ExtendSeq]
    use_kernel: bool = False  # attend through the C++ kernel (else gather + SDPA)
    # The kernel's batch-invariant arithmetic (paged_decode.DETERMINISTIC);
    # the runner sets it only with use_kernel and the kernel's tiles.
    deterministic: bool = False
    # Decodes sharing a cached prefix (see DecodeGroups); None: no sharing.
    # Read by the C++ kernel only; the gather + SDPA fallback ignores it.
    dec_groups: DecodeGroups | None = None
    dec_masks: dict[int | None, tuple[int, torch.Tensor | None]] = field(default_factory=dict)
    _dec_grid: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False)
    _dec_flat: torch.Tensor | None = field(default=None, init=False)
    _ext_flat: ExtendArgs | None = field(default=None, init=False)
    _dec_index: Rows | None = field(default=None, init=False)

    def dec_index(self) -> Rows:
        """The decodes' packed rows: a slice when they are consecutive (the
        scheduler puts them first), so a mixed step's attention reads and
        writes them as views instead of gathering and scattering every layer."""
        if self._dec_index is None:
            rows = self.dec_rows  # increasing: the batch's single-token sequences in order
            first, last = int(rows[0]), int(rows[-1])
            self._dec_index = slice(first, last + 1) if last - first == len(rows) - 1 else rows
        return self._dec_index

    def ext_flat(self) -> ExtendArgs:
        """(packed rows, addr, offsets, q_offsets) of every extend, as ``paged_extend`` takes.

        The rows are None when every row of the batch is an extend's (no
        decodes): the queries are then the batch's own, in order.
        """
        if self._ext_flat is None:
            ext = self.extends
            dev = self.write_addr.device
            rows: Rows | None = None
            if self.dec_rows.numel():
                if all(a.end == b.start for a, b in itertools.pairwise(ext)):
                    rows = slice(ext[0].start, ext[-1].end)
                else:
                    rows = torch.cat([torch.arange(e.start, e.end, device=dev) for e in ext])
            lens = torch.tensor([0] + [e.addr.shape[-1] for e in ext], device=dev)
            news = torch.tensor([0] + [e.end - e.start for e in ext], device=dev)
            addr = torch.cat([e.addr for e in ext])
            self._ext_flat = (rows, addr, lens.cumsum(0), news.cumsum(0))
        return self._ext_flat

    def dec_addr(self) -> torch.Tensor:
        """Store addresses of ``dec_slots`` (computed once, read by every layer)."""
        if self._dec_flat is None:
            self._dec_flat = self.store.address(self.dec_slots)
        return self._dec_flat

    def dec_padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(addresses ``[Bd, Lmax]``, key positions ``[Bd, Lmax]``), right-aligned.

        Padding sits on the left with position -1 (and address 0, never read
        unmasked), so every sequence's newest keys share the last columns.
        """
        if self._dec_grid is None:
            lens = self.dec_offsets[1:] - self.dec_offsets[:-1]
            lmax = int(lens.max())
            col = torch.arange(lmax, device=lens.device)
            lead = (lmax - lens)[:, None]  # padding columns per row
            valid = col[None, :] >= lead
            src = (self.dec_offsets[:-1, None] + col[None, :] - lead).clamp_min(0)
            slots = torch.where(valid, self.dec_slots[src], 0)
            k_pos = torch.where(valid, self.dec_q_pos[:, None] - (lmax - 1 - col)[None, :], -1)
            self._dec_grid = (self.store.address(slots), k_pos)
        return self._dec_grid

    def dec_mask(self, window: int | None) -> tuple[int, torch.Tensor | None]:
        """(first column to read, ``[Bd, 1, 1, L]`` mask or None) of the padded decode group."""
        if window not in self.dec_masks:
            k_pos = self.dec_padded()[1]
            lmax = k_pos.shape[1]
            # Right alignment puts every sequence's newest keys in the last
            # columns, so a window only needs the last ``window`` of them.
            first = max(0, lmax - window) if window is not None else 0
            k = k_pos[:, first:]
            q = self.dec_q_pos[:, None]
            m = (k >= 0) & (k <= q)
            if window is not None:
                m &= k > q - window
            # All keys visible (equal lengths, no window cut): SDPA without a
            # mask takes its fastest path.
            self.dec_masks[window] = (first, None if bool(m.all()) else m[:, None, None, :])
        return self.dec_masks[window]


@dataclass(frozen=True)
class LayerGroups:
    """A forward whose model keeps its K/V in several layer groups, each in
    its own slots (models sharing lower layers, ``ForwardBatch.layer_splits``):
    group ``g`` holds layers ``starts[g]`` up to the next start, and
    ``batches[g]`` addresses them (its layer ``0`` is layer ``starts[g]``)."""

    starts: tuple[int, ...]
    batches: tuple[PagedBatch, ...]

    def route(self, layer: int) -> tuple[PagedBatch, int]:
        """The batch that holds ``layer``, and the layer's index inside it."""
        g = bisect.bisect_right(self.starts, layer) - 1
        return self.batches[g], layer - self.starts[g]


_current: PagedBatch | LayerGroups | None = None


def active() -> bool:
    """Whether a radixmux forward (a :func:`paged_batch`) is running."""
    return _current is not None


@contextlib.contextmanager
def paged_batch(batch: PagedBatch | LayerGroups) -> Iterator[None]:
    """Make ``batch`` the metadata the attention function uses during a forward."""
    global _current
    previous, _current = _current, batch
    try:
        yield
    finally:
        _current = previous


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    # SDPA cannot soft-cap scores; do it by hand (Gemma 2 style).
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)


def _decode_by_gather(
    batch: PagedBatch,
    layer: int,
    qd: torch.Tensor,
    kv_heads: int,
    scaling: float | None,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Decode attention of ``qd [Bd, H, D]`` by copying contexts out and running SDPA."""
    bd, heads, head_dim = qd.shape
    first, mask = batch.dec_mask(window)
    kd, vd = batch.store.gather(layer, batch.dec_padded()[0][..., first:])
    kd, vd = batch.store.dequantized(layer, kd, vd, qd.dtype)
    kd = kd.transpose(1, 2)  # [Bd, KVH, L, D]
    vd = vd.transpose(1, 2)
    # Grouped-query attention without repeating K/V: the G query heads of
    # one KV head become G query rows against that head.
    qd = qd.reshape(bd, kv_heads, heads // kv_heads, head_dim)
    return _attend(qd, kd, vd, mask, scaling, softcap).reshape(bd, heads, head_dim)


def _decode_by_kernel(
    batch: PagedBatch,
    layer: int,
    qd: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Decode attention of ``qd [Bd, H, D]`` (contiguous) in the C++ kernel, groups and all."""
    k_rows, v_rows = batch.store.rows(layer)
    addr, offsets, groups = batch.dec_addr(), batch.dec_offsets, batch.dec_groups
    if groups is None:
        return paged_decode(
            qd, k_rows, v_rows, addr, offsets, scale, softcap, window, batch.deterministic
        )
    return paged_decode_cascade(
        qd,
        k_rows,
        v_rows,
        addr,
        offsets,
        groups.group_of,
        groups.prefix_len,
        scale,
        softcap,
        window,
        batch.deterministic,
    )


def _extend_by_sdpa(
    batch: PagedBatch,
    layer: int,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    scaling: float | None,
    window: int | None,
    softcap: float | None,
) -> None:
    """Extends' attention into ``out``: one masked SDPA per sequence over its gathered context."""
    _, heads, head_dim = q.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    for seq in batch.extends:
        first, mask = seq.mask(window)
        n = seq.end - seq.start
        if seq.end - seq.start == seq.k_pos.shape[0] and not batch.store.quantized:
            # No cached prefix: the context is exactly this chunk, already in hand.
            ke = key[0, :, seq.start + first : seq.end]  # [KVH, L, D]
            ve = value[0, :, seq.start + first : seq.end]
        else:
            ke, ve = batch.store.gather(layer, seq.addr[..., first:])
            ke, ve = batch.store.dequantized(layer, ke, ve, q.dtype)
            ke = ke.transpose(0, 1)  # [KVH, L, D]
            ve = ve.transpose(0, 1)
        qe = q[seq.start : seq.end].view(n, kv_heads, group, head_dim)
        qe = qe.permute(1, 2, 0, 3).reshape(1, kv_heads, group * n, head_dim)
        # 4-D inputs: torch's CPU flash kernel only takes those (3x faster than
        # the math fallback a 3-D call gets).
        oe = _attend(qe, ke[None], ve[None], mask.repeat(group, 1)[None, None], scaling, softcap)
        oe = oe.view(kv_heads, group, n, head_dim).permute(2, 0, 1, 3)
        out[seq.start : seq.end] = oe.reshape(n, heads, head_dim)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: write K/V to the arena, attend over slots.

    ``query`` is ``[1, heads, T, head_dim]``, ``key``/``value`` ``[1, kv_heads,
    T, head_dim]`` for the packed batch; returns ``[1, T, heads, head_dim]``.
    """
    current = _current
    if current is None:
        raise RuntimeError(f"{ATTN_NAME} attention called outside a paged_batch() context")
    if isinstance(current, LayerGroups):
        batch, layer = current.route(module.layer_idx)
    else:
        batch, layer = current, module.layer_idx
    store = batch.store
    store.write(layer, batch.write_addr, key[0].transpose(0, 1), value[0].transpose(0, 1))

    q = query[0].transpose(0, 1)  # [T, H, D]
    head_dim = q.shape[-1]
    scale = scaling if scaling is not None else head_dim**-0.5
    # A float8 arena's stored values times these are the model's: K's folds
    # into the softmax scale, V's multiplies the kernels' output.
    k_scale, v_scale = store.k_scale[layer], store.v_scale[layer]
    # Only decodes, or only extends through the kernel: the output rows are
    # already in batch order, no scatter needed.
    out = torch.empty_like(q) if batch.dec_rows.numel() and batch.extends else None

    if batch.dec_rows.numel():
        dec = batch.dec_index()
        qd = q if out is None else q[dec]
        if batch.use_kernel:
            od = _decode_by_kernel(
                batch, layer, qd.contiguous(), scale * k_scale, sliding_window, softcap
            )
            if v_scale != 1.0:
                od = od * v_scale
        else:
            kv_heads = key.shape[1]
            od = _decode_by_gather(batch, layer, qd, kv_heads, scaling, sliding_window, softcap)
        if out is None:
            return od.unsqueeze(0), None
        out[dec] = od

    # Extends through the kernel only where its vector tiles run: elsewhere
    # its scalar loops are slower than SDPA.
    if batch.use_kernel and batch.extends and has_tiled_path(head_dim):
        rows, addr, offsets, q_offsets = batch.ext_flat()
        qe = (q if rows is None else q[rows]).contiguous()
        k_rows, v_rows = store.rows(layer)
        oe = paged_extend(
            qe,
            k_rows,
            v_rows,
            addr,
            offsets,
            q_offsets,
            scale * k_scale,
            softcap,
            sliding_window,
            batch.deterministic,
        )
        if v_scale != 1.0:
            oe = oe * v_scale
        if out is None:
            return oe.unsqueeze(0), None
        out[rows] = oe
        return out.unsqueeze(0), None

    if out is None:
        out = torch.empty_like(q)
    _extend_by_sdpa(batch, layer, q, key, value, out, scaling, sliding_window, softcap)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_NAME, paged_attention_forward)


def set_attention(model: torch.nn.Module, name: str) -> None:
    """Point the model's config and every sub-config at transformers attention ``name``."""
    model.config._attn_implementation = name
    for sub in model.modules():  # sub-configs (e.g. text_config) carry their own copy
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name
