"""Runner supervision as the scheduler does it: hung runners, deaths, returns.

The launcher starts, restarts and gives up on runner processes; the
scheduler times each sent batch (``--runner-timeout``) and kills a runner
that does not answer, moves a lost runner's requests to a live replica (or
fails them when none is left), and takes a restarted runner back once it
reports the same weights.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import TYPE_CHECKING

from radixmux import protocol
from radixmux.scheduler import request_life
from radixmux.scheduler.models import ModelState
from radixmux.scheduler.runners import RunnerState

if TYPE_CHECKING:
    from radixmux.scheduler.scheduler import Scheduler

log = logging.getLogger("radixmux.scheduler")


def check_timeouts(sched: Scheduler) -> None:
    """A runner that has not answered a batch within ``--runner-timeout`` is
    hung: kill it (the launcher restarts it) and fail or move its requests.
    Only what was sent is timed: a batch held for a disk save is the
    disk's wait (``disk_holds.check_stalls``), never the runner's."""
    limit = sched.args.runner_timeout
    now = time.monotonic()
    for runner in sched.runners.values():
        if runner.runner_id in sched.held:
            continue
        if runner.up and runner.inflight is not None and now - runner.sent_at > limit:
            sched.version += 1
            log.error(
                "runner %s did not answer batch %d within %.0f s; killing it",
                runner.runner_id,
                runner.inflight.batch_id,
                limit,
            )
            if runner.pid is not None:
                _kill(runner.pid)
            why = f"runner {runner.runner_id} hung (no answer in {limit:g} s)"
            runner_lost(sched, runner, why, restarting=True)


def runner_died(sched: Scheduler, msg: protocol.RunnerDied) -> None:
    """The launcher saw a runner exit (and restarts it unless it gave up)."""
    runner = sched.runners.get(msg.runner_id)
    if runner is None:
        return
    why = f"runner {msg.runner_id} exited with code {msg.exitcode}"
    if runner.up:
        runner_lost(sched, runner, why, msg.restarting)
    else:  # already failed over (e.g. killed after a hang): just track the restart
        runner.state = "restarting" if msg.restarting else "down"
        model = sched.models[runner.model]
        _update_down_reason(model, runner.error or why)
        request_life.fail_unserved(sched, model)
    if not msg.restarting:
        log.error("runner %s will not be restarted: its model has no live runner", runner.runner_id)


def runner_lost(sched: Scheduler, runner: RunnerState, why: str, restarting: bool) -> None:
    """Take a dead or hung runner out of service. Its running requests move
    to a live replica of the model (same greedy output: they resume from
    their tokens so far); with no live replica left, every request of the
    model fails with 503 (``request_life.fail_unserved``)."""
    runner.state = "restarting" if restarting else "down"
    runner.error = why
    runner.inflight = None
    sched.held.pop(runner.runner_id, None)
    if restarting:
        runner.restarts += 1
    model = sched.models[runner.model]
    _update_down_reason(model, why)
    if model.up:
        running = list(runner.running)
        for req in reversed(running):
            sched.builder.requeue(runner, model.waiting, req)
        log.error("%s; %d requests moved to a replica", why, len(running))
    else:
        log.error("%s; model %s has no live runner", why, model.name)
        request_life.fail_unserved(sched, model)


def runner_back(sched: Scheduler, runner: RunnerState, msg: protocol.Ready) -> None:
    """A restarted runner reported ``Ready``: its model serves again, unless
    it came back with other weights (its KV would not match the tree's)."""
    model = sched.models[runner.model]
    if msg.info.kv_share_key != model.info.kv_share_key or msg.info.layout != model.info.layout:
        log.error("runner %s came back with different weights; not using it", runner.runner_id)
        _kill(msg.pid)
        return
    runner.state = "up"
    runner.pid = msg.pid
    runner.error = None
    _update_down_reason(model, "")
    log.info(
        "runner %s back in service (pid %d, %.1fs load, restart %d)",
        runner.runner_id,
        msg.pid,
        msg.load_seconds,
        runner.restarts,
    )


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _update_down_reason(model: ModelState, why: str) -> None:
    model.down_reason = None if model.up else why
