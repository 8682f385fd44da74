"""Models at run time: the front's side of a load, unload or reload, over HTTP
(``api/models.py``) and the ZMQ client (``zmq_server.py``) alike.

The front owns *which* instance a served name means: a request is bound to
one instance when the front accepts it, so a reload can never mix versions.
A reload is blue/green: the new version loads while the old one keeps
serving; then the name switches to it at once (requests accepted from then on
run on the new version), the old version drains (running requests finish on
it, or fail with a 503 after ``?timeout=``, default ``--drain-timeout``) and is
unloaded. No request waits for the load. An unload first stops admitting (the
name answers 404), drains the same way, then the launcher stops the runners
and the scheduler returns the instance's blocks to the arena. One change runs
at a time, and every change ends: a drain within its timeout (a stream whose
client stopped reading is cut), a load within ``--model-load-timeout`` (the
launcher cancels it; the front, should the launcher not answer, asks it to).

Loads are admitted by ``admission``: at most one replica per usable core
(400 here), and only when the weights fit the memory left (507, from the
launcher, which measures it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Container

from radixmux import protocol
from radixmux.common.model_entry import DTYPES, check_model_name, default_model_name
from radixmux.common.server_args import ServerArgs
from radixmux.protocol import ModelArg
from radixmux.runtime import admission
from radixmux.runtime.api_error import APIError
from radixmux.runtime.client.messages import (
    LoadModelBody,
    ModelChange,
    ReloadModelBody,
    model_card,
)
from radixmux.runtime.front.api.common import served_model
from radixmux.runtime.front.hub import InFlight, RequestHub, new_rid
from radixmux.runtime.front.metrics import LoadMetrics

log = logging.getLogger("radixmux.front")

# The launcher times a load out itself (--model-load-timeout) and answers;
# the front waits this much longer, so that answer is the one the client gets.
LAUNCHER_GRACE_S = 60.0
UNLOAD_TIMEOUT_S = 60.0  # the launcher's part: runners stop within seconds
DRAIN_POLL_S = 0.05
# After a drain's timeout: how long a failed stream may take to send its 503
# event before its writer, stuck on a client that does not read, is cancelled.
ABORT_GRACE_S = 2.0


class ModelManager:
    """The front's side of model changes (see the module docstring)."""

    def __init__(
        self,
        hub: RequestHub,
        served: dict[str, protocol.ServedModel],
        args: ServerArgs,
        started: int,
        metrics: LoadMetrics,
    ) -> None:
        self.hub = hub
        self.metrics = metrics
        self.served = served  # the front's own dict: a change updates it in place
        self.args = args
        self.started = started  # the front's start, the cards' ``created``
        self.lock = asyncio.Lock()
        # Names a request loads again (the on-demand registry): the last loaded
        # model may be unloaded when it is one of them, the server still serves it.
        self.registered: Container[str] = frozenset()

    async def load(self, body: LoadModelBody) -> ModelChange:
        name = body.name if body.name is not None else default_model_name(body.source)
        check_load_fields(name, body.dtype, body.priority, body.replicas)
        t0 = time.monotonic()
        async with self.lock:
            if name in self.served:
                raise APIError(409, f"model '{name}' is already served", "name")
            arg = ModelArg(body.source, name, body.dtype, body.priority, body.replicas)
            model = await self._load(arg, name, 1)
            self.served[name] = model
        self.metrics.loaded(name, "manual", time.monotonic() - t0)
        return self._change(model, "loaded", t0)

    async def load_arg(self, arg: ModelArg, reason: str) -> protocol.ServedModel:
        """Load ``arg`` (checked already) as version 1 of its name, counted under ``reason``."""
        t0 = time.monotonic()
        async with self.lock:
            if arg.name in self.served:
                return self.served[arg.name]
            model = await self._load(arg, arg.name, 1)
            self.served[arg.name] = model
        self.metrics.loaded(arg.name, reason, time.monotonic() - t0)
        return model

    async def reload(self, name: str, body: ReloadModelBody, timeout: float | None) -> ModelChange:
        check_load_fields(name, body.dtype, 1.0, 1)
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
            self.served[name] = model  # from here on, new requests run on the new version
            aborted = await self._drain(old, timeout)
            freed = await self._unload(old)
        return self._change(model, "reloaded", t0, freed, aborted)

    async def unload(self, name: str, timeout: float | None) -> ModelChange:
        return await self.unload_model(name, timeout, "manual")

    async def unload_model(self, name: str, timeout: float | None, reason: str) -> ModelChange:
        """Unload ``name`` after a drain (see the module docstring), counted under ``reason``."""
        t0 = time.monotonic()
        async with self.lock:
            model = self._served(name)
            if len(self.served) == 1 and name not in self.registered:
                raise APIError(
                    409,
                    "the last served model cannot be unloaded (unless it is on demand: "
                    "its next request loads it again)",
                    "name",
                )
            del self.served[name]  # stop admitting: the name is not served from here on
            aborted = await self._drain(model, timeout)
            freed = await self._unload(model)
        self.metrics.unloaded(name, reason)
        change = self._change(model, "unloaded", t0, freed, aborted)
        change.model = None
        return change

    # ---- steps ----------------------------------------------------------------------
    def _served(self, name: str) -> protocol.ServedModel:
        return served_model(self.served, name, "name")

    async def _load(self, arg: ModelArg, served: str, version: int) -> protocol.ServedModel:
        reply = await self._command(protocol.ModelCommand(new_rid(), "load", arg, served, version))
        assert reply.model is not None
        return reply.model

    async def _unload(self, model: protocol.ServedModel) -> int:
        arg = ModelArg(model.folder, model.instance)
        reply = await self._command(protocol.ModelCommand(new_rid(), "unload", arg))
        return reply.freed_tokens

    async def _command(self, cmd: protocol.ModelCommand) -> protocol.ModelCommandReply:
        load = cmd.op == "load"
        timeout = self.args.model_load_timeout + LAUNCHER_GRACE_S if load else UNLOAD_TIMEOUT_S
        # Shielded: a client that leaves must not leave a half-made change behind.
        ask = self.hub.launcher_call(cmd, timeout)
        try:
            reply = await asyncio.shield(asyncio.ensure_future(ask))
        except APIError:
            if load:  # no answer: whatever the launcher still does must not outlive this
                await asyncio.shield(asyncio.ensure_future(self._cancel(cmd)))
            raise
        if reply.status >= 400:
            param = "source" if load and reply.status in (400, 507) else None
            raise APIError(reply.status, reply.message, param)
        return reply

    async def _cancel(self, load: protocol.ModelCommand) -> None:
        """Have the launcher undo ``load``: cancelled if still loading, unloaded
        if its success is late (the front would never serve it)."""
        cmd = protocol.ModelCommand(new_rid(), "unload", ModelArg("", load.model.name))
        try:
            await self.hub.launcher_call(cmd, UNLOAD_TIMEOUT_S)
        except APIError as exc:
            log.error("model %s: the launcher did not cancel the load: %s", load.model.name, exc)

    async def _drain(self, model: protocol.ServedModel, timeout: float | None) -> int:
        """Wait until no request of ``model``'s instance is in flight; after
        ``timeout`` seconds (default ``--drain-timeout``) fail the rest with a
        503 and end their streams. Returns how many failed."""
        if timeout is None:
            timeout = self.args.drain_timeout
        if await self._drained(model, timeout):
            return 0
        live = self._live(model)
        why = f"model '{model.name}' (version {model.version}) was unloaded"
        for gen in live:
            gen.queue.put_nowait(protocol.RequestError(gen.rid, 503, why))
            self.hub.abort(gen.rid, "unloaded")
        # A client that reads gets the 503 at once. One that stopped reading
        # keeps its stream's writer waiting on a full socket, for ever: cut it
        # (its connection closes without the end of the stream).
        if not await self._drained(model, ABORT_GRACE_S):
            for gen in self._live(model):
                if gen.writer is not None:
                    gen.writer.cancel()
            await self._drained(model, ABORT_GRACE_S)
        return len(live)

    def busy(self, model: protocol.ServedModel) -> bool:
        """Whether ``model``'s instance has requests in flight."""
        return any(g.model == model.instance for g in self.hub.live.values())

    def _live(self, model: protocol.ServedModel) -> list[InFlight]:
        return [g for g in self.hub.live.values() if g.model == model.instance]

    async def _drained(self, model: protocol.ServedModel, timeout: float) -> bool:
        """Whether ``model``'s instance has nothing in flight within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self._live(model):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True

    def _change(
        self, model: protocol.ServedModel, what: str, t0: float, freed: int = 0, aborted: int = 0
    ) -> ModelChange:
        return ModelChange(
            name=model.name,
            version=model.version,
            message=f"{what} {model.name} (version {model.version})",
            seconds=round(time.monotonic() - t0, 3),
            model=model_card(model, self.started),
            freed_tokens=freed,
            aborted=aborted,
        )


def check_load_fields(name: str, dtype: str | None, priority: float, replicas: int) -> None:
    """400 naming the first bad field of a load."""
    try:
        check_model_name(name)
    except ValueError as exc:
        raise APIError(400, str(exc), "name") from None
    if dtype is not None and dtype not in DTYPES:
        raise APIError(400, f"dtype must be one of {list(DTYPES)}", "dtype")
    if not (math.isfinite(priority) and priority > 0):
        raise APIError(400, "priority must be a finite number > 0", "priority")
    cores = admission.max_replicas()
    if not 1 <= replicas <= cores:
        raise APIError(
            400,
            f"replicas must be in [1, {cores}]: each replica is a runner process that needs a "
            f"core of its own, and this server may use {cores}",
            "replicas",
        )
