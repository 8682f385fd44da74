"""Model loads, reloads and unloads under streams that are never read."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx

from bench.soak.hostile.client import call, client_for, stopped, wait_or_stop
from bench.soak.hostile.config import DRAIN_COLLECT_S, EXTRA
from bench.soak.hostile.records import ChangeRecord, HostileRun
from bench.soak.hostile.streams import (
    RawStream,
    finish_stream,
    judge_events,
    open_stream,
    stream_body,
)
from bench.soak.records import Outage, RequestRecord, RunState


async def hold_streams(run: RunState, rng: random.Random) -> list[tuple[RequestRecord, RawStream]]:
    """Streams on the extra model whose clients read the headers and then nothing."""
    hs: HostileRun = run.hostile
    held = []
    for i in range(hs.profile.drain_readers):
        endpoint = "/generate" if i % 2 == 0 else "/v1/completions"
        rec = run.new_record("model_change", "drain_reader", EXTRA, endpoint, True)
        rec.case = "never reads"
        prompt = " ".join(rng.choice(run.words) for _ in range(16))
        body = stream_body(endpoint, EXTRA, prompt, hs.profile.drain_max_tokens)
        stream = await open_stream(run, rec, body)
        if stream is None:
            rec.t_end = run.now()
        else:
            held.append((rec, stream))
    await asyncio.sleep(3.0)  # let them fill their buffers
    return held


async def collect(run: RunState, held: list[tuple[RequestRecord, RawStream]]) -> list[str]:
    """After a change: every held stream must end (its 503 event, or cut) soon."""
    outcomes = []
    for rec, stream in held:
        try:
            how = await stream.read(65536, 0.0, time.monotonic() + DRAIN_COLLECT_S)
            if how == "timeout":
                rec.outcome = "timeout"
                rec.detail = f"held open {DRAIN_COLLECT_S:g} s after its model changed"
            elif how == "eof" and not stream.body.done:
                judge_events(rec, bytes(stream.body.data), False)
                rec.outcome = "drain_cut"
                rec.detail = "cut at the drain's end: the client never read"
            else:
                finish_stream(run, rec, stream, how)
        except (OSError, ValueError) as exc:
            rec.outcome, rec.detail = "transport", f"{type(exc).__name__}: {exc}"[:300]
        finally:
            stream.close()
        rec.e2e = run.now() - rec.t_start
        rec.t_end = run.now()
        outcomes.append(rec.outcome if rec.outcome != "stream_error" else f"{rec.error_code} event")
    return outcomes


async def change(
    run: RunState,
    client: httpx.AsyncClient,
    op: str,
    method: str,
    path: str,
    body: Any,
    held: list[tuple[RequestRecord, RawStream]],
) -> ChangeRecord:
    """One model change, timed; the held streams' ends are collected after it."""
    rec = run.new_record("model_change", "model_change", EXTRA, path, False)
    rec.case = op
    t0 = run.now()
    answer = await call(run, client, rec, method, json_body=body)
    if held:  # its old instance's requests may fail with the drain's 503 until now
        run.drains.append(Outage(EXTRA, t0, run.now()))
    aborted = answer.get("aborted") if isinstance(answer, dict) else None
    record = ChangeRecord(op, t0, rec.e2e, rec.status, aborted, await collect(run, held))
    run.hostile.changes.append(record)
    print(
        f"[soak] {run.now():6.0f}s {op} {EXTRA}: {rec.status} in {rec.e2e:.1f} s, "
        f"aborted {aborted}, held streams: {record.readers}",
        flush=True,
    )
    return record


async def model_cycle(run: RunState, client: httpx.AsyncClient, rng: random.Random) -> None:
    """Load the extra model, reload it and unload it, each under held streams."""
    hs: HostileRun = run.hostile
    body = {"source": hs.extra_source, "name": EXTRA, "dtype": run.config.dtype}
    loaded = await change(run, client, "load", "POST", "/models", body, [])
    if loaded.status != 200:
        return  # a 507 (memory) is the documented refusal; the check says so
    if not stopped(run):  # after the load: only the unload, to leave nothing behind
        held = await hold_streams(run, rng)
        await change(run, client, "reload", "POST", f"/models/{EXTRA}/reload", {}, held)
    held = await hold_streams(run, rng)
    unloaded = await change(run, client, "unload", "DELETE", f"/models/{EXTRA}", None, held)
    if unloaded.status not in (200, 404):  # the check reports it; the next cycle needs it gone
        await change(run, client, "unload", "DELETE", f"/models/{EXTRA}", None, [])


async def model_cycle_task(run: RunState) -> None:
    """Change cycles of the extra model; the last one finishes after the load stops."""
    hs: HostileRun = run.hostile
    rng = random.Random(run.config.seed * 3571)
    if await wait_or_stop(run, hs.profile.cycle_first_s):
        return
    async with client_for(run) as client:
        while True:
            started = time.monotonic()
            await model_cycle(run, client, rng)
            if await wait_or_stop(run, hs.profile.cycle_every_s - (time.monotonic() - started)):
                return
