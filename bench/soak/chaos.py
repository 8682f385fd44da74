"""The killer: SIGKILL to one model's runner at a time, and when its model serves again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import httpx

from bench.soak.config import DOWN_FOR_GOOD_S, KILL_MARGIN_S, RESTART_TIMEOUT_S
from bench.soak.monitor import info_models, info_state, server_info
from bench.soak.records import KillRecord, RunState


async def runner_pids(
    run: RunState, client: httpx.AsyncClient, model: str
) -> tuple[list[int], str, str]:
    """A model's runner pids, its state, and where the pids came from.

    The contract is ``runner_pids`` in ``/get_server_info``; without it the
    launcher's children are scanned (so the chaos still runs against older
    servers, and the contract check reports the gap).
    """
    m = info_models(await server_info(client, run.url)).get(model, {})
    state = info_state(m) if m else "missing"
    pids = m.get("runner_pids")
    if isinstance(pids, list):
        return [int(p) for p in pids], state, "server_info"
    procs = run.server.processes()
    found = [pid for pid, role in procs.items() if role.startswith(f"runner {model}#")]
    return found, state, "proc"


async def watch_recovery(run: RunState, kill: KillRecord) -> None:
    """Record when the killed runner's model serves again from a new runner process."""
    deadline = kill.t_kill + RESTART_TIMEOUT_S
    down_since: float | None = None
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        while run.now() < deadline and run.server.proc.poll() is None:
            pids, state, _ = await runner_pids(run, client, kill.model)
            if state == "serving" and pids and kill.pid not in pids:
                kill.t_serving = run.now()
                return
            # "down" is the server giving up on the model; wait a little in case
            # it is only the moment between the death and the restart.
            down_since = (down_since or run.now()) if state == "down" else None
            if down_since is not None and run.now() - down_since > DOWN_FOR_GOOD_S:
                print(f"[soak] {run.now():6.0f}s {kill.model} stays down after the kill")
                return
            await asyncio.sleep(1.0)


async def kill_one(run: RunState, client: httpx.AsyncClient, model: str) -> None:
    """SIGKILL one serving runner of ``model`` and start watching it come back."""
    pids, state, source = await runner_pids(run, client, model)
    if state != "serving" or not pids:
        print(f"[soak] {run.now():6.0f}s skip kill of {model}: state {state}", flush=True)
        return
    pid = pids[0]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    kill = KillRecord(model, pid, source, run.now())
    run.kills.append(kill)
    print(f"[soak] {kill.t_kill:6.0f}s SIGKILL runner of {model} (pid {pid})", flush=True)
    run.watchers.append(asyncio.create_task(watch_recovery(run, kill)))


async def killer_task(run: RunState) -> None:
    """One kill every ``kill_every_s``, models in turn; none near the end of the load."""
    names = list(run.facts)
    k = 1
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        while True:
            at = k * run.config.kill_every_s
            if at > run.config.load_s - KILL_MARGIN_S:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run.stop.wait(), max(0.0, at - run.now()))
                return
            await kill_one(run, client, names[(k - 1) % len(names)])
            k += 1
