"""The front's HTTP routes: OpenAI, SGLang-native and operations endpoints.

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}``.
Before anything else, ``guard.HttpGuard`` refuses a foreign Host (421),
a foreign browser Origin (403) and a body that is not JSON (415). With
``--api-key`` every route then needs ``Authorization: Bearer KEY`` except
``/health`` and ``/metrics``, which probes and scrapers reach without secrets,
and the pages that hold none (``/openapi.json``, ``/docs``, ``/dashboard``).
"""

from __future__ import annotations

import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from radixmux import __name__ as _pkg
from radixmux.common.allowed_names import HostAllowList, OriginAllowList
from radixmux.runtime.api_error import APIError
from radixmux.runtime.front.api import (
    dashboard,
    models,
    native,
    openai,
    ops,
    tokenize,
    warmup,
)
from radixmux.runtime.front.api.common import error_response, json_response
from radixmux.runtime.front.api.ops import server_version
from radixmux.runtime.front.guard import HttpGuard
from radixmux.runtime.front.openapi import docs_page, openapi_document
from radixmux.runtime.front.state import Front

log = logging.getLogger("radixmux.front")

# The API description holds no secret; tools fetch it before they have a key.
# Nor does the dashboard page: it sends the key (from its URL fragment) to
# /dashboard.json, which needs it like every other route.
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/dashboard"})
# Each API's routes, in the order the app tries them and the document lists them.
APIS = (openai, native, tokenize, ops, models, dashboard, warmup)


def build_app(front: Front) -> ASGIApp:
    """The ASGI app of one front: every API module's routes, the OpenAPI
    document made from them, JSON errors, the Host / Origin / content-type
    guard and the API key guard."""
    endpoints = [route for api in APIS for route in api.endpoints(front)]
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
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    response = error_response(
        APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")
    )
    response.headers.update(exc.headers or {})  # a 405's Allow: the methods the route takes
    return response


async def _server_error(request: Request, exc: Exception) -> Response:
    # The details are for the operator, not the client.
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(APIError(500, "internal server error (the server log has details)"))


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
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)
