"""What the radix tree is not: its diagnostics, kept apart so the tree reads in one sitting.

``check_invariants`` (every structural and ownership rule, for tests and
``--check-invariants``), ``dump`` (every cached token's slot), ``python_bytes``
(a measured walk, against which ``RadixCache.index_bytes`` is checked) and
``top_prefixes`` (the most shared prefixes, for ``/dashboard``). They read the
tree's private state on purpose: they check or show it, and never change it.
"""

from __future__ import annotations

import heapq
import itertools
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from radixmux.memory.radix_cache import CacheHandle, Node, RadixCache, _Entry, _walk


@dataclass(frozen=True)
class PrefixHolder:
    """One generation's KV under a shared prefix (``top_prefixes``)."""

    models: tuple[str, ...]  # the models of the generation (replicas, aliases share one)
    hits: int  # lookups of these models that matched through the prefix
    locks: int  # running requests holding it
    subtree_tokens: int  # KV tokens the generation holds for the prefix and what extends it
    bytes_per_token: int


@dataclass(frozen=True)
class PrefixSummary:
    """A cached prefix that lookups share, where cached paths branch or end."""

    group: str  # tokenizer group (namespace under the root)
    tokens: bytes  # the prefix, packed int32
    children: int  # cached continuations branching here
    holders: list[PrefixHolder]

    @property
    def hits(self) -> int:
        return sum(h.hits for h in self.holders)


@dataclass(frozen=True)
class TreeTop:
    """The most shared prefixes; ``complete`` False when the walk's budget ran
    out first (then later prefixes and subtree sums may be missing)."""

    prefixes: list[PrefixSummary]
    complete: bool


def top_prefixes(cache: RadixCache, k: int = 16, max_visits: int = 20_000) -> TreeTop:
    """The ``k`` most shared cached prefixes, most hits first.

    A node's hits (summed over live generations) never exceed its parent's:
    every recorded match counts on its whole path. So a best-first walk
    from the roots meets prefixes in falling hit order and stops at the
    ``k``-th, visiting O(k x branching) nodes instead of the tree. A node
    is reported only where sharing changes: it branches, a path ends, or
    its one child has fewer hits or generations (else the longer child says
    the same). ``max_visits`` bounds the work, subtree sums included.
    """
    live = {gid for gid, g in cache._generations.items() if not g.orphaned}

    def shared(node: Node) -> tuple[int, int]:
        entries = [e for gid, e in node.entries.items() if gid in live]
        return sum(e.hits for e in entries), len(entries)

    seq = itertools.count()
    heap: list[tuple[int, int, Node, str]] = []
    visits = 0

    def push_children(node: Node, group: str) -> list[tuple[int, int]]:
        nonlocal visits
        found = []
        for child in node.children.values():
            visits += 1
            hits, generations = shared(child)
            found.append((hits, generations))
            if hits:
                heapq.heappush(heap, (-hits, next(seq), child, group))
        return found

    for group, root in cache._roots.items():
        push_children(root, group)
    out: list[PrefixSummary] = []
    while heap and len(out) < k and visits < max_visits:
        neg, _, node, group = heapq.heappop(heap)
        below = push_children(node, group)
        if len(below) == 1 and below[0] == (-neg, shared(node)[1]):
            continue  # its one child is the same sharing, longer
        sums, walked = _subtree_tokens(node, live, max_visits - visits)
        visits += walked
        holders = [
            PrefixHolder(
                tuple(sorted(cache._generations[gid].models)),
                entry.hits,
                entry.lock_ref,
                sums[gid],
                cache._generations[gid].bytes_per_token,
            )
            for gid, entry in sorted(node.entries.items())
            if gid in live
        ]
        out.append(PrefixSummary(group, _tokens_to(node), len(node.children), holders))
    return TreeTop(out, visits < max_visits)


def _subtree_tokens(top: Node, live: set[int], budget: int) -> tuple[Counter[int], int]:
    """KV tokens per live generation at and below ``top``, walking at most
    ``budget`` nodes; and how many it walked."""
    sums: Counter[int] = Counter()
    walked = 0
    for node in itertools.islice(_walk(top), max(0, budget)):
        walked += 1
        for gid, entry in node.entries.items():
            if gid in live:
                sums[gid] += len(entry.slots)
    return sums, walked


def _tokens_to(node: Node) -> bytes:
    """The packed tokens from the root to the end of ``node``."""
    keys: list[bytes] = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return b"".join(reversed(keys))


def python_bytes(cache: RadixCache) -> int:
    """Approximate Python heap the tree's nodes and entries take."""
    total = 0
    for root in cache._roots.values():
        for node in _walk(root):
            total += sys.getsizeof(node) + sys.getsizeof(node.key)
            total += sys.getsizeof(node.children) + sys.getsizeof(node.entries)
            for entry in node.entries.values():
                total += sys.getsizeof(entry) + entry.slots.nbytes + 112
    return total


