"""The scheduler's side of the disk tier: finished jobs, held batches, stalls.

A batch that would write KV into arena blocks a disk save still reads is
held (built, not sent) until the save is done, so a wrong chunk never
reaches the disk. Finished loads put their requests back first in their
queue. A disk that finishes no job for ``--kv-disk-timeout`` while someone
waits on it is turned off and its waiters fail with a 503.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixmux.scheduler import request_life
from radixmux.scheduler.batch_builder import ScheduledBatch
from radixmux.scheduler.request import Req

if TYPE_CHECKING:
    from radixmux.scheduler.scheduler import Scheduler

log = logging.getLogger("radixmux.scheduler")


@dataclass
class HeldBatch:
    """A batch built for a runner but not sent: it would overwrite KV a disk
    save still reads. The wait is the disk's, not the runner's."""

    batch: ScheduledBatch
    since: float  # time.monotonic() when it was held


def disk_results(sched: Scheduler) -> None:
    """Finished disk jobs: loaded requests go back first in their queue;
    batches held for a save are sent once it is done."""
    disk = sched.disk
    assert disk is not None, "disk results without a disk tier"
    sched.version += 1
    sched.disk_progress_at = time.monotonic()
    for req in disk.poll():
        sched.kv.release(req, keep=True)  # the loaded pages go into the tree
        model = sched.models[req.model]
        if req.aborted is not None or req.rid not in sched.requests:
            sched.requests.pop(req.rid, None)  # failed or aborted while it loaded: answered then
        else:
            model.waiting.insert(0, req)
            # A model without a live runner fails its requests when it
            # loses the last one (this one included); never queue on it.
            request_life.fail_unserved(sched, model)
    for runner_id, held in list(sched.held.items()):
        runner = sched.runners[runner_id]
        if runner.inflight is not held.batch or not runner.up:
            del sched.held[runner_id]  # the runner was lost meanwhile
        elif not overwrites_pending_save(sched, held.batch):
            del sched.held[runner_id]
            sched.send_batch(runner, held.batch)


def overwrites_pending_save(sched: Scheduler, batch: ScheduledBatch) -> bool:
    """Whether the batch writes KV into arena blocks a disk save still reads."""
    return any(
        _writes_pending_save(sched, req, n) for req, n in zip(batch.reqs, batch.chunks, strict=True)
    )


def _writes_pending_save(sched: Scheduler, req: Req, n: int) -> bool:
    """Whether computing ``n`` tokens of ``req`` writes blocks a disk save still reads."""
    if sched.disk is None:
        return False
    disk, cache, end = sched.disk, sched.cache, req.kv_len + n
    if disk.holds_back(cache.pool_of(req.model), req.slots[req.kv_len : end]):
        return True
    return any(  # a lower layer group writes from where it holds the prompt up to
        disk.holds_back(cache.pool_of(p.name), p.slots[max(req.kv_len, p.handle.length) : end])
        for p in req.lower
    )


def check_stalls(sched: Scheduler) -> None:
    """A request waiting on the disk tier (its load, or a save its batch
    is held for) while the I/O thread finished no job for
    ``--kv-disk-timeout`` means the disk hangs (a slow one still finishes
    jobs; a broken one fails them with an error). The waiters get a 503
    instead of waiting forever and the tier is turned off: no new disk
    I/O. Blocks a stuck save still reads stay held back (a batch writing
    them waits, then fails the same way): KV is never overwritten under a
    save, so a wrong chunk never reaches the disk."""
    disk = sched.disk
    if disk is None or (not disk.loading and not sched.held):
        return
    limit = sched.args.kv_disk_timeout
    now = time.monotonic()
    if now - sched.disk_progress_at <= limit:
        return
    loads = disk.loading_requests(started_before=now - limit)
    held = [(rid, h) for rid, h in sched.held.items() if now - h.since > limit]
    if not loads and not held:
        return
    sched.version += 1
    what = "load" if loads else "save"
    disk.turn_off(f"a disk {what} made no progress in {limit:g} s (--kv-disk-timeout)")
    why = f"the KV disk tier stalled: no disk {what} finished in {limit:g} s"
    for runner_id, h in held:
        _unhold(sched, runner_id, h, why)
    # A failed load's slots are freed when (if ever) its job ends.
    request_life.fail(sched, [r.rid for r in loads if r.rid in sched.requests], 503, why)


def _unhold(sched: Scheduler, runner_id: str, held: HeldBatch, why: str) -> None:
    """Give up a held batch: the requests that would overwrite a stuck
    save's blocks fail with ``why``, the others wait again (their KV so far
    cached: they resume where they were), an aborted one ends."""
    del sched.held[runner_id]
    runner = sched.runners[runner_id]
    runner.inflight = None
    waiting = sched.models[runner.model].waiting
    blocked: list[str] = []
    again: list[Req] = []
    for req, n in zip(held.batch.reqs, held.batch.chunks, strict=True):
        if req.aborted:
            request_life.end(sched, req)
        elif _writes_pending_save(sched, req, n):
            blocked.append(req.rid)
        else:
            again.append(req)
    for req in reversed(again):
        sched.builder.requeue(runner, waiting, req)
    request_life.fail(sched, blocked, 503, why)
