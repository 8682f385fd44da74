"""Reading and writing one model's K/V in the arena by slot id.

The arena view is ``[blocks, layers, 2, slots_per_block, kv_heads, head_dim]``
with blocks a fixed byte stride apart; the blocks are stored head-major
(``memory/layout.py``), so one slot's K (or V) in one layer is ``kv_heads``
contiguous pieces of ``head_dim`` values, ``slots_per_block * head_dim``
apart. Every such piece of one (layer, K|V) pair sits on a single regular
grid of ``head_dim``-wide rows, so the store sees each pair as one table
``[rows, kv_heads, head_dim]`` (row stride ``head_dim``, head stride
``slots_per_block * head_dim``) addressed by one number per slot: gathering a
sequence's context is one ``index_select`` (about 8x faster on CPU than
indexing the view by ``(block, offset)`` pairs), and the kernels read a head's
keys from the same table. Where a block is not a whole number of rows the
store falls back to ``(block, offset)`` indexing; both give identical
results. Writes on the grid go through the kernel library's ``scatter_rows``
where it is loaded (one copy per token and head, straight from the
attention's transposed K/V views, on every thread), else through
``index_copy_``: the same bytes.
"""

from __future__ import annotations

import torch

from radixmux.model_runners import paged_decode

# Largest float8 e4m3 magnitude (--kv-cache-dtype fp8).
FP8_MAX = 448.0


def _scatterable(k: torch.Tensor, v: torch.Tensor, addr: torch.Tensor) -> bool:
    """Whether scatter_rows takes these as they are (else index_copy_ does)."""
    return (
        k.dim() in (2, 3)
        and v.dim() == k.dim()
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and addr.dim() == 1
        and addr.dtype == torch.int64
        and addr.is_contiguous()
    )


