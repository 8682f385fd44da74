"""Slow and stalled readers on raw sockets, and the judging of what they read."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from typing import Any

from bench.soak.client import (
    StreamJudge,
    close_record,
    error_fields,
    parse_json,
)
from bench.soak.hostile.client import stopped, wait_or_stop
from bench.soak.hostile.config import (
    HEAD_TIMEOUT_S,
    RCVBUF,
    SLOW_BYTES,
    SLOW_EVERY_S,
    SLOW_MODES,
    TOP,
    TRICKLE_BYTES,
    TRICKLE_EVERY_S,
)
from bench.soak.hostile.records import HostileRun, StreamFacts
from bench.soak.load import endpoints_for, raw_request
from bench.soak.records import RequestRecord, RunState
from bench.sse import sse_data


class Dechunker:
    """An HTTP/1.1 chunked body, fed as it arrives."""

    def __init__(self) -> None:
        self.raw = bytearray()
        self.data = bytearray()
        self.done = False

    def feed(self, chunk: bytes) -> None:
        self.raw += chunk
        while not self.done:
            end = self.raw.find(b"\r\n")
            if end < 0:
                return
            size = int(bytes(self.raw[:end]).split(b";")[0], 16)  # ValueError: not chunked
            if len(self.raw) < end + 2 + size + 2:
                return
            self.data += self.raw[end + 2 : end + 2 + size]
            del self.raw[: end + 2 + size + 2]
            self.done = size == 0


class RawStream:
    """A request on a raw socket with a small receive buffer, read at the client's pace.

    Nothing is read ahead: every byte the client does not ask for stays in the
    kernel's buffers, so a client that stops reading fills them and the
    server's writer blocks, as it would behind a stalled browser tab.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = Dechunker()
        self.length: int | None = None  # a body with Content-Length (an error)
        self.plain = bytearray()
        self.received = 0
        self.eof = False

    @classmethod
    async def open(cls, port: int, path: str, body: bytes) -> RawStream:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), 30)
            await asyncio.wait_for(loop.sock_sendall(sock, raw_request(port, path, body)), 30)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def _recv(self, n: int, timeout: float) -> bytes:
        data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(self.sock, n), timeout)
        self.received += len(data)
        self.eof = not data
        return data

    async def read_head(self, timeout: float) -> None:
        """Read up to the end of the headers (a byte at a time past them is not wanted)."""
        head = bytearray()
        deadline = time.monotonic() + timeout
        while b"\r\n\r\n" not in head:
            data = await self._recv(1024, max(0.1, deadline - time.monotonic()))
            if not data:
                raise ConnectionError("closed before the headers")
            head += data
            if len(head) > 65536:
                raise ValueError("headers over 64 KiB")
        raw, _, rest = bytes(head).partition(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        for line in lines[1:]:
            key, _, value = line.partition(":")
            self.headers[key.strip().lower()] = value.strip()
        if "content-length" in self.headers:
            self.length = int(self.headers["content-length"])
        self._take(rest)

    def _take(self, data: bytes) -> None:
        if self.length is not None:
            self.plain += data
        else:
            self.body.feed(data)

    @property
    def done(self) -> bool:
        if self.length is not None:
            return len(self.plain) >= self.length
        return self.body.done

    async def read(self, step: int, every_s: float, until: float) -> str:
        """Read ``step`` bytes every ``every_s`` until the body ends ("done"), the
        server closes ("eof") or monotonic time ``until`` ("timeout")."""
        while not self.done:
            left = until - time.monotonic()
            if left <= 0:
                return "timeout"
            try:
                data = await self._recv(step, left)
            except asyncio.TimeoutError:
                return "timeout"
            if not data:
                return "eof"
            self._take(data)
            if every_s:
                await asyncio.sleep(every_s)
        return "done"

    def close(self) -> None:
        self.sock.close()


def judge_events(rec: RequestRecord, data: bytes, ended: bool) -> dict[str, Any]:
    """Judge an SSE body as the soak's streamed requests are judged; ``ended``: the
    body's last chunk came.

    Returns what a ``/generate`` stream with logprobs sent (tokens, logprob
    entries, the widest alternatives list) for the delta check.
    """
    facts = {"tokens": 0, "entries": 0, "widest": 0}
    judge = StreamJudge(rec)
    for event in data.split(b"\n\n"):
        payload = sse_data(event.decode(errors="replace").strip())
        if payload is None:
            continue
        msg = judge.feed(payload)
        if judge.judged:
            return facts
        meta = msg.get("meta_info") if msg is not None else None
        if isinstance(meta, dict):
            facts["tokens"] = len(msg.get("output_ids") or [])  # cumulative (SGLang's default)
            facts["entries"] += len(meta.get("output_token_logprobs") or [])
            tops = meta.get("output_top_logprobs") or []
            facts["widest"] = max([facts["widest"], *(len(t or []) for t in tops)])
    judge.cut("stream ended without [DONE]" if ended else "stream cut")
    return facts


def stream_body(
    endpoint: str, model: str, prompt: str, max_tokens: int, seed: int | None = None
) -> bytes:
    """A long streamed request that sends as many bytes per token as the API allows."""
    sampling: dict[str, Any] = {"temperature": 0} if seed is None else {"temperature": 0.8}
    if seed is not None:
        sampling["seed"] = seed
    if endpoint == "/generate":
        body: dict[str, Any] = {
            "model": model,
            "text": prompt,
            "stream": True,
            "return_logprob": True,
            "top_logprobs_num": TOP,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True, **sampling},
        }
    elif endpoint == "/v1/chat/completions":
        body = {"model": model, "messages": [{"role": "user", "content": prompt}]}
        body |= {"logprobs": True, "top_logprobs": TOP}
    else:
        body = {"model": model, "prompt": prompt, "logprobs": TOP}
    if endpoint != "/generate":
        body |= {"max_tokens": max_tokens, "ignore_eos": True, "stream": True, **sampling}
    return json.dumps(body).encode()


