"""The unified radix tree: one prefix cache shared by every served model.

Edges are token-id sequences (stored as packed int32 bytes, so comparing an
edge is one ``memcmp``). Under the root there is one namespace per tokenizer
compatibility group: models whose tokenizers are identical share paths. Each
node holds, per *generation*, that generation's KV slot ids for the node's
tokens, a lock count, the last access time and a hit count. A generation is
the KV that models with identical weights (one pool) read and write: replicas
and aliases share it, so a prefix one replica computed is a hit for the other.
Invalidating a model (new weights, a reload) moves it to a new generation; one
that no model uses any more is orphaned: it never matches again and its
entries are freed as their locks go.

Per generation the cached entries are prefix-closed: if a node holds a
generation's entry, so does its parent. So ``match`` walks down while the
model has KV, and eviction only ever removes leaf-most entries of a
generation.

The tree is single-threaded by design (the scheduler's event loop owns it);
requests hold ``CacheHandle`` locks on the path they use instead of mutexes.
"""

from __future__ import annotations

import itertools
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from radixmux.memory.allocator import KVAllocator
from radixmux.memory.eviction import Evictor, get_policy
from radixmux.memory.layout import KVLayout
from radixmux.memory.tree_events import TreeEventKind, TreeEventLog

Tokens = Sequence[int] | np.ndarray | bytes
# "unload": a model removed at run time (its generation's entries go with it).
EVICTION_REASONS = ("capacity", "invalidation", "flush", "unload")


@dataclass(frozen=True)
class ModelSpec:
    """A served model as the cache sees it.

    ``group`` is the tokenizer fingerprint (compatibility group), ``pool`` the
    KV pool key: the weights fingerprint (``ModelInfo.kv_share_key``) and the
    KV dtype; models with equal ``pool`` share KV (one generation, one pool of
    arena slots).
    """

    name: str
    group: str
    pool: str
    layout: KVLayout
    priority: float = 1.0
    cost_per_token: float = 1.0
    floor_bytes: int = 0
    cap_bytes: int | None = None


class _Entry:
    __slots__ = ("child_refs", "hits", "last_access", "lock_ref", "slots")

    def __init__(self, slots: np.ndarray, last_access: float) -> None:
        self.slots = slots
        self.lock_ref = 0
        self.last_access = last_access
        self.hits = 0
        self.child_refs = 0  # children holding an entry of the same generation


