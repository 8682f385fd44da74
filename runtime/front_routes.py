"""The front's HTTP routes: OpenAI, SGLang-native and operations endpoints.

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}``.
With ``--api-key`` every route needs ``Authorization: Bearer KEY`` except
``/health`` and ``/metrics``, which probes and scrapers reach without secrets,
and the pages that hold none (``/openapi.json``, ``/docs``, ``/dashboard``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from radixmux import __name__ as _pkg
from radixmux.runtime import models_api, tokenize_api, warmup_api
from radixmux.runtime import native_api as N
from radixmux.runtime import openai_api as O
from radixmux.runtime import protocol as P
from radixmux.runtime.api_common import (
    APIError,
    check_json_content_type,
    decode_body,
    fan_out,
    json_response,
    read_body,
    resolve_model,
)
from radixmux.runtime.dashboard import DASHBOARD_PAGE, Dashboard, DashboardView
from radixmux.runtime.front_formats import ChatFormat, CompletionFormat, NativeFormat
from radixmux.runtime.front_hub import new_rid
from radixmux.runtime.front_stream import serve_generation
from radixmux.runtime.openapi import Endpoint, docs_page, openapi_document

if TYPE_CHECKING:
    from radixmux.runtime.front import Front

log = logging.getLogger("radixmux.front")

# The API description holds no secret; tools fetch it before they have a key.
# Nor does the dashboard page: it sends the key (from its URL fragment) to
# /dashboard.json, which needs it like every other route.
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/dashboard"})
HEALTH_TIMEOUT_S = 5.0
HEALTH_GENERATE_TIMEOUT_S = 60.0


def _log_user(rid: str, req: O.CompletionRequest | O.ChatRequest) -> None:
    """OpenAI's end-user fields change no answer; the log keeps them with the request id."""
    if req.user or req.safety_identifier:
        log.info("rid=%s user=%r safety_identifier=%r", rid, req.user, req.safety_identifier)


