"""An input embedding read from the output projection's kernel copy (tied weights).

A model whose output projection is its input embedding (SmolLM2, Gemma 3:
that vocabulary-sized matrix is 21% and 63% of their weights) would hold it
twice once the projection is packed for the small-batch kernel
(``packed_linear.py``): row-major for the embedding's look-ups, tiled for the
projection. The tiled copy holds every element (``[N/16][K/2][16][2]``:
element ``(n, c)`` at ``[n // 16, c // 2, n % 16, c % 2]``), so the look-up
gathers its rows from there (the same values, bit for bit) and the row-major
copy is freed. A float32 projection held compact for the widening kernel
(``kernels/widen_linear.cpp``: bfloat16 ``[N/16][K][16]``, or a 4/8-bit grid)
serves a float32 embedding the same way: each row widened back, the values it
held. Only
embeddings whose forward is known are switched: plain ``nn.Embedding``
(Llama) and Gemma 3's scaled one (same bytecode as transformers' own); any
other keeps its weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from radixmux.model_runners.fused_ops import references, same_code

BLOCK_N = 16  # outputs per tile block (kernels/amx_linear.cpp, kBlockN)


def gather_rows(tiles: torch.Tensor, ids: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    """``weight[ids]`` (shape ``[*ids.shape, dim]``) of the ``[rows, dim]`` weight
    that ``amx_pack`` tiled into ``tiles``, or that ``widen_pack`` or ``grid_pack``
    packed (3-d: the rows come back as float32)."""
    flat = ids.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows):
        raise IndexError(f"token id out of range [0, {rows})")
    if tiles.dim() == 3:
        return torch.ops.radixmux.widen_gather_rows(tiles, flat).reshape(*ids.shape, dim)
    # A word (a k pair) at a time (kernels/amx_linear.cpp): torch's indexing
    # of the 4-d tiles copied element by element, 2.7 ms for 1,000 tokens.
    return torch.ops.radixmux.amx_gather_rows(tiles, flat, dim).reshape(*ids.shape, dim)


def _lookup(embed: nn.Embedding, tiles: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    rows, dim = embed.num_embeddings, embed.embedding_dim
    if type(embed) is nn.Embedding:
        return lambda ids: gather_rows(tiles, ids, rows, dim)
    # Gemma 3: its forward is ``super().forward(ids) * self.embed_scale.to(weight dtype)``.
    scale = embed.embed_scale.to(embed.weight.dtype)
    return lambda ids: gather_rows(tiles, ids, rows, dim) * scale


def _known(embed: nn.Module) -> bool:
    if not isinstance(embed, nn.Embedding) or embed.max_norm is not None:
        return False  # (max_norm renormalises the weight in place on look-up)
    if type(embed) is nn.Embedding:
        return True
    return same_code(type(embed).forward, references()["gemma_embedding"]) and isinstance(
        getattr(embed, "embed_scale", None), torch.Tensor
    )


def embed_from_tiles(embed: nn.Module, tiles: torch.Tensor) -> bool:
    """Make ``embed`` look its rows up in ``tiles`` (``amx_pack`` of its own
    weight, or ``widen_pack`` of its float32 weight) and drop its row-major
    weight; False (nothing changed) for an embedding whose code is not known
    here or whose shape or dtype does not fit."""
    if not _known(embed):
        return False
    rows, dim = embed.weight.shape
    if tiles.dim() == 4:
        fits = embed.weight.dtype == tiles.dtype and tiles.shape[1] * 2 >= dim
    else:  # widen_pack's [N/16][K][16] bfloat16, grid_pack's [N/16][K/32][group] bytes
        k = tiles.shape[1] * (32 if tiles.dtype == torch.uint8 else 1) if tiles.dim() == 3 else -1
        fits = embed.weight.dtype == torch.float32 and k == dim
    if not fits or tiles.shape[0] * BLOCK_N < rows:
        return False
    embed.forward = _lookup(embed, tiles)
    shape, dtype = embed.weight.shape, embed.weight.dtype
    del embed.weight
    # Shape and dtype stay readable; no memory and no parameter behind them.
    embed.weight = torch.empty(shape, dtype=dtype, device="meta")
    embed.radixmux_tiles = tiles
    return True
