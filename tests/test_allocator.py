"""The logical arena: blocks owned by one pool at a time, pages, floors and caps.

Every test runs twice: with the page bitmap's C operations and with numpy's
(``page_bitmap``), which must behave the same."""

import shutil

import numpy as np
import pytest

from radixmux.memory import page_bitmap
from radixmux.memory.allocator import KVAllocator
from radixmux.memory.layout import KVLayout

SMALL = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16)  # 256 B/token -> 16 per block
BIG = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16)  # 1 KiB/token -> 4 per block


@pytest.fixture(autouse=True, params=["native", "numpy"])
def bitmap_ops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which ``PageRows`` every allocator of the test gets (through the env switch)."""
    native = request.param == "native"
    if native and page_bitmap.load() is None:
        if shutil.which(page_bitmap.compiler()) is None:
            pytest.skip("no C compiler: the allocator runs on numpy only")
        pytest.fail("a C compiler is here but the page bitmap library did not load")
    monkeypatch.setenv(page_bitmap.NATIVE_ENV, "1" if native else "0")
    probe = KVAllocator(1, 4096)
    probe.register("probe", SMALL)
    assert isinstance(probe._pools["probe"].rows, page_bitmap.NativePageRows) == native
    return request.param


def make(num_blocks: int = 8, page_size: int = 1) -> KVAllocator:
    alloc = KVAllocator(num_blocks, 4096, page_size)
    alloc.register("a", SMALL)
    alloc.register("b", BIG)
    return alloc


def test_alloc_free_returns_block_to_global_list() -> None:
    alloc = make()
    s = alloc.alloc("a", 20)
    assert s is not None and len(s) == 20 and len(np.unique(s)) == 20
    assert alloc.usage().free_blocks == 6
    assert alloc.pool_usage("a").free_slots_in_blocks == 12
    alloc.check()
    alloc.free("a", s[:10])
    alloc.check()
    alloc.free("a", s[10:])
    alloc.check()
    assert alloc.usage().free_blocks == 8
    assert alloc.pool_usage("a").blocks == 0


def test_memory_moves_between_models() -> None:
    alloc = make(num_blocks=4)
    a = alloc.alloc("a", 64)  # all four blocks
    assert a is not None
    assert alloc.alloc("b", 1) is None
    alloc.free("a", a[:16])  # the first block taken, whole
    alloc.check()
    freed_blocks = alloc.usage().free_blocks
    b = alloc.alloc("b", 4 * freed_blocks)
    assert freed_blocks == 1 and b is not None
    alloc.check()


def test_slots_map_to_blocks_owned_by_one_pool() -> None:
    alloc = make()
    a = alloc.alloc("a", 16)
    b = alloc.alloc("b", 4)
    assert a is not None and b is not None
    a_blocks = set((a // 16).tolist())
    b_blocks = set((b // 4).tolist())
    assert a_blocks.isdisjoint(b_blocks)


def test_alloc_none_when_full_and_double_free_rejected() -> None:
    alloc = make(num_blocks=1)
    s = alloc.alloc("a", 16)
    assert s is not None
    assert alloc.alloc("a", 1) is None
    assert not alloc.can_alloc("a", 1)
    alloc.free("a", s[:1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free("a", s[:1])
    with pytest.raises(KeyError):
        alloc.alloc("zzz", 1)


def test_pages_are_whole() -> None:
    alloc = KVAllocator(4, 4096, page_size=4)
    alloc.register("a", SMALL)
    s = alloc.alloc("a", 5)
    assert s is not None and len(s) == 8
    pages = s.reshape(-1, 4)
    assert (pages - pages[:, :1] == np.arange(4)).all()
    assert (pages[:, 0] % 4 == 0).all()
    with pytest.raises(ValueError, match="whole"):
        alloc.free("a", s[:3])
    alloc.free("a", s)
    alloc.check()


def test_floor_and_cap() -> None:
    alloc = KVAllocator(4, 4096)
    alloc.register("cold", SMALL, floor_bytes=4096)  # keeps one block
    alloc.register("hot", BIG, cap_bytes=2 * 4096)  # at most two blocks
    assert alloc.alloc("hot", 12) is None  # three blocks: over the cap
    h = alloc.alloc("hot", 8)
    assert h is not None
    alloc.register("other", KVLayout(1, 1, 16))
    # One block is left beside the cold floor; "other" may not take the floor's block.
    assert alloc.alloc("other", 2 * (4096 // 128)) is None
    assert alloc.alloc("other", 4096 // 128) is not None
    assert alloc.alloc("cold", 16) is not None
    alloc.check()


def test_fragmentation_reports_stranded_slots() -> None:
    alloc = make()
    s = alloc.alloc("a", 32)
    assert s is not None
    alloc.free("a", s[::2])
    usage = alloc.usage()
    assert usage.fragmented_slots == 16
    assert usage.fragmented_bytes == 16 * SMALL.bytes_per_token
    assert usage.pools["a"].used_bytes == 16 * SMALL.bytes_per_token


def test_register_conflicting_layout_rejected() -> None:
    alloc = make()
    with pytest.raises(ValueError, match="another layout"):
        alloc.register("a", BIG)


def test_alloc_hands_out_ascending_runs_and_reuses_the_lowest_free_pages() -> None:
    # Kernels read a context's K/V rows in slot order: a fresh block gives one
    # ascending run, and a block with holes fills them lowest first (oldest
    # block with free pages first), so a request's slots stay runs.
    alloc = make()
    s = alloc.alloc("a", 20)  # a whole block of 16, then 4 of a fresh one
    assert s is not None
    assert s.tolist() == list(range(s[0], s[0] + 16)) + list(range(s[16], s[16] + 4))
    assert s[0] % 16 == 0 and s[16] % 16 == 0
    holes = s[[3, 4, 5, 9]]
    alloc.free("a", holes)
    alloc.check()
    # The first block (now holding the holes) joined the free-page order after
    # the second block, which has had free pages since it was taken.
    t = alloc.alloc("a", 14)
    assert t is not None
    assert t.tolist() == list(range(s[16] + 4, s[16] + 16)) + holes[:2].tolist()
    u = alloc.alloc("a", 2)
    assert u is not None and u.tolist() == holes[2:].tolist()
    alloc.check()
    alloc.free("a", np.concatenate([s[:3], s[6:9], s[10:], t, u]))
    alloc.check()
    assert alloc.usage().free_blocks == 8
