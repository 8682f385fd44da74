"""The stall probe: a small greedy request every few seconds beside the hostile clients."""

from __future__ import annotations

import httpx

from bench.soak.client import send
from bench.soak.hostile.client import client_for, wait_or_stop
from bench.soak.hostile.config import STALL_PROMPT, STALL_TOKENS
from bench.soak.hostile.records import HostileRun
from bench.soak.records import RequestRecord, RunState


async def stall_once(run: RunState, client: httpx.AsyncClient, model: str) -> RequestRecord:
    body = {
        "model": model,
        "prompt": STALL_PROMPT,
        "max_tokens": STALL_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    rec = run.new_record("stall_probe", "stall_probe", model, "/v1/completions", False)
    rec.case = run.hostile.phase
    await send(run, client, rec, body)
    return rec


async def stall_task(run: RunState) -> None:
    """The small probe, models in turn, all through the load."""
    hs: HostileRun = run.hostile
    names = list(run.facts)
    async with client_for(run) as c:
        i = 0
        while not await wait_or_stop(run, hs.profile.stall_every_s):
            await stall_once(run, c, names[i % len(names)])
            i += 1