def build_app(front: Front) -> ASGIApp:
    """The ASGI app of one front."""

    async def body(request: Request, type_: type) -> Any:
        check_json_content_type(request.headers.get("content-type"))
        return decode_body(await read_body(request, front.args.max_request_bytes), type_)

    async def prompt_text(gen: P.GenerateRequest) -> str:
        """A prompt as text (``echo``): as sent, or its token ids decoded."""
        if gen.prompt is not None:
            return gen.prompt
        ids = gen.input_ids or []
        reply = await front.hub.tokenizer_call(P.DetokenizeRequest(new_rid(), gen.model, ids))
        return reply.text or ""

    async def completions(request: Request) -> Response:
        req = await body(request, O.CompletionRequest)
        model = resolve_model(front.served, req.model)
        rid = new_rid()
        prompts = O.completion_request(req, rid, model, time.time())
        _log_user(rid, req)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        n, best_of = O.n_choices(req), O.best_of(req)
        echo = [await prompt_text(p) for p in prompts] if req.echo else None
        shown = req.logprobs is not None  # best_of > n asks for logprobs to rank by
        fmt = CompletionFormat(rid, model.name, shown, usage, n, echo, best_of)
        gens = fan_out(prompts, best_of, "best_of" if best_of > n else "n")
        return await serve_generation(request, front.hub, gens, fmt, "completions")

    async def chat(request: Request) -> Response:
        req = await body(request, O.ChatRequest)
        model = resolve_model(front.served, req.model)
        rid = new_rid()
        template = front.args.chat_template is not None
        gen = O.chat_request(req, rid, model, time.time(), template)
        _log_user(rid, req)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = ChatFormat(rid, model.name, gen.params.logprobs, usage)
        gens = fan_out([gen], O.n_choices(req))
        return await serve_generation(request, front.hub, gens, fmt, "chat")

    async def generate(request: Request) -> Response:
        req = await body(request, N.NativeGenerate)
        model = resolve_model(front.served, req.model)
        rid = new_rid()
        gens = N.generate_request(req, rid, model, time.time())
        with_text = bool(req.return_text_in_logprobs)
        fmt = NativeFormat(gens[0].params.logprobs, with_text, N.is_batch(req))
        return await serve_generation(request, front.hub, gens, fmt, "generate")

    async def tokenize(request: Request) -> Response:
        req = await body(request, tokenize_api.TokenizeBody)
        model = resolve_model(front.served, req.model)
        template = front.args.chat_template is not None
        reply = await front.hub.tokenizer_call(
            tokenize_api.tokenize_request(req, new_rid(), model, template)
        )
        return json_response(tokenize_api.tokenize_response(reply, model))

    async def detokenize(request: Request) -> Response:
        req = await body(request, tokenize_api.DetokenizeBody)
        model = resolve_model(front.served, req.model)
        reply = await front.hub.tokenizer_call(
            tokenize_api.detokenize_request(req, new_rid(), model)
        )
        return json_response(tokenize_api.DetokenizeResponse(reply.text or ""))

    async def models(request: Request) -> Response:
        return json_response(O.model_list(list(front.served.values()), front.started))

    async def model_card(request: Request) -> Response:
        model = resolve_model(front.served, request.path_params["name"])
        return json_response(O.model_card(model, front.started))

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
        if not down:
            return json_response({"status": "ok", "models": states})
        why = "; ".join(f"model '{name}' is {states[name]}: {r}" for name, r in down.items())
        body = APIError(503, why).body()
        return json_response({"status": "degraded", "models": states, "down": down, **body}, 503)

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

    async def _probe(model: P.ServedModel) -> str | None:
        """One greedy token from ``model``; the reason it failed, or None."""
        params = P.SamplingParams(max_new_tokens=1)
        req = P.GenerateRequest(
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

    async def _stats(timeout: float, op: str = "stats") -> P.SchedulerStats:
        reply = await front.hub.control(op, timeout=timeout)
        if not reply.ok or reply.stats is None:
            raise APIError(503, f"the scheduler could not report stats: {reply.message}")
        return reply.stats

    async def model_info(request: Request) -> Response:
        model = resolve_model(front.served, request.query_params.get("model") or _first())
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
        return next(iter(front.served))

    async def server_info(request: Request) -> Response:
        args = msgspec.to_builtins(front.args)
        if args.get("api_key"):
            args["api_key"] = "<set>"  # never echo the secret
        stats: Any = None
        error = None
        try:
            # "check": the scheduler's independent invariant check runs too.
            stats = msgspec.to_builtins(await _stats(HEALTH_TIMEOUT_S, "check"))
        except APIError as exc:
            error = exc.message
        served = [msgspec.to_builtins(m) for m in front.served.values()]
        return json_response(
            {
                **args,
                "version": _version(),
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
        model = resolve_model(front.served, request.path_params["name"])
        reply = await front.hub.control("invalidate", model.instance)
        if not reply.ok:
            raise APIError(400, f"model '{model.name}' not invalidated: {reply.message}")
        return json_response({"ok": True, "model": model.name, "message": reply.message})

    async def metrics(request: Request) -> Response:
        try:
            stats: P.SchedulerStats | None = await _stats(2.0)
        except APIError:
            stats = None  # radixmux_scheduler_up 0 says so; front metrics still useful
        return Response(front.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    dashboard = Dashboard(front.hub, front.metrics)

    async def dashboard_page(request: Request) -> Response:
        return HTMLResponse(DASHBOARD_PAGE)

    async def dashboard_json(request: Request) -> Response:
        return json_response(await dashboard.view())

    endpoints: list[tuple[Endpoint, Callable[[Request], Awaitable[Response]]]] = [
        (
            Endpoint(
                "/v1/completions",
                "POST",
                "OpenAI text completion",
                O.CompletionRequest,
                O.CompletionResponse,
                streams=True,
            ),
            completions,
        ),
        (
            Endpoint(
                "/v1/chat/completions",
                "POST",
                "OpenAI chat completion (the model's chat template)",
                O.ChatRequest,
                O.ChatResponse,
                streams=True,
            ),
            chat,
        ),
        (Endpoint("/v1/models", "GET", "served models", response=O.ModelList), models),
        (
            Endpoint("/v1/models/{name:path}", "GET", "one served model", response=O.ModelCard),
            model_card,
        ),
        (
            Endpoint(
                "/generate",
                "POST",
                "SGLang native generation",
                N.NativeGenerate,
                N.NativeResponse,
                streams=True,
            ),
            generate,
        ),
        (
            Endpoint(
                "/tokenize",
                "POST",
                "vLLM's tokenize: the ids a generation request would be served with",
                tokenize_api.TokenizeBody,
                tokenize_api.TokenizeResponse,
            ),
            tokenize,
        ),
        (
            Endpoint(
                "/detokenize",
                "POST",
                "vLLM's detokenize: token ids back to text",
                tokenize_api.DetokenizeBody,
                tokenize_api.DetokenizeResponse,
            ),
            detokenize,
        ),
        (Endpoint("/health", "GET", "per-model state; 503 while starting or degraded"), health),
        (Endpoint("/health_generate", "GET", "one token from every model"), health_generate),
        (Endpoint("/get_model_info", "GET", "SGLang's model info"), model_info),
        (Endpoint("/get_server_info", "GET", "flags and scheduler state"), server_info),
        (Endpoint("/flush_cache", "GET", "drop every cached prefix"), flush_cache),
        (Endpoint("/flush_cache", "POST", "drop every cached prefix"), flush_cache),
        (
            Endpoint("/models/{name:path}/invalidate", "POST", "drop one model's cache"),
            invalidate,
        ),
        (Endpoint("/metrics", "GET", "Prometheus metrics", text=True), metrics),
        *models_api.endpoints(front, body),
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
        *warmup_api.endpoints(front, body),
    ]
    doc = openapi_document([ep for ep, _ in endpoints], _pkg, _version())
    page = docs_page(doc)

    async def openapi_json(request: Request) -> Response:
        return json_response(doc)

    async def docs(request: Request) -> Response:
        return HTMLResponse(page)

    routes = [Route(ep.path, handler, methods=[ep.method]) for ep, handler in endpoints]
    routes += [
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/docs", docs, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
    )
    return ApiKeyGuard(app, front.args.api_key)


async def _drain(gen: Any) -> None:
    async for _ in gen:
        pass


def _model_states(served: dict[str, P.ServedModel], stats: P.SchedulerStats) -> dict[str, str]:
    """Each served model's state: serving, restarting or down."""
    reported = {m.name: m.state for m in stats.models}
    return {name: reported.get(m.instance, "down") for name, m in served.items()}


def _down_models(served: dict[str, P.ServedModel], stats: P.SchedulerStats) -> dict[str, str]:
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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(_pkg)
    except PackageNotFoundError:
        return "unknown"


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return APIError(
        exc.status_code, f"{exc.detail}: {request.method} {request.url.path}"
    ).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    # The details are for the operator, not the client.
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return APIError(500, "internal server error (the server log has details)").response()


class ApiKeyGuard:
    """401 unless ``Authorization: Bearer <key>``, when a key is set (constant-time compare)."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app = app
        self.key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            error = APIError(401, "missing or wrong API key (Authorization: Bearer KEY)")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