class Node:
    """A tree node: an edge of tokens and the generations that hold KV for it."""

    __slots__ = ("children", "entries", "key", "parent")

    def __init__(self, key: bytes, parent: Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.entries: dict[int, _Entry] = {}

    @property
    def num_tokens(self) -> int:
        return len(self.key) // 4


# Fixed sizes behind ``RadixCache.index_bytes`` (the terms ``python_bytes``
# sums): a node with its empty key, no children and one entry; an entry with
# its slot array's header; one int64 slot id.
_NODE_BYTES = (
    sys.getsizeof(Node(b"", None)) + sys.getsizeof(b"") + sys.getsizeof({}) + sys.getsizeof({0: 0})
)
_ENTRY_BYTES = sys.getsizeof(_Entry(np.zeros(0, np.int64), 0.0)) + sys.getsizeof(
    np.zeros(0, np.int64)
)
_SLOT_BYTES = np.dtype(np.int64).itemsize


# The two below are made on every match, on the scheduler's loop: as frozen
# Structs they cost a seventh of a frozen dataclass (0.15 against 1.0 us each).
class CacheHandle(msgspec.Struct, frozen=True):
    """A matched path in one generation: what a request locks and later inserts from."""

    node: Node
    generation_id: int
    length: int


class MatchResult(msgspec.Struct, frozen=True):
    """The longest cached prefix: its length, its slot ids, and a handle to lock."""

    length: int
    slots: np.ndarray
    handle: CacheHandle


@dataclass
class ModelCounters:
    """Match statistics of one model."""

    matches: int = 0
    hits: int = 0
    misses: int = 0
    tokens_queried: int = 0
    tokens_matched: int = 0

    @property
    def hit_rate(self) -> float:
        return self.tokens_matched / self.tokens_queried if self.tokens_queried else 0.0


@dataclass
class CacheStats:
    """A snapshot of the cache's counters (feeds ``/metrics``)."""

    per_model: dict[str, ModelCounters]
    cached_tokens: dict[str, int]  # per model (replicas report their shared generation)
    cached_bytes: dict[str, int]
    nodes: int
    evicted_tokens: dict[str, int]  # by reason
    total: ModelCounters = field(default_factory=ModelCounters)
    # Capacity evictions made to give each model room (any pool's tokens).
    evicted_for: dict[str, int] = field(default_factory=dict)
    # Tokens evicted from each model's generations, by reason: a generation
    # several models share (replicas, aliases) counts for each of them.
    evicted_by_model: dict[str, dict[str, int]] = field(default_factory=dict)
    tree_tokens: int = 0  # KV tokens the tree holds, summed over generations
    index_bytes: int = 0  # Python heap of the tree's index (``index_bytes()``)


@dataclass
class _Generation:
    """One generation: the KV its models (all of one pool) read and write in the tree."""

    pool: str
    bytes_per_token: int
    models: set[str]
    cached_tokens: int = 0
    # Every model that ever used this generation: once invalidation or unloading
    # leaves it orphaned (``models`` empty), its evictions are still theirs.
    owners: set[str] = field(default_factory=set)
    leaves: set[Node] = field(default_factory=set)  # nodes whose entry has no child entry
    weight: float = 1.0  # priority * cost_per_token / bytes_per_token (weighted policy)

    @property
    def orphaned(self) -> bool:
        return not self.models

    def attach(self, model: str) -> None:
        self.models.add(model)
        self.owners.add(model)


def as_token_bytes(tokens: Tokens) -> bytes:
    """Packed int32 bytes of a token sequence (the tree's edge format)."""
    if isinstance(tokens, bytes):
        return tokens
    return np.asarray(tokens, dtype=np.int32).tobytes()


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Number of leading int32 tokens two packed sequences share (one memcmp
    when one is a prefix of the other)."""
    n = min(len(a), len(b)) // 4
    if a[: n * 4] == b[: n * 4]:
        return n
    x = np.frombuffer(a, dtype=np.int32, count=n)
    y = np.frombuffer(b, dtype=np.int32, count=n)
    return int(np.argmin(x == y))


class RadixCache:
    """One radix tree over one KV allocator, shared by every registered model.

    All lengths are in tokens. With ``page_size > 1`` matching and inserting
    work in whole pages: a match stops at the last whole page, an insert must
    be page-aligned.
    """

    def __init__(
        self,
        allocator: KVAllocator,
        eviction_policy: str = "lru",
        half_life: float = 1000.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._page_bytes = 4 * self.page_size
        self.eviction_policy = eviction_policy
        self._ticks = itertools.count(1)
        self._clock = clock or (lambda: float(next(self._ticks)))
        self._roots: dict[str, Node] = {}
        self._models: dict[str, ModelSpec] = {}
        self._model_generation: dict[str, int] = {}
        self._pool_generation: dict[str, int] = {}  # pool -> its current generation id
        self._generations: dict[int, _Generation] = {}
        # What to free and in which order; told of every entry change below.
        self._evictor = Evictor(
            allocator,
            self._generations,
            get_policy(eviction_policy, half_life),
            self._remove_entry,
            self._drop_under,
            self._every_entry,
        )
        self._next_generation = itertools.count()
        self._counters: dict[str, ModelCounters] = {}
        self._evicted: Counter[str] = Counter()
        self._evicted_for: Counter[str] = Counter()  # capacity evictions made for each model
        self._evicted_by_model: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self._locks: Counter[tuple[Node, int]] = Counter()
        self._nodes = 0
        # Kept as the tree changes so ``index_bytes`` is O(1) at every scrape
        # (``python_bytes`` walks the whole tree): edge bytes, entries.
        self._edge_bytes = 0
        self._entries = 0
        # Called with (pool, path tokens, path slots, first evicted position)
        # just before a capacity eviction frees an entry's slots: the disk
        # tier copies the KV out first. The slots stay intact until the next
        # forward pass writes them.
        self.on_evict: Callable[[str, bytes, np.ndarray, int], None] | None = None
        # What each model starts and stops holding, for KV event publishing;
        # None (the default) records nothing.
        self.events: TreeEventLog | None = None

    # ---- models ------------------------------------------------------------
    def register_model(self, spec: ModelSpec) -> None:
        """Add a model; one with the ``pool`` of another joins its current generation."""
        if spec.name in self._models:
            raise ValueError(f"model {spec.name!r} is already registered")
        geometry = self.allocator.register(spec.pool, spec.layout, spec.floor_bytes, spec.cap_bytes)
        self._models[spec.name] = spec
        self._roots.setdefault(spec.group, Node(b"", None))
        gid = self._pool_generation.get(spec.pool)
        if gid is None or self._generations[gid].orphaned:
            gid = self._new_generation(spec.pool, geometry.layout.bytes_per_token)
            self._pool_generation[spec.pool] = gid
        self._generations[gid].attach(spec.name)
        self._model_generation[spec.name] = gid
        self._counters[spec.name] = ModelCounters()
        self._record_all("stored", spec.name, gid)  # a generation it joins already holds KV
        self._reweigh(gid)

    def unregister_model(self, name: str) -> int:
        """Remove a model unloaded at run time. Its generation's entries go
        too unless another model (an alias or version with the same weights)
        still uses that generation; entries still locked are freed at their last unlock.
        Returns tokens freed now."""
        self.model(name)
        gid = self._model_generation.pop(name)
        self._record_all("removed", name, gid)
        del self._models[name]
        del self._counters[name]
        self._evicted_for.pop(name, None)
        gen = self._generations[gid]
        gen.models.discard(name)
        self._reweigh(gid)
        return self._drop_all([gid], "unload") if gen.orphaned else 0

    def _reweigh(self, gid: int) -> None:
        gen = self._generations[gid]
        specs = [self._models[m] for m in gen.models]
        if specs:
            best = max(s.priority * s.cost_per_token for s in specs)
            gen.weight = best / gen.bytes_per_token

    def _new_generation(self, pool: str, bytes_per_token: int) -> int:
        gid = next(self._next_generation)
        self._generations[gid] = _Generation(pool, bytes_per_token, set())
        return gid

    def model(self, name: str) -> ModelSpec:
        try:
            return self._models[name]
        except KeyError:
            raise KeyError(f"unknown model {name!r}; registered: {sorted(self._models)}") from None

    def pool_of(self, model: str) -> str:
        """The allocator pool (KV-share key) that holds this model's slots."""
        return self.model(model).pool

    @property
    def models(self) -> list[str]:
        return list(self._models)

    # ---- match ---------------------------------------------------------------
    def match(self, model: str, tokens: Tokens, record: bool = True) -> MatchResult:
        """Longest prefix of ``tokens`` (whole pages) for which ``model`` has KV.

        O(prefix length): one dict lookup and one edge compare per node. A match
        ending inside an edge splits the node there, so the handle's path is
        exactly the matched tokens. Updates access times, hit counts and
        counters unless ``record`` is False (a scheduler's probe or re-match).
        """
        spec = self.model(model)
        gid = self._model_generation[model]
        q = as_token_bytes(tokens)
        limit = (len(q) // self._page_bytes) * self._page_bytes
        node = self._roots[spec.group]
        pos = 0
        parts: list[np.ndarray] = []
        while pos < limit:
            child = node.children.get(q[pos : pos + self._page_bytes])
            if child is None or gid not in child.entries:
                break
            klen = len(child.key)
            partial = pos + klen > limit or not q.startswith(child.key, pos)
            if partial:
                # The first page matched (it is the child's dict key), so the
                # page-aligned common part is at least one page.
                common = common_prefix_tokens(child.key, q[pos:limit])
                child = self._split(child, common - common % self.page_size)
                klen = len(child.key)
            parts.append(child.entries[gid].slots)
            pos += klen
            node = child
            if partial:
                break
        length = pos // 4
        handle = CacheHandle(node, gid, length)
        if record:
            self.record(model, handle, len(q) // 4)
        slots = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return MatchResult(length, slots, handle)

    def record(self, model: str, handle: CacheHandle, queried: int) -> None:
        """Count a match: statistics, access times and hit counts of its path
        (``match`` calls it; a scheduler calls it for a ``record=False`` probe
        it then used)."""
        now = self._clock()
        node = handle.node
        while node.parent is not None:
            entry = node.entries[handle.generation_id]
            entry.last_access = now
            entry.hits += 1
            node = node.parent
        self._count_match(model, queried, handle.length)

    def _count_match(self, model: str, queried: int, matched: int) -> None:
        c = self._counters[model]
        c.matches += 1
        c.tokens_queried += queried
        c.tokens_matched += matched
        if matched:
            c.hits += 1
        else:
            c.misses += 1

    def _split(self, child: Node, ntok: int) -> Node:
        """Cut ``child``'s edge after ``ntok`` tokens; returns the new upper node.

        Every generation's entry splits with it; the upper part inherits lock counts
        (every lock through the child passes through it), access time and hits.
        """
        parent = child.parent
        assert parent is not None and 0 < ntok < child.num_tokens
        cut = ntok * 4
        upper = Node(child.key[:cut], parent)
        parent.children[child.key[: self._page_bytes]] = upper
        child.key = child.key[cut:]
        child.parent = upper
        upper.children[child.key[: self._page_bytes]] = child
        for gid, entry in child.entries.items():
            top = _Entry(entry.slots[:ntok].copy(), entry.last_access)
            top.lock_ref = entry.lock_ref
            top.hits = entry.hits
            top.child_refs = 1
            entry.slots = entry.slots[ntok:].copy()
            upper.entries[gid] = top
            self._evictor.split(child, upper, gid, top)
        self._nodes += 1
        self._entries += len(upper.entries)
        # Lock handles point at nodes, never at the part that moved up, so
        # they stay valid: a handle on `child` still covers both halves.
        return upper

    def path(self, node: Node, gid: int) -> tuple[bytes, np.ndarray]:
        """The tokens from the root to the end of ``node`` and ``gid``'s slots for them."""
        keys: list[bytes] = []
        slots: list[np.ndarray] = []
        while node.parent is not None:
            keys.append(node.key)
            slots.append(node.entries[gid].slots)
            node = node.parent
        empty = np.zeros(0, dtype=np.int64)
        return b"".join(reversed(keys)), np.concatenate([empty, *reversed(slots)])

    def _path_tokens(self, node: Node) -> bytes:
        keys: list[bytes] = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return b"".join(reversed(keys))

    def _record_all(self, kind: TreeEventKind, model: str, gid: int) -> None:
        """Record every entry of ``gid`` as stored or removed for ``model``
        alone (it joins or leaves the generation), parents before children."""
        if self.events is None:
            return
        for root in self._roots.values():
            for node in _walk(root):
                entry = node.entries.get(gid)
                if entry is not None:
                    path = self._path_tokens(node)
                    self.events.add(kind, (model,), path, len(path) // 4 - len(entry.slots))

    def cached_paths(self) -> Iterable[tuple[str, bytes, np.ndarray]]:
        """``(pool, tokens, slots)`` of every leaf-most entry of a live generation:
        together they cover everything the tree holds (for a flush to disk)."""
        for gid, gen in self._generations.items():
            if not gen.orphaned:
                for node in list(gen.leaves):
                    yield (gen.pool, *self.path(node, gid))

    def unload_paths(self, name: str) -> list[tuple[bytes, np.ndarray]]:
        """``(tokens, slots)`` of every leaf-most entry ``unregister_model(name)``
        would drop, most recently used first (what to save before an unload);
        empty when another model still uses ``name``'s generation (nothing is
        dropped then)."""
        gid = self._model_generation[self.model(name).name]
        gen = self._generations[gid]
        if gen.models != {name}:
            return []
        leaves = sorted(gen.leaves, key=lambda node: -node.entries[gid].last_access)
        return [self.path(node, gid) for node in leaves]

    # ---- sharing ---------------------------------------------------------------
    def shared_prefixes(
        self, handles: Sequence[CacheHandle | None], min_tokens: int = 1
    ) -> list[tuple[int, list[int]]]:
        """Group matched paths by the longest cached prefix they share.

        Returns ``(prefix tokens, member indices into handles)`` per group of
        two or more: each member's deepest ancestor (of at least
        ``min_tokens``) that another member also passes through, in the same
        generation. Members of a group hold the same slot ids for that prefix, so
        it can be read once for all of them (shared-prefix decode attention).
        One level only: a request is in at most one group.
        """
        paths: list[list[tuple[Node, int, int]]] = []  # (node, generation id, depth) leaf first
        passing: Counter[tuple[Node, int]] = Counter()
        for handle in handles:
            path = []
            if handle is not None:
                node, depth = handle.node, handle.length
                while node.parent is not None and depth >= min_tokens:
                    path.append((node, handle.generation_id, depth))
                    passing[(node, handle.generation_id)] += 1
                    depth -= node.num_tokens
                    node = node.parent
            paths.append(path)
        groups: dict[tuple[Node, int], tuple[int, list[int]]] = {}
        for i, path in enumerate(paths):
            for node, gid, depth in path:
                if passing[(node, gid)] > 1:
                    groups.setdefault((node, gid), (depth, []))[1].append(i)
                    break
        return [g for g in groups.values() if len(g[1]) > 1]

    # ---- lock ----------------------------------------------------------------
    def lock(self, handle: CacheHandle) -> None:
        """Protect every entry on the handle's path from eviction."""
        gid = handle.generation_id
        node = handle.node
        while node.parent is not None:
            entry = node.entries[gid]
            entry.lock_ref += 1
            if entry.lock_ref == 1:
                self._evictor.lock_changed(node, gid, 1)
            node = node.parent
        self._locks[(handle.node, handle.generation_id)] += 1

    def unlock(self, handle: CacheHandle) -> None:
        """Release a ``lock``; entries of an orphaned generation are freed at once."""
        key = (handle.node, handle.generation_id)
        if self._locks[key] <= 0:
            raise ValueError("unlock of a handle that is not locked")
        self._locks[key] -= 1
        if not self._locks[key]:
            del self._locks[key]
        gid = handle.generation_id
        node = handle.node
        while node.parent is not None:
            entry = node.entries[gid]
            entry.lock_ref -= 1
            if not entry.lock_ref:
                self._evictor.lock_changed(node, gid, -1)
                if not entry.child_refs:
                    self._evictor.offer(node, gid, entry)
            node = node.parent
        if self._generations[gid].orphaned:
            self._drop_all([gid], "invalidation")

    # ---- insert --------------------------------------------------------------
    def insert(
        self,
        model: str,
        tokens: Tokens,
        slots: np.ndarray,
        prefix: CacheHandle | None = None,
    ) -> int:
        """Cache ``tokens`` whose KV the caller wrote at ``slots``.

        ``prefix`` is the handle of the caller's earlier match (its first
        ``prefix.length`` slots belong to the tree already). Afterwards the
        caller owns none of ``slots``: new ones are adopted by the tree, and
        ones that duplicate KV the tree already holds are freed here. Returns
        how many leading tokens were already cached for this model.
        ``tokens`` must be whole pages.
        """
        spec = self.model(model)
        q = as_token_bytes(tokens)
        n = len(q) // 4
        slots = np.asarray(slots, dtype=np.int64)
        if n % self.page_size:
            raise ValueError(f"insert of {n} tokens is not whole pages of {self.page_size}")
        if len(slots) != n:
            raise ValueError(f"{n} tokens but {len(slots)} slots")
        owned = prefix.length if prefix is not None else 0
        gid = prefix.generation_id if prefix is not None else self._model_generation[model]
        if self._generations[gid].orphaned:
            # The model was invalidated while this request ran: its KV is stale.
            self.allocator.free(spec.pool, slots[owned:])
            return n
        now = self._clock()
        node = self._roots[spec.group]
        pos = 0
        cached = 0
        while pos < n:
            b = pos * 4
            child = node.children.get(q[b : b + self._page_bytes])
            if child is None:
                child = Node(q[b:], node)
                node.children[q[b : b + self._page_bytes]] = child
                self._nodes += 1
                self._edge_bytes += len(child.key)
            elif not q.startswith(child.key, b):  # (startswith: a memcmp, no copy of q)
                common = common_prefix_tokens(child.key, q[b : b + len(child.key)])
                child = self._split(child, common - common % self.page_size)
            klen = len(child.key) // 4
            entry = child.entries.get(gid)
            if entry is None:
                self._add_entry(child, gid, slots[pos : pos + klen].copy(), now)
            else:
                entry.last_access = now
                dup = slots[max(pos, owned) : pos + klen]
                if dup.size:
                    self.allocator.free(spec.pool, dup)
                cached = pos + klen
            node = child
            pos += klen
        return cached

    def _add_entry(self, node: Node, gid: int, slots: np.ndarray, now: float) -> None:
        entry = node.entries[gid] = _Entry(slots, now)
        self._entries += 1
        self._evictor.added(node, gid, entry)
        self._evictor.offer(node, gid, entry)
        gen = self._generations[gid]
        gen.cached_tokens += len(slots)
        gen.leaves.add(node)
        if self.events is not None:
            path = self._path_tokens(node)
            self.events.add("stored", tuple(sorted(gen.models)), path, len(path) // 4 - len(slots))
        parent = node.parent
        if parent is not None and parent.parent is not None:
            up = parent.entries[gid]
            up.child_refs += 1
            gen.leaves.discard(parent)

    def _remove_entry(self, node: Node, gid: int, reason: str) -> int:
        entry = node.entries[gid]
        assert entry.lock_ref == 0 and entry.child_refs == 0
        gen = self._generations[gid]
        if self.on_evict is not None and reason == "capacity" and not gen.orphaned:
            tokens, slots = self.path(node, gid)
            self.on_evict(gen.pool, tokens, slots, len(slots) - len(entry.slots))
        if self.events is not None:
            # An orphaned generation's entries were reported gone when its last
            # model left (``_record_all``): they no longer match from then on.
            path = self._path_tokens(node)
            models = tuple(sorted(gen.models))
            self.events.add("removed", models, path, len(path) // 4 - len(entry.slots))
        del node.entries[gid]
        self._evictor.removed(node, gid, entry)
        self.allocator.free(gen.pool, entry.slots)
        gen.cached_tokens -= len(entry.slots)
        gen.leaves.discard(node)
        self._evicted[reason] += len(entry.slots)
        self._entries -= 1
        for name in gen.models or gen.owners:
            self._evicted_by_model[name][reason] += len(entry.slots)
        parent = node.parent
        assert parent is not None
        if parent.parent is not None:
            up = parent.entries[gid]
            up.child_refs -= 1
            if up.child_refs == 0:
                gen.leaves.add(parent)
                if not up.lock_ref:
                    self._evictor.offer(parent, gid, up)
        if not node.entries:
            assert not node.children
            del parent.children[node.key[: self._page_bytes]]
            self._nodes -= 1
            self._edge_bytes -= len(node.key)
        return len(entry.slots)

    def _every_entry(self) -> Iterator[tuple[Node, int, _Entry]]:
        """Every ``(node, generation id, entry)`` of the tree (roots hold none)."""
        for root in self._roots.values():
            for node in _walk(root):
                for gid, entry in node.entries.items():
                    yield node, gid, entry

    # ---- eviction ------------------------------------------------------------
    def evict(self, num_tokens: int = 0, num_bytes: int = 0) -> int:
        """Free unlocked leaf entries across all models, lowest policy key
        first, until at least ``num_tokens`` tokens or ``num_bytes`` bytes are
        free. Returns tokens freed (less only if everything left is locked)."""
        return self._evictor.evict(num_tokens, num_bytes)

    def evict_for(self, model: str, num_tokens: int) -> bool:
        """Evict until ``num_tokens`` slots can be allocated for ``model``;
        False if locked entries leave too little room.

        Only what can give this model room goes (``Evictor.make_room``): the
        model's own pool's entries and whole blocks of other pools that hold
        nothing but unlocked cache entries, cheapest by policy first.
        """
        pool = self.pool_of(model)
        self._evicted_for[model] += self._evictor.make_room(pool, num_tokens)
        return self.allocator.can_alloc(pool, num_tokens)

    def _drop_under(self, node: Node, gid: int, reason: str) -> int:
        """Free every unlocked entry of ``gid`` in ``node``'s subtree (``node``'s own too)."""
        return self._drop_all([gid], reason, under=node)

    def _drop_all(self, gids: Iterable[int], reason: str, under: Node | None = None) -> int:
        """Free every unlocked entry of ``gids`` (in ``under``'s subtree if given),
        leaves first. Order does not matter: everything eligible goes."""
        stack = [
            (node, gid)
            for gid in gids
            for node in self._generations[gid].leaves
            if under is None or _is_under(node, under)
        ]
        freed = 0
        while stack:
            node, gid = stack.pop()
            entry = node.entries[gid]
            if entry.lock_ref or entry.child_refs:
                continue
            parent = node.parent
            freed += self._remove_entry(node, gid, reason)
            if (
                parent is not None
                and parent.parent is not None
                and gid in parent.entries
                and (under is None or _is_under(parent, under))
            ):
                stack.append((parent, gid))
        return freed

    # ---- invalidation ----------------------------------------------------------
    def invalidate(self, model: str) -> int:
        """Move ``model`` to a new, empty generation (e.g. new weights); other
        models, replicas included, keep theirs. The old generation's entries,
        once no model uses it, are freed now, or, when locked by running
        requests, unmatchable from now on and freed when their last lock goes.
        Returns tokens freed now."""
        spec = self.model(model)
        old = self._model_generation[model]
        gen = self._generations[old]
        self._record_all("removed", model, old)
        gen.models.discard(model)
        new = self._new_generation(spec.pool, gen.bytes_per_token)
        self._generations[new].attach(model)
        self._model_generation[model] = new
        if self._pool_generation[spec.pool] == old and gen.orphaned:
            self._pool_generation[spec.pool] = new
        self._reweigh(old)
        self._reweigh(new)
        return self._drop_all([old], "invalidation") if gen.orphaned else 0

    def invalidate_prefix(self, group: str, tokens: Tokens) -> int:
        """Drop every unlocked entry (all models of ``group``) holding KV of
        ``tokens`` or of any extension of it. KV is dropped in whole pages, so
        with ``page_size > 1`` the page holding the first token of the last
        partial page goes too. Locked entries stay. Returns tokens freed."""
        root = self._roots.get(group)
        q = as_token_bytes(tokens)
        n = len(q) // 4
        if root is None:
            return 0
        if n == 0:
            return self.flush("invalidation", group)
        cut = (n - 1) // self.page_size * self.page_size
        node, pos = root, 0
        while pos < cut:
            child = node.children.get(q[pos * 4 : (pos + self.page_size) * 4])
            if child is None:
                return 0
            if common_prefix_tokens(child.key, q[pos * 4 : cut * 4]) < min(
                child.num_tokens, cut - pos
            ):
                return 0
            if child.num_tokens > cut - pos:
                child = self._split(child, cut - pos)
            node, pos = child, pos + child.num_tokens
        rest = q[cut * 4 :]
        hit = [c for k, c in node.children.items() if k.startswith(rest)]
        return sum(self._drop_subtree(c) for c in hit)

    def _drop_subtree(self, top: Node, reason: str = "invalidation") -> int:
        gids = {gid for n in _walk(top) for gid in n.entries}
        return self._drop_all(gids, reason, under=top)

    def flush(self, reason: str = "flush", group: str | None = None) -> int:
        """Drop every unlocked entry (of one group, or all). Returns tokens freed."""
        roots = [self._roots[group]] if group is not None else list(self._roots.values())
        return sum(self._drop_subtree(r, reason) for r in roots)

    # ---- statistics ------------------------------------------------------------
    def cached_tokens(self, model: str) -> int:
        return self._generations[self._model_generation[model]].cached_tokens

    @property
    def num_nodes(self) -> int:
        return self._nodes

    def stats(self) -> CacheStats:
        per_model = {m: ModelCounters(**vars(c)) for m, c in self._counters.items()}
        total = ModelCounters()
        for c in per_model.values():
            for k, v in vars(c).items():
                setattr(total, k, getattr(total, k) + v)
        cached = {m: self.cached_tokens(m) for m in self._models}
        return CacheStats(
            per_model=per_model,
            cached_tokens=cached,
            cached_bytes={
                m: t * self._generations[self._model_generation[m]].bytes_per_token
                for m, t in cached.items()
            },
            nodes=self._nodes,
            evicted_tokens={r: self._evicted[r] for r in EVICTION_REASONS},
            total=total,
            evicted_for={m: self._evicted_for[m] for m in self._models},
            evicted_by_model={
                m: {r: self._evicted_by_model[m][r] for r in EVICTION_REASONS} for m in self._models
            },
            tree_tokens=self.tree_tokens,
            index_bytes=self.index_bytes(),
        )

    @property
    def tree_tokens(self) -> int:
        """KV tokens the tree holds, summed over generations (a shared one counts once)."""
        return sum(g.cached_tokens for g in self._generations.values())

    def index_bytes(self) -> int:
        """About what ``python_bytes`` measures, in O(1) instead of a walk of
        the tree: from counts kept as the tree changes (nodes, edge bytes,
        entries, slot ids) and each object's fixed size, measured once. Cheap
        enough for every ``/metrics`` scrape; dict growth past one item is
        not counted, so it reads a little low on wide nodes."""
        nodes = self._nodes + len(self._roots)
        return (
            nodes * _NODE_BYTES
            + self._edge_bytes
            + self._entries * _ENTRY_BYTES
            + self.tree_tokens * _SLOT_BYTES
        )

    @property
    def locks_held(self) -> int:
        """Lock references currently held on the tree (0 on an idle server)."""
        return sum(self._locks.values())

    def generation_of(self, model: str) -> int:
        """The id of the generation ``model`` reads and writes now (a new one
        after ``invalidate``; models of one pool share it)."""
        self.model(model)
        return self._model_generation[model]


def _walk(root: Node) -> Iterable[Node]:
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _is_under(node: Node | None, top: Node) -> bool:
    while node is not None:
        if node is top:
            return True
        node = node.parent
    return False
