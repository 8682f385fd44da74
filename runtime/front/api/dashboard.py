"""``GET /dashboard``: a live view of the server, and ``GET /dashboard.json``, its figures.

The page (``dashboard.html`` next to this module) is self-contained: no
build step, nothing fetched but ``dashboard.json``, which it polls every
second. It draws the arena block by block coloured by the pool (the models)
owning each block, each model's cache and queue figures, every served or
registered model's state (loaded, loading, registered, failed) with its loads
and unloads by reason and load time, the most shared prefixes of the unified
tree with a text preview, and evictions by reason over time (the page keeps
that series itself from successive polls).

The JSON is one ``DashboardView``: the scheduler's ``SchedulerStats`` and
``DashboardSnapshot`` from one ``dashboard`` control op (so the figures are
the ones ``/metrics`` reports), the front's queue-time histogram counts and
model lifecycle (the registry's states, the load and unload counters), and
prefix previews decoded by a tokenizer worker (cached: a prefix is decoded
once, not at every poll).

With ``--api-key`` the JSON needs the key like every route; the page holds
no secret and is open: it reads the key from the URL fragment
(``/dashboard#key=KEY``, which a browser never sends to the server) and sends
it as ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from pathlib import Path

import msgspec
from prometheus_client.metrics import MetricWrapperBase
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from radixmux import protocol
from radixmux.runtime.api_error import APIError
from radixmux.runtime.front.api.common import json_response
from radixmux.runtime.front.hub import RequestHub, new_rid
from radixmux.runtime.front.metrics import FrontMetrics
from radixmux.runtime.front.on_demand import OnDemand
from radixmux.runtime.front.openapi import Endpoint, Handler
from radixmux.runtime.front.state import Front

log = logging.getLogger("radixmux.front")

DASHBOARD_PAGE = (Path(__file__).parent / "dashboard.html").read_text(encoding="utf-8")
SNAPSHOT_TIMEOUT_S = 2.0
PREVIEW_TIMEOUT_S = 2.0
PREVIEWS_CACHED = 512


class QueueTimeView(msgspec.Struct, frozen=True):
    """The front's queue-time histogram of one model: observations and their sum."""

    count: int
    sum_s: float


class ModelLifecycleView(msgspec.Struct, frozen=True):
    """One served or registered model's state, loads and unloads (by reason,
    as ``radixmux_model_loads_total`` / ``radixmux_model_unloads_total``) and
    the time its run-time loads took (``radixmux_model_load_seconds``)."""

    name: str
    state: str  # loaded, loading, registered or failed (its last load failed)
    on_demand: bool  # registered: loaded by its first request, unloaded when idle
    loads: dict[str, int]  # on_demand, manual
    unloads: dict[str, int]  # lru, memory, idle, manual
    load_seconds: float  # summed over its run-time loads


class DashboardView(msgspec.Struct, frozen=True):
    """Everything one poll of ``/dashboard`` draws.

    ``stats`` and ``snapshot`` are None when the scheduler did not answer
    (``error`` says why; the page shows it and keeps polling).
    ``previews[i]`` is the text of ``snapshot.prefixes[i]`` (head, then
    " … " and the tail when the prefix is longer), None if it could not be
    decoded.
    """

    time: float
    stats: protocol.SchedulerStats | None
    snapshot: protocol.DashboardSnapshot | None
    previews: list[str | None]
    queue_time: dict[str, QueueTimeView]
    lifecycle: list[ModelLifecycleView] = msgspec.field(default_factory=list)
    error: str | None = None


