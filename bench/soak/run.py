"""One soak run against a started server: load, end phase, checks, report."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence

import httpx

from bench.soak.chaos import killer_task
from bench.soak.checks import all_checks
from bench.soak.config import MODEL_NAMES, SoakConfig
from bench.soak.end import end_phase
from bench.soak.hostile import checks as hostile_checks
from bench.soak.hostile import phases as hostile_phases
from bench.soak.load import (
    abandon_task,
    bad_input_task,
    burst_task,
    cache_ops_task,
    disconnect_task,
    multi_turn_task,
    probe_all,
    probe_task,
    shared_prefix_task,
)
from bench.soak.monitor import health_task, progress_task, rss_task, sample_rss
from bench.soak.procfs import is_alive
from bench.soak.records import ModelFacts, RunState
from bench.soak.report import plot, print_summary, report
from bench.soak.server import SoakServer
from bench.workloads import resolve_tokenizer, vocabulary_words


async def model_facts(url: str, names: Sequence[str]) -> dict[str, ModelFacts]:
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        out = {}
        for name in names:
            info = (await client.get(url + "/get_model_info", params={"model": name})).json()
            out[name] = ModelFacts(
                name,
                int(info["vocab_size"]),
                int(info["context_length"]),
                bool(info["has_chat_template"]),
            )
        return out


def load_tasks(run: RunState) -> list[Callable[[], Awaitable[None]]]:
    """The client tasks of the mixed load (each a closed loop until the stop event)."""
    return [
        lambda: shared_prefix_task(run, 0),
        lambda: shared_prefix_task(run, 1),
        lambda: multi_turn_task(run, 0),
        lambda: multi_turn_task(run, 1),
        lambda: abandon_task(run, 0),
        lambda: burst_task(run),
        lambda: disconnect_task(run, 0),
        lambda: bad_input_task(run, 0),
        lambda: cache_ops_task(run),
        lambda: probe_task(run),
        lambda: killer_task(run),
        lambda: health_task(run),
        lambda: rss_task(run),
        lambda: progress_task(run),
        *(hostile_phases.load_tasks(run) if run.config.hostile else []),
    ]


async def drive(run: RunState) -> None:
    """Run the load for ``--minutes``, then let every client finish its request."""
    tasks = [asyncio.create_task(make()) for make in load_tasks(run)]
    # Returns early only if a task raised: a harness bug, reported below.
    await asyncio.wait(tasks, timeout=run.config.load_s, return_when=asyncio.FIRST_EXCEPTION)
    run.stop.set()
    print(f"[soak] {run.now():.0f}s load stopped; waiting for clients to finish", flush=True)
    _, late = await asyncio.wait(tasks, timeout=run.config.profile.request_timeout_s + 30)
    for t in late:  # cannot happen (every request is bounded); never hang the harness
        t.cancel()
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # a harness bug: say so loudly


def shift_origin(run: RunState) -> None:
    """Make now the load's time 0: what happened before (probes, samples) gets negative times."""
    delta = time.monotonic() - run.t0
    run.t0 += delta
    for rec in run.records:
        rec.t_start, rec.t_end, rec.minute = rec.t_start - delta, rec.t_end - delta, -1
    for probe in run.probes:
        probe.t -= delta
    for series in run.rss.values():
        series.t = [round(t - delta, 2) for t in series.t]


async def soak(config: SoakConfig, server: SoakServer, sources: Sequence[str]) -> int:
    """Run against a started server; returns the exit code (0: every check passed)."""
    await server.wait_healthy_async(config.profile.start_timeout_s)
    facts = await model_facts(server.base_url, MODEL_NAMES)
    words = vocabulary_words(str(resolve_tokenizer(sources[0])))
    run = RunState(config, server, facts, words, time.monotonic(), asyncio.Event())
    print(f"[soak] server ready: {server.base_url}; load for {config.minutes:g} min", flush=True)
    sample_rss(run)
    await probe_all(run, "before")
    if config.hostile:
        await hostile_phases.before_load(run)
    shift_origin(run)
    await drive(run)
    end = await end_phase(run)
    if config.hostile:
        await hostile_phases.after_load(run)
    procs = list(server.processes())
    end.exit_code = server.stop()
    end.leftover = [p for p in procs if p != server.pid and is_alive(p)]
    if config.hostile:
        await hostile_phases.restart_phase(run)
    checks, rss_detail = all_checks(run, end)
    checks += hostile_checks.checks(run) if config.hostile else []
    data = report(run, end, checks, rss_detail)
    if config.hostile:
        data["hostile"] = hostile_checks.report(run)
    print_summary(data, checks)  # first: a half-hour's verdict must not hang on a file write
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(data, indent=1) + "\n")
    plot(data, config.png)
    print(f"[soak] wrote {config.out} and {config.png}; server log {config.log}")
    if config.hostile:
        hostile_phases.cleanup(run, data["passed"])
    return 0 if data["passed"] else 1
