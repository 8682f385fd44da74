"""Control operations, the stats report, and the invariant walk.

``reply`` answers the front's ``ControlRequest`` (stats, check, dashboard,
flush_cache, invalidate); ``stats`` assembles every figure ``/metrics`` and
``/get_server_info`` report; ``check`` walks the cache's invariants against
what the scheduler tracks, rate-limited when a client asks for it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixmux import protocol
from radixmux.memory.radix_diagnostics import check_invariants
from radixmux.scheduler.dashboard import dashboard_snapshot

if TYPE_CHECKING:
    from radixmux.memory.allocator import ArenaUsage
    from radixmux.memory.radix_cache import CacheStats
    from radixmux.scheduler.scheduler import Scheduler

log = logging.getLogger("radixmux.scheduler")

# The invariant walk (``check``) costs time on the loop in proportion to the
# tree and the requests. Asked for (``check``, so ``/get_server_info``), it
# runs at most once a second and at most 1% of the time, and not at all while
# nothing changed since the last one; otherwise the answer is the last walk's
# result with its age.
CHECK_MIN_INTERVAL_S = 1.0
CHECK_MAX_SHARE = 0.01
# Control operations that change nothing (they do not make the last walk stale).
READ_ONLY_OPS = ("stats", "check", "dashboard")


@dataclass
class InvariantWalk:
    """The last run of ``check`` and when the next one may run."""

    result: str | None = None  # "ok" or "violated: ..."; None: never run
    at: float = 0.0  # time.monotonic() of the walk
    version: int = -1  # Scheduler.version it saw
    next_at: float = 0.0  # no walk on request before this (the rate limit)
    count: int = 0  # walks so far


def reply(sched: Scheduler, msg: protocol.ControlRequest) -> protocol.ControlReply:
    """The answer to one control operation."""
    cache = sched.cache
    if msg.op in ("stats", "check"):
        if msg.op == "check":
            invariants_on_request(sched)
        return protocol.ControlReply(msg.req_id, True, stats=stats(sched))
    if msg.op == "dashboard":
        return protocol.ControlReply(
            msg.req_id, True, stats=stats(sched), dashboard=dashboard_snapshot(cache)
        )
    if msg.op == "flush_cache":
        pins = sched.warmups.pins.drop()  # a flush empties the cache, pins included
        freed = cache.flush()
        if sched.disk is not None:
            sched.disk.clear()
        log.info("cache flushed: %d tokens freed, %d pins dropped", freed, pins)
        return protocol.ControlReply(
            msg.req_id, True, f"flushed {freed} cached tokens ({pins} pins dropped)"
        )
    if msg.op == "invalidate":
        if msg.model not in sched.models:
            return protocol.ControlReply(msg.req_id, False, f"model {msg.model!r} is not served")
        sched.warmups.pins.drop(msg.model)  # its pinned KV is stale too
        freed = sched.kv.invalidate(msg.model)
        log.info("model %s invalidated: %d cached tokens freed", msg.model, freed)
        return protocol.ControlReply(
            msg.req_id, True, f"invalidated {msg.model}: freed {freed} tokens"
        )
    return protocol.ControlReply(msg.req_id, False, f"unknown control op {msg.op!r}")


def stats(sched: Scheduler) -> protocol.SchedulerStats:
    """Every figure ``/metrics`` and ``/get_server_info`` report; O(models),
    never the invariant walk (its last result is reported, with its age)."""
    cache = sched.cache
    cs = cache.stats()
    usage = cache.allocator.usage()
    pins = sched.warmups.pins
    models = []
    for m in sched.models.values():
        c = cs.per_model[m.name]
        pool = usage.pools[cache.pool_of(m.name)]
        models.append(
            protocol.ModelStatus(
                name=m.name,
                up=m.up,
                error=m.down_reason or next((r.error for r in m.runners if r.error), None),
                waiting=len(m.waiting),
                running=len(m.running()),
                replicas_up=sum(r.up for r in m.runners),
                cache_hits=c.hits,
                cache_misses=c.misses,
                tokens_queried=c.tokens_queried,
                tokens_matched=c.tokens_matched,
                cached_tokens=cs.cached_tokens[m.name],
                arena_bytes=pool.blocks * usage.block_bytes,
                steps=sum(r.steps for r in m.runners),
                runner_busy_seconds=sum(r.busy_s for r in m.runners),
                threads=max((r.threads for r in m.runners), default=0),
                state=m.state,
                runner_pids=[r.pid for r in m.runners if r.up and r.pid is not None],
                restarts=sum(r.restarts for r in m.runners),
                evicted_for_tokens=cs.evicted_for.get(m.name, 0),
                kv_allocated_tokens=sched.kv.allocated_tokens[m.name],
                evicted_tokens=cs.evicted_by_model.get(m.name, {}),
                pinned_tokens=pins.tokens(m.name),
            )
        )
    walk = sched.walk
    return protocol.SchedulerStats(
        models=models,
        evicted_tokens=cs.evicted_tokens,
        arena_total_bytes=sched.arena.total_bytes,
        arena_free_bytes=usage.free_blocks * usage.block_bytes,
        arena_fragmented_bytes=usage.fragmented_bytes,
        tree_nodes=cs.nodes,
        steps=sum(r.steps for r in sched.runners.values()),
        retractions=sched.builder.retractions,
        waits_for_decodes=sched.builder.waits_for_decodes,
        prompt_tokens_computed=sched.prompt_tokens_computed,
        invariants=walk.result,
        invariants_age_s=time.monotonic() - walk.at if walk.result is not None else None,
        invariants_current=walk.version == sched.version,
        invariant_checks=walk.count,
        locks_held=cache.locks_held,
        request_owned_slots=sum(
            len(r.owned_slots) + sum(len(p.owned_slots) for p in r.lower)
            for r in sched.requests.values()
        ),
        aborted_before_arrival=sched.aborted_before_arrival,
        contained_failures=sched.contained_failures,
        shared_prefix_rows=sched.builder.shared_prefix_rows,
        disk=sched.disk.stats() if sched.disk is not None else None,
        tree_tokens=cs.tree_tokens,
        tree_index_bytes=cs.index_bytes,
        pins=len(pins.by_key),
        pinned_bytes=pins.bytes(),
        max_pinned_bytes=pins.cap_bytes,
        layer_groups=layer_group_status(sched, cs, usage),
    )


def layer_group_status(
    sched: Scheduler, cs: CacheStats, usage: ArenaUsage
) -> list[protocol.LayerGroupStatus]:
    """The lower layer groups of every model cut for layer sharing."""
    cache, out = sched.cache, []
    for model, groups in sched.kv.groups.items():
        bounds = [0, *groups.splits]
        for name, start, end in zip(groups.lower, bounds, bounds[1:], strict=False):
            pool = cache.pool_of(name)
            out.append(
                protocol.LayerGroupStatus(
                    model=model,
                    start=start,
                    end=end,
                    pool=pool,
                    shared_with=sorted(
                        m for m, g in sched.kv.groups.items() if m != model and pool in g.pools
                    ),
                    cached_tokens=cs.cached_tokens[name],
                    tokens_matched=cs.per_model[name].tokens_matched,
                    tokens_recomputed=sched.kv.lower_recomputed[name],
                    tokens_reused=sched.kv.lower_reused[name],
                    arena_bytes=usage.pools[pool].blocks * usage.block_bytes,
                )
            )
    return out


def invariants_on_request(sched: Scheduler) -> None:
    """Walk the invariants for a ``check`` unless the last walk is still
    current (nothing changed since) or the rate limit says not yet: a
    client asking in a loop costs the loop at most ``CHECK_MAX_SHARE``."""
    if sched.walk.version != sched.version and time.monotonic() >= sched.walk.next_at:
        walk_invariants(sched)


def walk_invariants(sched: Scheduler) -> str:
    """Run ``check`` now and remember its result: "ok" or "violated: ..."."""
    t0 = time.monotonic()
    try:
        check(sched)
        result = "ok"
    except AssertionError as exc:
        result = f"violated: {exc}"
    now = time.monotonic()
    walk = sched.walk
    walk.result, walk.at, walk.version = result, now, sched.version
    walk.next_at = now + max(CHECK_MIN_INTERVAL_S, (now - t0) / CHECK_MAX_SHARE)
    walk.count += 1
    return result


def check(sched: Scheduler) -> None:
    """The cache's invariants, checked against what the scheduler itself
    tracks (not the tree's own record): the tree's locks are exactly those
    of tracked running requests, every allocated slot is in the tree or
    owned by one of them, and a waiting request holds no KV at all. So an
    idle server holds zero locks and zero request-owned slots."""
    running = [req for m in sched.models.values() for req in m.running()]
    tracked = set(map(id, sched.requests.values()))
    assert all(id(r) in tracked for r in running), "a runner runs an untracked request"
    disk = sched.disk
    loading = disk.loading_requests() if disk else []
    for req in sched.requests.values():
        if req.runner is None and req not in loading:
            assert req.handle is None and not len(req.slots) and not req.lower, (
                f"rid={req.rid} waits holding KV"
            )
    check_invariants(
        sched.cache,
        held=sched.kv.held_slots(running + loading),
        locks=[r.handle for r in running if r.handle is not None]
        + [p.handle for r in running for p in r.lower]
        + (disk.locks if disk else [])
        + sched.warmups.pins.handles(),
    )