class Dashboard:
    """Builds ``DashboardView``s for one front, caching prefix previews."""

    def __init__(self, hub: RequestHub, metrics: FrontMetrics, on_demand: OnDemand) -> None:
        self.hub = hub
        self.metrics = metrics
        self.on_demand = on_demand
        self._previews: dict[tuple[str, tuple[int, ...], tuple[int, ...]], str | None] = {}

    async def view(self) -> DashboardView:
        """One poll's figures; a scheduler that does not answer is reported, not raised."""
        stats = snapshot = error = None
        try:
            reply = await self.hub.control("dashboard", timeout=SNAPSHOT_TIMEOUT_S)
            stats, snapshot = reply.stats, reply.dashboard
            if not reply.ok:
                error = reply.message
        except APIError as exc:
            error = exc.message
        prefixes = snapshot.prefixes if snapshot is not None else []
        previews = list(await asyncio.gather(*(self._preview(p) for p in prefixes)))
        return DashboardView(
            time.time(),
            stats,
            snapshot,
            previews,
            self.queue_times(),
            self.lifecycle(),
            error,
        )

    def queue_times(self) -> dict[str, QueueTimeView]:
        """Per model, the ``radixmux_request_queue_time_seconds`` count and sum."""
        count = _samples(self.metrics.queue_time, "_count")
        total = _samples(self.metrics.queue_time, "_sum")
        return {key[0]: QueueTimeView(int(n), total.get(key, 0.0)) for key, n in count.items()}

    def lifecycle(self) -> list[ModelLifecycleView]:
        """Every served or registered model: its state, loads, unloads, load time."""
        changes = self.metrics.changes
        loads: defaultdict[str, dict[str, int]] = defaultdict(dict)
        unloads: defaultdict[str, dict[str, int]] = defaultdict(dict)
        for counts, metric in ((loads, changes.loads), (unloads, changes.unloads)):
            for (model, reason), n in _samples(metric, "_total").items():
                counts[model][reason] = int(n)
        seconds = _samples(changes.load_seconds, "_sum")
        registry = self.on_demand.registry
        return [
            ModelLifecycleView(
                name,
                self.on_demand.state(name) if name in registry else "loaded",
                name in registry,
                loads[name],
                unloads[name],
                seconds.get((name,), 0.0),
            )
            for name in sorted({*self.on_demand.served, *registry})
        ]

    async def _preview(self, prefix: protocol.SharedPrefixView) -> str | None:
        if not prefix.holders or not prefix.holders[0].models:
            return None
        model = prefix.holders[0].models[0]  # every holder tokenizes alike (one group)
        key = (model, tuple(prefix.head_ids), tuple(prefix.tail_ids))
        if key in self._previews:
            return self._previews[key]
        try:
            head = await self._decode(model, prefix.head_ids)
            tail = await self._decode(model, prefix.tail_ids) if prefix.tail_ids else None
        except APIError as exc:  # no worker answered, or it refused the ids
            log.debug("dashboard preview not decoded: %s", exc)
            return None  # not cached: the next poll tries again
        text = head if tail is None else f"{head} … {tail}"
        if len(self._previews) >= PREVIEWS_CACHED:
            self._previews.clear()  # prefixes change slowly: refilled within a poll or two
        self._previews[key] = text
        return text

    async def _decode(self, model: str, ids: list[int]) -> str:
        req = protocol.DetokenizeRequest(new_rid(), model, ids)
        reply = await self.hub.tokenizer_call(req, timeout=PREVIEW_TIMEOUT_S)
        return reply.text or ""


def _samples(metric: MetricWrapperBase, suffix: str) -> dict[tuple[str, ...], float]:
    """A labelled metric's samples named ``<name><suffix>``, by their label values."""
    return {
        tuple(s.labels.values()): s.value
        for family in metric.collect()
        for s in family.samples
        if s.name.endswith(suffix)
    }


def endpoints(front: Front) -> list[tuple[Endpoint, Handler]]:
    """``/dashboard`` (the page, open) and ``/dashboard.json`` (its figures)."""
    view = Dashboard(front.hub, front.metrics, front.on_demand)

    async def dashboard_page(request: Request) -> Response:
        return HTMLResponse(DASHBOARD_PAGE)

    async def dashboard_json(request: Request) -> Response:
        return json_response(await view.view())

    return [
        (
            Endpoint(
                "/dashboard",
                "GET",
                "live view (HTML, open; give the API key as /dashboard#key=KEY)",
                html=True,
            ),
            dashboard_page,
        ),
        (
            Endpoint("/dashboard.json", "GET", "the live view's figures", response=DashboardView),
            dashboard_json,
        ),
    ]
