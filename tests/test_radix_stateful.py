"""Hypothesis stateful test of the unified radix cache against a plain reference.

Random interleavings of request start (match + lock + allocate), finish
(insert + unlock), abort (free + unlock), evict, invalidate, invalidate_prefix
and flush, across four models (two sharing weights) in two tokenizer groups.
The reference is, per generation, a dict ``{token prefix: slot id}``. After every
step the tree must equal the reference, every live request's matched prefix
must still be cached with the same slots (nothing evicted while locked), and
``check_invariants`` must prove every slot is free, in the tree or held by a
live request (nothing leaked).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from radixmux.memory.allocator import KVAllocator
from radixmux.memory.layout import KVLayout
from radixmux.memory.radix_cache import CacheHandle, ModelSpec, RadixCache
from radixmux.memory.radix_diagnostics import check_invariants, dump

TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8)  # 64 slots per 4 KiB block
WIDE = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)  # 32 slots per block
MODELS = (
    ModelSpec("m0", group="g1", pool="w0", layout=TINY),
    ModelSpec("m1", group="g1", pool="w1", layout=WIDE, priority=2.0),
    ModelSpec("m0b", group="g1", pool="w0", layout=TINY),  # replica of m0
    ModelSpec("m3", group="g2", pool="w3", layout=TINY, cost_per_token=3.0),
)
NAMES = [m.name for m in MODELS]
GROUP = {m.name: m.group for m in MODELS}
Key = tuple[tuple[int, ...], int]
BASES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 1, 2]]

token_lists = st.one_of(
    st.lists(st.integers(0, 6), min_size=0, max_size=24),
    st.tuples(st.sampled_from(BASES), st.lists(st.integers(0, 6), max_size=16)).map(
        lambda t: t[0] + t[1]
    ),
)


@dataclass(eq=False)
class Req:
    model: str
    tokens: list[int]
    slots: np.ndarray
    handle: CacheHandle
    generation_id: int  # the generation it matched in (orphaned once its model is invalidated)

    @property
    def owned(self) -> np.ndarray:
        """Slots this request owns (the matched prefix belongs to the tree)."""
        return self.slots[self.handle.length :]


class RadixMachine(RuleBasedStateMachine):
    """Drives one cache and a reference side by side."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.page = 1
        self.cache: RadixCache | None = None
        self.ref: dict[int, dict[Key, int]] = {}
        self.live: list[Req] = []

    @initialize(
        page=st.sampled_from([1, 4]),
        policy=st.sampled_from(["lru", "lfu", "weighted"]),
        blocks=st.integers(3, 6),
    )
    def setup(self, page: int, policy: str, blocks: int) -> None:
        self.page = page
        self.cache = RadixCache(KVAllocator(blocks, 4096, page), eviction_policy=policy)
        for spec in MODELS:
            self.cache.register_model(spec)
        for name in NAMES:
            self.ref.setdefault(self.cache.generation_of(name), {})

    # ---- reference helpers ------------------------------------------------
    def key(self, tokens: list[int], i: int) -> Key:
        """Token i's identity in a paged tree: its path to the end of its page."""
        return (tuple(tokens[: (i // self.page + 1) * self.page]), i)

    def expected_match(self, model: str, tokens: list[int]) -> tuple[int, list[int]]:
        table = self.ref[self.cache.generation_of(model)]
        n = 0
        limit = len(tokens) - len(tokens) % self.page
        while n < limit and self.key(tokens, n) in table:
            n += 1
        n -= n % self.page
        return n, [table[self.key(tokens, i)] for i in range(n)]

    def reconcile_removal(self, freed: int | None) -> dict[int, set[Key]]:
        """After an eviction-like call: the tree lost a subset of the reference
        (``freed`` tokens of it, when the call reports a count)."""
        tree = dump(self.cache)
        gone: dict[int, set[Key]] = {}
        total = 0
        for gid, table in self.ref.items():
            now = tree.get(gid, {})
            for prefix, slot in now.items():
                assert table.get(prefix) == slot, "eviction changed or invented an entry"
            lost = set(table) - set(now)
            for prefix, _ in lost:  # prefix-closed: a removed page takes its extensions
                for longer, _ in now:
                    assert len(longer) <= len(prefix) or longer[: len(prefix)] != prefix, (
                        "evicted a head, kept its tail"
                    )
            gone[gid] = lost
            total += len(lost)
            self.ref[gid] = dict(now)
        assert freed is None or total == freed, f"reported {freed} tokens freed, {total} gone"
        return gone

    # ---- rules ----------------------------------------------------------------
    @rule(target=requests, model=st.sampled_from(NAMES), tokens=token_lists)
    def start(self, model: str, tokens: list[int]):
        cache = self.cache
        want_len, want_slots = self.expected_match(model, tokens)
        m = cache.match(model, np.asarray(tokens, dtype=np.int32))
        assert m.length == want_len
        assert m.slots.tolist() == want_slots
        cache.lock(m.handle)
        aligned = len(tokens) - len(tokens) % self.page
        pool = cache.pool_of(model)
        need = max(aligned - m.length, 0)
        new = cache.allocator.alloc(pool, need)
        if new is None:
            room = cache.evict_for(model, need)
            self.reconcile_removal(None)
            new = cache.allocator.alloc(pool, need)
            assert (new is not None) == room
        if new is None:
            cache.unlock(m.handle)
            self._drop_orphans()
            return None
        req = Req(
            model,
            tokens[:aligned],
            np.concatenate([m.slots, new]),
            m.handle,
            cache.generation_of(model),
        )
        self.live.append(req)
        return req

    def _drop_orphans(self) -> None:
        """Orphaned generations lose their entries as soon as no lock holds them."""
        current = {self.cache.generation_of(n) for n in NAMES}
        for gid in set(self.ref) - current:
            locked = self._locked_prefixes(gid)
            self.ref[gid] = {p: s for p, s in self.ref[gid].items() if p in locked}

    @rule(req=consumes(requests))
    def finish(self, req: Req | None) -> None:
        if req is None:
            return
        cache = self.cache
        orphaned = req.generation_id not in {cache.generation_of(n) for n in NAMES}
        table = self.ref[req.generation_id]
        already = 0
        while already < len(req.tokens) and self.key(req.tokens, already) in table:
            already += 1
        got = cache.insert(req.model, req.tokens, req.slots, prefix=req.handle)
        self.live.remove(req)
        cache.unlock(req.handle)
        if orphaned:
            assert got == len(req.tokens)
            self._drop_orphans()
            return
        assert got == already - already % self.page
        for i, slot in enumerate(req.slots.tolist()):
            table.setdefault(self.key(req.tokens, i), slot)

    @rule(req=consumes(requests))
    def abort(self, req: Req | None) -> None:
        if req is None:
            return
        self.cache.allocator.free(self.cache.pool_of(req.model), req.owned)
        self.live.remove(req)
        self.cache.unlock(req.handle)
        self._drop_orphans()

    @rule(n=st.integers(1, 40))
    def evict(self, n: int) -> None:
        freed = self.cache.evict(num_tokens=n)
        self.reconcile_removal(freed)
        remaining = sum(len(t) for t in self.ref.values())
        if freed < n:
            # Everything left must be protected by a live lock.
            assert remaining == self._locked_tokens()

    @rule(model=st.sampled_from(NAMES))
    def invalidate(self, model: str) -> None:
        old = self.cache.generation_of(model)
        sharers = [n for n in NAMES if n != model and self.cache.generation_of(n) == old]
        freed = self.cache.invalidate(model)
        new = self.cache.generation_of(model)
        assert new != old and new not in self.ref
        self.ref[new] = {}
        gone = self.reconcile_removal(freed)
        if sharers:
            assert not gone[old], "invalidating a replica dropped the other's KV"
        assert self.expected_match(model, BASES[0])[0] == 0

    @rule(model=st.sampled_from(NAMES), cut=st.integers(0, 6), base=st.sampled_from(BASES))
    def invalidate_prefix(self, model: str, cut: int, base: list[int]) -> None:
        prefix = tuple(base[:cut])
        freed = self.cache.invalidate_prefix(GROUP[model], list(prefix))
        gone = self.reconcile_removal(freed)
        cut = (len(prefix) - 1) // self.page * self.page if prefix else 0
        for lost in gone.values():
            for p, i in lost:
                common = min(len(p), len(prefix))
                assert i >= cut and p[:common] == prefix[:common], (
                    "invalidate_prefix dropped KV outside the prefix"
                )

    @rule()
    def flush(self) -> None:
        self.reconcile_removal(self.cache.flush())
        assert sum(len(t) for t in self.ref.values()) == self._locked_tokens()

    def _locked_prefixes(self, gid: int) -> set[Key]:
        return {
            self.key(r.tokens, i)
            for r in self.live
            if r.generation_id == gid
            for i in range(r.handle.length)
        }

    def _locked_tokens(self) -> int:
        return sum(len(self._locked_prefixes(gid)) for gid in self.ref)

    # ---- invariants -------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if self.cache is None:
            return
        STEPS[0] += 1
        tree = dump(self.cache)
        for gid, table in self.ref.items():
            assert tree.get(gid, {}) == table, f"generation {gid} differs from the reference"
        assert set(tree) <= set(self.ref)
        for r in self.live:
            table = tree.get(r.generation_id, {})
            for i in range(r.handle.length):
                assert table.get(self.key(r.tokens, i)) == int(r.slots[i]), (
                    "a locked prefix was evicted"
                )
        held: dict[str, list[np.ndarray]] = {}
        for r in self.live:
            held.setdefault(self.cache.pool_of(r.model), []).append(r.owned)
        check_invariants(self.cache, held=held)

    def teardown(self) -> None:
        # Draining every request must leave only the tree's slots allocated.
        if self.cache is None:
            return
        for r in list(self.live):
            self.cache.allocator.free(self.cache.pool_of(r.model), r.owned)
            self.cache.unlock(r.handle)
        self.live.clear()
        check_invariants(self.cache, held={})
        self.cache.flush()
        assert self.cache.allocator.usage().free_blocks == self.cache.allocator.num_blocks


RadixMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
STEPS = [0]  # checked steps, reported so CI shows the test ran thousands


class TestRadixMachine(RadixMachine.TestCase):
    def test_ran_thousands_of_steps(self) -> None:
        self.runTest()
        print(f"radix stateful: {STEPS[0]} checked steps")
        assert STEPS[0] >= 2000