def dump(cache: RadixCache) -> dict[int, dict[tuple[tuple[int, ...], int], int]]:
    """Every cached token as ``{generation id: {(page path, position): slot id}}``.

    A token's key is the token path up to the end of its page and its
    position, so tokens of different pages never collide (tests, debugging).
    """
    out: dict[int, dict[tuple[tuple[int, ...], int], int]] = {}
    p = cache.page_size
    for root in cache._roots.values():
        stack: list[tuple[Node, tuple[int, ...]]] = [(root, ())]
        while stack:
            node, path = stack.pop()
            toks = tuple(np.frombuffer(node.key, dtype=np.int32).tolist())
            for gid, entry in node.entries.items():
                table = out.setdefault(gid, {})
                for j, slot in enumerate(entry.slots.tolist()):
                    table[(path + toks[: (j // p + 1) * p], len(path) + j)] = slot
            stack.extend((c, path + toks) for c in node.children.values())
    return out


def check_invariants(
    cache: RadixCache,
    held: Mapping[str, Iterable[np.ndarray]] | None = None,
    locks: Iterable[CacheHandle] | None = None,
) -> None:
    """Raise AssertionError if the tree, its locks or the allocator disagree.

    ``held`` maps a pool (``pool_of(model)``) to the slot arrays live
    requests own outside the tree; when given, every allocated slot must
    be exactly one of: in the tree, held by a request. ``locks`` are the
    handles live requests hold, as their owner tracks them; when given,
    the tree's lock counts must be exactly those (a lock nobody holds is
    a leak the tree's own record cannot reveal).
    """
    cache.allocator.check()
    recorded = Counter({key: n for key, n in cache._locks.items() if n})
    if locks is not None:
        claimed = Counter((h.node, h.generation_id) for h in locks)
        assert recorded == claimed, (
            f"{sum(recorded.values())} locks in the tree but live requests hold "
            f"{sum(claimed.values())} ({sum((recorded - claimed).values())} leaked, "
            f"{sum((claimed - recorded).values())} missing)"
        )
    expected_locks: Counter[tuple[int, int]] = Counter()
    for (node, gid), count in recorded.items():
        n = node
        while n.parent is not None:
            expected_locks[(id(n), gid)] += count
            n = n.parent
    tree_slots: dict[str, list[np.ndarray]] = {}
    tokens: Counter[int] = Counter()
    leaves: dict[int, set[Node]] = {gid: set() for gid in cache._generations}
    nodes = edge_bytes = entries = 0
    every_entry: list[tuple[Node, int, _Entry]] = []
    for root in cache._roots.values():
        assert not root.entries, "a root holds KV"
        for node in _walk(root):
            if node is root:
                continue
            nodes += 1
            edge_bytes += len(node.key)
            entries += len(node.entries)
            parent = node.parent
            assert (
                parent is not None and parent.children.get(node.key[: cache._page_bytes]) is node
            ), "parent/child links broken"
            assert node.key and len(node.key) % cache._page_bytes == 0, "edge not whole pages"
            assert node.entries, "node with no entries left in the tree"
            for gid, entry in node.entries.items():
                assert len(entry.slots) == node.num_tokens, "entry size != edge size"
                if parent.parent is not None:
                    assert gid in parent.entries, "generation not prefix-closed"
                refs = sum(gid in c.entries for c in node.children.values())
                assert entry.child_refs == refs, "child_refs drifted"
                if refs == 0:
                    leaves[gid].add(node)
                assert entry.lock_ref == expected_locks[(id(node), gid)], (
                    f"lock count {entry.lock_ref} != live locks {expected_locks[(id(node), gid)]}"
                )
                assert entry.lock_ref >= 0
                tree_slots.setdefault(cache._generations[gid].pool, []).append(entry.slots)
                every_entry.append((node, gid, entry))
                tokens[gid] += len(entry.slots)
    assert nodes == cache._nodes, f"node count {cache._nodes} != {nodes}"
    assert (edge_bytes, entries) == (cache._edge_bytes, cache._entries), "index size drifted"
    # Eviction's per-block counts, kept incrementally, equal a recount.
    cache._evictor.check(every_entry)
    offered = cache._evictor.offered()
    for gid, g in cache._generations.items():
        assert g.cached_tokens == tokens[gid], "cached token count drifted"
        assert g.leaves == leaves[gid], "leaf index drifted"
        for node in g.leaves:
            entry = node.entries[gid]
            assert entry.lock_ref or id(entry) in offered, "unlocked leaf not evictable"
    for pool in {s.pool for s in cache._models.values()}:
        in_tree = np.concatenate(tree_slots.get(pool, [np.zeros(0, np.int64)]))
        assert len(np.unique(in_tree)) == len(in_tree), f"pool {pool}: slot in tree twice"
        allocated = cache.allocator.allocated_slots(pool)
        assert np.isin(in_tree, allocated).all(), f"pool {pool}: tree holds a free slot"
        if held is None:
            continue
        req = np.concatenate([np.zeros(0, np.int64), *map(np.asarray, held.get(pool, ()))])
        both = np.concatenate([in_tree, req]).astype(np.int64)
        assert len(np.unique(both)) == len(both), f"pool {pool}: slot owned twice"
        assert np.array_equal(np.sort(both), allocated), (
            f"pool {pool}: {len(allocated)} slots allocated but "
            f"{len(in_tree)} in tree + {len(req)} held by requests"
        )
