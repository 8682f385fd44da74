"""Many evict/insert cycles over one arena shared by pools of different layouts:
eviction frees exactly what it reports, only in ways that give the asking
model's pool room, and the tree stays consistent throughout."""

from __future__ import annotations

import numpy as np

from radixmux.memory.allocator import KVAllocator
from radixmux.memory.layout import KVLayout
from radixmux.memory.radix_cache import ModelSpec, RadixCache
from radixmux.memory.radix_diagnostics import check_invariants

TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8)  # 64 slots per 4 KiB block
WIDE = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)  # 32 slots per block
MODELS = (
    ModelSpec("a", group="g1", pool="wa", layout=TINY),
    ModelSpec("b", group="g1", pool="wb", layout=WIDE),
    ModelSpec("c", group="g2", pool="wc", layout=TINY),
)


def allocated(cache: RadixCache) -> dict[str, set[int]]:
    return {spec.pool: set(cache.allocator.allocated_slots(spec.pool).tolist()) for spec in MODELS}


def check_block_options(cache: RadixCache, pool: str) -> None:
    """The blocks eviction may empty for ``pool`` are exactly the other pools'
    blocks whose every used slot is an unlocked entry, fewest used first."""
    alloc = cache.allocator
    by_block: dict[int, list] = {}
    covered: dict[int, int] = {}
    locked: set[int] = set()
    for node, gid, entry in walk_entries(cache):
        other = cache._generations[gid].pool
        if other == pool:
            continue
        for block in set(alloc.block_of(other, entry.slots).tolist()):
            by_block.setdefault(block, []).append((node, gid))
            covered[block] = covered.get(block, 0) + int(
                (alloc.block_of(other, entry.slots) == block).sum()
            )
            if entry.lock_ref:
                locked.add(block)
    expect = {
        b for b, n in covered.items() if b not in locked and n == alloc.used_slots_in_block(b)
    }
    options = list(cache._evictor.emptiable_blocks(pool))
    assert {o.block for o in options} == expect
    for o in options:
        assert o.used == alloc.used_slots_in_block(o.block)
        assert o.pool == alloc.block_pool(o.block) != pool
        assert o.key == max(cache._evictor.key(g, n.entries[g]) for n, g in by_block[o.block])
        # Each entry with slots in the block once (in the order they came to it).
        assert sorted((id(n), g) for n, g in o.entries) == sorted(
            (id(n), g) for n, g in by_block[o.block]
        )
    assert [o.used for o in options] == sorted(o.used for o in options)


def walk_entries(cache: RadixCache):
    """Every (node, generation id, entry) in the tree."""
    stack = list(cache._roots.values())
    while stack:
        node = stack.pop()
        yield from ((node, gid, entry) for gid, entry in node.entries.items())
        stack.extend(node.children.values())


def cycle(cache: RadixCache, rng: np.random.Generator, locked: list, held: list) -> None:
    """One request: match, evict for the rest, check what went, insert."""
    model = MODELS[int(rng.integers(len(MODELS)))]
    prefix = int(rng.integers(4))
    tokens = [prefix * 1000 + t for t in range(int(rng.integers(8, 40)))]
    tokens += rng.integers(5000, 9000, size=int(rng.integers(1, 60))).tolist()
    m = cache.match(model.name, tokens)
    cache.lock(m.handle)
    extra = len(tokens) - m.length
    check_block_options(cache, model.pool)
    before = allocated(cache)
    freed_before = cache.stats().evicted_for[model.name]
    ok = cache.evict_for(model.name, extra)
    after = allocated(cache)
    lost = {pool: before[pool] - after[pool] for pool in before}
    assert all(not (after[pool] - before[pool]) for pool in before)  # eviction allocates nothing
    freed = cache.stats().evicted_for[model.name] - freed_before
    assert freed == sum(len(s) for s in lost.values())
    alloc = cache.allocator
    for pool, slots in lost.items():
        if pool != model.pool and slots:
            # Another pool's KV goes only to empty a whole block of it (with
            # what hangs below the entries there), never for nothing.
            blocks = set(alloc.block_of(pool, np.fromiter(slots, np.int64)).tolist())
            assert any(alloc.block_pool(b) is None for b in blocks), (pool, blocks)
    assert ok == alloc.can_alloc(model.pool, extra)
    if ok:
        new = alloc.alloc(model.pool, extra)
        assert new is not None
        cache.insert(model.name, tokens, np.concatenate([m.slots, new]), prefix=m.handle)
    if ok and rng.random() < 0.2:
        locked.append(cache.match(model.name, tokens).handle)
        cache.lock(locked[-1])
    if rng.random() < 0.2:  # a running request's fresh slots, in no entry yet
        slots = cache.allocator.alloc(model.pool, 3)
        if slots is not None:
            held.append((model.pool, slots))
    if held and rng.random() < 0.3:
        cache.allocator.free(*held.pop(0))
    if locked and rng.random() < 0.3:
        cache.unlock(locked.pop(0))
    cache.unlock(m.handle)


def test_many_evict_insert_cycles_free_exactly_and_keep_invariants() -> None:
    rng = np.random.default_rng(7)
    cache = RadixCache(KVAllocator(12, 4096), eviction_policy="lru")
    for spec in MODELS:
        cache.register_model(spec)
    locked: list = []
    held: list = []
    evicting = 0
    for i in range(400):
        before = sum(cache.stats().evicted_for.values())
        cycle(cache, rng, locked, held)
        evicting += sum(cache.stats().evicted_for.values()) > before
        if i % 25 == 0:
            mine: dict[str, list] = {}
            for pool, slots in held:
                mine.setdefault(pool, []).append(slots)
            check_invariants(cache, held=mine)
    while locked:
        cache.unlock(locked.pop())
    while held:
        cache.allocator.free(*held.pop())
    check_invariants(cache, held={})
    assert evicting > 100  # the arena was under pressure most of the run
