"""A small Python client that talks to the front over ZeroMQ (no HTTP).

    client = Client(endpoint)  # the front's ``endpoints.client`` (--zmq-endpoint)
    done = client.generate("smollm2", prompt="Hello", max_new_tokens=16)
    for delta in client.stream("smollm2", messages=[{"role": "user", "content": "Hi"}]):
        print(delta.text, end="")

Sampling keywords are :class:`SamplingParams` fields (``max_tokens`` is accepted
for ``max_new_tokens``) plus ``stop``; defaults are SamplingParams's (greedy,
128 new tokens). Errors raise :class:`ClientError` with the HTTP-style status.
:class:`Client` is for one thread; :class:`AsyncClient` multiplexes many
requests over one socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from radixmux.protocol import (
    ChatMessage,
    RequestError,
    SamplingParams,
    TextBatch,
    TextOutput,
    encode,
)
from radixmux.runtime.client.messages import (
    ClientAbort,
    ClientGenerate,
    ClientModelChange,
    ClientModelChanged,
    ClientReply,
    ModelChange,
)

_PARAM_NAMES = {f.name for f in msgspec.structs.fields(SamplingParams)}


class ClientError(Exception):
    """A request the server refused or could not finish."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.param = param


@dataclass
class Completion:
    """A finished generation."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def build_request(
    model: str | None,
    prompt: str | None,
    input_ids: list[int] | None,
    messages: list[Any] | None,
    stream: bool,
    api_key: str | None,
    sampling: dict[str, Any],
) -> ClientGenerate:
    """A ``ClientGenerate``; unknown sampling keywords fail here, before anything is sent."""
    sampling = dict(sampling)
    stop = sampling.pop("stop", None)
    skip = sampling.pop("skip_special_tokens", True)
    if "max_tokens" in sampling:
        sampling["max_new_tokens"] = sampling.pop("max_tokens")
    unknown = set(sampling) - _PARAM_NAMES
    if unknown:
        raise TypeError(
            f"unknown sampling parameters {sorted(unknown)}; use {sorted(_PARAM_NAMES)}"
        )
    chat = None
    if messages is not None:
        chat = [m if isinstance(m, ChatMessage) else ChatMessage(**m) for m in messages]
    return ClientGenerate(
        rid=uuid.uuid4().hex,
        model=model,
        prompt=prompt,
        input_ids=list(input_ids) if input_ids is not None else None,
        messages=chat,
        params=SamplingParams(**sampling),
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stream=stream,
        skip_special_tokens=skip,
        api_key=api_key,
    )


def _unwrap(reply: TextBatch | RequestError) -> TextOutput:
    if isinstance(reply, RequestError):
        raise ClientError(reply.status, reply.message, reply.param)
    out = reply.outputs[0]
    if out.error is not None:
        raise ClientError(out.status, out.error)
    return out


def _completion(out: TextOutput) -> Completion:
    names = [f.name for f in fields(Completion)]
    return Completion(**{n: getattr(out, n) for n in names})


class Client:
    """Blocking client: one request at a time on one DEALER socket."""

    def __init__(self, endpoint: str, api_key: str | None = None, timeout: float = 120.0) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(ClientReply)
        self.api_key = api_key
        self.timeout = timeout

    def _recv(self, rid: str) -> TextOutput:
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000)):
                raise ClientError(504, f"no reply within {self.timeout:g} s")
            reply = self._decoder.decode(self._sock.recv())
            # Replies to an earlier, abandoned stream may still arrive: skip them.
            if isinstance(reply, ClientModelChanged):
                continue
            if (reply.rid if isinstance(reply, RequestError) else reply.outputs[0].rid) == rid:
                return _unwrap(reply)

    def generate(
        self,
        model: str | None = None,
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        messages: list[Any] | None = None,
        **sampling: Any,
    ) -> Completion:
        """Generate to the end and return the whole completion."""
        req = build_request(model, prompt, input_ids, messages, False, self.api_key, sampling)
        self._sock.send(encode(req))
        return _completion(self._recv(req.rid))

    def stream(
        self,
        model: str | None = None,
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        messages: list[Any] | None = None,
        **sampling: Any,
    ) -> Iterator[TextOutput]:
        """Yield text deltas as they come; closing the iterator early aborts the request."""
        req = build_request(model, prompt, input_ids, messages, True, self.api_key, sampling)
        self._sock.send(encode(req))
        finished = False
        try:
            while not finished:
                out = self._recv(req.rid)
                finished = out.finish_reason is not None
                yield out
        finally:
            if not finished:
                self._sock.send(encode(ClientAbort(req.rid)))

    def change_model(self, op: str, name: str | None = None, **fields: Any) -> ModelChange:
        """``load`` (``source=``, ``name``, ``dtype``, ``priority``, ``replicas``),
        ``unload`` or ``reload`` (``source``, ``dtype``, ``timeout``) a model;
        raises ``ClientError`` with the server's status and message."""
        change = ClientModelChange(uuid.uuid4().hex, op, name, api_key=self.api_key, **fields)
        self._sock.send(encode(change))
        deadline = time.monotonic() + max(self.timeout, 1800.0)  # a load may fetch first
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000)):
                raise ClientError(504, f"no answer to {op} in time")
            reply = self._decoder.decode(self._sock.recv())
            if isinstance(reply, ClientModelChanged) and reply.rid == change.rid:
                return reply.change
            if isinstance(reply, RequestError) and reply.rid == change.rid:
                raise ClientError(reply.status, reply.message)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client: many concurrent requests over one socket, routed by rid."""

    def __init__(self, endpoint: str, api_key: str | None = None) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(ClientReply)
        self._queues: dict[str, asyncio.Queue[TextBatch | RequestError]] = {}
        self._reader: asyncio.Task | None = None
        self.api_key = api_key

    async def _read(self) -> None:
        while True:
            reply = self._decoder.decode(await self._sock.recv())
            rid = reply.rid if isinstance(reply, RequestError) else reply.outputs[0].rid
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(reply)

    async def stream(
        self,
        model: str | None = None,
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        messages: list[Any] | None = None,
        _stream: bool = True,
        **sampling: Any,
    ) -> AsyncIterator[TextOutput]:
        """Yield text deltas; leaving the loop early aborts the request."""
        req = build_request(model, prompt, input_ids, messages, _stream, self.api_key, sampling)
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        queue: asyncio.Queue[TextBatch | RequestError] = asyncio.Queue()
        self._queues[req.rid] = queue
        finished = False
        try:
            await self._sock.send(encode(req))
            while not finished:
                out = _unwrap(await queue.get())
                finished = out.finish_reason is not None
                yield out
        finally:
            self._queues.pop(req.rid, None)
            if not finished:
                await self._sock.send(encode(ClientAbort(req.rid)))

    async def generate(
        self,
        model: str | None = None,
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        messages: list[Any] | None = None,
        **sampling: Any,
    ) -> Completion:
        """Generate to the end and return the whole completion."""
        async for out in self.stream(model, prompt, input_ids, messages, _stream=False, **sampling):
            return _completion(out)
        raise ClientError(500, "the server ended the request without output")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._sock.close(linger=0)
        self._ctx.term()
