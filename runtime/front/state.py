"""``Front``: what one front process holds and every API module reads.

The process (``server.py``) makes one and hands it to the app (``app.py``),
each API's ``endpoints`` (``api/``) and the ZMQ client server
(``zmq_server.py``); none of them imports the process module.
"""

from __future__ import annotations

import time
from typing import TypeVar

import zmq
from starlette.requests import Request

from radixmux.common.process import ProcessContext
from radixmux.protocol import ServedModel
from radixmux.runtime.api_error import APIError, decode_body
from radixmux.runtime.front.api.common import check_json_content_type, read_body
from radixmux.runtime.front.hub import RequestHub
from radixmux.runtime.front.metrics import FrontMetrics
from radixmux.runtime.front.model_changes import ModelManager
from radixmux.runtime.front.on_demand import OnDemand, StateCollector

T = TypeVar("T")
PINNED_STATS_TIMEOUT_S = 5.0


class Front:
    """Flags, served models, metrics, the request hub and the model changes of one front."""

    def __init__(self, ctx: ProcessContext, zctx: zmq.Context) -> None:
        self.ctx = ctx
        self.args = ctx.args
        # Served name -> the instance it means now; model changes update it in place.
        self.served = {m.name: m for m in ctx.served}
        self.started = int(time.time())
        self.metrics = FrontMetrics()
        self.hub = RequestHub(zctx, ctx.endpoints, self.metrics)
        self.model_manager = ModelManager(
            self.hub, self.served, self.args, self.started, self.metrics.changes
        )
        self.on_demand = OnDemand(self.model_manager)
        self.on_demand.pinned = self._pinned
        self.metrics.registry.register(StateCollector(self.on_demand))

    async def model(self, name: str | None) -> ServedModel:
        """The served model a request names; a registered one is loaded first."""
        return await self.on_demand.model(name)

    async def _pinned(self) -> set[str]:
        """The instances holding pinned warm-up prefixes (none if the scheduler is silent)."""
        try:
            reply = await self.hub.control("stats", timeout=PINNED_STATS_TIMEOUT_S)
        except APIError:
            return set()
        if not reply.ok or reply.stats is None:
            return set()
        return {m.name for m in reply.stats.models if m.pinned_tokens}

    @property
    def chat_template_flag(self) -> bool:
        """Whether ``--chat-template`` gives models without a template of their own one."""
        return self.args.chat_template is not None

    async def body(self, request: Request, type_: type[T]) -> T:
        """``request``'s JSON body decoded into ``type_``: 415 unless declared
        JSON, 413 past ``--max-request-bytes``, 400 naming a bad field."""
        # HttpGuard checked the type already for every request with a body; checked
        # again where the body is decoded so no route depends on the wrapping.
        check_json_content_type(request.headers.get("content-type"))
        return decode_body(await read_body(request, self.args.max_request_bytes), type_)
