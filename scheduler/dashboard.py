"""What the scheduler contributes to ``/dashboard``: the arena map and the tree top.

Both are built on demand (one control op per poll of the page) and bounded,
so a big arena or tree costs the event loop little: the map has at most
``MAX_ARENA_CELLS`` cells (vectorized over the allocator's block table), the
tree top is ``TOP_PREFIXES`` prefixes from a best-first walk with a visit
budget (``RadixCache.top_prefixes``).
"""

from __future__ import annotations

import numpy as np

from radixmux import protocol
from radixmux.memory.radix_cache import RadixCache
from radixmux.memory.radix_diagnostics import PrefixSummary, top_prefixes

MAX_ARENA_CELLS = 4096
TOP_PREFIXES = 16
PREFIX_VISITS = 20_000  # tree nodes one snapshot may visit
HEAD_TOKENS = 24  # token ids of a prefix's start sent for its preview
TAIL_TOKENS = 8  # and of its end, when longer


def dashboard_snapshot(cache: RadixCache) -> protocol.DashboardSnapshot:
    """The arena map and the most shared prefixes of ``cache``, right now."""
    top = top_prefixes(cache, TOP_PREFIXES, PREFIX_VISITS)
    prefixes = [_prefix_view(p) for p in top.prefixes]
    return protocol.DashboardSnapshot(arena_map(cache), prefixes, top.complete)


def arena_map(cache: RadixCache) -> protocol.ArenaMap:
    """Each block's (or cell's) owner pool and fill, with the pools' models."""
    alloc = cache.allocator
    usage = alloc.usage()
    keys = sorted(usage.pools)
    pools = [
        protocol.ArenaPool(
            key=key,
            models=sorted(m for m in cache.models if cache.pool_of(m) == key),
            blocks=usage.pools[key].blocks,
            used_slots=usage.pools[key].used_slots,
            slots_per_block=usage.pools[key].slots_per_block,
            bytes_per_token=usage.pools[key].bytes_per_token,
        )
        for key in keys
    ]
    owners, used = alloc.block_table()
    index = {key: i for i, key in enumerate(keys)}
    codes = np.array([-1 if o is None else index[o] for o in owners], dtype=np.int64)
    per_block = np.array([p.slots_per_block for p in pools] + [0], dtype=np.int64)
    capacity = per_block[codes]  # code -1 picks the trailing 0: a free block holds no slots
    n = alloc.num_blocks
    per_cell = -(-n // MAX_ARENA_CELLS)
    cells = -(-n // per_cell)
    pad = cells * per_cell - n
    codes = np.pad(codes, (0, pad), constant_values=-1).reshape(cells, per_cell)
    used = np.pad(used, (0, pad)).reshape(cells, per_cell)
    capacity = np.pad(capacity, (0, pad)).reshape(cells, per_cell)
    if pools:
        counts = np.stack([(codes == i).sum(axis=1) for i in range(len(pools))])
        owner = np.where(counts.max(axis=0) > 0, counts.argmax(axis=0), -1)
    else:
        owner = np.full(cells, -1)
    room = capacity.sum(axis=1)
    fill = np.where(room > 0, 100 * used.sum(axis=1) // np.maximum(room, 1), 0)
    return protocol.ArenaMap(n, alloc.block_bytes, per_cell, pools, owner.tolist(), fill.tolist())


def _prefix_view(prefix: PrefixSummary) -> protocol.SharedPrefixView:
    ids = np.frombuffer(prefix.tokens, dtype=np.int32)
    head = ids[:HEAD_TOKENS].tolist()
    tail = ids[max(HEAD_TOKENS, len(ids) - TAIL_TOKENS) :].tolist()
    holders = [
        protocol.PrefixHolderView(
            list(h.models), h.hits, h.locks, h.subtree_tokens, h.subtree_tokens * h.bytes_per_token
        )
        for h in prefix.holders
    ]
    return protocol.SharedPrefixView(len(ids), prefix.hits, prefix.children, head, tail, holders)
