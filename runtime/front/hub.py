"""The front's ZeroMQ side: sockets, the reader that routes replies, one request's life.

A single reader task receives ``TextBatch`` / ``RequestError`` / ``ControlReply``
from the PULL socket and drops each into the waiting request's queue (by rid)
or control future (by req_id); HTTP handlers and the ZMQ-client server only
ever await those, so nothing in the front blocks on tokenization or models.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from radixmux import protocol
from radixmux.common.ipc import Endpoints, socket
from radixmux.runtime.api_error import APIError
from radixmux.runtime.front.metrics import FrontMetrics, model_labels

log = logging.getLogger("radixmux.front")


def new_rid() -> str:
    return uuid.uuid4().hex


class InFlight:
    """One request in flight: its output queue, usage and latency bookkeeping.

    Iterate it for ``TextOutput`` deltas; iteration ends after the finishing
    output and raises :class:`APIError` when the request fails downstream.
    """

    def __init__(self, hub: RequestHub, req: protocol.GenerateRequest) -> None:
        self.hub = hub
        self.rid = req.rid
        self.model = req.model
        self.labels = model_labels(req.model)  # served name and version, for the metrics
        self.queue: asyncio.Queue[protocol.TextOutput | protocol.RequestError] = asyncio.Queue()
        self.start = time.perf_counter()
        self.last_at: float | None = None
        self.last: protocol.TextOutput | None = None
        self.finish_reason: str | None = None
        self.matched_stop: str | None = None
        self.keep_stop_string = req.keep_stop_string
        self.done = False
        # The task writing this request's stream to its HTTP client: an unload
        # that fails the request cancels it if the client stopped reading.
        self.writer: asyncio.Task[Any] | None = None

    def __aiter__(self) -> InFlight:
        return self

    async def __anext__(self) -> protocol.TextOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, protocol.RequestError):
            self._fail(item.status, item.message, item.param)
        elif item.error is not None or item.finish_reason == "error":
            self.last = item
            self._fail(
                item.status if item.status >= 400 else 500, item.error or "generation failed"
            )
        if item.matched_stop is not None and self.keep_stop_string:
            item = msgspec.structs.replace(item, text=item.text + item.matched_stop)
        self._account(item)
        if item.matched_stop is not None:
            # A stop string ends the request, though the scheduler may not know
            # yet: tell it so it frees the KV now (a no-op if it already ended).
            self.matched_stop = item.matched_stop
            self.hub.abort(self.rid, "stop")
            self._finish("stop")
        elif item.finish_reason is not None:
            self._finish(item.finish_reason)
        return item

    @property
    def latency(self) -> float:
        return time.perf_counter() - self.start

    def _account(self, out: protocol.TextOutput) -> None:
        now = time.perf_counter()
        n = len(out.token_ids)
        m = self.hub.metrics
        if out.queue_time is not None:  # on the first output of an admitted request
            m.queue_time.labels(*self.labels).observe(out.queue_time)
        if n:
            if self.last_at is None:
                m.ttft.labels(*self.labels).observe(now - self.start)
                n -= 1  # the first token has no inter-token gap
            else:
                for _ in range(n):
                    m.itl.labels(*self.labels).observe((now - self.last_at) / n)
            self.last_at = now
        self.last = out

    def _finish(self, reason: str) -> None:
        self.done = True
        self.finish_reason = reason
        last = self.last
        m = self.hub.metrics
        m.requests.labels(*self.labels, reason).inc()
        m.e2e.labels(*self.labels).observe(self.latency)
        if last is not None:
            m.prompt_tokens.labels(*self.labels).inc(last.prompt_tokens)
            m.generation_tokens.labels(*self.labels).inc(last.completion_tokens)
            m.cached_prompt_tokens.labels(*self.labels).inc(last.cached_tokens)
        log.info(
            "rid=%s finished model=%s reason=%s prompt=%d completion=%d cached=%d latency_ms=%.1f",
            self.rid,
            self.model,
            reason,
            last.prompt_tokens if last else 0,
            last.completion_tokens if last else 0,
            last.cached_tokens if last else 0,
            self.latency * 1000,
        )

    def _fail(self, status: int, message: str, param: str | None = None) -> None:
        self.done = True
        self.finish_reason = "error"
        self.hub.metrics.requests.labels(*self.labels, "error").inc()
        self.hub.metrics.e2e.labels(*self.labels).observe(self.latency)
        log.info("rid=%s error model=%s status=%d: %s", self.rid, self.model, status, message)
        raise APIError(status, message, param)

    def abandon(self, reason: str) -> None:
        """The caller is gone before the end: abort so the scheduler frees the KV at once."""
        if self.done:
            return
        self.done = True
        self.finish_reason = "abort"
        self.hub.metrics.requests.labels(*self.labels, "abort").inc()
        # Nothing back yet: the request may still be in a tokenizer worker,
        # behind this abort (which goes straight to the scheduler).
        self.hub.abort(self.rid, reason, early=self.last is None)
        log.info("rid=%s aborted model=%s reason=%s", self.rid, self.model, reason)


class RequestHub:
    """Owns the front's sockets and routes every downstream reply to its waiter."""

    def __init__(self, zctx: zmq.Context, endpoints: Endpoints, metrics: FrontMetrics) -> None:
        actx = zmq.asyncio.Context.shadow(zctx)
        self.metrics = metrics
        # Instance -> when its last request left (idle unloads count from it).
        self.last_done: dict[str, float] = {}
        self.tokenizer = socket(actx, zmq.PUSH, endpoints.tokenizer, bind=True)
        self.inbox = socket(actx, zmq.PULL, endpoints.front, bind=True)
        self.scheduler = socket(actx, zmq.PUSH, endpoints.scheduler, bind=False)
        self.launcher = socket(actx, zmq.PUSH, endpoints.launcher, bind=False)
        self.live: dict[str, InFlight] = {}
        # Replies awaited by req_id: the scheduler's ControlReply, a tokenizer
        # worker's TokenizerReply.
        self.replies: dict[str, asyncio.Future[Any]] = {}
        self._decoder = protocol.decoder(protocol.FrontInbox)
        self._pending_sends: set[asyncio.Future] = set()
        # False until the launcher says every process is up: until then the
        # front answers "starting" (a tokenizer worker may still be loading).
        self.ready = False
        # Run on ServerReady before ``ready`` turns True (``--warmup FILE``);
        # it returns whether the server may report ready.
        self.before_ready: Callable[[], Awaitable[bool]] | None = None
        self._starting: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """The reader task: route every message on the front's PULL socket."""
        while True:
            data = await self.inbox.recv()
            try:
                msg = self._decoder.decode(data)
            except msgspec.DecodeError as exc:
                log.error("undecodable message on the front socket: %s", exc)
                continue
            if isinstance(msg, protocol.TextBatch):
                for out in msg.outputs:
                    self._deliver(out.rid, out)
            elif isinstance(msg, protocol.RequestError):
                self._deliver(msg.rid, msg)
            elif isinstance(msg, protocol.ServerReady):
                log.info("every process is ready")
                if self.before_ready is None:
                    self.ready = True
                else:  # a task: its replies come through this very loop
                    self._starting = asyncio.create_task(self._ready_after(self.before_ready))
            else:
                fut = self.replies.pop(msg.req_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _deliver(self, rid: str, item: protocol.TextOutput | protocol.RequestError) -> None:
        gen = self.live.get(rid)
        if gen is None:
            # Late output of an aborted or finished request: expected, harmless.
            log.debug("rid=%s output for a request no longer live; dropped", rid)
            return
        gen.queue.put_nowait(item)

    @contextlib.asynccontextmanager
    async def generate(self, req: protocol.GenerateRequest, source: str) -> AsyncIterator[InFlight]:
        """Submit ``req`` and yield its :class:`InFlight`; leaving early aborts it."""
        self._check_ready()
        gen = InFlight(self, req)
        self.live[req.rid] = gen
        log.info(
            "rid=%s accepted model=%s via=%s stream=%s max_new_tokens=%d",
            req.rid,
            req.model,
            source,
            req.stream,
            req.params.max_new_tokens,
        )
        try:
            await self.tokenizer.send(protocol.encode(req))
            yield gen
        finally:
            self.live.pop(req.rid, None)
            self.last_done[req.model] = time.monotonic()
            gen.abandon("client disconnected")

    async def _ready_after(self, hook: Callable[[], Awaitable[bool]]) -> None:
        self.ready = await hook()

    def _check_ready(self) -> None:
        if not self.ready:
            raise APIError(503, "the server is starting; retry when /health answers 200")

    def abort(self, rid: str, reason: str, early: bool = False) -> None:
        """Tell the scheduler to stop ``rid`` (callable from cleanup code: never awaits)."""
        self._send_later(self.scheduler, protocol.encode(protocol.AbortRequest(rid, reason, early)))

    def _send_later(self, sock: zmq.asyncio.Socket, data: bytes) -> None:
        # pyzmq sends at once when it can; the future only lingers under backpressure.
        fut = sock.send(data)
        self._pending_sends.add(fut)
        fut.add_done_callback(self._sent)

    def _sent(self, fut: asyncio.Future) -> None:
        self._pending_sends.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.error("send to the scheduler failed: %s", fut.exception())

    async def control(
        self, op: str, model: str | None = None, timeout: float = 5.0
    ) -> protocol.ControlReply:
        """Ask the scheduler for ``op``; 503 when it does not answer in ``timeout`` seconds."""
        req_id = new_rid()
        msg = protocol.ControlRequest(req_id, op, model)
        return await self._ask(self.scheduler, req_id, msg, timeout, f"the scheduler ({op!r})")

    async def tokenizer_call(
        self,
        req: protocol.TokenizeRequest | protocol.DetokenizeRequest,
        timeout: float = 30.0,
        starting: bool = False,
    ) -> protocol.TokenizerReply:
        """``/tokenize`` or ``/detokenize`` by a tokenizer worker; its errors raise APIError.
        ``starting``: a start-up warm-up's call, made before ``ready``."""
        if not starting:
            self._check_ready()
        reply = await self._ask(self.tokenizer, req.req_id, req, timeout, "a tokenizer worker")
        if reply.status >= 400:
            raise APIError(reply.status, reply.error or "tokenization failed", reply.param)
        return reply

    async def warmup(
        self, msg: protocol.WarmupRequest, timeout: float, starting: bool = False
    ) -> protocol.WarmupReply:
        """A warm-up run by the scheduler; answers when every prefix is cached.
        ``starting``: a ``--warmup FILE`` line, run before ``ready``."""
        if not starting:
            self._check_ready()
        return await self._ask(self.scheduler, msg.req_id, msg, timeout, "the scheduler (warm-up)")

    async def launcher_call(
        self, cmd: protocol.ModelCommand, timeout: float
    ) -> protocol.ModelCommandReply:
        """A model load or unload done by the launcher (``model_changes``)."""
        self._check_ready()
        return await self._ask(self.launcher, cmd.req_id, cmd, timeout, "the launcher")

    async def _ask(
        self, sock: zmq.asyncio.Socket, req_id: str, msg: msgspec.Struct, timeout: float, who: str
    ) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.replies[req_id] = fut
        try:
            await sock.send(protocol.encode(msg))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise APIError(503, f"{who} did not answer within {timeout:g} s") from None
        finally:
            self.replies.pop(req_id, None)

    def fail_all(self, status: int, message: str) -> None:
        """End every live request with an error (the server is shutting down)."""
        for rid, gen in list(self.live.items()):
            gen.queue.put_nowait(protocol.RequestError(rid, status, message))

    def close(self) -> None:
        for sock in (self.tokenizer, self.inbox, self.scheduler, self.launcher):
            sock.close(linger=200)
