"""``GET /dashboard``: a live view of the server, and ``GET /dashboard.json``, its figures.

The page (``dashboard.html`` next to this module) is self-contained: no
build step, nothing fetched but ``dashboard.json``, which it polls every
second. It draws the arena block by block coloured by the pool (the models)
owning each block, each model's cache and queue figures, the most shared
prefixes of the unified tree with a text preview, and evictions by reason
over time (the page keeps that series itself from successive polls).

The JSON is one ``DashboardView``: the scheduler's ``SchedulerStats`` and
``DashboardSnapshot`` from one ``dashboard`` control op (so the figures are
the ones ``/metrics`` reports), the front's queue-time histogram counts, and
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
from pathlib import Path

import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from radixmux import protocol
from radixmux.runtime.api_error import APIError
from radixmux.runtime.front.api.common import json_response
from radixmux.runtime.front.hub import RequestHub, new_rid
from radixmux.runtime.front.metrics import FrontMetrics
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
    error: str | None = None


class Dashboard:
    """Builds ``DashboardView``s for one front, caching prefix previews."""

    def __init__(self, hub: RequestHub, metrics: FrontMetrics) -> None:
        self.hub = hub
        self.metrics = metrics
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
        return DashboardView(time.time(), stats, snapshot, previews, self.queue_times(), error)

    def queue_times(self) -> dict[str, QueueTimeView]:
        """Per model, the ``radixmux_request_queue_time_seconds`` count and sum."""
        count: dict[str, float] = {}
        total: dict[str, float] = {}
        for family in self.metrics.queue_time.collect():
            for s in family.samples:
                if s.name.endswith("_count"):
                    count[s.labels["model"]] = s.value
                elif s.name.endswith("_sum"):
                    total[s.labels["model"]] = s.value
        return {m: QueueTimeView(int(n), total.get(m, 0.0)) for m, n in count.items()}

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


def endpoints(front: Front) -> list[tuple[Endpoint, Handler]]:
    """``/dashboard`` (the page, open) and ``/dashboard.json`` (its figures)."""
    view = Dashboard(front.hub, front.metrics)

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
