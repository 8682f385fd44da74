"""How busy models share the machine: cores among runners, arena by priority.

Compute follows load as memory does: an idle model's cores and KV go to the
busy ones, and while several models have work each gets a share weighted by
its ``priority``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixmux.scheduler.models import ModelState

if TYPE_CHECKING:
    from radixmux.scheduler.scheduler import Scheduler


def threads_per_runner(sched: Scheduler) -> int:
    """The cores divided among runners that have work now (0: leave as set).

    A runner mid-batch keeps its count until that batch ends, so a newly busy
    runner briefly shares cores. ``--runner-threads N`` fixes every runner at
    N instead.
    """
    if sched.args.runner_threads or len(sched.runners) < 2:
        return 0
    busy = sum(
        1
        for m in sched.models.values()
        for r in m.runners
        if r.up and (r.inflight is not None or r.running or m.waiting)
    )
    return max(1, sched.cores // max(1, busy))


def admit_cap(sched: Scheduler, model: ModelState) -> int | None:
    """Weighted fair share of the arena by priority, in tokens this model
    may still admit while another model has requests waiting (None: no
    bound). The batch builder still lets an idle runner start one request."""
    busy = [m for m in sched.models.values() if m.waiting or m.running()]
    if not any(m.waiting for m in busy if m is not model):
        return None
    total_priority = sum(m.arg.priority for m in busy)
    share = sched.arena.total_bytes * model.arg.priority / total_priority
    bpt = model.info.layout.bytes_per_token
    used = sum(len(r.slots) for r in model.running()) * bpt
    return max(0, int(share - used) // bpt)
