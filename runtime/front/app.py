"""The front's HTTP routes: OpenAI, SGLang-native and operations endpoints.

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}``.
Before anything else, ``http_guard.HttpGuard`` refuses a foreign Host (421),
a foreign browser Origin (403) and a body that is not JSON (415). With
``--api-key`` every route then needs ``Authorization: Bearer KEY`` except
``/health`` and ``/metrics``, which probes and scrapers reach without secrets,
and the pages that hold none (``/openapi.json``, ``/docs``, ``/dashboard``).
"""

from __future__ import annotations

import hmac
import logging
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from radixmux import __name__ as _pkg
from radixmux.common.allowed_names import HostAllowList, OriginAllowList
from radixmux.runtime import (
    dashboard,
    models_api,
    native_api,
    openai_api,
    ops_api,
    tokenize_api,
    warmup_api,
)
from radixmux.runtime.api_common import (
    APIError,
    check_json_content_type,
    decode_body,
    json_response,
    read_body,
)
from radixmux.runtime.http_guard import HttpGuard
from radixmux.runtime.openapi import docs_page, openapi_document
from radixmux.runtime.ops_api import server_version

if TYPE_CHECKING:
    from radixmux.runtime.front import Front

log = logging.getLogger("radixmux.front")

# The API description holds no secret; tools fetch it before they have a key.
# Nor does the dashboard page: it sends the key (from its URL fragment) to
# /dashboard.json, which needs it like every other route.
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/dashboard"})
HEALTH_TIMEOUT_S = 5.0
HEALTH_GENERATE_TIMEOUT_S = 60.0


def build_app(front: Front) -> ASGIApp:
    """The ASGI app of one front: every API module's routes, the OpenAPI
    document made from them, JSON errors, the Host / Origin / content-type
    guard and the API key guard."""

    async def body(request: Request, type_: type) -> Any:
        # HttpGuard checked it already for every request with a body; checked
        # again where the body is decoded so no route depends on the wrapping.
        check_json_content_type(request.headers.get("content-type"))
        return decode_body(await read_body(request, front.args.max_request_bytes), type_)

    endpoints = [
        *openai_api.endpoints(front, body),
        *native_api.endpoints(front, body),
        *tokenize_api.endpoints(front, body),
        *ops_api.endpoints(front),
        *models_api.endpoints(front, body),
        *dashboard.endpoints(front),
        *warmup_api.endpoints(front, body),
    ]
    doc = openapi_document([ep for ep, _ in endpoints], _pkg, server_version())
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
    args = front.args
    hosts = HostAllowList(args.host, args.allowed_hosts)
    if hosts.bound_to_all and not args.allowed_hosts:
        log.warning(
            "bound to %s: any Host header is served, so a web page can reach this server "
            "through DNS rebinding; name its public host names with --allowed-hosts",
            args.host,
        )
    guarded = ApiKeyGuard(app, args.api_key)
    return HttpGuard(guarded, hosts, OriginAllowList(args.allowed_origins))


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    response = APIError(
        exc.status_code, f"{exc.detail}: {request.method} {request.url.path}"
    ).response()
    response.headers.update(exc.headers or {})  # a 405's Allow: the methods the route takes
    return response


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
