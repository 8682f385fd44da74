"""Unit tests of the unified radix tree over the KV allocator."""

from __future__ import annotations

import numpy as np
import pytest

from radixmux.memory.allocator import KVAllocator
from radixmux.memory.layout import KVLayout
from radixmux.memory.radix_cache import ModelSpec, RadixCache
from radixmux.memory.radix_diagnostics import check_invariants

TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8)  # 64 B/token: 64 slots per block
WIDE = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)  # 128 B/token


def make_cache(
    page_size: int = 1, num_blocks: int = 64, policy: str = "lru", models: tuple = ()
) -> RadixCache:
    cache = RadixCache(KVAllocator(num_blocks, 4096, page_size), eviction_policy=policy)
    for spec in models or (
        ModelSpec("a", group="g1", pool="wa", layout=TINY),
        ModelSpec("b", group="g1", pool="wb", layout=WIDE),
        ModelSpec("a2", group="g1", pool="wa", layout=TINY),  # replica of a
        ModelSpec("c", group="g2", pool="wc", layout=TINY),
    ):
        cache.register_model(spec)
    return cache


def serve(cache: RadixCache, model: str, tokens: list[int]) -> np.ndarray:
    """One request's life: match, lock, allocate the rest, insert, unlock."""
    m = cache.match(model, tokens)
    cache.lock(m.handle)
    pool = cache.pool_of(model)
    aligned = len(tokens) - len(tokens) % cache.page_size
    extra = aligned - m.length
    assert cache.evict_for(model, extra)
    new = cache.allocator.alloc(pool, extra)
    assert new is not None and len(new) == extra
    slots = np.concatenate([m.slots, new])
    cache.insert(model, tokens[:aligned], slots, prefix=m.handle)
    cache.unlock(m.handle)
    check_invariants(cache, held={})
    return slots


def test_match_empty_then_hit() -> None:
    cache = make_cache()
    assert cache.match("a", [1, 2, 3]).length == 0
    slots = serve(cache, "a", [1, 2, 3, 4, 5])
    m = cache.match("a", [1, 2, 3, 4, 5, 6])
    assert m.length == 5
    assert np.array_equal(m.slots, slots)
    m = cache.match("a", [1, 2, 3, 9])
    assert m.length == 3 and np.array_equal(m.slots, slots[:3])
    check_invariants(cache, held={})


def test_split_under_two_models_keeps_both() -> None:
    cache = make_cache()
    sa = serve(cache, "a", [1, 2, 3, 4, 5, 6])
    sb = serve(cache, "b", [1, 2, 3, 7, 8])
    # One shared edge [1,2,3] now holds entries of both models.
    assert cache.num_nodes == 3
    assert np.array_equal(cache.match("a", [1, 2, 3, 4, 5, 6]).slots, sa)
    assert np.array_equal(cache.match("b", [1, 2, 3, 7, 8]).slots, sb)
    # b has no KV for a's branch and vice versa.
    assert cache.match("b", [1, 2, 3, 4, 5, 6]).length == 3
    assert cache.match("a", [1, 2, 3, 7, 8]).length == 3
    # A split inside an edge that only one model holds splits every entry.
    serve(cache, "b", [1, 2, 3, 4, 9])
    assert np.array_equal(cache.match("a", [1, 2, 3, 4, 5, 6]).slots, sa)
    assert cache.match("b", [1, 2, 3, 4, 5, 6]).length == 4
    check_invariants(cache, held={})


def test_replicas_share_kv_groups_do_not() -> None:
    cache = make_cache()
    sa = serve(cache, "a", [5, 6, 7, 8])
    m = cache.match("a2", [5, 6, 7, 8])
    assert m.length == 4 and np.array_equal(m.slots, sa)
    assert cache.match("c", [5, 6, 7, 8]).length == 0  # other tokenizer group
    assert cache.match("b", [5, 6, 7, 8]).length == 0  # other weights


def test_insert_returns_cached_len_and_frees_duplicates() -> None:
    cache = make_cache()
    serve(cache, "a", [1, 2, 3, 4])
    pool = cache.pool_of("a")
    before = cache.allocator.pool_usage(pool).used_slots
    # A request that did not match (e.g. raced another) computed the same prefix.
    dup = cache.allocator.alloc(pool, 6)
    assert cache.insert("a", [1, 2, 3, 4, 5, 6], dup) == 4
    assert cache.allocator.pool_usage(pool).used_slots == before + 2
    assert cache.cached_tokens("a") == 6
    check_invariants(cache, held={})
    with pytest.raises(ValueError, match="slots"):
        cache.insert("a", [1, 2], dup[:1])


