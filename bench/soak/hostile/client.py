"""One hostile request: send, time and record it; waits that end with the load."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx

from bench.soak.client import close_record, failures_recorded, parse_json, read_error
from bench.soak.records import RequestRecord, RunState


def stopped(run: RunState) -> bool:
    return run.hostile.stop.is_set()


async def wait_or_stop(run: RunState, seconds: float) -> bool:
    """Sleep ``seconds``; True when the hostile clients were stopped meanwhile (or before)."""
    stop = run.hostile.stop
    if stop.is_set():
        return True
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), max(0.0, seconds))
        return True
    return False


async def call(
    run: RunState,
    client: httpx.AsyncClient,
    rec: RequestRecord,
    method: str,
    *,
    headers: dict[str, str] | None = None,
    content: bytes | None = None,
    json_body: Any = None,
) -> Any:
    """Any request (method, headers, body as given), filling ``rec`` as ``send``
    does; returns the JSON body of a 200 (None otherwise). Never raises."""
    t = time.monotonic()
    body = None
    with failures_recorded(rec, run.config.profile.request_timeout_s, "answer"):
        kwargs: dict[str, Any] = {"headers": headers or {}}
        if json_body is not None:
            kwargs["json"] = json_body
        elif content is not None:
            kwargs["content"] = content
        resp = await asyncio.wait_for(
            client.request(method, run.url + rec.endpoint, **kwargs),
            run.config.profile.request_timeout_s,
        )
        rec.status = resp.status_code
        rec.rid = resp.headers.get("x-request-id", "")
        if resp.status_code == 200:
            body = parse_json(resp.text)
            rec.outcome = "ok" if body is not None else "bad_body"
        else:
            await read_error(rec, resp)
    close_record(run, rec, t)
    return body


def client_for(run: RunState) -> httpx.AsyncClient:
    """An HTTP client whose every request is bounded by the run's request timeout."""
    return httpx.AsyncClient(trust_env=False, timeout=run.config.profile.request_timeout_s)


def code_of(rec: RequestRecord) -> int | None:
    """The status a record ended with: HTTP, or an in-stream error's code."""
    return rec.status if rec.outcome == "error" else rec.error_code
