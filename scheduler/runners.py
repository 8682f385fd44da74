"""Runners as the scheduler sees them: their state, and the roll call of their start.

A runner is one process running one replica of an instance (see
docs/design.md, glossary). The launcher starts, restarts and gives up on
runner processes; the scheduler tracks their state, times their batches and
only asks for a kill (a hung runner: ``supervision.py``). Runner ids are
``protocol.RunnerId``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixmux.protocol import Failed, ModelInfo, Ready
from radixmux.scheduler.request import Req
from radixmux.scheduler.step_costs import StepCosts

if TYPE_CHECKING:
    from radixmux.scheduler.batch_builder import ScheduledBatch

log = logging.getLogger("radixmux.scheduler")


@dataclass(eq=False)
class RunnerState:
    """One runner process (a model instance) as the scheduler sees it."""

    runner_id: str
    model: str
    state: str = "starting"  # starting, up, restarting (a new process is coming), down
    error: str | None = None
    pid: int | None = None
    restarts: int = 0
    running: list[Req] = field(default_factory=list)
    inflight: ScheduledBatch | None = None
    sent_at: float = 0.0  # time.monotonic() when ``inflight`` was sent
    steps: int = 0  # batches it has run
    busy_s: float = 0.0  # seconds it spent in forward passes and sampling
    threads: int = 0  # torch threads its last batch ran with
    costs: StepCosts = field(default_factory=StepCosts)  # its measured step times

    @property
    def up(self) -> bool:
        return self.state == "up"


@dataclass
class RollCall:
    """The runners an instance (or the start-up) waits for, and what those
    that reported ``Ready`` said. One path for start-up and run-time loads."""

    expected: set[str]
    infos: dict[str, ModelInfo] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.infos) == len(self.expected)

    def missing(self) -> list[str]:
        return sorted(self.expected - set(self.infos))

    def answer(self, runner_id: str, msg: Ready | Failed) -> str | None:
        """Record a runner's start-up answer; its error when it failed."""
        if isinstance(msg, Failed):
            return msg.error
        if runner_id in self.expected:
            self.infos[runner_id] = msg.info
            self.pids[runner_id] = msg.pid
            log.info("runner %s ready (pid %d, %.1fs load)", runner_id, msg.pid, msg.load_seconds)
        return None
