"""A request's KV through its life: cache lookup, slot reservation, caching, release.

This is the only place the scheduler touches the radix cache and allocator,
so the ownership rule lives in one file: a request's first ``handle.length``
slots belong to the tree (locked), the rest are its own until it inserts
them or frees them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import numpy as np

from radixmux.memory.radix_cache import CacheHandle, RadixCache
from radixmux.scheduler.disk_tier import DiskTier
from radixmux.scheduler.layer_groups import ModelGroups
from radixmux.scheduler.request import LowerKV, Req


class KVManager:
    """Admission, growth and release of requests' KV over one radix cache.

    With ``use_cache`` False (``--disable-radix-cache``) nothing is matched or
    inserted: every request computes and frees its own KV. With a ``disk``
    tier, a prompt's chunks found on disk past the memory match are loaded
    instead of computed (``start_disk_load``).
    """

    def __init__(
        self, cache: RadixCache, use_cache: bool = True, disk: DiskTier | None = None
    ) -> None:
        self.cache = cache
        self.use_cache = use_cache
        self.disk = disk
        self.page = cache.page_size
        self.allocated_tokens: Counter[str] = Counter()  # KV slots given, per model
        # How models cut into layer groups are cut (layer_groups.py); a model
        # not cut is absent.
        self.groups: dict[str, ModelGroups] = {}
        self.share_layers = False  # not --disable-layer-sharing, unified arena
        # Per lower group: prompt tokens it held cached that a request could not
        # use (its model's upper layers lacked them) and recomputed.
        self.lower_recomputed: Counter[str] = Counter()
        # ... and prompt tokens it held cached past the full hit and served
        # (a partial hit: only the layers above were computed for them).
        self.lower_reused: Counter[str] = Counter()

    def lookup(self, req: Req) -> None:
        """Match and lock the longest cached prefix (leaving a token to compute).

        Statistics are not counted yet: a request may be looked up several
        times before it is admitted; ``admitted`` counts it once. A model cut
        into layer groups has a prefix cached only as far as every group
        holds it (the shortest group match).
        """
        if not self.use_cache:
            req.slots = np.zeros(0, dtype=np.int64)
            req.kv_len = 0
            return
        # Prompt logprobs come from computed positions only: the cached prefix
        # may cover no more than the positions before the first one scored.
        limit = req.num_tokens - 1
        if req.wants_prompt_logprobs:
            limit = min(limit, max(req.params.prompt_logprobs_start, 1) - 1)
        names = self.group_names(req.model)
        matches = [self.cache.match(name, req.tokens[:limit], record=False) for name in names]
        length = min(m.length for m in matches)
        found_lengths = [m.length for m in matches]
        groups = self.groups.get(req.model)
        # A runner that restarts upper layers from stored hidden states uses
        # every lower group's whole match (a partial hit); otherwise each
        # group is cut back to the common length and the rest recomputed.
        keep_lower = groups is not None and groups.restart
        for i, m in enumerate(matches):
            top = i == len(matches) - 1
            if m.length > length and (top or not keep_lower):  # whole pages
                matches[i] = self.cache.match(names[i], req.tokens[:length], record=False)
        for m in matches:
            self.cache.lock(m.handle)
        *lower, top = matches
        req.handle = top.handle
        req.slots = top.slots
        req.lower = [
            LowerKV(n, m.handle, m.slots, found)
            for n, m, found in zip(names, lower, found_lengths, strict=False)
        ]
        req.kv_len = length

    def admitted(self, req: Req) -> None:
        """The looked-up request runs: count its hit and refresh its path."""
        if req.handle is not None:
            self.cache.record(req.model, req.handle, req.num_tokens)
        for part in req.lower:
            self.cache.record(part.name, part.handle, req.num_tokens)
        if not req.admitted_once:
            for part in req.lower:
                # Found past the full hit: reused (a partial hit) or recomputed.
                self.lower_reused[part.name] += part.handle.length - req.kv_len
                self.lower_recomputed[part.name] += part.found - part.handle.length
            req.cached_tokens = req.kv_len
            req.admitted_once = True
            if req.arrival:  # time.time() at the front (0: not stamped, e.g. a test)
                req.queue_time = max(0.0, time.time() - req.arrival)

    def start_disk_load(self, req: Req) -> str | None:
        """After ``lookup``: start loading the prompt's chunks that are on disk.

        ``"loading"`` (slots reserved, the request is the tier's until its load
        ends), ``"wait"`` (another request is loading those chunks: look again
        next round), ``"no room"``, or None (nothing worth loading)."""
        if self.disk is None or req.wants_prompt_logprobs:
            return None
        groups = self.groups.get(req.model)
        plan = self.disk.plan_load(req, partial=groups is not None and groups.restart)
        if plan is None or plan == "wait":
            return plan
        assert not isinstance(plan, str)
        if not self.reserve(req, plan.tokens, plan.lower_ends(len(req.lower))):
            return "no room"
        self.disk.start_load(req, plan)
        return "loading"

    def group_names(self, model: str) -> tuple[str, ...]:
        """The cache names that hold ``model``'s K/V: its lower layer groups, then itself."""
        groups = self.groups.get(model)
        return (*groups.lower, model) if groups is not None else (model,)

    def layer_splits(self, model: str) -> list[int]:
        """Where ``model``'s layers are cut into groups (what its runner is told)."""
        groups = self.groups.get(model)
        return list(groups.splits) if groups is not None else []

    def unregister(self, model: str) -> int:
        """Take a model (every layer group of it) out of the cache; tokens freed now."""
        names = self.group_names(model)
        self.groups.pop(model, None)
        return sum(self.cache.unregister_model(n) for n in names)

    def invalidate(self, model: str) -> int:
        """Drop ``model``'s cached K/V in every layer group; tokens freed now."""
        return sum(self.cache.invalidate(n) for n in self.group_names(model))

    def room_for(self, req: Req, n: int) -> bool:
        """Whether ``n`` more slots for this model can be had (evicting if needed)."""
        for name in self.group_names(req.model):
            pool = self.cache.pool_of(name)
            if not self.cache.allocator.can_alloc(pool, n) and not (
                self.use_cache and self.cache.evict_for(name, n)
            ):
                return False
        return True

    def capacity_slots(self, model: str) -> int:
        """The most tokens of KV the arena could ever hold for one request of ``model``."""
        allocator = self.cache.allocator
        return min(allocator.capacity_slots(self.cache.pool_of(n)) for n in self.group_names(model))

    def reserve(self, req: Req, n: int, lower_ends: Sequence[int] = ()) -> bool:
        """Make room for ``n`` more tokens of KV (in every layer group of its
        model; lower group ``i`` up to ``lower_ends[i]`` at least, where a
        disk load fills it further); False, holding nothing new, when there is none."""
        ends = [*lower_ends, *[0] * (len(req.lower) - len(lower_ends)), 0]
        parts = [*((p.name, p.slots) for p in req.lower), (req.model, req.slots)]
        got: list[tuple[str, np.ndarray]] = []
        for (name, slots), end in zip(parts, ends, strict=True):
            # A lower group of a partial hit may already hold these tokens.
            need = max(0, req.kv_len + n - len(slots), end - len(slots))
            pool = self.cache.pool_of(name)
            new = self.cache.allocator.alloc(pool, need) if need else slots[:0]
            if new is None and self.cache.evict_for(name, need):
                new = self.cache.allocator.alloc(pool, need)
            if new is None:
                for taken_from, taken in got:
                    self.cache.allocator.free(self.cache.pool_of(taken_from), taken)
                return False
            got.append((name, new))
        *lower, (_, top) = got
        self.allocated_tokens[req.model] += len(top)
        req.slots = np.concatenate([req.slots, top])
        for part, (_, new) in zip(req.lower, lower, strict=True):
            part.slots = np.concatenate([part.slots, new])
        return True

    def cacheable(self, req: Req) -> bool:
        """False once the model was invalidated after this request matched."""
        return (
            self.use_cache
            and req.handle is not None
            and req.handle.generation_id == self.cache.generation_of(req.model)
            and all(p.handle.generation_id == self.cache.generation_of(p.name) for p in req.lower)
        )

    def hold_scheduled(self, reqs: Sequence[Req], chunks: Sequence[int]) -> None:
        """Report the prompt pages a batch is about to compute as stored, now.

        vLLM caches a block, and publishes its KV event, when it allocates the
        block for the step that computes it; the tree holds a page only once it
        is computed, a prefill later. A KV-event router that hears of a prompt
        that late spreads the prompt's other requests meanwhile (docs/cluster.md).
        The hold is one more holder of those pages to the publisher (which counts
        holders per block): ``cache_progress`` and ``release`` drop it after the
        tree's own insert, so a computed page is published once, and a page never
        computed (an abort, a failed batch) is published removed.
        """
        log = self.cache.events
        if log is None or not self.use_cache:
            return
        for req, n in zip(reqs, chunks, strict=True):
            if n < 2 or req.handle is None:
                continue  # decodes: published when the finished request is inserted
            start = req.handle.length
            end = req.kv_len + n
            end -= end % self.page
            if end <= start:
                continue
            hold = (np.asarray(req.tokens[:end], dtype=np.int32).tobytes(), start)
            log.add("stored", (req.model,), *hold)
            self._drop_hold(req)  # after the new one: pages in both never flicker
            req.event_hold = hold

    def _drop_hold(self, req: Req) -> None:
        """End ``req``'s hold (``hold_scheduled``); call after the tree's insert."""
        if req.event_hold is not None and self.cache.events is not None:
            self.cache.events.add("removed", (req.model,), *req.event_hold)
        req.event_hold = None

    def cache_progress(self, req: Req) -> None:
        """Insert the request's computed whole pages, so others can hit them now
        (in-batch prefix sharing, chunked prefill); it keeps using the tree's slots."""
        try:
            self._cache_progress(req)
        finally:
            self._drop_hold(req)

    def _cache_progress(self, req: Req) -> None:
        if not self.cacheable(req):
            return
        assert req.handle is not None
        aligned = req.kv_len - req.kv_len % self.page
        if aligned <= req.handle.length:
            return
        tokens = self._insert(req, aligned)
        for part in req.lower:
            if aligned > part.handle.length:
                part.handle, part.slots = self._relock(part.name, tokens, part.handle, part.slots)
        req.handle, req.slots = self._relock(req.model, tokens, req.handle, req.slots)

    def _relock(
        self, name: str, tokens: np.ndarray, old: CacheHandle, slots: np.ndarray
    ) -> tuple[CacheHandle, np.ndarray]:
        """Lock the just-inserted path of ``tokens`` in place of ``old``; the
        slots with the tree's copies of those tokens' K/V first."""
        m = self.cache.match(name, tokens, record=False)
        assert m.length == len(tokens), "a just-inserted prefix must match"
        self.cache.lock(m.handle)
        self.cache.unlock(old)
        return m.handle, np.concatenate([m.slots, slots[len(tokens) :]])

    def _insert(self, req: Req, aligned: int) -> np.ndarray:
        """Cache the request's first ``aligned`` tokens (whole pages) in every
        layer group and tell the disk tier (write-through saves them); returns
        those tokens."""
        tokens = req.tokens[:aligned]
        for part in req.lower:
            upto = self._held(part, aligned)
            if upto > part.handle.length:  # else it held them already (a partial hit)
                self.cache.insert(
                    part.name, req.tokens[:upto], part.slots[:upto], prefix=part.handle
                )
                if self.disk is not None:
                    self.disk.inserted(part.name, req.tokens[:upto])
        self.cache.insert(req.model, tokens, req.slots[:aligned], prefix=req.handle)
        if self.disk is not None:
            self.disk.inserted(req.model, tokens)
        return tokens

    def _held(self, part: LowerKV, aligned: int) -> int:
        """How far (whole pages) a lower group's slots hold the prompt for the
        tree: as far as the request's own layers (``aligned``), or further
        where a disk load filled the group past them."""
        return max(aligned, part.loaded - part.loaded % self.page)

    def release(self, req: Req, keep: bool) -> None:
        """Give back the request's KV: insert computed pages into the cache when
        ``keep`` (finished or retracted), free everything else, drop the lock."""
        allocator = self.cache.allocator
        if keep and self.cacheable(req):
            assert req.handle is not None
            aligned = req.kv_len - req.kv_len % self.page
            self._insert(req, aligned)
            allocator.free(self.cache.pool_of(req.model), req.slots[aligned:])
            for part in req.lower:
                kept = max(self._held(part, aligned), part.handle.length)  # the tree's now
                allocator.free(self.cache.pool_of(part.name), part.slots[kept:])
        else:
            allocator.free(self.cache.pool_of(req.model), req.owned_slots)
            for part in req.lower:
                allocator.free(self.cache.pool_of(part.name), part.owned_slots)
        self._drop_hold(req)
        if req.handle is not None:
            self.cache.unlock(req.handle)
        for part in req.lower:
            self.cache.unlock(part.handle)
        req.handle = None
        req.lower = []
        req.slots = np.zeros(0, dtype=np.int64)
        req.kv_len = 0

    def held_slots(self, reqs: list[Req]) -> dict[str, list[np.ndarray]]:
        """Slots live requests own, per pool (for ``check_invariants``)."""
        held: dict[str, list[np.ndarray]] = {}
        for req in reqs:
            held.setdefault(self.cache.pool_of(req.model), []).append(req.owned_slots)
            for part in req.lower:
                held.setdefault(self.cache.pool_of(part.name), []).append(part.owned_slots)
        return held