class KVStore:
    """Slot-addressed access to one model's view of the arena."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv
        # A float8 arena: K/V are rounded when stored, so attention must read
        # them back from it (never the unrounded values in hand).
        self.quantized = kv.dtype == torch.float8_e4m3fn
        self.cpu = kv.device.type == "cpu"
        blocks, layers, _, spb, heads, dim = kv.shape
        # Per layer, what a stored K (V) value is multiplied by to give the
        # model's value (kv_scales.py: float8 arenas; 1.0 otherwise).
        self.k_scale = [1.0] * layers
        self.v_scale = [1.0] * layers
        self.slots_per_block = spb
        self.num_slots = blocks * spb
        self.row = heads * dim
        self.head_shape = (heads, dim)
        # One address step is one slot: head_dim values in head-major blocks
        # (a whole row in slot-major ones, as views made by hand may be).
        slot_step, head_step = kv.stride(3), kv.stride(4)
        block_elems = kv.stride(0)
        self.fast = (
            kv.stride(5) == 1
            and block_elems % slot_step == 0
            and slot_step % dim == 0
            and head_step % dim == 0
        )
        self.rows_per_block = block_elems // slot_step if self.fast else 0
        # torch's index_select and index_copy_ move a strided [rows, heads,
        # dim] table's rows an element at a time (9x slower than whole rows),
        # so they get the same memory as head_dim-wide rows, head h of the
        # slot at address a being row a * slot_step / dim + h * head_step / dim.
        self._head_rows = (torch.arange(heads) * (head_step // dim)).to(kv.device)
        self._slot_rows = slot_step // dim
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._flat: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in range(layers):
            pair, flat = [], []
            for c in (0, 1):
                if self.fast:
                    base = kv[0, layer, c]
                    n_rows = (blocks - 1) * self.rows_per_block + spb
                    at = base.storage_offset()
                    pair.append(
                        torch.as_strided(base, (n_rows, heads, dim), (slot_step, head_step, 1), at)
                    )
                    last = (n_rows - 1) * self._slot_rows + int(self._head_rows[-1])
                    flat.append(torch.as_strided(base, (last + 1, dim), (dim, 1), at))
                else:
                    pair.append(kv[:, layer, c])  # [blocks, spb, heads, dim]
            self._views.append((pair[0], pair[1]))
            if flat:
                self._flat.append((flat[0], flat[1]))

    def address(self, slots: torch.Tensor) -> torch.Tensor:
        """Precomputed addresses of ``slots`` (any shape), reused by every layer."""
        blk, off = slots // self.slots_per_block, slots % self.slots_per_block
        if self.fast:
            return blk * self.rows_per_block + off
        return torch.stack([blk, off])

    def _head_index(self, addr: torch.Tensor) -> torch.Tensor:
        """``[*addr.shape, kv_heads]`` rows of the head_dim-wide tables."""
        return (addr * self._slot_rows).unsqueeze(-1) + self._head_rows

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V as ``[rows, kv_heads, head_dim]`` tables, a slot's
        address selecting its row (fast layout only)."""
        if not self.fast:
            raise ValueError("this arena view has no regular row grid")
        return self._views[layer]

    def write(self, layer: int, addr: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[n, kv_heads, head_dim]`` (or ``[n, row]``; views
        welcome) at the 1-D addresses ``addr``."""
        kc, vc = self._views[layer]
        if self.quantized:
            # float8 e4m3 has no infinity: out-of-range values saturate. torch
            # copies float8 by index only as bytes.
            k = (k / self.k_scale[layer]).clamp(-FP8_MAX, FP8_MAX).to(kc.dtype).view(torch.uint8)
            v = (v / self.v_scale[layer]).clamp(-FP8_MAX, FP8_MAX).to(vc.dtype).view(torch.uint8)
            kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
        else:
            k, v = k.to(kc.dtype), v.to(vc.dtype)
        if self.fast and self.cpu and paged_decode.loaded() and _scatterable(k, v, addr):
            # Straight from the (often transposed) views into the rows: no
            # token-major copy first, all threads (kernels/kv_write.cpp).
            torch.ops.radixmux.scatter_rows(kc, addr, k)
            torch.ops.radixmux.scatter_rows(vc, addr, v)
            return
        if self.fast:
            kf, vf = self._flat[layer]
            if self.quantized:
                kf, vf = kf.view(torch.uint8), vf.view(torch.uint8)
            rows = self._head_index(addr).reshape(-1)
            kf.index_copy_(0, rows, k.reshape(-1, self.head_shape[1]))
            vf.index_copy_(0, rows, v.reshape(-1, self.head_shape[1]))
        else:
            kc.index_put_((addr[0], addr[1]), k.reshape(-1, *self.head_shape))
            vc.index_put_((addr[0], addr[1]), v.reshape(-1, *self.head_shape))

    def gather(self, layer: int, addr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``addr`` (shape ``S``), each ``[*S, kv_heads, head_dim]``, as
        stored (a float8 arena's: divided by ``k_scale``/``v_scale``, see ``dequantized``)."""
        kc, vc = self._flat[layer] if self.fast else self._views[layer]
        dtype = kc.dtype
        if self.quantized:  # indexed as bytes (as in write)
            kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
        if self.fast:
            rows = self._head_index(addr).reshape(-1)
            k = kc.index_select(0, rows).view(*addr.shape, *self.head_shape)
            v = vc.index_select(0, rows).view(*addr.shape, *self.head_shape)
        else:
            k = kc[addr[0], addr[1]]
            v = vc[addr[0], addr[1]]
        return k.view(dtype), v.view(dtype)

    def dequantized(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered ``k``/``v`` of ``layer`` as the model's values in ``dtype``."""
        k, v = k.to(dtype), v.to(dtype)
        if self.quantized:
            k, v = k * self.k_scale[layer], v * self.v_scale[layer]
        return k, v

    # ---- boundary hidden states (layer groups, scheduler/layer_groups.py) -----
    # A lower layer group keeps, beside its layers' K/V, the hidden state its
    # last layer hands on, in pseudo-layers after its real ones: pseudo-layer
    # j's K row holds values [2j * row, (2j + 1) * row), its V row the next
    # ``row`` values (zero-padded at the end).

    def write_hidden(self, first: int, addr: torch.Tensor, hidden: torch.Tensor) -> None:
        """Store ``hidden [n, hidden_size]`` at ``addr`` from pseudo-layer ``first`` on."""
        n, size = hidden.shape
        layers = -(-size // (2 * self.row))
        padded = hidden.new_zeros(n, layers * 2 * self.row)
        padded[:, :size] = hidden
        parts = padded.view(n, layers, 2, self.row)
        for j in range(layers):
            self.write(first + j, addr, parts[:, j, 0], parts[:, j, 1])

    def read_hidden(self, first: int, addr: torch.Tensor, size: int) -> torch.Tensor:
        """The ``[n, size]`` hidden states stored at the 1-D ``addr`` (``write_hidden``)."""
        layers = -(-size // (2 * self.row))
        n = addr.shape[-1]
        rows = []
        for j in range(layers):
            k, v = self.gather(first + j, addr)
            rows += [k.reshape(n, self.row), v.reshape(n, self.row)]
        return torch.cat(rows, dim=1)[:, :size]
