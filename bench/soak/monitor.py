"""Watching the server during the load.

Model states from /health, resident memory, progress lines.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx

from bench.soak.client import parse_json
from bench.soak.config import HEALTH_EVERY_S, PROGRESS_EVERY_S, RSS_EVERY_S
from bench.soak.procfs import read_rss
from bench.soak.records import HealthSample, ProcessSeries, RequestRecord, RunState


def model_states(status: int, body: Any, names: Sequence[str]) -> dict[str, str]:
    """Per-model state from a ``/health`` answer.

    The contract's ``models`` map when present; otherwise (older
    servers) 200 means all serving and 503 names the ``down`` models.
    """
    body = body if isinstance(body, dict) else {}
    models = body.get("models")
    if isinstance(models, dict):
        return {n: str(models.get(n, "missing")) for n in names}
    if body.get("status") == "starting":
        return dict.fromkeys(names, "starting")
    down = body.get("down") if isinstance(body.get("down"), dict) else {}
    if status == 200:
        return dict.fromkeys(names, "serving")
    return {n: "down" if n in down or not down else "serving" for n in names}


async def server_info(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """``/get_server_info``'s scheduler section ({} when it cannot be read)."""
    try:
        resp = await client.get(url + "/get_server_info", timeout=30)
        sched = resp.json().get("scheduler") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return {}
    return sched if isinstance(sched, dict) else {}


def info_state(m: dict[str, Any]) -> str:
    """A model's state in ``/get_server_info`` (``up`` on older servers)."""
    if "state" in m:
        return str(m["state"])
    return "serving" if m.get("up") else "down"


def info_models(sched: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m.get("name"): m for m in sched.get("models") or [] if isinstance(m, dict)}


async def health_task(run: RunState) -> None:
    """Poll ``/health`` (and the launcher) for the model-state timeline."""
    names = list(run.facts)
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        while not run.stop.is_set():
            code = run.server.proc.poll()
            if code is not None:  # nothing left to learn: end the load now
                run.server_exit = (run.now(), code)
                print(f"[soak] {run.now():6.0f}s the launcher exited with code {code}", flush=True)
                run.stop.set()
                return
            try:
                resp = await client.get(run.url + "/health")
                states = model_states(resp.status_code, parse_json(resp.text), names)
                run.health.append(HealthSample(run.now(), resp.status_code, states))
            except httpx.HTTPError:
                run.health.append(HealthSample(run.now(), 0, dict.fromkeys(names, "unreachable")))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run.stop.wait(), HEALTH_EVERY_S)


def sample_rss(run: RunState) -> None:
    """One RSS sample of every live server process."""
    t = run.now()
    for pid, role in run.server.processes().items():
        rss = read_rss(pid)
        if rss is None:
            continue
        series = run.rss.setdefault(pid, ProcessSeries(pid, role))
        series.t.append(round(t, 2))
        series.rss_kib.append(rss[0])
        series.anon_kib.append(rss[1])


async def rss_task(run: RunState) -> None:
    while not run.stop.is_set():
        sample_rss(run)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(run.stop.wait(), RSS_EVERY_S)


def status_class(rec: RequestRecord) -> str:
    """The label a request is counted under in "requests by status"."""
    if rec.outcome == "ok":
        return "200"
    if rec.outcome in ("error", "stream_error"):
        code = rec.error_code if rec.outcome == "stream_error" else rec.status
        return f"{code}" + (" (in stream)" if rec.outcome == "stream_error" else "")
    return rec.outcome


def by_status(records: Sequence[RequestRecord]) -> dict[str, int]:
    return dict(sorted(Counter(status_class(r) for r in records if r.outcome).items()))


async def progress_task(run: RunState) -> None:
    """A line every ~10 s: time, requests by status, kills, restarts, model states."""
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run.stop.wait(), PROGRESS_EVERY_S)
                return
            models = info_models(await server_info(client, run.url))
            run.restarts = {n: int(m.get("restarts", 0)) for n, m in models.items()}
            states = " ".join(f"{n}={info_state(m)}" for n, m in models.items())
            counts = " ".join(f"{k}:{v}" for k, v in by_status(run.records).items())
            t = run.now()
            print(
                f"[soak] {int(t // 60)}:{int(t % 60):02d} / {run.config.minutes:g} min | "
                f"{counts} | kills {len(run.kills)} restarts {sum(run.restarts.values())} | "
                f"{states}",
                flush=True,
            )
