"""Paged attention over the shared KV arena, plugged into transformers' models.

The runner packs a ragged batch (prefill chunks and single-token decodes of
many sequences) into one row of ``T`` tokens with explicit position ids and
runs the unmodified transformers model with ``attn_implementation =
ATTN_NAME``. transformers then calls :func:`paged_attention_forward` once per
layer with the projected, rotary-embedded (and q/k-normed) states; it

1. scatters the new tokens' K/V into the arena at their slots, then
2. attends each sequence's queries over its whole context, gathered from the
   arena by slot id:

   * decodes (one new token) are batched: one padded gather over
     ``[sequences, longest context]`` and one masked SDPA call per layer;
   * extends (prefill chunks) run one SDPA call per sequence per layer, since
     their query lengths differ and padding them would waste quadratic work.

Because a custom implementation name has no mask function registered,
transformers builds no mask of its own; every mask (causal, padding, sliding
window) is made here from positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from radixmux.model_runners.kv_store import KVStore

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


@dataclass
class PagedBatch:
    """Per-forward metadata shared by every layer."""

    store: KVStore
    write_addr: torch.Tensor  # [T] where each new token's K/V go
    dec_rows: torch.Tensor  # [Bd] packed row of each decoding sequence
    dec_addr: torch.Tensor  # [Bd, Lmax] context slots, right-aligned (padding on the left)
    dec_k_pos: torch.Tensor  # [Bd, Lmax]; padding columns hold -1
    dec_q_pos: torch.Tensor  # [Bd]
    extends: list[ExtendSeq]
    dec_masks: dict[int | None, tuple[int, torch.Tensor | None]] = field(default_factory=dict)

    def dec_mask(self, window: int | None) -> tuple[int, torch.Tensor | None]:
        """(first column to read, ``[Bd, 1, 1, L]`` mask or None) of the decode group."""
        if window not in self.dec_masks:
            lmax = self.dec_k_pos.shape[1]
            # Right alignment puts every sequence's newest keys in the last
            # columns, so a window only needs the last ``window`` of them.
            first = max(0, lmax - window) if window is not None else 0
            k = self.dec_k_pos[:, first:]
            q = self.dec_q_pos[:, None]
            m = (k >= 0) & (k <= q)
            if window is not None:
                m &= k > q - window
            # All keys visible (equal lengths, no window cut): SDPA without a
            # mask takes its fastest path.
            self.dec_masks[window] = (first, None if bool(m.all()) else m[:, None, None, :])
        return self.dec_masks[window]


_current: PagedBatch | None = None


@contextlib.contextmanager
def paged_batch(batch: PagedBatch) -> Iterator[None]:
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
    batch = _current
    if batch is None:
        raise RuntimeError(f"{ATTN_NAME} attention called outside a paged_batch() context")
    layer = module.layer_idx
    store = batch.store
    store.write(layer, batch.write_addr, key[0].transpose(0, 1), value[0].transpose(0, 1))

    q = query[0].transpose(0, 1)  # [T, H, D]
    _num_tokens, heads, head_dim = q.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)

    if batch.dec_rows.numel():
        first, mask = batch.dec_mask(sliding_window)
        bd = batch.dec_rows.shape[0]
        kd, vd = store.gather(layer, batch.dec_addr[..., first:])
        kd = kd.to(q.dtype).transpose(1, 2)  # [Bd, KVH, L, D]
        vd = vd.to(q.dtype).transpose(1, 2)
        # Grouped-query attention without repeating K/V: the G query heads of
        # one KV head become G query rows against that head.
        only_decodes = not batch.extends
        qd = (q if only_decodes else q[batch.dec_rows]).reshape(bd, kv_heads, group, head_dim)
        od = _attend(qd, kd, vd, mask, scaling, softcap).reshape(bd, heads, head_dim)
        if only_decodes:  # rows are already in batch order: no scatter needed
            return od.unsqueeze(0), None
        out[batch.dec_rows] = od

    for seq in batch.extends:
        first, mask = seq.mask(sliding_window)
        n = seq.end - seq.start
        if seq.end - seq.start == seq.k_pos.shape[0]:
            # No cached prefix: the context is exactly this chunk, already in hand.
            ke = key[0, :, seq.start + first : seq.end]  # [KVH, L, D]
            ve = value[0, :, seq.start + first : seq.end]
        else:
            ke, ve = store.gather(layer, seq.addr[..., first:])
            ke = ke.to(q.dtype).transpose(0, 1)  # [KVH, L, D]
            ve = ve.to(q.dtype).transpose(0, 1)
        qe = q[seq.start : seq.end].view(n, kv_heads, group, head_dim)
        qe = qe.permute(1, 2, 0, 3).reshape(1, kv_heads, group * n, head_dim)
        # 4-D inputs: torch's CPU flash kernel only takes those (3x faster than
        # the math fallback a 3-D call gets).
        oe = _attend(qe, ke[None], ve[None], mask.repeat(group, 1)[None, None], scaling, softcap)
        oe = oe.view(kv_heads, group, n, head_dim).permute(2, 0, 1, 3)
        out[seq.start : seq.end] = oe.reshape(n, heads, head_dim)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_NAME, paged_attention_forward)
