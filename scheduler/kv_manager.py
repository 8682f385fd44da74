"""A request's KV through its life: cache lookup, slot reservation, caching, release.

This is the only place the scheduler touches the radix cache and allocator,
so the ownership rule lives in one file: a request's first ``handle.length``
slots belong to the tree (locked), the rest are its own until it inserts
them or frees them.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from radixmux.memory.radix_cache import RadixCache
from radixmux.scheduler.disk_tier import DiskTier
from radixmux.scheduler.request import Req


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

    def lookup(self, req: Req) -> None:
        """Match and lock the longest cached prefix (leaving a token to compute).

        Statistics are not counted yet: a request may be looked up several
        times before it is admitted; ``admitted`` counts it once.
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
        m = self.cache.match(req.model, req.tokens[:limit], record=False)
        self.cache.lock(m.handle)
        req.handle = m.handle
        req.slots = m.slots
        req.kv_len = m.length

    def admitted(self, req: Req) -> None:
        """The looked-up request runs: count its hit and refresh its path."""
        if req.handle is not None:
            self.cache.record(req.model, req.handle, req.num_tokens)
        if not req.admitted_once:
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
        plan = self.disk.plan_load(req)
        if plan is None or plan == "wait":
            return plan
        assert not isinstance(plan, str)
        if not self.reserve(req, plan.tokens):
            return "no room"
        self.disk.start_load(req, plan)
        return "loading"

    def room_for(self, req: Req, n: int) -> bool:
        """Whether ``n`` more slots for this model can be had (evicting if needed)."""
        pool = self.cache.pool_of(req.model)
        return self.cache.allocator.can_alloc(pool, n) or (
            self.use_cache and self.cache.evict_for(req.model, n)
        )

    def reserve(self, req: Req, n: int) -> bool:
        """Make room for ``n`` more tokens of KV; False when there is none."""
        need = req.kv_len + n - len(req.slots)
        if need <= 0:
            return True
        pool = self.cache.pool_of(req.model)
        new = self.cache.allocator.alloc(pool, need)
        if new is None and self.cache.evict_for(req.model, need):
            new = self.cache.allocator.alloc(pool, need)
        if new is None:
            return False
        self.allocated_tokens[req.model] += len(new)
        req.slots = np.concatenate([req.slots, new])
        return True

    def cacheable(self, req: Req) -> bool:
        """False once the model was invalidated after this request matched."""
        return (
            self.use_cache
            and req.handle is not None
            and req.handle.generation_id == self.cache.generation_of(req.model)
        )

    def cache_progress(self, req: Req) -> None:
        """Insert the request's computed whole pages, so others can hit them now
        (in-batch prefix sharing, chunked prefill); it keeps using the tree's slots."""
        if not self.cacheable(req):
            return
        assert req.handle is not None
        aligned = req.kv_len - req.kv_len % self.page
        if aligned <= req.handle.length:
            return
        tokens = self._insert(req, aligned)
        m = self.cache.match(req.model, tokens, record=False)
        assert m.length == aligned, "a just-inserted prefix must match"
        self.cache.lock(m.handle)
        self.cache.unlock(req.handle)
        req.slots = np.concatenate([m.slots, req.slots[aligned:]])
        req.handle = m.handle

    def _insert(self, req: Req, aligned: int) -> np.ndarray:
        """Cache the request's first ``aligned`` tokens (whole pages) and tell the
        disk tier (write-through saves them); returns those tokens."""
        tokens = req.tokens[:aligned]
        self.cache.insert(req.model, tokens, req.slots[:aligned], prefix=req.handle)
        if self.disk is not None:
            self.disk.inserted(req.model, tokens)
        return tokens

    def release(self, req: Req, keep: bool) -> None:
        """Give back the request's KV: insert computed pages into the cache when
        ``keep`` (finished or retracted), free everything else, drop the lock."""
        pool = self.cache.pool_of(req.model)
        if keep and self.cacheable(req):
            assert req.handle is not None
            aligned = req.kv_len - req.kv_len % self.page
            self._insert(req, aligned)
            self.cache.allocator.free(pool, req.slots[aligned:])
        else:
            self.cache.allocator.free(pool, req.owned_slots)
        if req.handle is not None:
            self.cache.unlock(req.handle)
        req.handle = None
        req.slots = np.zeros(0, dtype=np.int64)
        req.kv_len = 0

    def held_slots(self, reqs: list[Req]) -> dict[str, list[np.ndarray]]:
        """Slots live requests own, per pool (for ``check_invariants``)."""
        held: dict[str, list[np.ndarray]] = {}
        for req in reqs:
            held.setdefault(self.cache.pool_of(req.model), []).append(req.owned_slots)
        return held
