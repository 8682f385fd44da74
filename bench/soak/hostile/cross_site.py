"""What a web page can send (refused), and the server state compared before and after it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.soak.client import send
from bench.soak.config import IDLE_TIMEOUT_S
from bench.soak.end import scrape_metrics, wait_idle
from bench.soak.hostile.client import call, client_for, stopped, wait_or_stop
from bench.soak.hostile.config import FOREIGN_HOST, FOREIGN_ORIGIN, STATE_SETTLE_TRIES
from bench.soak.hostile.records import HostileRun, StateCheck
from bench.soak.monitor import info_models, server_info
from bench.soak.records import RequestRecord, RunState


@dataclass(frozen=True)
class CrossCase:
    """What a web page (or DNS rebinding) can make a browser send, and the refusal it must get."""

    name: str
    method: str
    path: str
    headers: dict[str, str]
    body: bytes | None
    status: int
    param: str | None


def cross_cases(run: RunState) -> list[CrossCase]:
    """Every shape, each carrying a request that would change state if served."""
    hs: HostileRun = run.hostile
    m = next(iter(run.facts))
    gen = json.dumps({"model": m, "prompt": "Hello", "max_tokens": 4}).encode()
    load = json.dumps({"source": hs.extra_source, "name": "evil"}).encode()
    warm = json.dumps({"model": m, "prompts": ["pinned by a web page"], "pin": True}).encode()
    jtype = {"content-type": "application/json"}
    evil_host = {"host": f"{FOREIGN_HOST}:{run.config.port}"}
    origin = {"origin": FOREIGN_ORIGIN}
    ctype = "content-type"
    return [
        CrossCase("completion without a type", "POST", "/v1/completions", {}, gen, 415, ctype),
        CrossCase(
            "completion as text/plain", "POST", "/v1/completions",
            {ctype: "text/plain"}, gen, 415, ctype,
        ),
        CrossCase(
            "generate as a form", "POST", "/generate",
            {ctype: "application/x-www-form-urlencoded"}, b"text=hi&model=" + m.encode(), 415,
            ctype,
        ),
        CrossCase(
            "flush as multipart", "POST", "/flush_cache",
            {ctype: "multipart/form-data; boundary=x"}, b"--x--\r\n", 415, ctype,
        ),
        CrossCase("load as text/plain", "POST", "/models", {ctype: "text/plain"}, load, 415, ctype),
        CrossCase(
            "invalidate without a type", "POST", f"/models/{m}/invalidate", {}, b"{}", 415, ctype
        ),
        CrossCase("pin as text/plain", "POST", "/cache/warmup", {ctype: "text/plain"}, warm, 415,
                  ctype),
        CrossCase("GET /flush_cache", "GET", "/flush_cache", {}, None, 405, None),
        CrossCase("GET /flush_cache, foreign Host", "GET", "/flush_cache", evil_host, None, 421,
                  "host"),
        CrossCase("completion, foreign Host", "POST", "/v1/completions", {**evil_host, **jtype},
                  gen, 421, "host"),
        CrossCase("server info, foreign Host", "GET", "/get_server_info", evil_host, None, 421,
                  "host"),
        CrossCase("flush, foreign Origin", "POST", "/flush_cache", origin, None, 403, "origin"),
        CrossCase("completion, foreign Origin", "POST", "/v1/completions", {**origin, **jtype},
                  gen, 403, "origin"),
        CrossCase("unload, foreign Origin", "DELETE", f"/models/{m}", origin, None, 403, "origin"),
        CrossCase("models list, foreign Origin", "GET", "/v1/models", origin, None, 403, "origin"),
        CrossCase("flush, Origin null", "POST", "/flush_cache", {"origin": "null"}, None, 403,
                  "origin"),
        CrossCase(
            "preflight, foreign Origin", "OPTIONS", "/v1/completions",
            {**origin, "access-control-request-method": "POST",
             "access-control-request-headers": "content-type"},
            None, 403, "origin",
        ),
    ]  # fmt: skip


async def send_cross(
    run: RunState, client: httpx.AsyncClient, case: CrossCase, task: str
) -> RequestRecord:
    rec = run.new_record(task, "cross_site", "-", case.path, False)
    rec.case = case.name
    rec.expected_status, rec.expected_param = case.status, case.param
    await call(run, client, rec, case.method, headers=case.headers, content=case.body)
    return rec


async def cross_site_task(run: RunState) -> None:
    """Every cross-site shape in turn, all through the load."""
    hs: HostileRun = run.hostile
    rng = random.Random(run.config.seed * 104729)
    cases = cross_cases(run)
    async with client_for(run) as c:
        i = 0
        while not stopped(run):
            await send_cross(run, c, cases[i % len(cases)], "cross_site")
            i += 1
            if await wait_or_stop(run, rng.uniform(*hs.profile.cross_site_every_s)):
                return


async def snapshot(run: RunState, client: httpx.AsyncClient) -> dict[str, Any]:
    """What a cross-site request could change: the cache, evictions, pins, requests
    served, the models, the disk tier and its files."""
    hs: HostileRun = run.hostile
    sched = await server_info(client, run.url)
    snap: dict[str, Any] = {}
    for name, m in info_models(sched).items():
        for key in ("state", "cached_tokens", "tokens_queried", "pinned_tokens", "evicted_tokens"):
            snap[f"{name}.{key}"] = m.get(key)
    for key in ("evicted_tokens", "pins", "tree_tokens"):
        snap[key] = sched.get(key)
    disk = sched.get("disk") or {}
    for key in ("store_chunks", "chunks_written", "chunks_dropped"):
        snap[f"disk.{key}"] = disk.get(key)
    try:
        listing = (await client.get(run.url + "/v1/models")).json()
        snap["served"] = sorted(card["id"] for card in listing["data"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        snap["served"] = None
    metrics = await scrape_metrics(run.url)
    snap["requests_total"] = sum(
        v for k, v in metrics.items() if k.startswith("radixmux_requests_total")
    )
    snap["store_files"] = store_listing(hs.store)
    return snap


def store_listing(root: Path) -> list[str]:
    """Every name under the store (relative, never following a link), with its type."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            with contextlib.suppress(FileNotFoundError):
                out.append(f"{path.relative_to(root)}:{stat.S_IFMT(path.lstat().st_mode):o}")
    return sorted(out)


