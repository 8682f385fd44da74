"""Per-model KV layout: how one model's K/V for a token are laid out in the arena.

The arena is cut into fixed-size blocks. A block owned by a model holds
``slots_per_block`` token slots for it, stored head-major: one array of shape
``[num_layers, 2, num_kv_heads, slots_per_block, head_dim]`` (K is index 0 on
the second axis, V index 1). Slot ``s`` of a model lives in block
``s // slots_per_block`` at offset ``s % slots_per_block``.

Layers outermost means a runner reads one layer's K (or V) for many slots
with a single gather. Heads before slots means one KV head's rows of a block
are contiguous, so a decode reading one head's context streams whole runs of
``slots_per_block * head_dim`` values instead of a head's slice of every
token row: on an AMD Zen 3 core that read ran 7.4-9.0 GB/s in slices against
12.5-13.1 contiguous (journal, stops 53-54). Everything outside the kernels
sees the slot-major ``[.., slots, heads, dim]`` order through ``slot_major``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch

# float8_e4m3fn: the --kv-cache-dtype fp8 arena (K/V only; models compute in their own dtype).
DTYPE_SIZES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


class KVLayout(msgspec.Struct, frozen=True):
    """The shape of one model's KV per token; equal layouts can share slots."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; one of {sorted(DTYPE_SIZES)}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"KV layout dimensions must be positive: {self}")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's K and V take across every layer."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize


def hidden_layers(layout: KVLayout, hidden_size: int) -> int:
    """Pseudo-layers a token's hidden state (``hidden_size`` values) takes when
    stored beside its K/V in a lower layer group (scheduler/layer_groups.py):
    each pseudo-layer's K and V rows hold ``num_kv_heads * head_dim`` values."""
    row = layout.num_kv_heads * layout.head_dim
    return -(-hidden_size // (2 * row))


@dataclass(frozen=True)
class BlockGeometry:
    """How a layout is carved into the arena's blocks at a given page size."""

    layout: KVLayout
    block_bytes: int
    page_size: int

    @property
    def slots_per_block(self) -> int:
        """Whole pages of slots that fit in one block."""
        pages = self.block_bytes // (self.layout.bytes_per_token * self.page_size)
        return pages * self.page_size

    @property
    def pages_per_block(self) -> int:
        return self.slots_per_block // self.page_size

    @property
    def wasted_bytes_per_block(self) -> int:
        """Tail of each block too small for another page of this layout."""
        return self.block_bytes - self.slots_per_block * self.layout.bytes_per_token

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """A block as stored: ``[layers, 2, kv_heads, slots_per_block, head_dim]``."""
        lay = self.layout
        return (lay.num_layers, 2, lay.num_kv_heads, self.slots_per_block, lay.head_dim)

    def check(self) -> None:
        if self.slots_per_block == 0:
            raise ValueError(
                f"a block of {self.block_bytes} bytes cannot hold one page of "
                f"{self.page_size} tokens at {self.layout.bytes_per_token} bytes per token; "
                "raise the block size or lower the page size"
            )


def slot_major(blocks: torch.Tensor) -> torch.Tensor:
    """Stored blocks ``[.., kv_heads, slots, X]`` seen as ``[.., slots, kv_heads, X]``
    (a view: writes land in the blocks)."""
    return blocks.transpose(-3, -2)
