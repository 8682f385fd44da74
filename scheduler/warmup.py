"""Warm-ups and pins: prefixes prefilled ahead of traffic, and kept there.

A warm-up prefix runs as an ordinary request for one token (discarded: the
runner always samples after a prompt, so one token is the least it can do),
whose prompt KV goes into the tree when it finishes, as any request's does.
It is low priority: the scheduler hides a model's warm-ups from the batch
builder while a real request of that model waits (``Warmups.real_requests_first``).

A pin is a lock on the prefix's path in the tree, like a running request's,
held here until it is unpinned (a later warm-up of the same prefix with
``pin: false``), its model is invalidated or unloaded, or ``/flush_cache``
drops every pin. The invariant walk (``control.check``) counts these locks with the requests'.
Pinned bytes are capped (``--max-pinned-fraction`` of the arena) so pins can
never leave running requests without KV.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from radixmux import protocol
from radixmux.memory.radix_cache import CacheHandle, RadixCache, common_prefix_tokens
from radixmux.scheduler import request_life
from radixmux.scheduler.request import Req

if TYPE_CHECKING:
    from radixmux.scheduler.scheduler import Scheduler

WARMUP_PARAMS = protocol.SamplingParams(max_new_tokens=1)
_ITEMSIZE = 4  # prefixes travel and are keyed as packed int32


@dataclass(eq=False)
class Pin:
    """A pinned prefix: the path it locks (``tokens``: the cached part, whole pages)."""

    model: str
    tokens: bytes
    handle: CacheHandle
    # The same path in the model's lower layer groups (layer_groups.py), if any.
    lower: list[CacheHandle] = field(default_factory=list)


def unique_tokens(paths: Iterable[bytes]) -> int:
    """Tokens of the trie the token paths (packed int32) form: a prefix
    shared by several pins is held once, so it is counted once. Sorted paths
    share most with their neighbour, so the trie's size is the sum of lengths
    minus each path's common prefix with the one before it."""
    total = 0
    prev = b""
    for path in sorted(set(paths)):
        total += len(path) // _ITEMSIZE - common_prefix_tokens(prev, path)
        prev = path
    return total


class Pins:
    """Pinned prefixes by (model, prefix as sent), within a byte cap."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.cache: RadixCache | None = None
        self.by_key: dict[tuple[str, bytes], Pin] = {}
        # The cache names holding a model's K/V: its lower layer groups, then
        # itself (KVManager.group_names); a pin locks its path in each.
        self.group_names: Callable[[str], tuple[str, ...]] = lambda model: (model,)

    def _paths(self, model: str) -> list[bytes]:
        return [p.tokens for (m, _), p in self.by_key.items() if m == model]

    def tokens(self, model: str) -> int:
        """Tokens ``model``'s pins hold (a shared prefix once)."""
        return unique_tokens(self._paths(model))

    def bytes(self, extra: dict[str, list[bytes]] | None = None) -> int:
        """KV bytes every pin holds, plus ``extra`` paths per model if they were pinned too."""
        assert self.cache is not None
        extra = extra or {}
        models = {m for m, _ in self.by_key} | set(extra)
        return sum(
            unique_tokens(self._paths(m) + extra.get(m, []))
            * sum(self.cache.model(n).layout.bytes_per_token for n in self.group_names(m))
            for m in models
        )

    def over_cap(self, model: str, paths: list[bytes]) -> str | None:
        """Why pinning ``paths`` too would pass the cap, or None if it fits."""
        need = self.bytes({model: paths})
        if need <= self.cap_bytes:
            return None
        return (
            f"pinning needs {need} bytes of KV with the pins already held, more than "
            f"--max-pinned-fraction allows ({self.cap_bytes} bytes)"
        )

    def pin(self, model: str, key: bytes, ids: np.ndarray) -> tuple[int, str | None]:
        """Lock the cached part of ``ids`` (after its warm-up inserted it):
        (tokens pinned, None), or (0, why) when the cap refuses it."""
        assert self.cache is not None
        old = self.by_key.get((model, key))
        if old is not None:
            return len(old.tokens) // _ITEMSIZE, None  # already pinned: one lock is enough
        m = self.cache.match(model, ids, record=False)
        tokens = ids[: m.length].tobytes()
        why = self.over_cap(model, [tokens])
        if why is not None:
            return 0, why
        self.cache.lock(m.handle)
        lower = [self.cache.match(n, ids[: m.length], record=False).handle
                 for n in self.group_names(model)[:-1]]  # fmt: skip
        for handle in lower:
            self.cache.lock(handle)
        self.by_key[(model, key)] = Pin(model, tokens, m.handle, lower)
        return m.length, None

    def unpin(self, model: str, key: bytes) -> bool:
        """Release one pin; False if that prefix was not pinned."""
        pin = self.by_key.pop((model, key), None)
        if pin is not None:
            assert self.cache is not None
            for handle in (pin.handle, *pin.lower):
                self.cache.unlock(handle)
        return pin is not None

    def drop(self, model: str | None = None) -> int:
        """Release every pin (of one model): before a flush, invalidation or
        unload, whose entries must be free to go. Returns how many."""
        keys = [k for k in self.by_key if model is None or k[0] == model]
        for model_name, key in keys:
            self.unpin(model_name, key)
        return len(keys)

    def handles(self) -> list[CacheHandle]:
        """The locks pins hold (for the scheduler's invariant check)."""
        return [h for p in self.by_key.values() for h in (p.handle, *p.lower)]


