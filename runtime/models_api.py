"""Models at run time over HTTP: ``POST /models``, ``DELETE /models/{name}``,
``POST /models/{name}/reload``.

The front owns *which* instance a served name means: a request is bound to
one instance when the front accepts it, so a reload can never mix versions.
A reload is blue/green: the new version loads while the old one keeps
serving; then the name switches to it at once (requests accepted from then on
run on the new version), the old version drains (running requests finish on
it, or fail with a 503 after ``?timeout=``) and is unloaded. No request waits
for the load. An unload first stops admitting (the name answers 404), drains
the same way, then the launcher stops the runners and the scheduler returns
the instance's blocks to the arena. One change runs at a time.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from radixmux import protocol
from radixmux.protocol import ModelArg
from radixmux.runtime import openai_api
from radixmux.runtime.api_common import APIError, json_response, served_model
from radixmux.runtime.front_hub import new_rid
from radixmux.runtime.openapi import Body, Endpoint, Handler
from radixmux.runtime.server_args import DTYPES, check_model_name, default_model_name

if TYPE_CHECKING:
    from radixmux.runtime.front import Front

LOAD_TIMEOUT_S = 1800.0  # a fetch and conversion of a large model takes minutes
UNLOAD_TIMEOUT_S = 60.0  # the launcher's part: runners stop within seconds
DRAIN_POLL_S = 0.05
MAX_REPLICAS = 16


class LoadModelBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /models``: the ``--model`` flag's fields."""

    source: str
    name: str | None = None  # default: the source's last path part
    dtype: str | None = None  # default: --dtype
    priority: float = 1.0
    replicas: int = 1


class ReloadModelBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /models/{name}/reload``: a new version of a served name."""

    source: str | None = None  # default: the current version's folder (new weights there)
    dtype: str | None = None  # default: the current version's


class ModelChange(msgspec.Struct):
    """What a load, unload or reload did."""

    name: str
    version: int
    message: str
    seconds: float
    model: openai_api.ModelCard | None = None  # after a load or reload
    freed_tokens: int = 0  # cached tokens the old or unloaded instance gave back
    aborted: int = 0  # requests still running at ?timeout=, failed with a 503
    ok: bool = True


class ModelManager:
    """The front's side of model changes (see the module docstring)."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.lock = asyncio.Lock()

    async def load(self, body: LoadModelBody) -> ModelChange:
        name = body.name if body.name is not None else default_model_name(body.source)
        _check_load_fields(name, body.dtype, body.priority, body.replicas)
        t0 = time.monotonic()
        async with self.lock:
            if name in self.front.served:
                raise APIError(409, f"model '{name}' is already served", "name")
            arg = ModelArg(body.source, name, body.dtype, body.priority, body.replicas)
            model = await self._load(arg, name, 1)
            self.front.served[name] = model
        return self._change(model, "loaded", t0)

    async def reload(self, name: str, body: ReloadModelBody, timeout: float | None) -> ModelChange:
        _check_load_fields(name, body.dtype, 1.0, 1)
        t0 = time.monotonic()
        async with self.lock:
            old = self._served(name)
            version = old.version + 1
            arg = ModelArg(
                body.source or old.folder,
                protocol.instance_name(name, version),
                body.dtype or old.info.dtype,
                old.priority,
                old.replicas,
            )
            model = await self._load(arg, name, version)
            self.front.served[name] = model  # from here on, new requests run on the new version
            aborted = await self._drain(old, timeout)
            freed = await self._unload(old)
        return self._change(model, "reloaded", t0, freed, aborted)

    async def unload(self, name: str, timeout: float | None) -> ModelChange:
        t0 = time.monotonic()
        async with self.lock:
            model = self._served(name)
            if len(self.front.served) == 1:
                raise APIError(409, "the last served model cannot be unloaded", "name")
            del self.front.served[name]  # stop admitting: the name is not served from here on
            aborted = await self._drain(model, timeout)
            freed = await self._unload(model)
        change = self._change(model, "unloaded", t0, freed, aborted)
        change.model = None
        return change

    # ---- steps ----------------------------------------------------------------------
    def _served(self, name: str) -> protocol.ServedModel:
        return served_model(self.front.served, name, "name")

    async def _load(self, arg: ModelArg, served: str, version: int) -> protocol.ServedModel:
        reply = await self._command(protocol.ModelCommand(new_rid(), "load", arg, served, version))
        assert reply.model is not None
        return reply.model

    async def _unload(self, model: protocol.ServedModel) -> int:
        arg = ModelArg(model.folder, model.instance)
        reply = await self._command(protocol.ModelCommand(new_rid(), "unload", arg))
        return reply.freed_tokens

    async def _command(self, cmd: protocol.ModelCommand) -> protocol.ModelCommandReply:
        timeout = LOAD_TIMEOUT_S if cmd.op == "load" else UNLOAD_TIMEOUT_S
        # Shielded: a client that leaves must not leave a half-made change behind.
        ask = self.front.hub.launcher_call(cmd, timeout)
        reply = await asyncio.shield(asyncio.ensure_future(ask))
        if reply.status >= 400:
            param = "source" if cmd.op == "load" and reply.status == 400 else None
            raise APIError(reply.status, reply.message, param)
        return reply

    async def _drain(self, model: protocol.ServedModel, timeout: float | None) -> int:
        """Wait until no request of ``model``'s instance is in flight; after
        ``timeout`` seconds fail the rest with a 503. Returns how many failed."""
        hub = self.front.hub
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            live = [g for g in hub.live.values() if g.model == model.instance]
            if not live:
                return 0
            if deadline is not None and time.monotonic() >= deadline:
                why = f"model '{model.name}' (version {model.version}) was unloaded"
                for gen in live:
                    gen.queue.put_nowait(protocol.RequestError(gen.rid, 503, why))
                    hub.abort(gen.rid, "unloaded")
                return len(live)
            await asyncio.sleep(DRAIN_POLL_S)

    def _change(
        self, model: protocol.ServedModel, what: str, t0: float, freed: int = 0, aborted: int = 0
    ) -> ModelChange:
        return ModelChange(
            name=model.name,
            version=model.version,
            message=f"{what} {model.name} (version {model.version})",
            seconds=round(time.monotonic() - t0, 3),
            model=openai_api.model_card(model, self.front.started),
            freed_tokens=freed,
            aborted=aborted,
        )


def _check_load_fields(name: str, dtype: str | None, priority: float, replicas: int) -> None:
    try:
        check_model_name(name)
    except ValueError as exc:
        raise APIError(400, str(exc), "name") from None
    if dtype is not None and dtype not in DTYPES:
        raise APIError(400, f"dtype must be one of {list(DTYPES)}", "dtype")
    if not (math.isfinite(priority) and priority > 0):
        raise APIError(400, "priority must be a finite number > 0", "priority")
    if not 1 <= replicas <= MAX_REPLICAS:
        raise APIError(400, f"replicas must be in [1, {MAX_REPLICAS}]", "replicas")


def _timeout(request: Request) -> float | None:
    """``?timeout=`` seconds before requests still running are failed (none: wait)."""
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


def endpoints(front: Front, body: Body) -> list[tuple[Endpoint, Handler]]:
    """The lifecycle routes, for the front's route table and OpenAPI document."""
    manager = front.model_manager

    async def load(request: Request) -> Response:
        req = await body(request, LoadModelBody)
        assert isinstance(req, LoadModelBody)
        return json_response(await manager.load(req))

    async def unload(request: Request) -> Response:
        name = request.path_params["name"]
        return json_response(await manager.unload(name, _timeout(request)))

    async def reload(request: Request) -> Response:
        req = await body(request, ReloadModelBody)
        assert isinstance(req, ReloadModelBody)
        name = request.path_params["name"]
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