async def populate(run: RunState, client: httpx.AsyncClient, tag: str) -> None:
    """Fill the cache of every model, and outgrow the arena so the disk tier saves files."""
    rng = random.Random(f"{run.config.seed}-{tag}")
    words = run.config.profile.disconnect_words
    for model in run.facts:
        for _ in range(run.hostile.profile.state_prompts):
            body = {"model": model, "max_tokens": 1, "temperature": 0}
            body["prompt"] = " ".join(rng.choice(run.words) for _ in range(words))
            rec = run.new_record("state", "state_fill", model, "/v1/completions", False)
            await send(run, client, rec, body)


async def state_check(run: RunState, when: str) -> None:
    """On the idle server: every cross-site shape once, and nothing may change."""
    hs: HostileRun = run.hostile
    async with client_for(run) as c:
        await populate(run, c, when)
        await wait_idle(run, IDLE_TIMEOUT_S, serving=False)
        # Disk saves finish on the I/O thread after the answers: wait until still.
        before, settled = await snapshot(run, c), False
        for _ in range(STATE_SETTLE_TRIES):
            await asyncio.sleep(1.0)
            again = await snapshot(run, c)
            settled, before = again == before, again
            if settled:
                break
        cases = cross_cases(run)
        for case in cases:
            await send_cross(run, c, case, f"state_{when}")
        await asyncio.sleep(1.0)
        await wait_idle(run, IDLE_TIMEOUT_S, serving=False)
        after = await snapshot(run, c)
    changed = {k: [before.get(k), after.get(k)] for k in before.keys() | after.keys()}
    changed = {k: v for k, v in changed.items() if v[0] != v[1]}
    hs.states.append(StateCheck(when, len(cases), settled, changed, after.get("served")))
    verdict = "unchanged" if not changed else f"CHANGED {sorted(changed)}"
    print(
        f"[soak] state check ({when}): {len(cases)} cross-site shapes, state {verdict}", flush=True
    )
