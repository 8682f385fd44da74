"""The end phase.

Wait for an idle server, hang up during tokenization, flush, read the final state.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.soak.client import parse_json
from bench.soak.config import (
    IDLE_GRACE_S,
    IDLE_TIMEOUT_S,
    QUIET_DISCONNECTS,
    QUIET_IDLE_S,
    QUIET_SETTLE_S,
)
from bench.soak.load import disconnect_body, disconnect_once, probe_all
from bench.soak.monitor import info_models, info_state, sample_rss, server_info
from bench.soak.records import CheckResult, RunState


@dataclass
class IdleResult:
    """How waiting for an idle server went."""

    idle: bool
    waited_s: float
    models: dict[str, dict[str, Any]]


async def wait_idle(run: RunState, timeout: float, serving: bool = True) -> IdleResult:
    """Wait until no model runs or queues anything (and, with ``serving``, none is
    restarting)."""
    t = time.monotonic()
    models: dict[str, dict[str, Any]] = {}
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        while True:
            models = info_models(await server_info(client, run.url))
            busy = [
                n
                for n, m in models.items()
                if m.get("running")
                or m.get("waiting")
                or (serving and info_state(m) in ("restarting", "starting"))
            ]
            if models and not busy:
                return IdleResult(True, time.monotonic() - t, models)
            if time.monotonic() - t > timeout or run.server.proc.poll() is not None:
                return IdleResult(False, time.monotonic() - t, models)
            await asyncio.sleep(1.0)


def busy_summary(models: dict[str, dict[str, Any]]) -> str:
    return ", ".join(
        f"{n}: {m.get('running')} running, {m.get('waiting')} waiting, {info_state(m)}"
        for n, m in models.items()
    )


async def quiet_disconnects(run: RunState) -> CheckResult:
    """On an idle server: clients hanging up during tokenization must leave nothing running."""
    rng = random.Random(run.config.seed + 77)
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        models = info_models(await server_info(client, run.url))
    serving = [n for n, m in models.items() if info_state(m) == "serving"]
    if not serving:  # a model that is down answers 503 at once: nothing would be tested
        return CheckResult("abort_during_tokenization", False, "not run: no model serving")
    for i in range(QUIET_DISCONNECTS):
        model = serving[i % len(serving)]
        rec = run.new_record("end", "disconnect", model, "/v1/completions", False)
        await disconnect_once(run, rec, disconnect_body(run, rng, model), 0.0)
    await asyncio.sleep(QUIET_SETTLE_S)
    idle = await wait_idle(run, QUIET_IDLE_S, serving=False)
    detail = (
        f"{QUIET_DISCONNECTS} clients of {serving} hung up during tokenization; server idle "
        f"{idle.waited_s + QUIET_SETTLE_S:.0f} s later"
        if idle.idle
        else f"still busy {QUIET_IDLE_S + QUIET_SETTLE_S:.0f} s after {QUIET_DISCONNECTS} "
        f"clients hung up during tokenization ({busy_summary(idle.models)}): "
        "their requests run for nobody"
    )
    return CheckResult("abort_during_tokenization", idle.idle, detail)


async def flush_and_read(run: RunState) -> tuple[int, dict[str, Any]]:
    """Flush the whole cache on the idle server; the scheduler's state right after."""
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        try:
            status = (await client.post(run.url + "/flush_cache")).status_code
        except httpx.HTTPError:
            status = 0
        return status, await server_info(client, run.url)


async def scrape_metrics(url: str) -> dict[str, float]:
    """``/metrics`` radixmux samples (no histogram buckets) as {"name{labels}": value}."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            text = (await client.get(url + "/metrics")).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.startswith("radixmux_") and not s.name.endswith("_bucket"):
                    labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                    out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out
    except (httpx.HTTPError, ValueError):
        return {}


@dataclass
class EndState:
    """What the end phase observed, for the checks."""

    idle_after_load: IdleResult
    idle_final: IdleResult
    quiet: CheckResult
    health_status: int
    health_body: Any
    sched: dict[str, Any]  # /get_server_info's scheduler section, idle
    flush_status: int
    flushed: dict[str, Any]  # the same right after /flush_cache
    metrics: dict[str, float]
    exit_code: int | None = None
    leftover: list[int] = field(default_factory=list)  # server pids alive after stop


async def end_phase(run: RunState) -> EndState:
    """Load stopped: wait for idle, probe, read the scheduler, flush, sample memory."""
    first = await wait_idle(run, IDLE_GRACE_S, serving=False)
    if not first.idle:
        print(f"[soak] not idle {IDLE_GRACE_S:.0f} s after the load: {busy_summary(first.models)}")
    pending = [w for w in run.watchers if not w.done()]
    if pending:  # a runner still coming back: its watcher decides within its deadline
        await asyncio.wait(pending)
    final = await wait_idle(run, IDLE_TIMEOUT_S)  # and every model back in service
    quiet = (
        await quiet_disconnects(run)
        if final.idle
        else CheckResult("abort_during_tokenization", False, "not run: the server never got idle")
    )
    await probe_all(run, "after")
    final = await wait_idle(run, IDLE_TIMEOUT_S)
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        try:
            resp = await client.get(run.url + "/health")
            health_status, health_body = resp.status_code, parse_json(resp.text)
        except httpx.HTTPError:
            health_status, health_body = 0, None
        sched = await server_info(client, run.url)
    flush_status, flushed = await flush_and_read(run)
    sample_rss(run)  # the end point of the memory check
    metrics = await scrape_metrics(run.url)
    return EndState(
        first, final, quiet, health_status, health_body, sched, flush_status, flushed, metrics
    )
