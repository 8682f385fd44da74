"""Models at run time over HTTP: ``POST /models``, ``DELETE /models/{name}``,
``POST /models/{name}/reload``.

How a change runs (one at a time, blue/green reloads, drains, admission) is
``front/model_changes.py``, which the ZMQ client's changes go through too;
the bodies and the answer are ``runtime/client/messages.py``'s.
"""

from __future__ import annotations

import math

from starlette.requests import Request
from starlette.responses import Response

from radixmux.common.model_entry import default_model_name
from radixmux.protocol import ModelArg
from radixmux.runtime.api_error import APIError
from radixmux.runtime.client.messages import LoadModelBody, ModelChange, ReloadModelBody
from radixmux.runtime.front.api.common import json_response
from radixmux.runtime.front.openapi import Endpoint, Handler
from radixmux.runtime.front.state import Front


def _timeout(request: Request) -> float | None:
    """``?timeout=`` seconds before requests still running are failed (none:
    ``--drain-timeout``)."""
    text = request.query_params.get("timeout")
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise APIError(400, "timeout must be a number of seconds >= 0", "timeout")
    return value


def endpoints(front: Front) -> list[tuple[Endpoint, Handler]]:
    """The lifecycle routes, for the front's route table and OpenAPI document."""
    manager = front.model_manager

    async def load(request: Request) -> Response:
        req = await front.body(request, LoadModelBody)
        if req.load == "on_demand":
            return json_response(await front.on_demand.register_body(req, front.started))
        if req.load != "start" or req.keep_alive is not None:
            raise APIError(
                400, "load must be 'start' or 'on_demand' (keep_alive: only on demand)", "load"
            )
        name = req.name if req.name is not None else default_model_name(req.source)
        arg = ModelArg(req.source, name, req.dtype, req.priority, req.replicas)
        return json_response(await front.on_demand.load_with_room(arg, lambda: manager.load(req)))

    async def unload(request: Request) -> Response:
        name = request.path_params["name"]
        if front.on_demand.unregister(name):  # registered, not loaded: forget it
            return json_response(ModelChange(name, 0, f"unregistered {name}", 0.0))
        return json_response(await manager.unload(name, _timeout(request)))

    async def reload(request: Request) -> Response:
        req = await front.body(request, ReloadModelBody)
        name = request.path_params["name"]
        front.on_demand.check_loaded(name, "name")  # nothing to reload: its next request loads it
        return json_response(await manager.reload(name, req, _timeout(request)))

    return [
        (
            Endpoint("/models", "POST", "load a model", LoadModelBody, ModelChange),
            load,
        ),
        (
            Endpoint(
                "/models/{name:path}/reload",
                "POST",
                "load a new version of a served model and switch to it",
                ReloadModelBody,
                ModelChange,
            ),
            reload,
        ),
        (
            Endpoint("/models/{name:path}", "DELETE", "unload a model", response=ModelChange),
            unload,
        ),
    ]