def test_lock_blocks_eviction() -> None:
    cache = make_cache()
    serve(cache, "a", [1, 2, 3, 4])
    serve(cache, "a", [9, 9, 9])
    m = cache.match("a", [1, 2, 3, 4])
    cache.lock(m.handle)
    assert cache.evict(num_tokens=100) == 3
    assert cache.match("a", [1, 2, 3, 4]).length == 4
    assert cache.evict(num_tokens=100) == 0
    check_invariants(cache, held={})
    cache.unlock(m.handle)
    assert cache.evict(num_tokens=100) == 4
    check_invariants(cache, held={})
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(m.handle)


def test_eviction_is_leaf_first_per_model() -> None:
    cache = make_cache()
    serve(cache, "a", [1, 2, 3, 4, 5, 6])
    serve(cache, "a", [1, 2, 3, 7])
    cache.match("a", [1, 2, 3])  # touch the shared head: it is still not a leaf
    assert cache.evict(num_tokens=1) == 3  # the older leaf [4,5,6]
    assert cache.match("a", [1, 2, 3, 7]).length == 4
    assert cache.match("a", [1, 2, 3, 4]).length == 3
    check_invariants(cache, held={})


def _three_leaves(policy: str) -> RadixCache:
    cache = make_cache(policy=policy)
    serve(cache, "a", [1, 1])
    serve(cache, "a", [2, 2])
    serve(cache, "a", [3, 3])
    return cache


def test_lru_order() -> None:
    cache = _three_leaves("lru")
    cache.match("a", [1, 1])
    cache.evict(num_tokens=1)
    assert [cache.match("a", [t, t]).length for t in (1, 2, 3)] == [2, 0, 2]


def test_lfu_order() -> None:
    cache = _three_leaves("lfu")
    for _ in range(3):
        cache.match("a", [1, 1])
    cache.match("a", [2, 2])
    cache.match("a", [3, 3])
    cache.match("a", [2, 2])
    cache.evict(num_tokens=1)  # [3,3]: one hit, even though most recent but one
    assert [cache.match("a", [t, t]).length for t in (1, 2, 3)] == [2, 2, 0]


def test_weighted_prefers_priority_and_compute_per_byte() -> None:
    models = (
        ModelSpec("cheap", "g", "k1", TINY, priority=1.0, cost_per_token=1.0),
        ModelSpec("dear", "g", "k2", TINY, priority=1.0, cost_per_token=10.0),
        ModelSpec("vip", "g", "k3", TINY, priority=50.0, cost_per_token=1.0),
    )
    cache = make_cache(policy="weighted", models=models)
    serve(cache, "vip", [1, 2])
    serve(cache, "dear", [1, 2])
    serve(cache, "cheap", [1, 2])  # most recent, but worth least
    cache.evict(num_tokens=1)
    assert cache.match("cheap", [1, 2]).length == 0
    cache.evict(num_tokens=1)
    assert cache.match("dear", [1, 2]).length == 0
    assert cache.match("vip", [1, 2]).length == 2


def test_invalidate_one_model_keeps_others() -> None:
    cache = make_cache()
    for model in ("a", "b"):
        serve(cache, model, [1, 2, 3])
    assert cache.invalidate("b") == 3
    assert cache.match("b", [1, 2, 3]).length == 0
    assert cache.match("a", [1, 2, 3]).length == 3
    assert cache.match("a2", [1, 2, 3]).length == 3
    # Invalidating a replica leaves the other replica's (shared) KV alone.
    assert cache.invalidate("a2") == 0
    assert cache.match("a2", [1, 2, 3]).length == 0
    assert cache.match("a", [1, 2, 3]).length == 3
    assert cache.stats().evicted_tokens["invalidation"] == 3
    check_invariants(cache, held={})


def test_invalidate_while_locked_frees_on_unlock() -> None:
    cache = make_cache()
    serve(cache, "b", [1, 2, 3, 4])
    m = cache.match("b", [1, 2, 3, 4, 5, 6])
    cache.lock(m.handle)
    pool = cache.pool_of("b")
    extra = cache.allocator.alloc(pool, 2)
    assert cache.invalidate("b") == 0  # still locked
    assert cache.match("b", [1, 2, 3, 4]).length == 0  # but no longer served
    check_invariants(cache, held={pool: [extra]})
    # The request finishes: its stale KV is not cached.
    assert cache.insert("b", [1, 2, 3, 4, 5, 6], np.concatenate([m.slots, extra]), m.handle) == 6
    cache.unlock(m.handle)
    assert cache.allocator.pool_usage(pool).used_slots == 0
    check_invariants(cache, held={})


