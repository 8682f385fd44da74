"""Models on demand: a registry of models that may be served, loaded by their
first request and unloaded when room is needed or nobody asked for them lately.

A registered model (``--model ...,load=on_demand`` or ``POST /models`` with
``"load": "on_demand"``) is not loaded at start. The first request naming it
starts its load through :class:`ModelManager` and waits for it; every request
for it during the load shares that one load, and all get the same 503 if it
fails (its state is then ``failed``; the next request tries again).

Only on-demand models are ever unloaded automatically; models loaded at start
(or by ``POST /models`` without ``load``) stay until ``DELETE``. Before any
load at run time (on demand or by ``POST /models``), with
``--max-loaded-models`` models loaded, the least recently used *idle*
on-demand model is unloaded: idle means no request in flight or
about to be submitted, and no pinned warm-up prefix. ``--max-weights-bytes``
makes room the same way: the weights the loaded models' runners reported
plus the new model's (counted from its files) must fit. When only busy models
could make room the load waits for one to turn idle (within
``--model-load-timeout``); when none ever could, it fails at once (503). A
load the launcher refuses for memory (507) unloads one idle on-demand model
and tries once more. ``--idle-unload-seconds`` (per model ``keep_alive``)
unloads an idle on-demand model nobody asked for that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixmux import protocol
from radixmux.common.model_entry import default_model_name
from radixmux.common.server_args import ServerArgs
from radixmux.protocol import ModelArg
from radixmux.runtime import admission
from radixmux.runtime.api_error import APIError
from radixmux.runtime.client.messages import LoadModelBody, ModelCard, ModelChange, model_card
from radixmux.runtime.front.api.common import resolve_model
from radixmux.runtime.front.model_changes import ModelManager, check_load_fields
from radixmux.runtime.model_sources import LaunchError
from radixmux.runtime.model_sources import resolve_model as resolve_model_arg

log = logging.getLogger("radixmux.front")

STATES = ("loaded", "loading", "registered", "failed")
T = TypeVar("T")
# How often a load that waits for a busy model to turn idle looks again.
ROOM_POLL_S = 0.05


@dataclass
class Registered:
    """One on-demand model: how to load it, and what became of its last load."""

    arg: ModelArg  # source resolved to a local path, dtype concrete
    last_used: float
    load: asyncio.Task[protocol.ServedModel] | None = None
    error: str | None = None  # why its last load failed
    # Requests handed the model that may not be in flight yet: not idle.
    claims: int = 0


class OnDemand:
    """The registry, its loads on first request, LRU room-making and idle unloads."""

    def __init__(self, manager: ModelManager) -> None:
        self.served = manager.served
        self.manager = manager
        self.args: ServerArgs = manager.args
        now = time.monotonic()
        self.registry = {m.name: Registered(m, now) for m in manager.args.on_demand_models}
        manager.registered = self.registry
        self.room = asyncio.Lock()  # one room-making load at a time
        # The instances with pinned warm-up prefixes (the scheduler knows them).
        self.pinned: Callable[[], Awaitable[set[str]]] | None = None

    # ---- the registry ----------------------------------------------------------------
    def register(self, arg: ModelArg) -> None:
        """Add ``arg`` (resolved) to the registry; 409 if its name is taken."""
        if arg.name in self.served or arg.name in self.registry:
            raise APIError(409, f"model '{arg.name}' is already served or registered", "name")
        self.registry[arg.name] = Registered(arg, time.monotonic())

    async def register_body(self, body: LoadModelBody, created: int) -> ModelChange:
        """``POST /models`` with ``"load": "on_demand"``: check and resolve the
        source as a load would (404 when it is not there), then register it."""
        t0 = time.monotonic()
        name = body.name if body.name is not None else default_model_name(body.source)
        check_load_fields(name, body.dtype, body.priority, body.replicas)
        if body.keep_alive is not None and not body.keep_alive >= 0:
            raise APIError(400, "keep_alive must be >= 0 seconds (0: never unload)", "keep_alive")
        arg = ModelArg(
            body.source, name, body.dtype, body.priority, body.replicas, True, body.keep_alive
        )
        try:
            arg = await asyncio.to_thread(resolve_model_arg, arg, self.args.dtype)
        except LaunchError as exc:
            raise APIError(404, str(exc), "source") from None
        self.register(arg)
        return ModelChange(
            name=name,
            version=0,
            message=f"registered {name} (loaded by its first request)",
            seconds=round(time.monotonic() - t0, 3),
            model=self.card(name, created),
        )

    def unregister(self, name: str) -> bool:
        """Drop ``name`` from the registry if it is not loaded; whether it was there."""
        entry = self.registry.get(name)
        if entry is None or name in self.served or entry.load is not None:
            return False
        del self.registry[name]
        return True

    def state(self, name: str) -> str:
        """``name``'s state: loaded, loading, registered or failed."""
        entry = self.registry[name]
        if name in self.served:
            return "loaded"
        if entry.load is not None:
            return "loading"
        return "failed" if entry.error else "registered"

    def cards(self, created: int) -> list[ModelCard]:
        """Cards of the registered models that are not loaded (loaded ones are served)."""
        return [self.card(n, created) for n in self.registry if n not in self.served]

    def card(self, name: str, created: int) -> ModelCard:
        """``name``'s card: the served one when loaded, else what the registry knows."""
        if name in self.served:
            return model_card(self.served[name], created)
        arg = self.registry[name].arg
        return ModelCard(
            id=name,
            created=created,
            owned_by="radixmux",
            root=arg.source,
            max_model_len=0,
            architecture="",
            dtype=arg.dtype or "",
            tokenizer_group="",
            kv_share_key="",
            state=self.state(name),
        )

    # ---- a request's model -------------------------------------------------------------
    async def model(self, name: str | None) -> protocol.ServedModel:
        """The served model a request names, loading a registered one first."""
        entry = self.registry.get(name) if name else None
        if entry is None:
            return resolve_model(self.served, name)
        entry.last_used = time.monotonic()
        if name in self.served:
            return self.served[name]
        if entry.load is None:
            entry.load = asyncio.create_task(self._load(entry))
        entry.claims += 1
        try:
            model = await asyncio.shield(entry.load)
        finally:
            # The caller submits its request without yielding first: by the next
            # turn of the loop it is in flight, or gone.
            asyncio.get_running_loop().call_soon(self._release, entry)
        return model

    @staticmethod
    def _release(entry: Registered) -> None:
        entry.claims -= 1

    @contextlib.asynccontextmanager
    async def hold(self, name: str | None) -> AsyncIterator[protocol.ServedModel]:
        """The model ``name`` (loaded first if registered), kept from automatic
        unloads until the block ends: for routes whose work is no request in
        flight (``/tokenize``, warm-ups), which an unload would not wait for."""
        model = await self.model(name)
        entry = self.registry.get(model.name)
        if entry is None:  # not on demand: never unloaded automatically
            yield model
            return
        entry.claims += 1  # no await since the load: the model is still there
        try:
            yield model
        finally:
            entry.claims -= 1

    def check_loaded(self, name: str | None, param: str) -> None:
        """For a route that needs ``name`` loaded and does not load it: a
        registered model that is not loaded answers 409 ``model_not_loaded``
        (a 404 would say it does not exist)."""
        if name and name in self.registry and name not in self.served:
            raise APIError(
                409,
                f"model '{name}' is registered but not loaded (state: {self.state(name)}); "
                "a request for it (completion, chat, /generate, /tokenize, warm-up) loads it",
                param,
                "model_not_loaded",
            )

    async def _load(self, entry: Registered) -> protocol.ServedModel:
        name = entry.arg.name
        try:
            async with self.room:
                deadline = time.monotonic() + self.args.model_load_timeout
                await self._make_room(entry.arg, deadline)
                try:
                    model = await self.manager.load_arg(entry.arg, "on_demand")
                except APIError as exc:
                    if exc.status != 507 or not await self._unload_one(name, "memory"):
                        raise
                    model = await self.manager.load_arg(entry.arg, "on_demand")
            entry.error = None
            entry.last_used = time.monotonic()
            return model
        except APIError as exc:
            entry.error = exc.message
            log.warning("model %s: on-demand load failed: %s", name, exc.message)
            raise APIError(
                503,
                f"model '{name}' could not be loaded: {exc.message}",
                "model",
                "model_load_failed",
            ) from None
        finally:
            entry.load = None

    # ---- making room -----------------------------------------------------------------
    async def load_with_room(self, arg: ModelArg, load: Callable[[], Awaitable[T]]) -> T:
        """A load that is not on demand (``POST /models``; ``arg`` as asked,
        source not resolved yet) counts against ``--max-loaded-models`` and
        ``--max-weights-bytes`` too: room is made as for an on-demand load
        (least recently used idle on-demand model first; 503 ``no_room`` when
        none can go), and no on-demand load takes the room meanwhile."""
        if arg.name in self.served:  # the load answers 409: nothing to make room for
            return await load()
        async with self.room:
            await self._make_room(arg, time.monotonic() + self.args.model_load_timeout)
            return await load()

    async def _make_room(self, arg: ModelArg, deadline: float) -> None:
        """Unload LRU idle on-demand models until ``arg`` fits ``--max-loaded-models``
        and ``--max-weights-bytes``."""
        loading = arg.name
        weights = await self._weights(arg)
        budget = self.args.max_weights_bytes
        if budget and weights > budget:
            raise APIError(
                503,
                f"model '{loading}' has {_mib(weights)} of weights, more than "
                f"--max-weights-bytes {_mib(budget)} holds",
                "model",
                "no_room",
            )
        while (full := self._full(loading, weights)) is not None:
            reason, why = full
            if await self._unload_one(loading, reason):
                continue
            if not self._candidates(loading):
                raise APIError(
                    503,
                    f"{why} and none can be unloaded: only idle on-demand models without "
                    "pinned warm-ups are unloaded automatically",
                    "model",
                    "no_room",
                )
            if time.monotonic() >= deadline:
                why += " and none turned idle within --model-load-timeout"
                raise APIError(503, why, "model", "no_room")
            await asyncio.sleep(ROOM_POLL_S)

    def _full(self, loading: str, weights: int) -> tuple[str, str] | None:
        """Why one more model of ``weights`` bytes does not fit now: (the unload
        reason that makes room, what is full), or None when it fits."""
        limit = self.args.max_loaded_models
        if limit and len(self.served) >= limit:
            return "lru", f"{len(self.served)} models are loaded (--max-loaded-models {limit})"
        budget, held = self.args.max_weights_bytes, self.weight_bytes()
        if budget and held + weights > budget:
            return "weights", (
                f"the loaded models hold {_mib(held)} of weights and '{loading}' needs "
                f"{_mib(weights)} more (--max-weights-bytes {_mib(budget)})"
            )
        return None

    def weight_bytes(self) -> int:
        """Weight bytes the loaded models hold, as their runners reported them
        (``ModelInfo.weight_bytes``, one copy per replica)."""
        return sum(m.info.weight_bytes * m.replicas for m in self.served.values())

    async def _weights(self, arg: ModelArg) -> int:
        """``arg``'s weight bytes from its files, before it loads (0 without a
        budget, or when its source cannot be read: its load then says why)."""
        if not self.args.max_weights_bytes:
            return 0
        try:
            resolved = await asyncio.to_thread(resolve_model_arg, arg, self.args.dtype)
            dtype = resolved.dtype or self.args.dtype
            need = await asyncio.to_thread(admission.estimate, resolved.source, dtype, 1)
        except (LaunchError, OSError, ValueError):
            return 0
        return need.weights_bytes * arg.replicas

    def _candidates(self, loading: str) -> list[Registered]:
        """Loaded on-demand models that may be unloaded some time (busy or not)."""
        return [e for n, e in self.registry.items() if n in self.served and n != loading]

    async def _unload_one(self, loading: str, reason: str) -> bool:
        """Unload the least recently used idle on-demand model; whether one was."""
        idle = [e for e in self._candidates(loading) if self._idle(e)]
        if idle and self.pinned is not None:  # asked only when it can matter
            pinned = await self.pinned()
            idle = [e for e in idle if self._idle(e) and self._instance(e) not in pinned]
        if not idle:
            return False
        victim = min(idle, key=lambda e: e.last_used)
        await self._unload(victim.arg.name, reason)
        return True

    def _instance(self, entry: Registered) -> str:
        model = self.served.get(entry.arg.name)
        return "" if model is None else model.instance

    def _idle(self, entry: Registered) -> bool:
        model = self.served.get(entry.arg.name)
        return model is not None and entry.claims == 0 and not self.manager.busy(model)

    async def _unload(self, name: str, reason: str) -> None:
        log.info("model %s: unloading (%s)", name, reason)
        await self.manager.unload_model(name, None, reason)

    # ---- idle unloads ----------------------------------------------------------------
    def keep_alive(self, entry: Registered) -> float:
        """Idle seconds before ``entry`` is unloaded (0: never)."""
        if entry.arg.keep_alive is not None:
            return entry.arg.keep_alive
        return self.args.idle_unload_seconds

    async def run_idle_unloads(self) -> None:
        """Unload on-demand models idle past their keep-alive, for ever."""
        while True:
            periods = [self.keep_alive(e) for e in self.registry.values()]
            period = min([p for p in periods if p > 0], default=1.0)
            await asyncio.sleep(min(1.0, max(0.05, period / 4)))
            await self.unload_idle()

    async def unload_idle(self) -> None:
        """One pass of :meth:`run_idle_unloads` (skipped while a load makes room:
        both would pick among the same models)."""
        if self.room.locked():
            return
        async with self.room:
            now = time.monotonic()
            for name, entry in list(self.registry.items()):
                keep = self.keep_alive(entry)
                if name not in self.served or keep <= 0:
                    continue
                if not self._idle(entry):
                    continue
                done = self.manager.hub.last_done.get(self._instance(entry), 0.0)
                if now - max(entry.last_used, done) < keep:  # from its last request's end
                    continue
                try:
                    await self._unload(name, "idle")
                except APIError as exc:  # a change in progress: try again next pass
                    log.warning("model %s: idle unload failed: %s", name, exc.message)


class StateCollector(Collector):
    """``radixmux_model_registered_state{model,state}``: 1 for each on-demand
    model's current state, 0 for the others."""

    def __init__(self, on_demand: OnDemand) -> None:
        self.on_demand = on_demand

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "radixmux_model_registered_state",
            "State of each on-demand model (1 for its current one)",
            labels=["model", "state"],
        )
        for name in self.on_demand.registry:
            now = self.on_demand.state(name)
            for state in STATES:
                family.add_metric([name, state], 1.0 if state == now else 0.0)
        yield family


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"
