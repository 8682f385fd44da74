"""What a soak run records.

Requests, probes, kills, health and memory samples, the run's shared state.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.soak.config import SoakConfig
from bench.soak.server import SoakServer


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the load's start.

    ``outcome``: ok (200, complete), error (non-200 with a JSON error body),
    stream_error (an error event, then ``[DONE]``), abandoned / disconnected (the
    client hung up on purpose), timeout, transport (connection failed), incomplete
    (no finish reason, or a stream cut without ``[DONE]``), bad_body (an answer
    that is not the documented JSON), drain_cut (a stream whose client stopped
    reading, cut when an unload's drain timed out, as documented).
    """

    task: str
    kind: str
    model: str
    endpoint: str
    stream: bool
    t_start: float
    minute: int
    t_end: float = 0.0
    status: int = 0  # HTTP status; 0 when none came
    outcome: str = ""
    ttft: float | None = None
    e2e: float = 0.0
    error_type: str | None = None
    error_code: int | None = None  # HTTP status, or the code of an in-stream error event
    error_param: str | None = None
    detail: str = ""
    rid: str = ""  # the server's X-Request-Id, to find the request in the server log
    case: str = ""  # bad input: which malformed request this is
    expected_status: int | None = None  # bad input: the one status that is right
    expected_param: str | None = None


@dataclass
class ProbeResult:
    """One greedy probe answer (``text`` is empty unless ``status`` is 200)."""

    model: str
    phase: str  # before, during, after
    t: float
    status: int
    outcome: str
    text: str


@dataclass
class KillRecord:
    """One SIGKILL of a runner and when its model served again (None: never seen)."""

    model: str
    pid: int
    pid_source: str  # server_info (the contract) or proc (found by scanning /proc)
    t_kill: float
    t_serving: float | None = None


@dataclass
class HealthSample:
    """``/health`` at one moment: HTTP status and each model's state."""

    t: float
    status: int
    states: dict[str, str]


@dataclass
class ProcessSeries:
    """Resident memory of one server process over time (KiB)."""

    pid: int
    role: str
    t: list[float] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)
    anon_kib: list[int] = field(default_factory=list)


@dataclass
class CheckResult:
    """One end-of-run check, printed as one PASS/FAIL line."""

    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class ModelFacts:
    """What the harness needs to know about a served model."""

    name: str
    vocab_size: int
    context_length: int
    has_chat_template: bool


@dataclass(frozen=True)
class BadCase:
    """A malformed or out-of-range request and the one answer that is right for it."""

    name: str
    path: str
    body: dict[str, Any] | bytes
    status: int
    param: str | None  # the field the error must name (None: no particular field)


@dataclass(frozen=True)
class Outage:
    """An interval in which a model was not serving (503s inside it are expected)."""

    model: str
    start: float
    end: float


@dataclass
class Conversation:
    """A multi-turn chat so far."""

    model: str
    system: str
    turns: list[str] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)


@dataclass
class RunState:
    """Everything the tasks of one run share."""

    config: SoakConfig
    server: SoakServer
    facts: dict[str, ModelFacts]
    words: Sequence[str]
    t0: float
    stop: asyncio.Event
    records: list[RequestRecord] = field(default_factory=list)
    probes: list[ProbeResult] = field(default_factory=list)
    kills: list[KillRecord] = field(default_factory=list)
    health: list[HealthSample] = field(default_factory=list)
    rss: dict[int, ProcessSeries] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # latest seen, for progress
    watchers: list[asyncio.Task] = field(default_factory=list)  # kill recovery watchers
    server_exit: tuple[float, int] | None = None  # the launcher died mid-run: (t, code)
    drains: list[Outage] = field(default_factory=list)  # model changes: 503s documented
    hostile: Any = None  # hostile.records.HostileRun with --hostile

    def now(self) -> float:
        return time.monotonic() - self.t0

    @property
    def url(self) -> str:
        return self.server.base_url

    def new_record(
        self, task: str, kind: str, model: str, endpoint: str, stream: bool
    ) -> RequestRecord:
        t = self.now()
        rec = RequestRecord(task, kind, model, endpoint, stream, t, math.floor(t / 60.0))
        self.records.append(rec)
        return rec
