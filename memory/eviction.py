"""Eviction: which cached entries and arena blocks the radix tree frees, and in which order.

Two parts: the *policies* (the order entries go in) and the ``Evictor`` (what
to free so a pool can allocate N more slots: its own entries, or whole blocks
of other pools, planned from per-block counts kept as the tree changes).

Policies. A policy maps an entry to a sort key; the tree evicts the smallest key first.
Only leaf-most entries of a model are ever candidates (an entry whose node has
no child holding the same model's KV), so a cached prefix never loses its head
while its tail stays.

``weighted`` scores the value a cached entry keeps per byte it holds::

    value = priority * (1 + hits) * cost_per_token / bytes_per_token
            * 0.5 ** (age / half_life)

- ``cost_per_token`` is the compute a hit saves for that model (e.g. its
  parameter count, so a hit on a big model is worth more than on a small one);
  a hit on an entry of ``t`` tokens saves ``t * cost_per_token`` and the entry
  holds ``t * bytes_per_token``, so ``t`` cancels and the score is per byte.
- ``hits`` counts matches that used the entry (frequency).
- ``age`` is the time since the entry was last used, in the tree's clock
  (a logical tick per match/insert by default); it halves the value every
  ``half_life`` ticks (recency).
- ``priority`` is the model's ``--model-priority``.

Because ``age = now - last_access`` and ``now`` is the same for every entry
at one eviction, ordering by ``log2(value)`` equals ordering by
``log2(priority * (1 + hits) * cost / bytes) + last_access / half_life``: a key
that does not change while the entry is untouched, so the tree can keep its
candidates in one persistent heap instead of re-scoring every leaf per call.
Entries of an invalidated (orphaned) model always sort first.

Blocks. Pools of different layouts share the arena's blocks, and a slot
freed in another pool's block is of no use to a needy pool until the whole
block is empty. So ``Evictor.make_room`` weighs the needy pool's own
candidates against emptying whole blocks of others, fewest used slots first.
Per block it keeps the slots live entries hold and how many locked entries
touch it, updated as the tree adds, splits, removes, locks and unlocks
entries: finding the blocks that could go is a mask over two arrays, not a
walk of the tree on each call. That index is built only once it can matter:
when a second pool caches KV, or a pool asks for room while only another one
has cached any (one walk of the tree then). Until then every block with
cached KV is the one caching pool's, none can be emptied for it, and its
evictions skip the per-block work (a single-model server never pays for it).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from radixmux.memory.allocator import KVAllocator

if TYPE_CHECKING:
    from radixmux.memory.radix_cache import Node, _Entry, _Generation

    # An eviction heap item: (policy key, push order, node, generation id, entry).
    Candidate = tuple[tuple[float, ...], int, Node, int, _Entry]

EVICTION_POLICIES = ("lru", "lfu", "weighted")

# (orphaned, last_access, hits, weight) -> sort key; weight is
# priority * cost_per_token / bytes_per_token of the entry's cache.
KeyFn = Callable[[bool, float, int, float], tuple[float, ...]]


def _lru(orphaned: bool, last_access: float, hits: int, weight: float) -> tuple[float, ...]:
    return (0.0 if orphaned else 1.0, last_access)


def _lfu(orphaned: bool, last_access: float, hits: int, weight: float) -> tuple[float, ...]:
    return (0.0 if orphaned else 1.0, float(hits), last_access)


def make_weighted(half_life: float) -> KeyFn:
    """The ``weighted`` policy with a recency half-life in clock ticks."""

    def key(orphaned: bool, last_access: float, hits: int, weight: float) -> tuple[float, ...]:
        if orphaned:
            return (0.0, last_access)
        return (1.0, math.log2(weight * (1 + hits)) + last_access / half_life)

    return key


def get_policy(name: str, half_life: float = 1000.0) -> KeyFn:
    """The sort-key function of a policy by name (``lru``, ``lfu``, ``weighted``)."""
    if name == "lru":
        return _lru
    if name == "lfu":
        return _lfu
    if name == "weighted":
        return make_weighted(half_life)
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {EVICTION_POLICIES}")


@dataclass
class BlockOption:
    """Another pool's block that eviction could empty for a needy pool."""

    block: int
    pool: str
    used: int  # slots in use (all of them unlocked cache entries)
    key: tuple[float, ...]  # the most valuable entry lost with it (policy order)
    entries: list[tuple[Node, int]]