def test_invalidate_prefix_and_flush() -> None:
    cache = make_cache()
    serve(cache, "a", [1, 2, 3, 4])
    serve(cache, "b", [1, 2, 5])
    serve(cache, "a", [7, 8])
    serve(cache, "c", [1, 2, 3])
    # Position 1 onwards of every g1 path starting [1, 2]: a's [2,3,4], b's [2,5].
    assert cache.invalidate_prefix("g1", [1, 2]) == 3 + 2
    assert cache.match("a", [1, 2, 3, 4]).length == 1
    assert cache.match("a", [7, 8]).length == 2
    assert cache.match("c", [1, 2, 3]).length == 3
    assert cache.invalidate_prefix("g1", [9]) == 0
    assert cache.flush() == 1 + 1 + 2 + 3
    assert cache.num_nodes == 0
    assert cache.stats().evicted_tokens["flush"] == 7
    check_invariants(cache, held={})


@pytest.mark.parametrize("page_size", [1, 16])
def test_pages(page_size: int) -> None:
    cache = make_cache(page_size=page_size)
    tokens = list(range(100, 148))  # 48 tokens: 3 pages of 16
    slots = serve(cache, "a", tokens + [1, 2, 3])
    m = cache.match("a", tokens + [7])
    assert m.length == 48
    assert np.array_equal(m.slots, slots[:48])
    # A divergence inside a page: the match stops at the last whole page.
    other = tokens[:20] + [0] * 28
    expect = 20 if page_size == 1 else 16
    assert cache.match("a", other).length == expect
    serve(cache, "a", other)
    assert cache.match("a", other).length == 48
    check_invariants(cache, held={})
    if page_size > 1:
        with pytest.raises(ValueError, match="whole pages"):
            cache.insert("a", tokens[:5], slots[:5])


def test_stats_count_hits_and_tokens() -> None:
    cache = make_cache()
    cache.match("a", [1, 2, 3, 4])
    serve(cache, "a", [1, 2, 3, 4])  # a miss (its own match)
    cache.match("a", [1, 2, 3, 4, 5])
    s = cache.stats()
    assert s.per_model["a"].hits == 1
    assert s.per_model["a"].misses == 2
    assert s.per_model["a"].tokens_queried == 4 + 4 + 5
    assert s.per_model["a"].tokens_matched == 4
    assert s.cached_tokens["a"] == s.cached_tokens["a2"] == 4
    assert s.cached_bytes["a"] == 4 * TINY.bytes_per_token
    assert s.total.tokens_matched == 4
    assert s.nodes == 1


def test_evict_for_frees_room_across_models() -> None:
    cache = make_cache(num_blocks=2)  # 64 TINY tokens or 32 WIDE tokens per block
    serve(cache, "a", list(range(64)))
    serve(cache, "b", list(range(32)))
    assert not cache.allocator.can_alloc("wb", 40)
    assert cache.evict_for("b", 40)  # must take a's block
    assert cache.match("a", list(range(64))).length == 0
    m = cache.match("b", list(range(32)))
    cache.lock(m.handle)
    assert not cache.evict_for("b", 64 + 33)  # can't: its own KV is locked
    cache.unlock(m.handle)
    check_invariants(cache, held={})


def test_unknown_model_is_clear() -> None:
    cache = make_cache()
    with pytest.raises(KeyError, match="registered"):
        cache.match("nope", [1])
    with pytest.raises(ValueError, match="already registered"):
        cache.register_model(ModelSpec("a", "g1", "wa", TINY))


def two_pools(num_blocks: int, cap_blocks: int | None = None) -> RadixCache:
    """Models ``a`` and ``b`` (same layout, different weights) over one arena;
    with ``cap_blocks`` each pool is fixed at that many blocks (a static split)."""
    cap = None if cap_blocks is None else cap_blocks * 4096
    floor = cap or 0
    return make_cache(
        num_blocks=num_blocks,
        models=(
            ModelSpec("a", "g", "wa", TINY, floor_bytes=floor, cap_bytes=cap),
            ModelSpec("b", "g", "wb", TINY, floor_bytes=floor, cap_bytes=cap),
        ),
    )