@dataclass(eq=False)
class WarmupJob:
    """One ``WarmupRequest``: its prefixes' results as they finish."""

    msg: protocol.WarmupRequest
    items: list[protocol.WarmedPrefix | None]
    left: int
    error: protocol.WarmupReply | None = None


@dataclass
class Warmups:
    """Warm-up requests in flight (by each prefix request's rid) and the pins."""

    pins: Pins
    jobs: dict[str, tuple[WarmupJob, int]] = field(default_factory=dict)

    def __contains__(self, rid: str) -> bool:
        return rid in self.jobs

    def refusal(
        self, msg: protocol.WarmupRequest, served: Iterable[str]
    ) -> protocol.WarmupReply | None:
        """A reply refusing the whole warm-up before anything runs, or None."""
        if msg.model not in served:
            return protocol.WarmupReply(
                msg.req_id, 404, f"model {msg.model!r} is not served", "model"
            )
        if not msg.prefixes:
            return protocol.WarmupReply(msg.req_id, 400, "nothing to warm up", "prompts")
        if msg.pin:
            why = self.pins.over_cap(msg.model, list(msg.prefixes))
            if why is not None:
                return protocol.WarmupReply(msg.req_id, 400, why, "pin")
        return None

    def start(self, msg: protocol.WarmupRequest) -> Iterator[tuple[str, bytes]]:
        """Register a warm-up; yields (rid, packed ids) of each prefix's request.
        ``pin: false`` releases the prefixes' pins first, so they may be evicted."""
        if not msg.pin:
            for prefix in msg.prefixes:
                self.pins.unpin(msg.model, prefix)
        job = WarmupJob(msg, [None] * len(msg.prefixes), len(msg.prefixes))
        for i, prefix in enumerate(msg.prefixes):
            rid = f"warmup-{msg.req_id}-{i}"
            self.jobs[rid] = (job, i)
            yield rid, prefix

    def failed(
        self, rid: str, status: int, message: str, param: str | None = None
    ) -> protocol.WarmupReply | None:
        """A prefix's request was refused or failed; the job's reply once all are done."""
        job, _ = self.jobs[rid]
        if job.error is None:
            job.error = protocol.WarmupReply(job.msg.req_id, status, message, param)
        return self._done(rid)

    def finished(self, out: protocol.RequestOutput) -> protocol.WarmupReply | None:
        """A prefix's request ended (its KV is in the tree now): pin it if
        asked; the job's reply once every prefix is done."""
        if out.error is not None or out.finish_reason in ("error", "abort"):
            status = out.status if out.status >= 400 else 500
            return self.failed(out.rid, status, out.error or "warm-up failed")
        job, i = self.jobs[out.rid]
        assert self.pins.cache is not None
        prefix = job.msg.prefixes[i]
        ids = protocol.unpack_ids(prefix).astype(np.int32)
        pinned = 0
        if job.msg.pin:
            pinned, why = self.pins.pin(job.msg.model, prefix, ids)
            if why is not None and job.error is None:
                job.error = protocol.WarmupReply(job.msg.req_id, 400, why, "pin")
        cached = self.pins.cache.match(job.msg.model, ids, record=False).length
        job.items[i] = protocol.WarmedPrefix(
            len(ids), cached, out.prompt_tokens - out.cached_tokens, pinned
        )
        return self._done(out.rid)

    def split_outputs(
        self, outputs: list[protocol.RequestOutput]
    ) -> tuple[list[protocol.RequestOutput], list[protocol.WarmupReply]]:
        """Take warm-ups' outputs out of a batch's (their token is discarded;
        a finished one is pinned if asked): the rest, and the replies of the
        warm-ups now complete."""
        rest: list[protocol.RequestOutput] = []
        replies: list[protocol.WarmupReply] = []
        for out in outputs:
            if out.rid not in self.jobs:
                rest.append(out)
            elif out.finish_reason is not None:
                reply = self.finished(out)
                if reply is not None:
                    replies.append(reply)
        return rest, replies

    @contextlib.contextmanager
    def real_requests_first(self, waiting: list[Req]) -> Iterator[None]:
        """Low priority for warm-ups: while a real request of the model waits,
        its warm-ups are out of the queue the batch builder sees (put back
        after it, behind whatever it requeued). Once admitted, a warm-up runs
        like any request."""
        warm = [r for r in waiting if r.rid in self.jobs]
        if not warm or len(warm) == len(waiting):
            yield
            return
        waiting[:] = [r for r in waiting if r.rid not in self.jobs]
        try:
            yield
        finally:
            waiting.extend(warm)

    def _done(self, rid: str) -> protocol.WarmupReply | None:
        job, _ = self.jobs.pop(rid)
        job.left -= 1
        if job.left:
            return None
        if job.error is not None:
            return job.error
        return protocol.WarmupReply(
            job.msg.req_id, items=[it for it in job.items if it is not None]
        )


def warm_up(sched: Scheduler, msg: protocol.WarmupRequest) -> None:
    """Queue one one-token request per prefix (refused up front when the
    model is unknown or the pins would pass the cap); the front gets one
    ``WarmupReply`` when every prefix is cached."""
    refusal = sched.warmups.refusal(msg, sched.models)
    if refusal is not None:
        sched.reply_warmup(refusal)
        return
    for rid, ids in list(sched.warmups.start(msg)):
        request_life.admit(sched, protocol.TokenizedRequest(rid, msg.model, ids, WARMUP_PARAMS))
