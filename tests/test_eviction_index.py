"""The evictor's per-block counts, kept incrementally as the tree changes,
always equal a recount from scratch, and the blocks it offers to empty are
exactly the ones a from-scratch scan finds.

Random operation sequences (hypothesis) over three pools of two layouts:
inserts whose slots come from several interleaved allocations (so an entry
can return to a block it left), matches that split edges, locks and unlocks,
``evict_for``, ``evict``, invalidation and flushes.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixmux.memory.allocator import KVAllocator
from radixmux.memory.layout import KVLayout
from radixmux.memory.radix_cache import CacheHandle, ModelSpec, RadixCache
from radixmux.memory.radix_diagnostics import check_invariants
from tests.test_evict_cycles import walk_entries

TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8)  # 64 slots per 4 KiB block
WIDE = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)  # 32 slots per block
MODELS = (
    ModelSpec("a", group="g", pool="pa", layout=TINY),
    ModelSpec("a2", group="g", pool="pa", layout=TINY),  # replica: same pool
    ModelSpec("b", group="g", pool="pb", layout=WIDE),
    ModelSpec("c", group="h", pool="pc", layout=TINY, priority=3.0),
)
NAMES = [m.name for m in MODELS]


def recount_emptiable(cache: RadixCache, pool: str) -> set[int]:
    """Other pools' blocks whose every used slot an unlocked entry holds, from scratch."""
    alloc = cache.allocator
    held: dict[int, int] = {}
    locked: set[int] = set()
    for _, gid, entry in walk_entries(cache):
        owner = cache._generations[gid].pool
        if owner == pool:
            continue
        for block in alloc.block_of(owner, entry.slots).tolist():
            held[block] = held.get(block, 0) + 1
            if entry.lock_ref:
                locked.add(block)
    return {b for b, n in held.items() if b not in locked and n == alloc.used_slots_in_block(b)}


insert = st.tuples(
    st.just("insert"),
    st.sampled_from(NAMES),
    st.integers(0, 3),  # shared head
    st.integers(0, 2**32 - 1),  # seeds the tail (varied lengths and tokens)
    st.integers(1, 4),  # allocations the slots come from
)
op = st.one_of(
    insert,
    insert,
    insert,
    st.tuples(st.just("lock"), st.sampled_from(NAMES), st.integers(0, 3), st.integers(1, 60)),
    st.tuples(st.just("unlock")),
    st.tuples(st.just("evict_for"), st.sampled_from(NAMES), st.integers(1, 150)),
    st.tuples(st.just("evict"), st.integers(1, 80)),
    st.tuples(st.just("invalidate"), st.sampled_from(NAMES)),
    st.tuples(st.just("flush")),
)


def head(prefix: int) -> list[int]:
    return [100 + prefix] * 4 + list(range(200, 230))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page=st.sampled_from([1, 4]),
    policy=st.sampled_from(["lru", "weighted"]),
    ops=st.lists(op, min_size=5, max_size=60),
)
def test_incremental_counts_equal_a_recount(page: int, policy: str, ops: list[tuple]) -> None:
    cache = RadixCache(KVAllocator(4, 4096, page), eviction_policy=policy)
    for spec in MODELS:
        cache.register_model(spec)
    locks: list[CacheHandle] = []
    for step in ops:
        kind = step[0]
        if kind == "insert":
            _, model, prefix, seed, parts = step
            rng = np.random.default_rng(seed)
            tokens = head(prefix) + rng.integers(0, 9, size=int(rng.integers(1, 90))).tolist()
            tokens = tokens[: len(tokens) - len(tokens) % page]
            m = cache.match(model, tokens)
            cache.lock(m.handle)  # as a request does: its prefix stays while it evicts
            need = len(tokens) - m.length
            pool = cache.pool_of(model)
            # Slots from several allocations, with the same pool's slots
            # taken before the first and given back after it, and another
            # pool allocating in between: the entry's runs can come back to
            # a block they left.
            cuts = sorted({need * i // parts // page * page for i in range(parts)} | {need})
            got = []
            spare = [(pool, cache.allocator.alloc(pool, 3 * page))]
            for lo, hi in itertools.pairwise(cuts):
                new = cache.allocator.alloc(pool, hi - lo)
                if new is None and cache.evict_for(model, hi - lo):
                    new = cache.allocator.alloc(pool, hi - lo)
                if new is None:
                    break
                got.append(new)
                for key, slots in spare:
                    if slots is not None:
                        cache.allocator.free(key, slots)
                other = "pc" if pool != "pc" else "pa"
                spare = [(other, cache.allocator.alloc(other, page))]
            for key, slots in spare:
                if slots is not None:
                    cache.allocator.free(key, slots)
            if sum(map(len, got)) == need:
                slots = np.concatenate([m.slots, *got]).astype(np.int64)
                cache.insert(model, tokens, slots, prefix=m.handle)
            elif got:
                cache.allocator.free(pool, np.concatenate(got))
            cache.unlock(m.handle)
        elif kind == "lock":
            _, model, prefix, n = step
            tokens = head(prefix)[:n]
            m = cache.match(model, tokens[: len(tokens) - len(tokens) % page])
            cache.lock(m.handle)
            locks.append(m.handle)
        elif kind == "unlock" and locks:
            cache.unlock(locks.pop(0))
        elif kind == "evict_for":
            _, model, n = step
            cache.evict_for(model, n)
        elif kind == "evict":
            cache.evict(num_tokens=step[1])
        elif kind == "invalidate":
            cache.invalidate(step[1])
        elif kind == "flush":
            cache.flush()
        cache._evictor.check(walk_entries(cache))
        for spec in MODELS:
            offered = {o.block for o in cache._evictor.emptiable_blocks(spec.pool)}
            assert offered == recount_emptiable(cache, spec.pool)
    check_invariants(cache, held={}, locks=locks)
    while locks:
        cache.unlock(locks.pop())
    cache.flush()
    cache._evictor.check(walk_entries(cache))
    assert cache.allocator.usage().free_blocks == cache.allocator.num_blocks


def test_the_recount_catches_drift() -> None:
    """The check is not vacuous: a count off by one in any index fails it."""
    cache = RadixCache(KVAllocator(8, 4096))
    for spec in MODELS:
        cache.register_model(spec)
    tokens = list(range(40))
    slots = cache.allocator.alloc("pa", len(tokens))
    cache.insert("a", tokens, slots)
    m = cache.match("a", tokens[:20])  # splits the edge
    cache.lock(m.handle)
    ev = cache._evictor
    ev.check(walk_entries(cache))
    block = int(slots[0]) // 64
    for index in (ev._tally, ev._locks_in, ev._lock_mask):
        index[block] = not index[block] if index is ev._lock_mask else index[block] + 1
        with pytest.raises(AssertionError):
            ev.check(walk_entries(cache))
        index[block] = not index[block] if index is ev._lock_mask else index[block] - 1
    ev.check(walk_entries(cache))
    cache.unlock(m.handle)
    cache.flush()
    ev.check(walk_entries(cache))
    assert not ev._tally.any() and not any(ev._locks_in) and not ev._lock_mask.any()
