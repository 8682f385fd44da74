"""What the hostile mode records.

Traps, model changes, state checks, streams, its share of the run.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.soak.hostile.config import HostileProfile


@dataclass
class Trap:
    """Something planted in the store that the server must leave as it is."""

    path: str
    kind: str  # file, dir, symlink, fifo
    content: str = ""  # a file's text, a link's target


@dataclass
class ChangeRecord:
    """One model change (load, reload, unload) made under held streams."""

    op: str
    t: float
    seconds: float
    status: int
    aborted: int | None  # the drain's failed requests, from the answer
    readers: list[str] = field(default_factory=list)  # how each held stream ended


@dataclass
class StateCheck:
    """Server state on the idle server before and after every cross-site shape."""

    when: str
    shapes: int
    settled: bool
    changed: dict[str, Any]  # key -> [before, after] for what differs
    served: list[str] | None  # the models listed afterwards


@dataclass
class StreamFacts:
    """What one streamed ``/generate`` with logprobs sent: tokens, logprob entries, bytes."""

    rid: str
    tokens: int
    logprob_entries: int
    widest_top: int
    bytes: int


@dataclass
class HostileRun:
    """Everything the hostile tasks share (``RunState.hostile``)."""

    profile: HostileProfile
    store: Path
    canary: Path
    extra_source: str
    huge_source: str
    # What ends the hostile clients: their own window's event before the load, then the load's.
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    # The stall probe's label: idle, hostile (the hostile-only window), idle_after, load.
    phase: str = "idle"
    traps: list[Trap] = field(default_factory=list)
    trapped: set[str] = field(default_factory=set)  # directories already planted in
    canary_digest: dict[str, str] = field(default_factory=dict)
    changes: list[ChangeRecord] = field(default_factory=list)
    states: list[StateCheck] = field(default_factory=list)
    streams: list[StreamFacts] = field(default_factory=list)
    restart: dict[str, Any] = field(default_factory=dict)
    trap_problems: list[str] = field(default_factory=list)
