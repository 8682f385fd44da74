"""One request as a soak client sends it, and how its answer is judged (plain or streamed)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx

from bench.soak.config import CONTROL_KINDS, ERROR_TYPE_STATUS
from bench.soak.records import RequestRecord, RunState


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


def finish_reason(msg: Any) -> str | None:
    """The finish reason of a response or stream event in any of the three APIs."""
    if not isinstance(msg, dict):
        return None
    meta = msg.get("meta_info")
    if isinstance(meta, dict):  # SGLang /generate
        finish = meta.get("finish_reason")
        return finish.get("type") if isinstance(finish, dict) else None
    choices = msg.get("choices") or []
    return choices[0].get("finish_reason") if choices and isinstance(choices[0], dict) else None


def event_text(msg: Any) -> str:
    """The text of a response or stream event (``/generate`` streams carry it cumulative)."""
    if not isinstance(msg, dict):
        return ""
    if "meta_info" in msg:
        return str(msg.get("text") or "")
    choices = msg.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    holder = c.get("message") or c.get("delta") or {}
    return holder.get("content") or ""


def judge_finish(rec: RequestRecord, finish: str | None) -> None:
    """A 200 answer: ok only when it says how it finished (stop or length)."""
    if finish in ("stop", "length"):
        rec.outcome = "ok"
    else:
        rec.outcome = "incomplete"
        rec.detail = f"finish_reason {finish!r}"


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
    text = ""
    async with client.stream("POST", url, headers=headers, **kwargs) as resp:
        rec.status = resp.status_code
        rec.rid = resp.headers.get("x-request-id", "")
        if resp.status_code != 200:
            await read_error(rec, resp)
            return ""
        events, finish, errored = 0, None, False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                if errored:
                    rec.outcome = "stream_error"
                else:
                    judge_finish(rec, finish)
                return text
            msg = parse_json(data)
            if not isinstance(msg, dict) or errored:  # after an error event: only [DONE]
                rec.outcome, rec.detail = "bad_body", f"unexpected stream event {data[:80]!r}"
                return text
            if "error" in msg:
                errored = error_fields(rec, msg)
                if not errored:
                    rec.outcome, rec.detail = "bad_body", "error event without the error shape"
                    return text
                continue
            piece = event_text(msg)
            if piece and rec.ttft is None:
                rec.ttft = time.monotonic() - t_start
            text = piece if "meta_info" in msg else text + piece
            finish = finish_reason(msg) or finish
            events += 1
            if abandon_after is not None and events >= abandon_after:
                rec.outcome = "abandoned"  # leaving the block closes the connection
                return text
    rec.outcome = "incomplete"
    rec.detail = "stream ended without [DONE]"
    return text


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
    try:
        work = (
            stream_request(client, rec, url, body, abandon_after)
            if rec.stream
            else plain_request(client, rec, url, body)
        )
        text = await asyncio.wait_for(work, run.config.profile.request_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        rec.outcome = "timeout"
        rec.detail = f"no complete answer within {run.config.profile.request_timeout_s:g} s"
    except (httpx.HTTPError, OSError) as exc:
        rec.outcome = "transport"
        rec.detail = f"{type(exc).__name__}: {exc}"[:300]
    rec.e2e = time.monotonic() - t
    rec.t_end = run.now()
    return text


async def pause_after(rec: RequestRecord, rng: random.Random, low: float, high: float) -> None:
    """Think time between requests; back off a second after 429/503 as Retry-After asks."""
    backoff = 1.0 if rec.error_code in (429, 503) else 0.0
    await asyncio.sleep(backoff + rng.uniform(low, high))