class Evictor:
    """What the radix tree frees to give a pool room, and in which order.

    It keeps two indexes as the tree changes, so a call plans without a walk
    of the tree:

    * per pool, a lazy heap of eviction candidates (unlocked leaf-most
      entries) by policy key;
    * per arena block, how many of its slots live entries hold, how many
      locked entries have slots in it, and which entries those are. A block
      another pool could take is one whose used slots are all held by
      unlocked entries: ``tally == used`` and no lock.

    The tree reports every change of an entry (``added``, ``removed``,
    ``split``, ``lock_changed``, ``offer``) and lends two ways to free:
    ``remove`` (one unlocked leaf entry) and ``drop_under`` (every unlocked
    entry of a generation in a subtree, leaves first). Single-threaded, like
    the tree.
    """

    def __init__(
        self,
        allocator: KVAllocator,
        generations: Mapping[int, _Generation],
        key: KeyFn,
        remove: Callable[[Node, int, str], int],
        drop_under: Callable[[Node, int, str], int],
        entries: Callable[[], Iterable[tuple[Node, int, _Entry]]],
    ) -> None:
        self._alloc = allocator
        self._entries = entries  # every entry of the tree, to build the index from
        self._generations = generations
        self._policy_key = key
        self._remove = remove
        self._drop_under = drop_under
        # Candidates: (key, seq, node, generation id, entry). Lazy: an item is
        # checked when it reaches the top (entry gone, locked, no longer a
        # leaf or touched since: dropped or re-pushed), so the hot paths only
        # push when an entry becomes an unlocked leaf.
        self._heaps: dict[str, list[Candidate]] = {}
        # A heap is rebuilt once its stale items outnumber the live ones.
        # Counting the live ones walks the pool's generations, so it is done
        # only when the heap outgrows the bound set at the last count.
        self._compact_at: dict[str, int] = {}
        self._seq = itertools.count()
        n = allocator.num_blocks
        self._tally = np.zeros(n, dtype=np.int64)  # slots live entries hold
        # Locked entries with slots in each block: counted in a list (a lock
        # or unlock changes a few blocks, and a list item costs a tenth of a
        # numpy one), mirrored as a mask only when a count leaves or reaches 0.
        self._locks_in = [0] * n
        self._lock_mask = np.zeros(n, dtype=bool)
        # The pool (an index into ``_pool_ids``) whose entries hold a block's
        # slots; stale once the block's tally is 0 (the mask ignores it then).
        self._block_pool = np.full(n, -1, dtype=np.int64)
        self._members: list[dict[tuple[Node, int], None]] = [{} for _ in range(n)]
        # Each entry's blocks, each with its slot count there.
        self._spans: dict[tuple[Node, int], dict[int, int]] = {}
        # Every pool that ever cached an entry, in order of its first one.
        self._pool_ids: dict[str, int] = {}
        self._slots_per_block: dict[str, int] = {}
        # Whether the per-block index above is kept (see the module doc):
        # until it is, its arrays stay zero and the hooks below return at once.
        self._indexed = False

    # ---- keys and candidates ---------------------------------------------------
    def key(self, gid: int, entry: _Entry) -> tuple[float, ...]:
        """The policy's sort key of an entry now (lowest goes first)."""
        gen = self._generations[gid]
        return self._policy_key(gen.orphaned, entry.last_access, entry.hits, gen.weight)

    def offer(self, node: Node, gid: int, entry: _Entry) -> None:
        """Make an entry that just became an unlocked leaf a candidate (in its pool's heap)."""
        heap = self._heaps.setdefault(self._generations[gid].pool, [])
        heapq.heappush(heap, (self.key(gid, entry), next(self._seq), node, gid, entry))

    def offered(self) -> set[int]:
        """``id`` of every entry some heap holds (stale items included), for checks."""
        return {id(item[4]) for heap in self._heaps.values() for item in heap}

    def _compact_heap(self, pool: str) -> None:
        """Rebuild a pool's candidate heap when stale items outnumber live ones."""
        heap = [
            (self.key(gid, node.entries[gid]), next(self._seq), node, gid, node.entries[gid])
            for gid, gen in self._generations.items()
            if gen.pool == pool
            for node in gen.leaves
            if not node.entries[gid].lock_ref
        ]
        heapq.heapify(heap)
        self._heaps[pool] = heap

    def _head(self, pool: str) -> Candidate | None:
        """The pool's lowest-key evictable entry, dropping stale heap items on the way."""
        heap = self._heaps.get(pool)
        if not heap:
            return None
        if len(heap) > self._compact_at.get(pool, 64):
            live = sum(len(g.leaves) for g in self._generations.values() if g.pool == pool)
            if len(heap) > 2 * live + 64:
                self._compact_heap(pool)
                heap = self._heaps[pool]
            self._compact_at[pool] = 2 * live + 64
        while heap:
            key, _, node, gid, entry = heap[0]
            if node.entries.get(gid) is not entry or entry.lock_ref or entry.child_refs:
                heapq.heappop(heap)
                continue
            current = self.key(gid, entry)
            if current != key:  # touched since it was pushed
                heapq.heapreplace(heap, (current, next(self._seq), node, gid, entry))
                continue
            return heap[0]
        return None

    def _evict_head(self, candidate: Candidate) -> int:
        _, _, node, gid, _ = candidate
        heapq.heappop(self._heaps[self._generations[gid].pool])
        return self._remove(node, gid, "capacity")

    # ---- the per-block index ------------------------------------------------------
    def _span(self, pool: str, slots: np.ndarray) -> dict[int, int]:
        """The blocks ``slots`` lie in, each with how many of them it holds.

        An allocation hands out one run of slots per block, so the runs'
        ends (one compare over the slots) give it without a sort; a request
        that grew by several allocations can come back to a block, which the
        per-run sum takes care of."""
        spb = self._slots_per_block.get(pool)
        if spb is None:
            spb = self._slots_per_block[pool] = self._alloc.geometry(pool).slots_per_block
        if not len(slots):
            return {}
        blocks = slots // spb
        cut = (blocks[1:] != blocks[:-1]).nonzero()[0]
        if not cut.size:
            return {int(blocks[0]): len(slots)}
        runs = blocks[cut].tolist()
        runs.append(int(blocks[-1]))
        ends = (cut + 1).tolist()
        ends.append(len(slots))
        span: dict[int, int] = {}
        start = 0
        for block, end in zip(runs, ends, strict=True):
            span[block] = span.get(block, 0) + end - start
            start = end
        return span

    def added(self, node: Node, gid: int, entry: _Entry) -> None:
        """Count a new entry's slots (and its lock, if it has one) in their blocks."""
        pool = self._generations[gid].pool
        if pool not in self._pool_ids:
            self._pool_ids[pool] = len(self._pool_ids)
            if not self._indexed and len(self._pool_ids) > 1:
                self._build_index()  # the new entry is in the tree: counted there
                return
        if self._indexed:
            self._index(node, gid, entry)

    def _build_index(self) -> None:
        """Count every entry of the tree from scratch and keep the index from now on."""
        self._indexed = True
        for node, gid, entry in self._entries():
            self._index(node, gid, entry)

    def _index(self, node: Node, gid: int, entry: _Entry) -> None:
        pool = self._generations[gid].pool
        span = self._span(pool, entry.slots)
        key = (node, gid)
        self._spans[key] = span
        self._count(span, 1, self._pool_ids[pool])
        if entry.lock_ref:
            self._lock_blocks(span, 1)
        for block in span:
            self._members[block][key] = None

    def removed(self, node: Node, gid: int, entry: _Entry) -> None:
        """Take an entry that leaves the tree out of its blocks' counts."""
        if not self._indexed:
            return
        key = (node, gid)
        span = self._spans.pop(key)
        self._count(span, -1)
        if entry.lock_ref:
            self._lock_blocks(span, -1)
        for block in span:
            del self._members[block][key]

    def split(self, lower: Node, upper: Node, gid: int, top: _Entry) -> None:
        """``lower``'s entry lost its first slots to ``top``, the new entry of
        ``upper`` (an edge cut in two). The same slots stay in the tree, so the
        tallies stand: only which entry holds them moves, and ``lower``'s span
        is its old one less ``top``'s (one span to compute, not two)."""
        if not self._indexed:
            return
        pool = self._generations[gid].pool
        lower_key, upper_key = (lower, gid), (upper, gid)
        rest = self._spans[lower_key]
        span = self._span(pool, top.slots)
        gone = []
        for block, n in span.items():
            rest[block] -= n
            if not rest[block]:
                del rest[block]
                del self._members[block][lower_key]
                gone.append(block)
            self._members[block][upper_key] = None
        self._spans[upper_key] = span
        if top.lock_ref:  # the lower entry's lock state as well (a split copies it)
            self._lock_blocks(span, 1)
            self._lock_blocks(gone, -1)

    def lock_changed(self, node: Node, gid: int, delta: int) -> None:
        """An entry became locked (``delta`` 1) or unlocked (-1): its blocks' lock counts follow."""
        if self._indexed:
            self._lock_blocks(self._spans[(node, gid)], delta)

    def _count(self, span: dict[int, int], sign: int, pool_id: int | None = None) -> None:
        """Add (``sign`` 1) or take (-1) a span's slots in the blocks' tallies;
        with ``pool_id``, mark the blocks as that pool's. One block (most
        entries) takes scalar updates, more take one indexed op each."""
        if len(span) == 1:
            ((block, n),) = span.items()
            self._tally[block] += sign * n
            if pool_id is not None:
                self._block_pool[block] = pool_id
            return
        blocks = np.fromiter(span, np.int64, len(span))
        self._tally[blocks] += sign * np.fromiter(span.values(), np.int64, len(span))
        if pool_id is not None:
            self._block_pool[blocks] = pool_id

    def _lock_blocks(self, blocks: Iterable[int], delta: int) -> None:
        counts = self._locks_in
        for block in blocks:
            counts[block] += delta
            if delta > 0 and counts[block] == 1:
                self._lock_mask[block] = True
            elif delta < 0 and counts[block] == 0:
                self._lock_mask[block] = False

    def check(self, entries: Iterable[tuple[Node, int, _Entry]]) -> None:
        """Raise AssertionError unless the per-block index equals a recount of ``entries``
        (every entry in the tree); an index not built yet must be empty, and
        may only be so while at most one pool has cached KV."""
        n = self._alloc.num_blocks
        if not self._indexed:
            assert len(self._pool_ids) <= 1, "two pools cached KV but the index is not built"
            assert not self._tally.any() and not any(self._locks_in), "unbuilt index counts"
            assert not self._lock_mask.any() and not self._spans, "unbuilt index has entries"
            assert not any(self._members), "unbuilt index lists entries"
            return
        tally = np.zeros(n, dtype=np.int64)
        locked = np.zeros(n, dtype=np.int64)
        members: list[set[tuple[Node, int]]] = [set() for _ in range(n)]
        keys = set()
        for node, gid, entry in entries:
            pool = self._generations[gid].pool
            blocks = entry.slots // self._alloc.geometry(pool).slots_per_block
            np.add.at(tally, blocks, 1)
            distinct = np.unique(blocks)
            locked[distinct] += bool(entry.lock_ref)
            for block in distinct.tolist():
                members[block].add((node, gid))
                assert self._block_pool[block] == self._pool_ids[pool], f"block {block}: pool"
            keys.add((node, gid))
            if len(entry.slots):
                span = self._spans[(node, gid)]
                d, c = np.unique(blocks, return_counts=True)
                assert sorted(span.items()) == list(zip(d.tolist(), c.tolist(), strict=True)), (
                    "an entry's block span drifted"
                )
        assert (tally <= self._alloc.used_slots_per_block()).all(), "entries hold free slots"
        assert set(self._spans) == keys, "span index holds entries the tree does not"
        assert np.array_equal(tally, self._tally), "per-block slot tally drifted"
        assert locked.tolist() == self._locks_in, "per-block lock count drifted"
        assert np.array_equal(locked > 0, self._lock_mask), "lock mask drifted"
        assert [set(m) for m in self._members] == members, "per-block entry lists drifted"

    # ---- planning -------------------------------------------------------------------
    def evict(self, num_tokens: int = 0, num_bytes: int = 0) -> int:
        """Free unlocked leaf entries of every pool, lowest key first, until at
        least ``num_tokens`` tokens or ``num_bytes`` bytes are free. Returns tokens freed."""
        if num_tokens <= 0 and num_bytes <= 0:
            return 0
        tokens = nbytes = 0
        while tokens < (num_tokens or 1 << 62) and nbytes < (num_bytes or 1 << 62):
            heads = [h for h in map(self._head, list(self._heaps)) if h is not None]
            if not heads:
                break
            best = min(heads, key=lambda h: (h[0], h[1]))
            freed = self._evict_head(best)
            tokens += freed
            nbytes += freed * self._generations[best[3]].bytes_per_token
        return tokens

    def make_room(self, pool: str, num_tokens: int) -> int:
        """Evict until ``num_tokens`` slots can be allocated for ``pool``; returns tokens freed.

        Only what can give this pool room goes, cheapest (by policy) first:
        its own entries (freed slots are its to reuse), and, while it may
        still take blocks, whole blocks of other pools that hold nothing but
        unlocked cache entries, fewest used slots first. A slot freed in
        another pool's block is of no use until the whole block is empty, so
        another model's cached KV is never wiped for nothing.
        """
        alloc = self._alloc
        blocks: Iterator[BlockOption] | None = None  # built on first need
        option: BlockOption | None = None  # the next of ``blocks``, if any
        freed = 0
        # Another pool's block is an option only once another pool has cached
        # (with one pool, as mostly, the scan and its checks are skipped).
        others = len(self._pool_ids) > (pool in self._pool_ids)
        while not alloc.can_alloc(pool, num_tokens):
            own = self._head(pool)
            if others and blocks is None and alloc.may_grow(pool):
                blocks = self.emptiable_blocks(pool)
                option = next(blocks, None)
            offer = None
            if blocks is not None and alloc.may_grow(pool):
                while option is not None and not alloc.gains_block(pool, option.pool):
                    option = next(blocks, None)  # that pool is at its floor: its block stays
                offer = option
            if own is None and offer is None:
                break
            if offer is None or (own is not None and own[0] <= offer.key):
                freed += self._evict_head(own)
            else:
                freed += self._empty_block(offer)
                option = next(blocks, None)
        return freed

    def emptiable_blocks(self, pool: str) -> Iterator[BlockOption]:
        """Other pools' blocks whose every used slot is an unlocked entry's,
        fewest used slots first, then least valuable, then block id, with the
        entries to drop.

        The candidates are one mask over the per-block counts; options are
        built one equal-``used`` group at a time (a call mostly takes the
        first few), with keys and entries as of then: a block emptied on
        the way by an earlier subtree drop is skipped."""
        own = self._pool_ids.get(pool, -1)
        if all(pid == own for pid in self._pool_ids.values()):
            return  # no other pool has ever cached a slot: no block of another to empty
        if not self._indexed:
            self._build_index()  # another pool's blocks could go: count them now
        used = self._alloc.used_slots_per_block()
        tally = self._tally
        ok = (tally > 0) & ~self._lock_mask & (tally == used)
        ok &= self._block_pool != self._pool_ids.get(pool, -1)
        qualified = np.flatnonzero(ok)
        if not qualified.size:
            return
        used_of = tally[qualified]
        order = np.argsort(used_of, kind="stable")  # block id order within one count
        qualified, used_of = qualified[order].tolist(), used_of[order]
        edges = [0, *(np.flatnonzero(np.diff(used_of)) + 1).tolist(), len(order)]
        # An entry spans several blocks: its key, computed once per call,
        # serves each (a group of full blocks can hold hundreds).
        keys: dict[tuple[Node, int], tuple[float, ...]] = {}

        def key_of(member: tuple[Node, int]) -> tuple[float, ...]:
            key = keys.get(member)
            if key is None:
                node, gid = member
                key = keys[member] = self.key(gid, node.entries[gid])
            return key

        for lo, hi in itertools.pairwise(edges):
            group = []
            for block in qualified[lo:hi]:
                entries = list(self._members[block])
                owner = self._alloc.block_pool(block)
                if not entries or owner is None:
                    continue  # emptied since the scan
                group.append(
                    BlockOption(
                        block,
                        owner,
                        int(tally[block]),
                        max(map(key_of, entries)),
                        entries,
                    )
                )
            group.sort(key=lambda o: (o.key, o.block))
            yield from group

    def _empty_block(self, option: BlockOption) -> int:
        """Drop every entry with slots in the block (with what hangs below it)."""
        freed = 0
        for node, gid in option.entries:
            if node.entries.get(gid) is not None:  # not gone with an earlier subtree
                freed += self._drop_under(node, gid, "capacity")
        return freed
