"""The arena's K/V row writes: kernels/kv_write.cpp's scatter_rows and KVStore.write."""

from __future__ import annotations

import pytest
import torch

from radixmux.memory.arena import KVArena
from radixmux.memory.layout import BlockGeometry, KVLayout
from radixmux.model_runners import kv_store
from radixmux.model_runners import paged_decode as kernel
from radixmux.model_runners.kv_store import KVStore

pytestmark = pytest.mark.skipif(not kernel.load(), reason=f"kernel not built: {kernel.error()}")

HEADS, DIM = 3, 64


def _source(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """``[n, HEADS, DIM]`` transposed out of ``[HEADS, n, DIM]``, as attention hands K/V over."""
    if dtype == torch.uint8:
        base = torch.randint(0, 256, (HEADS, n, DIM), generator=g, dtype=torch.uint8)
    else:
        base = (torch.randn(HEADS, n, DIM, generator=g) * 10).to(dtype)
    return base.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("n", [1, 5, 1500])
@pytest.mark.parametrize("threads", [1, 2])
def test_scatter_rows_writes_what_index_copy_writes(dtype, n, threads) -> None:
    g = torch.Generator().manual_seed(n)
    table = _source(4000, dtype, g).reshape(4000, HEADS * DIM).clone()
    src = _source(n, dtype, g)
    addr = torch.randperm(4000, generator=g)[:n]
    expected = table.clone().index_copy_(0, addr, src.reshape(n, -1))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        strided, flat = table.clone(), table.clone()
        torch.ops.radixmux.scatter_rows(strided, addr, src)
        torch.ops.radixmux.scatter_rows(flat, addr, src.reshape(n, -1))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(strided, expected)
    assert torch.equal(flat, expected)


def test_scatter_rows_refuses_bad_rows_before_writing_any() -> None:
    table = torch.zeros(10, HEADS * DIM, dtype=torch.bfloat16)
    src = torch.ones(3, HEADS * DIM, dtype=torch.bfloat16)
    for bad in ([0, 1, 10], [2, -1, 3]):
        with pytest.raises(RuntimeError, match="outside the table"):
            torch.ops.radixmux.scatter_rows(table, torch.tensor(bad), src)
        assert not table.any()  # the good rows before the bad one were not written either
    with pytest.raises(RuntimeError, match="src is"):
        torch.ops.radixmux.scatter_rows(table, torch.tensor([0]), src[:1].float())
    with pytest.raises(RuntimeError, match="for 2 rows"):
        torch.ops.radixmux.scatter_rows(table, torch.tensor([0, 1]), src)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_store_writes_the_same_arena_with_and_without_the_kernel(dtype, monkeypatch) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=HEADS, head_dim=DIM, dtype=dtype)
    block = 16 * layout.bytes_per_token
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(8 * 16, generator=g)[:50]
    k, v = (_source(50, torch.float32, g).to(torch.bfloat16) for _ in range(2))
    hidden = torch.randn(50, 500, generator=g).to(torch.bfloat16)
    arenas, taken = [], []
    scatterable = kv_store._scatterable
    monkeypatch.setattr(
        kv_store, "_scatterable", lambda *a: taken.append(scatterable(*a)) or taken[-1]
    )
    for use_kernel in (True, False):
        if not use_kernel:
            assert taken and all(taken)  # every write above went through the kernel
            monkeypatch.setattr(kv_store, "_scatterable", lambda *a: False)
        arena = KVArena.create(8, block)
        arenas.append(arena)
        store = KVStore(arena.view(BlockGeometry(layout, block, 1)))
        store.k_scale = [0.5, 2.0]
        addr = store.address(slots)
        if dtype == "bfloat16":  # boundary hidden states: [n, row] slices of a wider row
            store.write_hidden(0, addr, hidden)  # (pseudo-layers 0 and 1)
            assert torch.equal(store.read_hidden(0, addr, 500), hidden)
        store.write(1, addr, k, v)
        got_k, got_v = store.gather(1, addr)
        got_k, got_v = store.dequantized(1, got_k, got_v, torch.float32)
        if dtype == "bfloat16":
            assert torch.equal(got_k, k.float()) and torch.equal(got_v, v.float())
    try:
        assert torch.equal(arenas[0].bytes, arenas[1].bytes)
        assert arenas[0].bytes.any()
    finally:
        for arena in arenas:
            arena.destroy()


@pytest.mark.parametrize("src_rows", [False, True])
def test_scatter_rows_fills_tables_whose_heads_are_apart(src_rows) -> None:
    """A ``[N, HEADS, DIM]`` table whose heads are a block's slots apart (as
    ``KVStore.rows`` hands over head-major blocks) gets each source head in its place."""
    blocks, spb = 5, 7
    g = torch.Generator().manual_seed(5)
    storage = torch.zeros(blocks, HEADS, spb, DIM, dtype=torch.bfloat16)
    rows_per_block = HEADS * spb
    n_rows = (blocks - 1) * rows_per_block + spb
    table = torch.as_strided(storage, (n_rows, HEADS, DIM), (DIM, spb * DIM, 1))
    slots = torch.randperm(blocks * spb, generator=g)[:20]
    src = _source(20, torch.bfloat16, g)
    addr = slots // spb * rows_per_block + slots % spb
    torch.ops.radixmux.scatter_rows(table, addr, src.reshape(20, -1) if src_rows else src)
    expected = torch.zeros_like(storage)
    for i, s in enumerate(slots.tolist()):
        expected[s // spb, :, s % spb] = src[i]
    assert torch.equal(storage, expected)


def test_store_keeps_each_head_of_a_block_contiguous() -> None:
    """The arena's blocks are head-major (memory/layout.py): a slot's head h of
    layer l lies in [block, l, K|V, h, offset], read here from the raw bytes."""
    layout = KVLayout(num_layers=2, num_kv_heads=HEADS, head_dim=DIM, dtype="bfloat16")
    spb = 16
    block = spb * layout.bytes_per_token
    g = torch.Generator().manual_seed(2)
    slots = torch.randperm(4 * spb, generator=g)[:30]
    k, v = (_source(30, torch.float32, g).to(torch.bfloat16) for _ in range(2))
    arena = KVArena.create(4, block)
    try:
        store = KVStore(arena.view(BlockGeometry(layout, block, 1)))
        addr = store.address(slots)
        store.write(1, addr, k, v)
        raw = arena.bytes.view(torch.bfloat16).view(4, 2, 2, HEADS, spb, DIM)
        blk, off = slots // spb, slots % spb
        assert torch.equal(raw[blk, 1, 0, :, off], k)
        assert torch.equal(raw[blk, 1, 1, :, off], v)
        assert not raw[:, 0].any()  # layer 0 untouched
        got_k, got_v = store.gather(1, addr)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
        k_rows, _ = store.rows(1)
        assert k_rows.stride() == (DIM, spb * DIM, 1)
    finally:
        arena.destroy()
