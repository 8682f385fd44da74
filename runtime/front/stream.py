"""Serving one generation over HTTP: wait for the first output, then stream SSE or answer once.

Waiting for the first output before sending headers lets errors raised before
generation (prompt too long, queue full, runner down) keep their HTTP status
even for ``stream: true``. Every wait races the client's disconnect, and every
exit path leaves the request's context, which aborts it if unfinished, so the
scheduler frees its KV at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from radixmux import protocol
from radixmux.runtime.api_error import APIError
from radixmux.runtime.front.api.common import error_response, json_response
from radixmux.runtime.front.hub import InFlight, RequestHub

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class Formatter(Protocol):
    """Turns one request's outputs into an API's wire format (one instance per request).

    A request asking for ``n`` choices runs as ``n`` generations; ``index`` is
    the choice an output belongs to, and ``tail``/``full`` see them all.
    """

    def chunks(
        self, out: protocol.TextOutput, gen: InFlight, index: int
    ) -> list[msgspec.Struct]: ...

    def tail(self, gens: list[InFlight]) -> list[msgspec.Struct]: ...

    def full(self, outputs: list[list[protocol.TextOutput]], gens: list[InFlight]) -> Any: ...


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (once the body is read, receive waits for that)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or :class:`ClientGone` if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        task.cancel()
        gone.cancel()


async def _collect(gen: InFlight, first: protocol.TextOutput) -> list[protocol.TextOutput]:
    return [first, *[out async for out in gen]]


async def _all(works: list[Awaitable[T]]) -> list[T]:
    """Every result, in order; when one fails (or we are cancelled) the rest are
    cancelled, so no task is left waiting on a request that is gone."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def serve_generation(
    request: Request,
    hub: RequestHub,
    reqs: list[protocol.GenerateRequest],
    fmt: Formatter,
    source: str,
) -> Response:
    """Run ``reqs`` (the choices of one API request) and answer with SSE
    (``stream``) or one JSON body; the first choice's rid names the response."""
    headers = {"X-Request-Id": reqs[0].rid}
    stack = contextlib.AsyncExitStack()
    try:
        gens = [await stack.enter_async_context(hub.generate(r, source)) for r in reqs]
        firsts = await unless_gone(request, _all([g.__anext__() for g in gens]))
    except StopAsyncIteration:  # pragma: no cover - the first output cannot be after the end
        await stack.aclose()
        raise
    except APIError as exc:
        await stack.aclose()
        return error_response(exc)
    except ClientGone:
        await stack.aclose()
        return Response(status_code=499)
    if reqs[0].stream:
        return EventStream(_events(gens, firsts, fmt), stack.aclose, headers)
    try:
        work = _all([_collect(g, f) for g, f in zip(gens, firsts, strict=True)])
        outputs = await unless_gone(request, work)
        return json_response(fmt.full(outputs, gens), 200, headers)
    except APIError as exc:
        return error_response(exc)
    except ClientGone:
        return Response(status_code=499)
    finally:
        await stack.aclose()


async def _interleaved(
    gens: list[InFlight], firsts: list[protocol.TextOutput]
) -> AsyncIterator[tuple[int, protocol.TextOutput]]:
    """Every choice's outputs, each as soon as it arrives; a failing choice raises."""
    for i, first in enumerate(firsts):
        yield i, first
    if len(gens) == 1:  # the common case, without a task per request
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, protocol.TextOutput | APIError | None]] = asyncio.Queue()

    async def pump(i: int, gen: InFlight) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except APIError as exc:
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _events(
    gens: list[InFlight], firsts: list[protocol.TextOutput], fmt: Formatter
) -> AsyncIterator[bytes]:
    for gen in gens:  # this runs in the stream's writer task (EventStream's pump)
        gen.writer = asyncio.current_task()
    try:
        async for i, out in _interleaved(gens, firsts):
            for chunk in fmt.chunks(out, gens[i], i):
                yield sse(chunk)
        for chunk in fmt.tail(gens):
            yield sse(chunk)
    except APIError as exc:
        # Headers are sent: the error travels as an event, as OpenAI's API does.
        yield sse(exc.body())
    yield DONE


class EventStream:
    """An ASGI SSE response that stops on client disconnect and always runs ``on_close``."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[Any]],
        headers: dict[str, str],
    ) -> None:
        self.events = events
        self.on_close = on_close
        self.headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                *self.headers,
            ],
        }

        async def pump() -> None:
            await send(start)
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        task = asyncio.ensure_future(pump())
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            task.cancel()
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task  # its errors were already turned into SSE events
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]
            await self.on_close()
