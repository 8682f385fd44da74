"""The page bitmap's C operations against its numpy ones, and building the library."""

import logging
import shutil

import numpy as np
import pytest

from radixmux.memory import page_bitmap
from radixmux.memory.allocator import KVAllocator
from radixmux.memory.layout import KVLayout
from radixmux.memory.page_bitmap import (
    DUPLICATE,
    NOT_IN_USE,
    OUT_OF_RANGE,
    NativePageRows,
    PageRows,
    ReleaseError,
)

NUM_BLOCKS, PPB = 12, 10


@pytest.fixture(scope="module")
def lib() -> object:
    lib = page_bitmap.load()
    if lib is None:
        if shutil.which(page_bitmap.compiler()) is None:
            pytest.skip("no C compiler: the allocator runs on numpy only")
        pytest.fail("a C compiler is here but the page bitmap library did not load")
    return lib


def pair(lib: object) -> tuple[PageRows, PageRows]:
    numpy_rows = PageRows(NUM_BLOCKS, PPB, np.zeros(NUM_BLOCKS, dtype=np.int64))
    native_rows = NativePageRows(NUM_BLOCKS, PPB, np.zeros(NUM_BLOCKS, dtype=np.int64), lib)
    return numpy_rows, native_rows


def same_state(a: PageRows, b: PageRows) -> None:
    assert np.array_equal(a.used, b.used)
    assert np.array_equal(a.block_used, b.block_used)
    per_block = a.used.reshape(NUM_BLOCKS, PPB).sum(1)
    assert np.array_equal(per_block, a.block_used), "counts drifted from the bitmap"


def test_native_and_numpy_agree_on_random_takes_and_releases(lib: object) -> None:
    rng = np.random.default_rng(7)
    numpy_rows, native_rows = pair(lib)
    held: list[np.ndarray] = []
    for _ in range(400):
        free = PPB - numpy_rows.block_used
        if held and (rng.random() < 0.45 or free.sum() == 0):
            # Give back a held run, or pieces of several, shuffled: release
            # must not rely on the order take handed them out in.
            k = int(rng.integers(1, min(3, len(held)) + 1))
            picks = [held.pop(int(rng.integers(len(held)))) for _ in range(k)]
            pages = np.concatenate(picks)
            rng.shuffle(pages)
            assert numpy_rows.release(pages) == native_rows.release(pages.copy())
        else:
            # As the allocator plans: all of each block's free pages but the last's.
            blocks = rng.permutation(np.flatnonzero(free))[: int(rng.integers(1, 4))].tolist()
            plan: list[int] = []
            for block in blocks[:-1]:
                plan += (block, int(free[block]))
            plan += (blocks[-1], int(rng.integers(1, free[blocks[-1]] + 1)))
            need = sum(plan[1::2])
            got = numpy_rows.take(plan, need)
            assert np.array_equal(got, native_rows.take(plan, need))
            held.append(got)
        same_state(numpy_rows, native_rows)


@pytest.mark.parametrize(
    "bad, code",
    [
        ([3, 4, NUM_BLOCKS * PPB], OUT_OF_RANGE),
        ([-1, 3], OUT_OF_RANGE),
        ([3, 4, 25], NOT_IN_USE),  # 25 was never taken
        ([3, 4, 5, 4], DUPLICATE),
    ],
)
def test_a_bad_release_changes_nothing(lib: object, bad: list[int], code: int) -> None:
    for rows in pair(lib):
        taken = rows.take([0, 10, 1, 4], 14)  # pages 0-9 and 10-13
        before = rows.used.copy(), rows.block_used.copy()
        with pytest.raises(ReleaseError) as err:
            rows.release(np.array(bad, dtype=np.int64))
        assert err.value.code == code, type(rows).__name__
        assert np.array_equal(rows.used, before[0]) and np.array_equal(rows.block_used, before[1])
        # The scratch the C side counts in was left clean: the next release is right.
        assert rows.release(taken) == [0, 10, 0, 1, 4, 0]
        assert not rows.used.any() and not rows.block_used.any()


def test_allocator_reports_a_duplicate_free_and_keeps_its_books(lib: object) -> None:
    for native in (True, False):
        alloc = KVAllocator(4, 4096, native=native)
        alloc.register("a", KVLayout(num_layers=2, num_kv_heads=1, head_dim=16))
        s = alloc.alloc("a", 20)
        assert s is not None
        with pytest.raises(ValueError, match="distinct"):
            alloc.free("a", np.concatenate([s[:5], s[2:3]]))
        with pytest.raises(ValueError, match="range"):
            alloc.free("a", np.array([10_000]))
        alloc.check()
        alloc.free("a", s)
        alloc.check()
        assert alloc.usage().free_blocks == 4


def test_library_builds_into_the_cache_and_a_failed_build_falls_back_to_numpy(
    lib: object, tmp_path: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("RADIXMUX_CACHE", str(tmp_path))
    monkeypatch.setattr(page_bitmap, "_loaded", {})
    fresh = page_bitmap.load()
    assert fresh is not None and page_bitmap.library_path().is_file()
    assert str(page_bitmap.library_path()).startswith(str(tmp_path))
    # Another compiler is another build key; one that fails leaves numpy in charge.
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(page_bitmap, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger=page_bitmap.__name__):
        assert page_bitmap.load() is None
    assert "unavailable" in caplog.text and "false" in caplog.text
    assert not page_bitmap.library_path().exists()
    assert not list(page_bitmap.library_path().parent.glob("build-*")), "scratch left behind"
    alloc = KVAllocator(2, 4096)
    alloc.register("a", KVLayout(num_layers=2, num_kv_heads=1, head_dim=16))
    assert type(alloc._pools["a"].rows) is PageRows
    s = alloc.alloc("a", 20)
    assert s is not None
    alloc.free("a", s)
    alloc.check()
