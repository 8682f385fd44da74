"""The hostile mode's phases around the soak's load.

Before, beside, after, the restart on the same store.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from bench.server_process import ServerFailed
from bench.soak.config import IDLE_TIMEOUT_S
from bench.soak.end import wait_idle
from bench.soak.hostile.bounds import bounds_task
from bench.soak.hostile.checks import stall_figures
from bench.soak.hostile.client import client_for
from bench.soak.hostile.config import EXTRA, STALL_PROMPT, profile, store_dir
from bench.soak.hostile.cross_site import cross_site_task, state_check
from bench.soak.hostile.model_cycle import change, model_cycle_task
from bench.soak.hostile.records import HostileRun
from bench.soak.hostile.stall import stall_once, stall_task
from bench.soak.hostile.streams import slow_reader_task
from bench.soak.hostile.traps import make_canary, plant_traps, trap_problems, trap_task
from bench.soak.monitor import server_info
from bench.soak.records import RunState
from bench.soak.server import SoakServer, model_sources


def extra_sources(root: Path) -> tuple[str, str]:
    """The extra model (tiny, one layer: 256 B of KV a token) and a model folder
    whose weights could never fit (their header only)."""
    from bench.tiny_models import make_tiny_model_dir
    from radixmux.model_runners.fetch import cache_root

    tiny = Path(model_sources(True)[0])
    base = cache_root() / "soak-tiny"
    extra = make_tiny_model_dir(base / "h-1layer-ctx4096", seed=43, layers=1, context=4096)
    huge = root / "huge-model"
    huge.mkdir()
    for p in tiny.iterdir():
        if p.suffix != ".safetensors":
            shutil.copy(p, huge / p.name)
    # 200,000 x 100,000 float32 weights (80 GB) declared; not one byte of them written.
    n = 200_000 * 100_000 * 4
    header = json.dumps(
        {"model.embed_tokens.weight": {"dtype": "F32", "shape": [200_000, 100_000],
                                       "data_offsets": [0, n]}}
    ).encode()  # fmt: skip
    header += b" " * (-len(header) % 8)
    (huge / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return str(extra), str(huge)


async def before_load(run: RunState) -> None:
    """Before the soak's load: canaries and the first traps; a first load and
    unload of the extra model; the stall probe on the idle server; the first
    state check; then the hostile clients alone for a window, probed."""
    root = Path(run.config.hostile_dir)
    extra, huge = extra_sources(root)
    hs = HostileRun(profile(run.config), store_dir(run.config), root / "canary", extra, huge)
    run.hostile = hs
    make_canary(hs)
    plant_traps(hs)
    async with client_for(run) as c:
        # The first run-time load grows the tokenizer processes once (module docstring).
        body = {"source": hs.extra_source, "name": EXTRA, "dtype": run.config.dtype}
        await change(run, c, "load", "POST", "/models", body, [])
        await change(run, c, "unload", "DELETE", f"/models/{EXTRA}", None, [])
        await idle_samples(run, c, "idle")
    await state_check(run, "before")
    await hostile_window(run)


async def idle_samples(run: RunState, client: httpx.AsyncClient, phase: str) -> None:
    """The stall probe on the idle server, every model in turn."""
    run.hostile.phase = phase
    await wait_idle(run, IDLE_TIMEOUT_S, serving=False)
    for i in range(run.hostile.profile.stall_idle_samples * len(run.facts)):
        await stall_once(run, client, list(run.facts)[i % len(run.facts)])


async def hostile_window(run: RunState) -> None:
    """The hostile clients alone (no model changes), the stall probe beside them:
    what they cost the others, measured without the soak's own load."""
    hs: HostileRun = run.hostile
    hs.phase = "hostile"
    print(f"[soak] hostile clients alone for {hs.profile.hostile_window_s:g} s", flush=True)
    makers = [m for name, m in hostile_tasks(run) if name != "model_cycle"]
    tasks = [asyncio.create_task(make()) for make in makers]
    await asyncio.wait(tasks, timeout=hs.profile.hostile_window_s)
    hs.stop.set()
    await asyncio.wait(tasks, timeout=run.config.profile.request_timeout_s + 30)
    for t in tasks:
        if not t.done():
            t.cancel()
        elif not t.cancelled() and t.exception() is not None:
            raise t.exception()  # a harness bug: say so loudly
    # Idle again after: the machine's other load moves the idle figure too.
    async with client_for(run) as c:
        await idle_samples(run, c, "idle_after")
    print(f"[soak] stall probe: {stall_figures(run)}", flush=True)


def hostile_tasks(run: RunState) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
    n = run.hostile.profile.slow_readers
    return [
        ("bounds", lambda: bounds_task(run)),
        ("cross_site", lambda: cross_site_task(run)),
        *((f"slow_reader-{i}", lambda i=i: slow_reader_task(run, i)) for i in range(n)),
        ("model_cycle", lambda: model_cycle_task(run)),
        ("traps", lambda: trap_task(run)),
        ("stall_probe", lambda: stall_task(run)),
    ]


def load_tasks(run: RunState) -> list[Callable[[], Awaitable[None]]]:
    """The hostile clients, run beside the soak's own load (and stopped with it)."""
    run.hostile.stop, run.hostile.phase = run.stop, "load"
    return [make for _, make in hostile_tasks(run)]


async def after_load(run: RunState) -> None:
    """The idle server after the soak's end phase: plant again, the last state check."""
    plant_traps(run.hostile)
    await state_check(run, "after")


async def restart_phase(run: RunState) -> None:
    """Start the server again on the same store (its start-up scan meets every
    trap), serve, flush, stop; then look at every trap and canary."""
    hs: HostileRun = run.hostile
    log = run.config.log.with_name(run.config.log.stem + "-restart.log")
    print(f"[soak] restarting the server on the same disk store (log {log})", flush=True)
    server = SoakServer(run.server.cmd, run.config.port, log)
    info: dict[str, Any] = {"log": str(log)}
    try:
        await server.wait_healthy_async(run.config.profile.start_timeout_s)
        info["ready"] = True
        async with httpx.AsyncClient(trust_env=False, timeout=120) as c:
            sched = await server_info(c, server.base_url)
            info["store_chunks_after_scan"] = (sched.get("disk") or {}).get("store_chunks")
            info["traps_after_scan"] = trap_problems(hs)
            for model in run.facts:
                body = {"model": model, "prompt": STALL_PROMPT, "max_tokens": 4}
                resp = await c.post(server.base_url + "/v1/completions", json=body)
                info[f"serve_{model}"] = resp.status_code
            info["get_flush"] = (await c.get(server.base_url + "/flush_cache")).status_code
            info["flush"] = (await c.post(server.base_url + "/flush_cache")).status_code
            sched = await server_info(c, server.base_url)
            info["store_chunks_after_flush"] = (sched.get("disk") or {}).get("store_chunks")
    except (ServerFailed, httpx.HTTPError) as exc:
        info["ready"] = info.get("ready", False)
        info["error"] = str(exc)[:500]
    finally:
        info["exit_code"] = server.stop()
    hs.restart = info
    hs.trap_problems = trap_problems(hs)
    print(f"[soak] restart: {info}", flush=True)


def cleanup(run: RunState, passed: bool) -> None:
    """Remove the run's directory (store, canaries) after a run that passed."""
    if not passed:
        print(f"[soak] kept {run.config.hostile_dir} (store, traps, canaries) for a look")
        return
    shutil.rmtree(run.config.hostile_dir, ignore_errors=True)
