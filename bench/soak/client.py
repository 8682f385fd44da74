"""One request as a soak client sends it, and how its answer is judged (plain or streamed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from bench.soak.config import CONTROL_KINDS, ERROR_TYPE_STATUS
from bench.soak.records import RequestRecord, RunState
from bench.sse import DONE, event_text, finish_reason, sse_data


def parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def error_fields(rec: RequestRecord, body: Any) -> bool:
    """Fill the record's error fields from an OpenAI-style error body; False if not one."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not {"message", "type", "param", "code"} <= err.keys():
        return False
    rec.error_type = str(err["type"])
    rec.error_param = None if err["param"] is None else str(err["param"])
    code = err["code"]
    if isinstance(code, int) and not isinstance(code, bool):
        rec.error_code = code
    elif rec.status != 200:
        rec.error_code = rec.status
    else:  # an in-stream error with a symbolic code: its type says which status it is
        rec.error_code = ERROR_TYPE_STATUS.get(rec.error_type)
    rec.detail = str(err["message"])[:300]
    return True


def judge_finish(rec: RequestRecord, finish: str | None) -> None:
    """A 200 answer: ok only when it says how it finished (stop or length)."""
    if finish in ("stop", "length"):
        rec.outcome = "ok"
    else:
        rec.outcome = "incomplete"
        rec.detail = f"finish_reason {finish!r}"


@dataclass
class StreamJudge:
    """Judges one SSE stream event by event into its record's outcome.

    ``feed`` takes each event's payload and returns its message while the stream
    goes on, None for an error event (after which only ``[DONE]`` may come);
    ``judged`` is set once the outcome is known. ``cut`` judges a stream that
    ended without ``[DONE]``.
    """

    rec: RequestRecord
    text: str = ""  # the text so far
    piece: str = ""  # the last event's text
    finish: str | None = None
    errored: bool = False
    judged: bool = False

    def feed(self, payload: str) -> dict[str, Any] | None:
        rec = self.rec
        if payload == DONE:
            if self.errored:
                rec.outcome = "stream_error"
            else:
                judge_finish(rec, self.finish)
            self.judged = True
            return None
        msg = parse_json(payload)
        if not isinstance(msg, dict) or self.errored:  # after an error event: only [DONE]
            rec.outcome, rec.detail = "bad_body", f"unexpected stream event {payload[:80]!r}"
            self.judged = True
            return None
        if "error" in msg:
            self.errored = error_fields(rec, msg)
            if not self.errored:
                rec.outcome, rec.detail = "bad_body", "error event without the error shape"
                self.judged = True
            return None
        self.piece = event_text(msg)
        self.text = self.piece if "meta_info" in msg else self.text + self.piece
        self.finish = finish_reason(msg) or self.finish
        return msg

    def cut(self, detail: str) -> None:
        self.rec.outcome, self.rec.detail = "incomplete", detail


async def read_error(rec: RequestRecord, resp: httpx.Response) -> None:
    body = parse_json((await resp.aread()).decode(errors="replace"))
    if error_fields(rec, body):
        rec.outcome = "error"
    else:
        rec.outcome = "bad_body"
        rec.detail = f"HTTP {resp.status_code} without a JSON error body"


async def plain_request(client: httpx.AsyncClient, rec: RequestRecord, url: str, body: Any) -> str:
    """A non-streamed request; returns the answer's text."""
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"content-type": "application/json"}
    resp = await client.post(url, headers=headers, **kwargs)
    rec.status = resp.status_code
    rec.rid = resp.headers.get("x-request-id", "")
    if resp.status_code != 200:
        await read_error(rec, resp)
        return ""
    msg = parse_json(resp.text)
    if not isinstance(msg, dict):
        rec.outcome, rec.detail = "bad_body", "200 with a body that is not a JSON object"
        return ""
    if rec.kind in CONTROL_KINDS:  # {"ok": true, ...}: no finish reason to look for
        rec.outcome = "ok" if msg.get("ok") is True else "bad_body"
        return ""
    judge_finish(rec, finish_reason(msg))
    return event_text(msg)


async def stream_request(
    client: httpx.AsyncClient, rec: RequestRecord, url: str, body: Any, abandon_after: int | None
) -> str:
    """A streamed request read event by event; returns the text streamed."""
    t_start = time.monotonic()
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"content-type": "application/json"}
    async with client.stream("POST", url, headers=headers, **kwargs) as resp:
        rec.status = resp.status_code
        rec.rid = resp.headers.get("x-request-id", "")
        if resp.status_code != 200:
            await read_error(rec, resp)
            return ""
        judge, events = StreamJudge(rec), 0
        async for line in resp.aiter_lines():
            payload = sse_data(line)
            if payload is None:
                continue
            msg = judge.feed(payload)
            if judge.judged:
                return judge.text
            if msg is None:  # an error event: only [DONE] may follow
                continue
            if judge.piece and rec.ttft is None:
                rec.ttft = time.monotonic() - t_start
            events += 1
            if abandon_after is not None and events >= abandon_after:
                rec.outcome = "abandoned"  # leaving the block closes the connection
                return judge.text
    judge.cut("stream ended without [DONE]")
    return judge.text


@contextlib.contextmanager
def failures_recorded(rec: RequestRecord, timeout_s: float, what: str) -> Iterator[None]:
    """A timeout or a transport failure inside the block goes into ``rec``, not up."""
    try:
        yield
    except (asyncio.TimeoutError, httpx.TimeoutException):
        rec.outcome = "timeout"
        rec.detail = f"no {what} within {timeout_s:g} s"
    except (httpx.HTTPError, OSError) as exc:
        rec.outcome = "transport"
        rec.detail = f"{type(exc).__name__}: {exc}"[:300]


def close_record(run: RunState, rec: RequestRecord, t: float) -> None:
    """The request is over: its duration since ``t`` and its end on the run's clock."""
    rec.e2e = time.monotonic() - t
    rec.t_end = run.now()


async def send(
    run: RunState,
    client: httpx.AsyncClient,
    rec: RequestRecord,
    body: dict[str, Any] | bytes,
    abandon_after: int | None = None,
) -> str:
    """Send one request, fill ``rec`` (never raises) and return the text answered.

    The whole request (not each read) is bounded by the run's request timeout,
    so a server that trickles bytes forever still counts as a hang.
    """
    url = run.url + rec.endpoint
    t = time.monotonic()
    text = ""
    with failures_recorded(rec, run.config.profile.request_timeout_s, "complete answer"):
        work = (
            stream_request(client, rec, url, body, abandon_after)
            if rec.stream
            else plain_request(client, rec, url, body)
        )
        text = await asyncio.wait_for(work, run.config.profile.request_timeout_s)
    close_record(run, rec, t)
    return text


async def pause_after(rec: RequestRecord, rng: random.Random, low: float, high: float) -> None:
    """Think time between requests; back off a second after 429/503 as Retry-After asks."""
    backoff = 1.0 if rec.error_code in (429, 503) else 0.0
    await asyncio.sleep(backoff + rng.uniform(low, high))