async def _error_body(stream: RawStream, rec: RequestRecord, until: float) -> None:
    """A non-200 answer: its JSON error."""
    await stream.read(65536, 0.0, until)
    raw = bytes(stream.plain if stream.length is not None else stream.body.data)
    if error_fields(rec, parse_json(raw.decode(errors="replace"))):
        rec.outcome = "error"
    else:
        rec.outcome, rec.detail = "bad_body", f"HTTP {rec.status} without a JSON error body"


async def open_stream(run: RunState, rec: RequestRecord, body: bytes) -> RawStream | None:
    """Send ``body`` on a raw socket and read the headers; None when the answer is
    not a stream (``rec`` then holds it) or the connection failed."""
    t = time.monotonic()
    try:
        stream = await RawStream.open(run.config.port, rec.endpoint, body)
    except (OSError, asyncio.TimeoutError) as exc:
        rec.outcome, rec.detail = "transport", f"{type(exc).__name__}: {exc}"[:300]
        return None
    try:
        await stream.read_head(HEAD_TIMEOUT_S)
        rec.status, rec.rid = stream.status, stream.headers.get("x-request-id", "")
        rec.ttft = time.monotonic() - t
        if stream.status != 200:
            await _error_body(stream, rec, time.monotonic() + 30)
            stream.close()
            return None
        return stream
    except (OSError, ValueError, asyncio.TimeoutError) as exc:
        rec.outcome = "timeout" if isinstance(exc, asyncio.TimeoutError) else "transport"
        rec.detail = f"headers: {type(exc).__name__}: {exc}"[:300]
        stream.close()
        return None


def finish_stream(run: RunState, rec: RequestRecord, stream: RawStream, how: str) -> None:
    """Judge what a stream read to its end (or cut) sent, and keep its logprob facts."""
    hs: HostileRun = run.hostile
    facts = judge_events(rec, bytes(stream.body.data), how == "done")
    if rec.endpoint == "/generate" and how == "done" and rec.outcome == "ok":
        hs.streams.append(
            StreamFacts(
                rec.rid, facts["tokens"], facts["entries"], facts["widest"], stream.received
            )
        )


async def slow_reader_once(
    run: RunState, rng: random.Random, index: int, mode: str, logprobs: bool
) -> None:
    """One stream read slowly to the end, never after its headers, or a trickle at a
    time; ``logprobs``: a streamed ``/generate`` with 20 alternatives a token."""
    hs: HostileRun = run.hostile
    p = hs.profile
    model = rng.choice(list(run.facts))
    endpoints = endpoints_for(run.facts[model])
    endpoint = "/generate" if logprobs else rng.choice(endpoints)
    rec = run.new_record(f"slow_reader-{index}", "slow_reader", model, endpoint, True)
    rec.case = mode
    prompt = " ".join(rng.choice(run.words) for _ in range(run.config.profile.question_words * 2))
    seed = None if rng.random() < 0.5 else rng.randrange(1 << 30)
    t = time.monotonic()
    stream = await open_stream(
        run, rec, stream_body(endpoint, model, prompt, p.slow_max_tokens, seed)
    )
    if stream is None:
        close_record(run, rec, t)
        return
    try:
        if mode == "never":
            await wait_or_stop(run, p.slow_hold_s)
            how = "held"
        elif mode == "trickle":
            how = await stream.read(
                TRICKLE_BYTES, TRICKLE_EVERY_S, time.monotonic() + p.slow_hold_s
            )
        else:
            how = await stream.read(
                SLOW_BYTES, SLOW_EVERY_S, t + run.config.profile.request_timeout_s
            )
        if how in ("done", "eof"):
            finish_stream(run, rec, stream, how)
        elif mode == "slow":
            rec.outcome = "timeout"
            rec.detail = f"not sent within {run.config.profile.request_timeout_s:g} s"
        else:
            rec.outcome = "abandoned"  # the client hangs up, as it meant to
    except (OSError, ValueError) as exc:
        rec.outcome, rec.detail = "transport", f"{type(exc).__name__}: {exc}"[:300]
    finally:
        stream.close()
        close_record(run, rec, t)


async def slow_reader_task(run: RunState, index: int) -> None:
    """Every way of reading in turn (so even a short run has each); every other
    stream is a ``/generate`` with logprobs, the most bytes a token."""
    rng = random.Random(run.config.seed * 15485863 + index)
    n = 0
    while not stopped(run):
        mode = SLOW_MODES[(n + index) % len(SLOW_MODES)]
        await slow_reader_once(run, rng, index, mode, logprobs=(n // len(SLOW_MODES)) % 2 == 0)
        n += 1
        if await wait_or_stop(run, rng.uniform(*run.hostile.profile.slow_pause_s)):
            return
