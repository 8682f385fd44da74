"""Host and Origin checks and JSON-only bodies: a web page must not drive a local server.

Every page the user opens can send requests to any server their machine
reaches, 127.0.0.1 included. Three shapes of that are refused here, before
the API key guard and the routes see the request:

- **DNS rebinding.** A page re-points its own name at 127.0.0.1; the browser
  then treats the server as the page's own origin and lets it read the
  answers (Ollama's CVE-2024-28224). Such a request carries the page's name
  in ``Host``: a Host outside the allow-list (loopback names and addresses,
  the bind address, ``--allowed-hosts``) is a 421.
- **Cross-site requests.** A page's fetch or form POST carries ``Origin``.
  One that is neither the server's own origin nor in ``--allowed-origins``
  is a 403, preflights included; CORS headers go to allowed origins only.
- **No-CORS bodies.** ``text/plain``, form and multipart bodies are sent
  cross-site without a preflight, so a body of any type other than JSON is a
  415 on every route (OpenAI and SGLang clients send ``application/json``).

GET never changes state (the routes say so): an ``<img>`` or a link, which
carries no Origin, can only read what it cannot see.
"""

from __future__ import annotations

import logging

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixmux.common.allowed_names import (
    HostAllowList,
    OriginAllowList,
    canonical_origin,
    split_host,
)
from radixmux.runtime.api_error import APIError
from radixmux.runtime.front.api.common import check_json_content_type, error_response

log = logging.getLogger("radixmux.front")

CORS_METHODS = "GET, POST, DELETE"
CORS_HEADERS = "authorization, content-type"
CORS_MAX_AGE_S = 600


class HttpGuard:
    """ASGI middleware: 421 for a Host outside the allow-list, 403 for an Origin
    that is neither the server's own nor allowed (preflights answered for
    allowed ones), 415 for a body that is not JSON; CORS headers for allowed
    cross-origin requests."""

    def __init__(self, app: ASGIApp, hosts: HostAllowList, origins: OriginAllowList) -> None:
        self.app = app
        self.hosts = hosts
        self.origins = origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host")
        if host is not None and not self.hosts.any:  # HTTP/1.0 may omit it; browsers never do
            hostport = split_host(host)
            if hostport is None or not self.hosts.allows(hostport[0]):
                await _refuse(scope, receive, send, _host_refused(host))
                return
        cors: list[tuple[bytes, bytes]] = []
        origin = headers.get("origin")
        if origin is not None:
            canonical = canonical_origin(origin)
            same = _same_origin(canonical, host)
            if not same and not self.origins.allows(canonical):
                await _refuse(scope, receive, send, _origin_refused(origin))
                return
            if not same:
                cors = [
                    (b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"vary", b"Origin"),
                ]
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                await _preflight(send, cors, headers)
                return
        send = _with_headers(send, cors) if cors else send
        if _has_body(headers):
            try:
                check_json_content_type(headers.get("content-type"))
            except APIError as exc:
                await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _same_origin(origin: str | None, host: str | None) -> bool:
    """Whether a canonical ``origin`` is the server's own: the Host it was sent to."""
    if origin is None or host is None:
        return False
    scheme = origin.split("://", 1)[0]  # behind a TLS proxy the page's is https
    return origin == canonical_origin(f"{scheme}://{host}")


def _has_body(headers: Headers) -> bool:
    length = headers.get("content-length")
    return "transfer-encoding" in headers or (length is not None and length.strip() != "0")


def _shown(value: str) -> str:
    return repr(value if len(value) <= 100 else value[:100] + "...")


def _host_refused(host: str) -> APIError:
    return APIError(
        421,
        f"Host {_shown(host)} is not served here (a web page reaching a local server "
        "through DNS rebinding looks like this); to serve it, start the server with "
        "--allowed-hosts NAME",
        "host",
        "host_not_allowed",
    )


def _origin_refused(origin: str) -> APIError:
    return APIError(
        403,
        f"cross-origin request from {_shown(origin)} refused; to allow a browser "
        "application at that origin, start the server with --allowed-origins ORIGIN",
        "origin",
        "origin_not_allowed",
    )


async def _refuse(scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
    log.debug("%s %s refused: %s", scope["method"], scope["path"], error.message)
    await error_response(error)(scope, receive, send)


async def _preflight(send: Send, cors: list[tuple[bytes, bytes]], asked: Headers) -> None:
    """A CORS preflight's answer (204) for an allowed origin."""
    wanted = asked.get("access-control-request-headers") or CORS_HEADERS
    headers = [
        *cors,
        (b"access-control-allow-methods", CORS_METHODS.encode()),
        (b"access-control-allow-headers", wanted.encode("latin-1")),
        (b"access-control-max-age", str(CORS_MAX_AGE_S).encode()),
        (b"content-length", b"0"),
    ]
    if "access-control-request-private-network" in asked:
        # Chrome asks before a public page may reach a loopback or private address.
        headers.append((b"access-control-allow-private-network", b"true"))
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    """``send`` adding ``extra`` to the response's headers."""

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return wrapped
