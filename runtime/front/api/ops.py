"""Operations endpoints: health, model and server info, cache control, metrics.

SGLang's names (``/health``, ``/health_generate``, ``/get_model_info``,
``/get_server_info``, ``/flush_cache``) plus ``/models/{name}/invalidate`` and
Prometheus ``/metrics``. Each answers from the scheduler's own ``stats``
reply (a ``check`` for ``/get_server_info``: the scheduler's invariant check,
run again only when something changed and at most once a second, its result
reported with its age; so polling it costs the scheduler's loop next to nothing).
"""

from __future__ import annotations

import asyncio
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from radixmux import __name__ as _pkg
from radixmux import protocol
from radixmux.runtime import admission
from radixmux.runtime.api_error import APIError
from radixmux.runtime.front.api.common import json_response, resolve_model
from radixmux.runtime.front.hub import new_rid
from radixmux.runtime.front.openapi import Endpoint, Handler
from radixmux.runtime.front.state import Front

HEALTH_TIMEOUT_S = 5.0
HEALTH_GENERATE_TIMEOUT_S = 60.0


def endpoints(front: Front) -> list[tuple[Endpoint, Handler]]:
    """The operations routes, for the front's route table and OpenAPI document."""

    async def health(request: Request) -> Response:
        if not front.hub.ready:
            body = APIError(503, "the server is starting").body()
            return json_response({"status": "starting", **body}, 503)
        try:
            stats = await _stats(HEALTH_TIMEOUT_S)
        except APIError as exc:
            return json_response({"status": "unavailable", **exc.body()}, 503)
        states = _model_states(front.served, stats)
        down = _down_models(front.served, stats)
        limits = _admission()
        if not down:
            return json_response({"status": "ok", "models": states, "admission": limits})
        why = "; ".join(f"model '{name}' is {states[name]}: {r}" for name, r in down.items())
        body = APIError(503, why).body()
        return json_response(
            {"status": "degraded", "models": states, "down": down, "admission": limits, **body},
            503,
        )

    def _admission() -> admission.Admission:
        """What a model load must fit: replicas per model, memory left now."""
        arena = front.ctx.arena
        return admission.health(
            arena.path if arena is not None else None,
            arena.total_bytes if arena is not None else front.args.kv_cache_bytes,
            front.args.memory_reserve_bytes,
        )

    async def health_generate(request: Request) -> Response:
        try:
            stats = await _stats(HEALTH_TIMEOUT_S)
        except APIError as exc:
            return json_response({"status": "unavailable", **exc.body()}, 503)
        down = _down_models(front.served, stats)
        up = [m for name, m in front.served.items() if name not in down]
        results = await asyncio.gather(*(_probe(m) for m in up))
        down.update({m.name: why for m, why in zip(up, results, strict=True) if why is not None})
        if not down:
            return json_response({"status": "ok", "models": sorted(front.served)})
        why = "; ".join(f"model '{name}' failed: {reason}" for name, reason in down.items())
        return json_response(
            {"status": "unhealthy", "down": down, **APIError(503, why).body()}, 503
        )

    async def _probe(model: protocol.ServedModel) -> str | None:
        """One greedy token from ``model``; the reason it failed, or None."""
        params = protocol.SamplingParams(max_new_tokens=1)
        req = protocol.GenerateRequest(
            new_rid(), model.instance, params, input_ids=[0], arrival=time.time()
        )
        try:
            async with front.hub.generate(req, "health_generate") as gen:
                await asyncio.wait_for(_drain(gen), HEALTH_GENERATE_TIMEOUT_S)
        except APIError as exc:
            return exc.message
        except asyncio.TimeoutError:
            return f"no token within {HEALTH_GENERATE_TIMEOUT_S:g} s"
        return None

    async def _stats(timeout: float, op: str = "stats") -> protocol.SchedulerStats:
        reply = await front.hub.control(op, timeout=timeout)
        if not reply.ok or reply.stats is None:
            raise APIError(503, f"the scheduler could not report stats: {reply.message}")
        return reply.stats

    async def model_info(request: Request) -> Response:
        name = request.query_params.get("model") or _first()
        front.on_demand.check_loaded(name, "model")  # no layout before its load
        model = resolve_model(front.served, name)
        info = model.info
        return json_response(
            {
                "model_path": model.folder,
                "tokenizer_path": model.folder,
                "is_generation": True,
                "served_model_name": model.name,
                "architecture": info.architecture,
                "context_length": info.context_length,
                "vocab_size": info.vocab_size,
                "has_chat_template": info.has_chat_template,
                "dtype": info.dtype,
                "device": info.device,
                "replicas": model.replicas,
                "priority": model.priority,
                "models": sorted(front.served),
            }
        )

    def _first() -> str:
        if not front.served:  # every model on demand, none asked for yet
            raise APIError(
                409,
                "no model is loaded yet (every model is on demand): a request for one loads it",
                "model",
                "model_not_loaded",
            )
        return next(iter(front.served))

    async def server_info(request: Request) -> Response:
        args = msgspec.to_builtins(front.args)
        if args.get("api_key"):
            args["api_key"] = "<set>"  # never echo the secret
        stats: Any = None
        error = None
        try:
            # "check": the scheduler's independent invariant check, rate-limited.
            stats = msgspec.to_builtins(await _stats(HEALTH_TIMEOUT_S, "check"))
        except APIError as exc:
            error = exc.message
        served = [msgspec.to_builtins(m) for m in front.served.values()]
        return json_response(
            {
                **args,
                "version": server_version(),
                "served_models": served,
                "scheduler": stats,
                "scheduler_error": error,
            }
        )

    async def flush_cache(request: Request) -> Response:
        reply = await front.hub.control("flush_cache")
        if not reply.ok:
            raise APIError(400, f"cache not flushed: {reply.message}")
        return json_response({"ok": True, "message": reply.message or "Cache flushed."})

    async def invalidate(request: Request) -> Response:
        name = request.path_params["name"]
        front.on_demand.check_loaded(name, "model")  # its cache left memory with it
        model = resolve_model(front.served, name)
        reply = await front.hub.control("invalidate", model.instance)
        if not reply.ok:
            raise APIError(400, f"model '{model.name}' not invalidated: {reply.message}")
        return json_response({"ok": True, "model": model.name, "message": reply.message})

    async def metrics(request: Request) -> Response:
        try:
            stats: protocol.SchedulerStats | None = await _stats(2.0)
        except APIError:
            stats = None  # radixmux_scheduler_up 0 says so; front metrics still useful
        return Response(front.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    return [
        (Endpoint("/health", "GET", "per-model state; 503 while starting or degraded"), health),
        (Endpoint("/health_generate", "GET", "one token from every model"), health_generate),
        (Endpoint("/get_model_info", "GET", "SGLang's model info"), model_info),
        (Endpoint("/get_server_info", "GET", "flags and scheduler state"), server_info),
        # POST only, as in SGLang: a GET that changes state is one an <img> can send.
        (Endpoint("/flush_cache", "POST", "drop every cached prefix"), flush_cache),
        (
            Endpoint("/models/{name:path}/invalidate", "POST", "drop one model's cache"),
            invalidate,
        ),
        (Endpoint("/metrics", "GET", "Prometheus metrics", text=True), metrics),
    ]


async def _drain(gen: Any) -> None:
    async for _ in gen:
        pass


def _model_states(
    served: dict[str, protocol.ServedModel], stats: protocol.SchedulerStats
) -> dict[str, str]:
    """Each served model's state: serving, restarting or down."""
    reported = {m.name: m.state for m in stats.models}
    return {name: reported.get(m.instance, "down") for name, m in served.items()}


def _down_models(
    served: dict[str, protocol.ServedModel], stats: protocol.SchedulerStats
) -> dict[str, str]:
    """Served models that are not up, with the reason the scheduler gives."""
    reported = {m.name: m for m in stats.models}
    down: dict[str, str] = {}
    for name, model in served.items():
        m = reported.get(model.instance)
        if m is None:
            down[name] = "not reported by the scheduler"
        elif not m.up:
            down[name] = m.error or "no live runner"
    return down


def server_version() -> str:
    """The installed package version ("unknown" when run from a bare checkout)."""
    try:
        return version(_pkg)
    except PackageNotFoundError:
        return "unknown"