def test_evict_for_a_capped_pool_spares_other_models() -> None:
    # Static split, 2 blocks each. a's entries are the oldest (lowest LRU key),
    # yet freeing them cannot give b a slot: b must evict its own.
    cache = two_pools(num_blocks=4, cap_blocks=2)
    for i in range(4):  # a: 4 x 32 tokens = its 2 blocks, all older than b's
        serve(cache, "a", [100 * i + t for t in range(1, 33)])
    for i in range(4):
        serve(cache, "b", [100 * i + t for t in range(1, 33)])
    assert not cache.allocator.can_alloc("wb", 32)
    assert cache.evict_for("b", 32)
    assert cache.cached_tokens("a") == 128  # untouched
    assert cache.cached_tokens("b") == 96
    assert cache.stats().evicted_for == {"a": 0, "b": 32}
    check_invariants(cache, held={})


def test_evict_for_empties_whole_blocks_closest_to_empty_first() -> None:
    # Unified arena of 3 blocks of 64 slots. a fills block 0 and half of block 1
    # with requests; then half of block 1 is freed. b (owning block 2, full)
    # needs a block: emptying block 1 (32 used) beats block 0 (64 used), and
    # a's block 0 entries must stay even though they are older.
    cache = two_pools(num_blocks=3)
    pool_a = cache.allocator
    old = serve(cache, "a", list(range(1, 65)))  # block 0, oldest
    serve(cache, "b", list(range(1000, 1064)))  # b's block
    m = cache.match("b", list(range(1000, 1064)))
    cache.lock(m.handle)  # b's own KV is in use: only a's blocks can help
    serve(cache, "a", list(range(200, 232)))  # 32 slots in a's second block
    assert len(np.unique(pool_a.block_of("wa", old))) == 1
    assert cache.evict_for("b", 10)
    assert cache.match("a", list(range(1, 65)), record=False).length == 64  # kept
    assert cache.match("a", list(range(200, 232)), record=False).length == 0
    assert cache.stats().evicted_for["b"] == 32
    cache.unlock(m.handle)
    check_invariants(cache, held={})


def test_evict_for_skips_blocks_it_cannot_empty() -> None:
    # a's only block holds a locked entry beside an unlocked one: nothing of a
    # can give b a block, so b gets no room and a keeps its unlocked entry too.
    cache = two_pools(num_blocks=2)
    serve(cache, "a", list(range(1, 33)))
    serve(cache, "a", list(range(100, 132)))
    busy = cache.match("a", list(range(100, 132)))
    cache.lock(busy.handle)
    serve(cache, "b", list(range(1, 65)))
    mb = cache.match("b", list(range(1, 65)))
    cache.lock(mb.handle)
    assert not cache.evict_for("b", 1)
    assert cache.cached_tokens("a") == 64
    cache.unlock(busy.handle)
    cache.unlock(mb.handle)
    check_invariants(cache, held={})


def test_check_invariants_catches_a_lock_nobody_holds() -> None:
    cache = make_cache()
    serve(cache, "a", [1, 2, 3, 4])
    m = cache.match("a", [1, 2, 3, 4])
    cache.lock(m.handle)
    check_invariants(cache, held={}, locks=[m.handle])
    assert cache.locks_held == 1
    with pytest.raises(AssertionError, match="1 leaked"):
        check_invariants(cache, held={}, locks=[])
    cache.unlock(m.handle)
    check_invariants(cache, held={}, locks=[])


def test_shared_prefixes_groups_paths_by_their_deepest_common_node() -> None:
    cache = make_cache()
    system = list(range(1, 41))
    prompts = [system + [100 + i, 7, 8] for i in range(3)] + [system + [100, 7, 8, 9]]
    handles = []
    for p in prompts:
        serve(cache, "a", p)
        m = cache.match("a", p)
        cache.lock(m.handle)
        handles.append(m.handle)
    other = cache.match("b", prompts[0])  # another cache: never grouped with a's
    groups = sorted(cache.shared_prefixes([*handles, other.handle, None], min_tokens=8))
    # 0 and 3 share 43 tokens; 1 and 2 share the 40-token system prompt only.
    assert groups == [(40, [1, 2]), (43, [0, 3])]
    assert cache.shared_prefixes(handles, min_tokens=41) == [(43, [0, 3])]
    for i, j in ((0, 3), (1, 2)):
        a, b = (cache.match("a", prompts[k], record=False).slots for k in (i, j))
        assert np.array_equal(a[:40], b[:40])  # the same slot ids: readable once
    for h in handles:
        cache.unlock(h)
