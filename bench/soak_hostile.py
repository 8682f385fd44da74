"""The soak's hostile-client mode (``python -m bench.soak --hostile``).

Beside the soak's mixed load and runner kills, clients that mean harm:

- ``bound_past`` / ``bound_at``: every bounded list and string of every API
  (stop strings, stop token ids, logit bias, chat messages and content parts,
  prompt batches, ``n`` with a full stop list, metadata, user and other tags,
  model names) just past its bound, which must be a 400 naming the field, and
  at it, which must be served (``admission``: more replicas than cores, 400,
  and a model whose weights cannot fit, 507);
- ``slow_reader``: streams on raw sockets with a small receive buffer, read a
  trickle at a time, never after the headers, or slowly to the end (streamed
  ``/generate`` with ``return_logprob`` and 20 alternatives per token, whose
  logprobs must come as deltas that add up to the answer);
- ``model_change``: an extra tiny model ``h`` loaded with ``POST /models``,
  reloaded and unloaded while ``drain_reader`` clients that never read hold
  long streams on it: each change must end within the drain timeout plus
  slack, and every held stream must end (a 503 event, or cut when its writer
  is stuck on the full socket);
- ``cross_site``: what a web page can send: bodies without a JSON
  Content-Type (415), ``GET /flush_cache`` (405), a foreign ``Host`` (421), a
  foreign ``Origin`` (403) and its CORS preflight; each refused, and, measured
  on the idle server before and after the load, changing no state (cached
  tokens, evictions, pins, requests, models, disk files);
- disk-store traps: the run turns on the disk tier with its store in a
  temporary directory, and plants foreign files, directories, a FIFO and
  symbolic links to canaries outside the store into the store, its ``v1``
  directory and every namespace directory as it appears; flushes, disk
  evictions and, after the load, a restart of the server on the same store
  (its start-up scan) and one more flush follow, and every planted thing and
  canary must be there and unchanged;
- ``stall_probe``: a small greedy request every few seconds. Before the
  load, the hostile clients (all but the model changes) run alone for a
  window, and the probe's median beside them must stay within 3x of the idle
  server's (measured before and after the window); under the whole load it is
  reported too, not judged: the soak's own dozen clients on two cores cost
  the probe more than that by themselves.

Before the load the extra model is loaded and unloaded once: a model's first
load at run time grows the tokenizer worker and the detokenizer once (by its
tokenizer, ~45 MB, kept by the allocator after the unload and reused by every
later load), which the soak's memory check must not read as a leak.

Each class adds a PASS/FAIL row to the soak's checks; the soak's own checks
(answers, probe, idle, invariants, locks, arena, memory, restarts) judge the
hostile run too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import socket
import stat
import statistics
import struct
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import soak
from radixmux.runtime.front.api.common import (
    MAX_CHAT_MESSAGES,
    MAX_CONTENT_PARTS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_METADATA_PAIRS,
    MAX_N,
    MAX_NAME_CHARS,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

EXTRA = "h"  # the model loaded, reloaded and unloaded at run time
RCVBUF = 4096  # a slow reader's receive buffer (the kernel doubles it)
TOP = 20  # alternatives per token in logprob streams (the most the APIs allow)
STALL_LIMIT = 3.0  # the stall probe's median beside the hostile clients, in idle medians
STALL_PROMPT = "Hello there"
STALL_TOKENS = 8
DRAIN_SLACK_S = 60.0  # a change may take this long past its drain timeout (loads included)
DRAIN_COLLECT_S = 60.0  # a held stream must end this soon after its model's change
HEAD_TIMEOUT_S = 120.0  # the first output of a slow reader's stream
TRICKLE_BYTES, TRICKLE_EVERY_S = 256, 0.5
SLOW_BYTES, SLOW_EVERY_S = 16 << 10, 0.1  # "slow to the end": 160 KB/s
SLOW_MODES = ("slow", "never", "trickle")  # to the end, never after the headers, a trickle
STATE_SETTLE_TRIES = 20
FOREIGN_HOST = "rebind.example"
FOREIGN_ORIGIN = "http://evil.example"
HOSTILE_KINDS = (
    "bound_past",
    "bound_at",
    "admission",
    "cross_site",
    "slow_reader",
    "drain_reader",
    "model_change",
    "stall_probe",
)
_HEX = "0123456789abcdef"


# ---- configuration --------------------------------------------------------------------
@dataclass(frozen=True)
class HostileProfile:
    """Pacing and sizes of the hostile clients (tiny random models or the real ones)."""

    bounds_every_s: tuple[float, float]
    cross_site_every_s: tuple[float, float]
    slow_readers: int  # concurrent slow-reader clients
    slow_pause_s: tuple[float, float]
    slow_max_tokens: int  # a slow reader's output: long
    slow_hold_s: float  # how long a reader that stopped reading keeps its socket
    cycle_first_s: float  # the first model change cycle starts this far into the load
    cycle_every_s: float
    drain_timeout_s: float  # the server's --drain-timeout
    drain_readers: int  # streams held on the extra model across each change
    drain_max_tokens: int
    trap_every_s: float
    hostile_window_s: float  # before the load: the hostile clients alone, probed
    stall_every_s: float
    stall_idle_samples: int  # per model, on the idle server before the load
    disk_bytes: int  # the disk tier: small, so its LRU deletes files all the time
    state_prompts: int  # long prompts per model before a state check (evictions: disk files)


# Tiny: the drain timeout is short so a short run holds a whole cycle; a held
# stream's 1,000 tokens are over 6 MB of /generate chunks (cumulative text and
# ids, 20 alternatives a token): past any socket buffer (4 MB here), so its
# writer blocks however fast the model is, and 256 KB of KV (the extra model
# has one layer), a quarter of the arena.
TINY_HOSTILE = HostileProfile(
    bounds_every_s=(0.3, 1.0),
    cross_site_every_s=(0.5, 1.5),
    slow_readers=2,
    slow_pause_s=(1.0, 3.0),
    slow_max_tokens=600,
    slow_hold_s=15.0,
    cycle_first_s=5.0,
    cycle_every_s=30.0,
    drain_timeout_s=10.0,
    drain_readers=2,
    drain_max_tokens=1000,
    trap_every_s=5.0,
    hostile_window_s=30.0,
    stall_every_s=3.0,
    stall_idle_samples=5,
    disk_bytes=4 << 20,
    state_prompts=3,
)
# Real: the drain timeout is the server's default; the extra model is tiny, so
# its held streams outgrow the socket buffers within seconds and their writers block.
REAL_HOSTILE = HostileProfile(
    bounds_every_s=(2.0, 5.0),
    cross_site_every_s=(2.0, 5.0),
    slow_readers=2,
    slow_pause_s=(5.0, 15.0),
    slow_max_tokens=300,
    slow_hold_s=45.0,
    cycle_first_s=60.0,
    cycle_every_s=240.0,
    drain_timeout_s=30.0,
    drain_readers=3,
    drain_max_tokens=2000,
    trap_every_s=30.0,
    hostile_window_s=120.0,
    stall_every_s=10.0,
    stall_idle_samples=5,
    disk_bytes=256 << 20,
    state_prompts=3,
)


def profile(config: soak.SoakConfig) -> HostileProfile:
    return TINY_HOSTILE if config.tiny else REAL_HOSTILE


def prepare(config: soak.SoakConfig) -> soak.SoakConfig:
    """``config`` with a fresh temporary directory for the store and the canaries."""
    path = tempfile.mkdtemp(prefix="radixmux-soak-hostile-")
    return dataclasses.replace(config, hostile_dir=path)


def store_dir(config: soak.SoakConfig) -> Path:
    return Path(config.hostile_dir) / "kv-store"


def server_flags(config: soak.SoakConfig) -> list[str]:
    """The disk tier in the run's directory and the drain timeout the checks use."""
    p = profile(config)
    return [
        "--kv-disk-bytes",
        str(p.disk_bytes),
        "--kv-disk-dir",
        str(store_dir(config)),
        "--drain-timeout",
        f"{p.drain_timeout_s:g}",
    ]


# ---- state of the hostile part of a run -------------------------------------------------
@dataclass
class Trap:
    """Something planted in the store that the server must leave as it is."""

    path: str
    kind: str  # file, dir, symlink, fifo
    content: str = ""  # a file's text, a link's target


@dataclass
class ChangeRecord:
    """One model change (load, reload, unload) made under held streams."""

    op: str
    t: float
    seconds: float
    status: int
    aborted: int | None  # the drain's failed requests, from the answer
    readers: list[str] = field(default_factory=list)  # how each held stream ended


@dataclass
class StateCheck:
    """Server state on the idle server before and after every cross-site shape."""

    when: str
    shapes: int
    settled: bool
    changed: dict[str, Any]  # key -> [before, after] for what differs
    served: list[str] | None  # the models listed afterwards


@dataclass
class StreamFacts:
    """What one streamed ``/generate`` with logprobs sent: tokens, logprob entries, bytes."""

    rid: str
    tokens: int
    logprob_entries: int
    widest_top: int
    bytes: int


@dataclass
class HostileRun:
    """Everything the hostile tasks share (``RunState.hostile``)."""

    profile: HostileProfile
    store: Path
    canary: Path
    extra_source: str
    huge_source: str
    # What ends the hostile clients: their own window's event before the load, then the load's.
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    # The stall probe's label: idle, hostile (the hostile-only window), idle_after, load.
    phase: str = "idle"
    traps: list[Trap] = field(default_factory=list)
    trapped: set[str] = field(default_factory=set)  # directories already planted in
    canary_digest: dict[str, str] = field(default_factory=dict)
    changes: list[ChangeRecord] = field(default_factory=list)
    states: list[StateCheck] = field(default_factory=list)
    streams: list[StreamFacts] = field(default_factory=list)
    restart: dict[str, Any] = field(default_factory=dict)
    trap_problems: list[str] = field(default_factory=list)


# ---- small helpers ---------------------------------------------------------------------
def stopped(run: soak.RunState) -> bool:
    return run.hostile.stop.is_set()


async def wait_or_stop(run: soak.RunState, seconds: float) -> bool:
    """Sleep ``seconds``; True when the hostile clients were stopped meanwhile (or before)."""
    stop = run.hostile.stop
    if stop.is_set():
        return True
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), max(0.0, seconds))
        return True
    return False


def _finish(run: soak.RunState, rec: soak.RequestRecord, t: float) -> None:
    rec.e2e = time.monotonic() - t
    rec.t_end = run.now()


async def call(
    run: soak.RunState,
    client: httpx.AsyncClient,
    rec: soak.RequestRecord,
    method: str,
    *,
    headers: dict[str, str] | None = None,
    content: bytes | None = None,
    json_body: Any = None,
) -> Any:
    """Any request (method, headers, body as given), filling ``rec`` as ``soak.send``
    does; returns the JSON body of a 200 (None otherwise). Never raises."""
    t = time.monotonic()
    body = None
    try:
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
            body = soak._json(resp.text)
            rec.outcome = "ok" if body is not None else "bad_body"
        else:
            await soak._read_error(rec, resp)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        rec.outcome = "timeout"
        rec.detail = f"no answer within {run.config.profile.request_timeout_s:g} s"
    except (httpx.HTTPError, OSError) as exc:
        rec.outcome = "transport"
        rec.detail = f"{type(exc).__name__}: {exc}"[:300]
    _finish(run, rec, t)
    return body


def client_for(run: soak.RunState) -> httpx.AsyncClient:
    """An HTTP client whose every request is bounded by the run's request timeout."""
    return httpx.AsyncClient(trust_env=False, timeout=run.config.profile.request_timeout_s)


def code_of(rec: soak.RequestRecord) -> int | None:
    """The status a record ended with: HTTP, or an in-stream error's code."""
    return rec.status if rec.outcome == "error" else rec.error_code


# ---- huge lists: every bound, past and at ---------------------------------------------------
@dataclass(frozen=True)
class BoundCase:
    """A request at or past a bound, and the one answer that is right for it
    (status None: served, 200)."""

    name: str
    path: str
    body: dict[str, Any]
    past: bool
    status: int | None = None
    param: str | None = None


def _stops(n: int, each: int) -> list[str]:
    """``n`` distinct stop strings of ``each`` characters that text rarely holds."""
    return [f"{i:04d}" + "q" * (each - 4) for i in range(n)]


def _bias(n: int) -> dict[str, float]:
    return {str(1000 + i): -1.0 for i in range(n)}


def bound_cases(facts: dict[str, soak.ModelFacts]) -> list[BoundCase]:
    """Every bound of every API, just past it (a 400 naming the field) and at it (served)."""
    m = next(iter(facts.values())).name
    chat_model = next((f.name for f in facts.values() if f.has_chat_template), None)
    each = MAX_STOP_CHARS // MAX_STOP_STRINGS
    long_name = "n" * (MAX_NAME_CHARS + 1)
    user = {"role": "user", "content": "x"}

    def cmpl(**kw: Any) -> dict[str, Any]:
        return {"model": m, "prompt": "Hello there", "max_tokens": 4, "temperature": 0, **kw}

    def gen(**sampling: Any) -> dict[str, Any]:
        sp = {"max_new_tokens": 4, "temperature": 0, **sampling}
        return {"model": m, "text": "Hello there", "sampling_params": sp}

    def chat(**kw: Any) -> dict[str, Any]:
        return {"model": chat_model, "messages": [user], "max_tokens": 4, "temperature": 0, **kw}

    def parts(n: int) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "text", "text": "x"}] * n}]

    C, G, H = "/v1/completions", "/generate", "/v1/chat/completions"
    over_ids = list(range(1000, 1001 + MAX_STOP_TOKEN_IDS))
    at_ids = over_ids[:-1]
    pairs = {f"k{i}": "v" * 64 for i in range(MAX_METADATA_PAIRS + 1)}
    at_pairs = dict(list(pairs.items())[:-1])
    past = [
        BoundCase("stop strings", C, cmpl(stop=_stops(MAX_STOP_STRINGS + 1, 8)), True, 400, "stop"),
        BoundCase(
            "stop characters", C, cmpl(stop=_stops(MAX_STOP_STRINGS, each + 1)), True, 400, "stop"
        ),
        BoundCase("stop_token_ids", C, cmpl(stop_token_ids=over_ids), True, 400, "stop_token_ids"),
        BoundCase(
            "logit_bias", C, cmpl(logit_bias=_bias(MAX_LOGIT_BIAS_TOKENS + 1)), True, 400,
            "logit_bias",
        ),
        BoundCase("n", C, cmpl(n=MAX_N + 1), True, 400, "n"),
        BoundCase("prompt batch", C, cmpl(prompt=["p"] * (MAX_PROMPTS + 1)), True, 400, "prompt"),
        BoundCase("user", C, cmpl(user=long_name), True, 400, "user"),
        BoundCase(
            "safety_identifier", C, cmpl(safety_identifier=long_name), True, 400,
            "safety_identifier",
        ),
        BoundCase(
            "prompt_cache_key", C, cmpl(prompt_cache_key=long_name), True, 400, "prompt_cache_key"
        ),
        BoundCase("metadata pairs", C, cmpl(metadata=pairs), True, 400, "metadata"),
        BoundCase(
            "metadata value", C, cmpl(metadata={"k": long_name}), True, 400, "metadata.k"
        ),
        BoundCase("model name", C, cmpl(model=long_name), True, 400, "model"),
        BoundCase(
            "stop strings", G, gen(stop=_stops(MAX_STOP_STRINGS + 1, 8)), True, 400,
            "sampling_params.stop",
        ),
        BoundCase(
            "stop characters", G, gen(stop="s" * (MAX_STOP_CHARS + 1)), True, 400,
            "sampling_params.stop",
        ),
        BoundCase(
            "stop_token_ids", G, gen(stop_token_ids=over_ids), True, 400,
            "sampling_params.stop_token_ids",
        ),
        BoundCase(
            "logit_bias", G, gen(logit_bias=_bias(MAX_LOGIT_BIAS_TOKENS + 1)), True, 400,
            "sampling_params.logit_bias",
        ),
        BoundCase("n", G, gen(n=MAX_N + 1), True, 400, "sampling_params.n"),
        BoundCase(
            "text batch", G, {**gen(), "text": ["p"] * (MAX_PROMPTS + 1)}, True, 400, "text"
        ),
        BoundCase(
            "input_ids batch", G,
            {**gen(), "text": None, "input_ids": [[5, 6]] * (MAX_PROMPTS + 1)}, True, 400,
            "input_ids",
        ),
        BoundCase("model name", G, {**gen(), "model": long_name}, True, 400, "model"),
        BoundCase(
            "model name", "/tokenize", {"model": long_name, "prompt": "x"}, True, 400, "model"
        ),
        BoundCase(
            "model name", "/detokenize", {"model": long_name, "tokens": [1]}, True, 400, "model"
        ),
        BoundCase(
            "prompts", "/cache/warmup", {"model": m, "prompts": ["p"] * (MAX_PROMPTS + 1)}, True,
            400, "prompts",
        ),
    ]  # fmt: skip
    at = [
        BoundCase(
            "every list at its bound",
            C,
            cmpl(
                stop=_stops(MAX_STOP_STRINGS, each),
                stop_token_ids=at_ids,
                logit_bias=_bias(MAX_LOGIT_BIAS_TOKENS),
                metadata=at_pairs,
                user="u" * MAX_NAME_CHARS,
                safety_identifier="s" * MAX_NAME_CHARS,
                prompt_cache_key="k" * MAX_NAME_CHARS,
            ),
            False,
        ),
        BoundCase(
            "n x stop strings", C, cmpl(n=MAX_N, stop=_stops(MAX_STOP_STRINGS, each), max_tokens=8),
            False,
        ),
        BoundCase("prompt batch", C, cmpl(prompt=["p"] * MAX_PROMPTS), False),
        BoundCase("metadata value", C, cmpl(metadata={"k": "v" * MAX_NAME_CHARS}), False),
        # A name at the bound passes it, and is then looked up: not served here.
        BoundCase("model name", C, cmpl(model="n" * MAX_NAME_CHARS), False, 404, "model"),
        BoundCase(
            "every list at its bound",
            G,
            gen(
                stop=_stops(MAX_STOP_STRINGS, each),
                stop_token_ids=at_ids,
                logit_bias=_bias(MAX_LOGIT_BIAS_TOKENS),
            ),
            False,
        ),
        BoundCase(
            "n x stop strings", G, gen(n=MAX_N, stop=_stops(MAX_STOP_STRINGS, each),
                                       max_new_tokens=8), False,
        ),
        BoundCase("stop characters", G, gen(stop="s" * MAX_STOP_CHARS), False),
        BoundCase("text batch", G, {**gen(), "text": ["p"] * MAX_PROMPTS}, False),
    ]  # fmt: skip
    if chat_model is not None:
        past += [
            BoundCase(
                "messages", H, chat(messages=[user] * (MAX_CHAT_MESSAGES + 1)), True, 400,
                "messages",
            ),
            BoundCase(
                "content parts", H, chat(messages=parts(MAX_CONTENT_PARTS + 1)), True, 400,
                "messages[0].content",
            ),
            BoundCase("stop strings", H, chat(stop=_stops(MAX_STOP_STRINGS + 1, 8)), True, 400,
                      "stop"),
            BoundCase("stop_token_ids", H, chat(stop_token_ids=over_ids), True, 400,
                      "stop_token_ids"),
            BoundCase("logit_bias", H, chat(logit_bias=_bias(MAX_LOGIT_BIAS_TOKENS + 1)), True,
                      400, "logit_bias"),
            BoundCase("user", H, chat(user=long_name), True, 400, "user"),
            BoundCase("metadata pairs", H, chat(metadata=pairs), True, 400, "metadata"),
            BoundCase(
                "messages", "/tokenize",
                {"model": chat_model, "messages": [user] * (MAX_CHAT_MESSAGES + 1)}, True, 400,
                "messages",
            ),
            BoundCase(
                "content parts", "/tokenize",
                {"model": chat_model, "messages": parts(MAX_CONTENT_PARTS + 1)}, True, 400,
                "messages[0].content",
            ),
            BoundCase(
                "messages", "/cache/warmup",
                {"model": chat_model, "messages": [user] * (MAX_CHAT_MESSAGES + 1)}, True, 400,
                "messages",
            ),
        ]  # fmt: skip
        at += [
            BoundCase(
                "every list at its bound",
                H,
                chat(
                    stop=_stops(MAX_STOP_STRINGS, each),
                    stop_token_ids=at_ids,
                    logit_bias=_bias(MAX_LOGIT_BIAS_TOKENS),
                    metadata=at_pairs,
                    user="u" * MAX_NAME_CHARS,
                ),
                False,
            ),
            BoundCase("content parts", H, chat(messages=parts(MAX_CONTENT_PARTS)), False),
            # 4,096 messages pass the bound; rendered, they outgrow the context.
            BoundCase(
                "messages", H, chat(messages=[user] * MAX_CHAT_MESSAGES), False, 400, "max_tokens"
            ),
            BoundCase(
                "messages",
                "/tokenize",
                {"model": chat_model, "messages": [user] * MAX_CHAT_MESSAGES},
                False,
            ),
        ]
    return past + at


def admission_cases(run: soak.RunState) -> list[BoundCase]:
    """Model loads the server must refuse before starting anything."""
    hs: HostileRun = run.hostile
    cores = len(os.sched_getaffinity(0))
    return [
        BoundCase(
            "replicas past the cores",
            "/models",
            {"source": hs.extra_source, "name": "too-many", "replicas": cores + 1},
            True,
            400,
            "replicas",
        ),
        BoundCase(
            "weights past the memory",
            "/models",
            {"source": hs.huge_source, "name": "huge"},
            True,
            507,
            "source",
        ),
    ]


async def send_case(
    run: soak.RunState,
    client: httpx.AsyncClient,
    case: BoundCase,
    kind: str,
    task: str,
    stream: bool,
) -> soak.RequestRecord:
    """Send one bound case (streamed when ``stream`` and the API streams)."""
    streams = case.path in ("/v1/completions", "/v1/chat/completions", "/generate")
    stream = stream and streams
    body = {**case.body, "stream": True} if stream else case.body
    model = str(case.body.get("model") or case.body.get("name") or "?")[:32]
    rec = run.new_record(task, kind, model, case.path, stream)
    rec.case = f"{case.path} {case.name}"
    rec.expected_status, rec.expected_param = case.status, case.param
    if case.path in ("/tokenize", "/detokenize", "/cache/warmup", "/models"):
        # Answers without a finish reason: judged by status alone.
        await call(run, client, rec, "POST", json_body=body)
    elif case.path == "/generate" and not stream:
        # A batch, or n > 1, is answered with a list (SGLang's shape): every item complete.
        answer = await call(run, client, rec, "POST", json_body=body)
        if answer is not None:
            items = answer if isinstance(answer, list) else [answer]
            finishes = {soak._finish_reason(item) for item in items}
            if items and finishes <= {"stop", "length"}:
                rec.outcome = "ok"
            else:
                rec.outcome = "incomplete"
                rec.detail = f"finish reasons {sorted(map(str, finishes))}"
    else:
        await soak.send(run, client, rec, body)
    return rec


async def bounds_task(run: soak.RunState) -> None:
    """Every bound in a shuffled cycle, past and at; now and then an oversized load."""
    hs: HostileRun = run.hostile
    rng = random.Random(run.config.seed * 7919)
    cases = bound_cases(run.facts)
    admission = admission_cases(run)
    order: list[BoundCase] = []
    p = hs.profile
    async with client_for(run) as c:
        i = 0
        while not stopped(run):
            if not order:
                order = rng.sample(cases, len(cases))
            if i % 10 == 9:
                case, kind = admission[(i // 10) % len(admission)], "admission"
            else:
                case = order.pop()
                kind = "bound_past" if case.past else "bound_at"
            await send_case(run, c, case, kind, "bounds", rng.random() < 0.4)
            i += 1
            if await wait_or_stop(run, rng.uniform(*p.bounds_every_s)):
                return


# ---- cross-site shapes ---------------------------------------------------------------------
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


def cross_cases(run: soak.RunState) -> list[CrossCase]:
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
    run: soak.RunState, client: httpx.AsyncClient, case: CrossCase, task: str
) -> soak.RequestRecord:
    rec = run.new_record(task, "cross_site", "-", case.path, False)
    rec.case = case.name
    rec.expected_status, rec.expected_param = case.status, case.param
    await call(run, client, rec, case.method, headers=case.headers, content=case.body)
    return rec


async def cross_site_task(run: soak.RunState) -> None:
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


async def snapshot(run: soak.RunState, client: httpx.AsyncClient) -> dict[str, Any]:
    """What a cross-site request could change: the cache, evictions, pins, requests
    served, the models, the disk tier and its files."""
    hs: HostileRun = run.hostile
    sched = await soak.server_info(client, run.url)
    snap: dict[str, Any] = {}
    for name, m in soak.info_models(sched).items():
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
    metrics = await soak.scrape_metrics(run.url)
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


async def populate(run: soak.RunState, client: httpx.AsyncClient, tag: str) -> None:
    """Fill the cache of every model, and outgrow the arena so the disk tier saves files."""
    rng = random.Random(f"{run.config.seed}-{tag}")
    words = run.config.profile.disconnect_words
    for model in run.facts:
        for _ in range(run.hostile.profile.state_prompts):
            body = {"model": model, "max_tokens": 1, "temperature": 0}
            body["prompt"] = " ".join(rng.choice(run.words) for _ in range(words))
            rec = run.new_record("state", "state_fill", model, "/v1/completions", False)
            await soak.send(run, client, rec, body)


async def state_check(run: soak.RunState, when: str) -> None:
    """On the idle server: every cross-site shape once, and nothing may change."""
    hs: HostileRun = run.hostile
    async with client_for(run) as c:
        await populate(run, c, when)
        await soak.wait_idle(run, soak.IDLE_TIMEOUT_S, serving=False)
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
        await soak.wait_idle(run, soak.IDLE_TIMEOUT_S, serving=False)
        after = await snapshot(run, c)
    changed = {k: [before.get(k), after.get(k)] for k in before.keys() | after.keys()}
    changed = {k: v for k, v in changed.items() if v[0] != v[1]}
    hs.states.append(StateCheck(when, len(cases), settled, changed, after.get("served")))
    verdict = "unchanged" if not changed else f"CHANGED {sorted(changed)}"
    print(
        f"[soak] state check ({when}): {len(cases)} cross-site shapes, state {verdict}", flush=True
    )


# ---- slow readers ---------------------------------------------------------------------------
class Dechunker:
    """An HTTP/1.1 chunked body, fed as it arrives."""

    def __init__(self) -> None:
        self.raw = bytearray()
        self.data = bytearray()
        self.done = False

    def feed(self, chunk: bytes) -> None:
        self.raw += chunk
        while not self.done:
            end = self.raw.find(b"\r\n")
            if end < 0:
                return
            size = int(bytes(self.raw[:end]).split(b";")[0], 16)  # ValueError: not chunked
            if len(self.raw) < end + 2 + size + 2:
                return
            self.data += self.raw[end + 2 : end + 2 + size]
            del self.raw[: end + 2 + size + 2]
            self.done = size == 0


class RawStream:
    """A request on a raw socket with a small receive buffer, read at the client's pace.

    Nothing is read ahead: every byte the client does not ask for stays in the
    kernel's buffers, so a client that stops reading fills them and the
    server's writer blocks, as it would behind a stalled browser tab.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = Dechunker()
        self.length: int | None = None  # a body with Content-Length (an error)
        self.plain = bytearray()
        self.received = 0
        self.eof = False

    @classmethod
    async def open(cls, port: int, path: str, body: bytes) -> RawStream:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), 30)
            await asyncio.wait_for(loop.sock_sendall(sock, soak.raw_request(port, path, body)), 30)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def _recv(self, n: int, timeout: float) -> bytes:
        data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(self.sock, n), timeout)
        self.received += len(data)
        self.eof = not data
        return data

    async def read_head(self, timeout: float) -> None:
        """Read up to the end of the headers (a byte at a time past them is not wanted)."""
        head = bytearray()
        deadline = time.monotonic() + timeout
        while b"\r\n\r\n" not in head:
            data = await self._recv(1024, max(0.1, deadline - time.monotonic()))
            if not data:
                raise ConnectionError("closed before the headers")
            head += data
            if len(head) > 65536:
                raise ValueError("headers over 64 KiB")
        raw, _, rest = bytes(head).partition(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        for line in lines[1:]:
            key, _, value = line.partition(":")
            self.headers[key.strip().lower()] = value.strip()
        if "content-length" in self.headers:
            self.length = int(self.headers["content-length"])
        self._take(rest)

    def _take(self, data: bytes) -> None:
        if self.length is not None:
            self.plain += data
        else:
            self.body.feed(data)

    @property
    def done(self) -> bool:
        if self.length is not None:
            return len(self.plain) >= self.length
        return self.body.done

    async def read(self, step: int, every_s: float, until: float) -> str:
        """Read ``step`` bytes every ``every_s`` until the body ends ("done"), the
        server closes ("eof") or monotonic time ``until`` ("timeout")."""
        while not self.done:
            left = until - time.monotonic()
            if left <= 0:
                return "timeout"
            try:
                data = await self._recv(step, left)
            except asyncio.TimeoutError:
                return "timeout"
            if not data:
                return "eof"
            self._take(data)
            if every_s:
                await asyncio.sleep(every_s)
        return "done"

    def close(self) -> None:
        self.sock.close()


def judge_events(rec: soak.RequestRecord, data: bytes, ended: bool) -> dict[str, Any]:
    """Judge an SSE body as ``soak._stream`` does; ``ended``: the body's last chunk came.

    Returns what a ``/generate`` stream with logprobs sent (tokens, logprob
    entries, the widest alternatives list) for the delta check.
    """
    facts = {"tokens": 0, "entries": 0, "widest": 0}
    finish, errored, text = None, False, ""
    for event in data.split(b"\n\n"):
        line = event.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            if errored:
                rec.outcome = "stream_error"
            else:
                soak._complete(rec, finish)
            return facts
        msg = soak._json(payload)
        if not isinstance(msg, dict) or errored:
            rec.outcome, rec.detail = "bad_body", f"unexpected stream event {payload[:80]!r}"
            return facts
        if "error" in msg:
            errored = soak._error_fields(rec, msg)
            if not errored:
                rec.outcome, rec.detail = "bad_body", "error event without the error shape"
                return facts
            continue
        piece = soak._text(msg)
        text = piece if "meta_info" in msg else text + piece
        finish = soak._finish_reason(msg) or finish
        meta = msg.get("meta_info")
        if isinstance(meta, dict):
            facts["tokens"] = len(msg.get("output_ids") or [])  # cumulative (SGLang's default)
            facts["entries"] += len(meta.get("output_token_logprobs") or [])
            tops = meta.get("output_top_logprobs") or []
            facts["widest"] = max([facts["widest"], *(len(t or []) for t in tops)])
    rec.outcome = "incomplete"
    rec.detail = "stream ended without [DONE]" if ended else "stream cut"
    return facts


def stream_body(
    endpoint: str, model: str, prompt: str, max_tokens: int, seed: int | None = None
) -> bytes:
    """A long streamed request that sends as many bytes per token as the API allows."""
    sampling: dict[str, Any] = {"temperature": 0} if seed is None else {"temperature": 0.8}
    if seed is not None:
        sampling["seed"] = seed
    if endpoint == "/generate":
        body: dict[str, Any] = {
            "model": model,
            "text": prompt,
            "stream": True,
            "return_logprob": True,
            "top_logprobs_num": TOP,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True, **sampling},
        }
    elif endpoint == "/v1/chat/completions":
        body = {"model": model, "messages": [{"role": "user", "content": prompt}]}
        body |= {"logprobs": True, "top_logprobs": TOP}
    else:
        body = {"model": model, "prompt": prompt, "logprobs": TOP}
    if endpoint != "/generate":
        body |= {"max_tokens": max_tokens, "ignore_eos": True, "stream": True, **sampling}
    return json.dumps(body).encode()


async def _error_body(stream: RawStream, rec: soak.RequestRecord, until: float) -> None:
    """A non-200 answer: its JSON error."""
    await stream.read(65536, 0.0, until)
    raw = bytes(stream.plain if stream.length is not None else stream.body.data)
    if soak._error_fields(rec, soak._json(raw.decode(errors="replace"))):
        rec.outcome = "error"
    else:
        rec.outcome, rec.detail = "bad_body", f"HTTP {rec.status} without a JSON error body"


async def open_stream(run: soak.RunState, rec: soak.RequestRecord, body: bytes) -> RawStream | None:
    """Send ``body`` on a raw socket and read the headers; None when the answer is
    not a stream (``rec`` then holds it) or the connection failed."""
    t = time.monotonic()
    try:
        stream = await RawStream.open(run.config.port, rec.endpoint, body)
    except (OSError, asyncio.TimeoutError) as exc:
        rec.outcome, rec.detail = "transport", f"{type(exc).__name__}: {exc}"[:300]
        return None
    try:
        await stream.read_head(HEAD_TIMEOUT_S)
        rec.status, rec.rid = stream.status, stream.headers.get("x-request-id", "")
        rec.ttft = time.monotonic() - t
        if stream.status != 200:
            await _error_body(stream, rec, time.monotonic() + 30)
            stream.close()
            return None
        return stream
    except (OSError, ValueError, asyncio.TimeoutError) as exc:
        rec.outcome = "timeout" if isinstance(exc, asyncio.TimeoutError) else "transport"
        rec.detail = f"headers: {type(exc).__name__}: {exc}"[:300]
        stream.close()
        return None


def finish_stream(run: soak.RunState, rec: soak.RequestRecord, stream: RawStream, how: str) -> None:
    """Judge what a stream read to its end (or cut) sent, and keep its logprob facts."""
    hs: HostileRun = run.hostile
    facts = judge_events(rec, bytes(stream.body.data), how == "done")
    if rec.endpoint == "/generate" and how == "done" and rec.outcome == "ok":
        hs.streams.append(
            StreamFacts(
                rec.rid, facts["tokens"], facts["entries"], facts["widest"], stream.received
            )
        )


async def slow_reader_once(
    run: soak.RunState, rng: random.Random, index: int, mode: str, logprobs: bool
) -> None:
    """One stream read slowly to the end, never after its headers, or a trickle at a
    time; ``logprobs``: a streamed ``/generate`` with 20 alternatives a token."""
    hs: HostileRun = run.hostile
    p = hs.profile
    model = rng.choice(list(run.facts))
    endpoints = soak.endpoints_for(run.facts[model])
    endpoint = "/generate" if logprobs else rng.choice(endpoints)
    rec = run.new_record(f"slow_reader-{index}", "slow_reader", model, endpoint, True)
    rec.case = mode
    prompt = " ".join(rng.choice(run.words) for _ in range(run.config.profile.question_words * 2))
    seed = None if rng.random() < 0.5 else rng.randrange(1 << 30)
    t = time.monotonic()
    stream = await open_stream(
        run, rec, stream_body(endpoint, model, prompt, p.slow_max_tokens, seed)
    )
    if stream is None:
        _finish(run, rec, t)
        return
    try:
        if mode == "never":
            await wait_or_stop(run, p.slow_hold_s)
            how = "held"
        elif mode == "trickle":
            how = await stream.read(
                TRICKLE_BYTES, TRICKLE_EVERY_S, time.monotonic() + p.slow_hold_s
            )
        else:
            how = await stream.read(
                SLOW_BYTES, SLOW_EVERY_S, t + run.config.profile.request_timeout_s
            )
        if how in ("done", "eof"):
            finish_stream(run, rec, stream, how)
        elif mode == "slow":
            rec.outcome = "timeout"
            rec.detail = f"not sent within {run.config.profile.request_timeout_s:g} s"
        else:
            rec.outcome = "abandoned"  # the client hangs up, as it meant to
    except (OSError, ValueError) as exc:
        rec.outcome, rec.detail = "transport", f"{type(exc).__name__}: {exc}"[:300]
    finally:
        stream.close()
        _finish(run, rec, t)


async def slow_reader_task(run: soak.RunState, index: int) -> None:
    """Every way of reading in turn (so even a short run has each); every other
    stream is a ``/generate`` with logprobs, the most bytes a token."""
    rng = random.Random(run.config.seed * 15485863 + index)
    n = 0
    while not stopped(run):
        mode = SLOW_MODES[(n + index) % len(SLOW_MODES)]
        await slow_reader_once(run, rng, index, mode, logprobs=(n // len(SLOW_MODES)) % 2 == 0)
        n += 1
        if await wait_or_stop(run, rng.uniform(*run.hostile.profile.slow_pause_s)):
            return


# ---- model changes under streams that are never read --------------------------------------
async def hold_streams(
    run: soak.RunState, rng: random.Random
) -> list[tuple[soak.RequestRecord, RawStream]]:
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


async def collect(
    run: soak.RunState, held: list[tuple[soak.RequestRecord, RawStream]]
) -> list[str]:
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
    run: soak.RunState,
    client: httpx.AsyncClient,
    op: str,
    method: str,
    path: str,
    body: Any,
    held: list[tuple[soak.RequestRecord, RawStream]],
) -> ChangeRecord:
    """One model change, timed; the held streams' ends are collected after it."""
    rec = run.new_record("model_change", "model_change", EXTRA, path, False)
    rec.case = op
    t0 = run.now()
    answer = await call(run, client, rec, method, json_body=body)
    if held:  # its old instance's requests may fail with the drain's 503 until now
        run.drains.append(soak.Outage(EXTRA, t0, run.now()))
    aborted = answer.get("aborted") if isinstance(answer, dict) else None
    record = ChangeRecord(op, t0, rec.e2e, rec.status, aborted, await collect(run, held))
    run.hostile.changes.append(record)
    print(
        f"[soak] {run.now():6.0f}s {op} {EXTRA}: {rec.status} in {rec.e2e:.1f} s, "
        f"aborted {aborted}, held streams: {record.readers}",
        flush=True,
    )
    return record


async def model_cycle(run: soak.RunState, client: httpx.AsyncClient, rng: random.Random) -> None:
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


async def model_cycle_task(run: soak.RunState) -> None:
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


# ---- disk-store traps -----------------------------------------------------------------------
def make_canary(hs: HostileRun) -> None:
    """Files outside the store, named like chunk files, that links in it point to."""
    rng = random.Random(17)
    hs.canary.mkdir(parents=True)
    (hs.canary / "canary.txt").write_text("the disk tier must never touch this\n")
    ns = hs.canary / "".join(rng.choice(_HEX) for _ in range(16))
    ns.mkdir()
    for where in (hs.canary, ns):
        for _ in range(2):
            name = "".join(rng.choice(_HEX) for _ in range(64)) + ".kv"
            (where / name).write_bytes(rng.randbytes(256))
    hs.canary_digest = digest_tree(hs.canary)


def digest_tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: its type and, for files, a hash of the bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            mode = path.lstat().st_mode
            value = f"{stat.S_IFMT(mode):o}"
            if stat.S_ISREG(mode):
                value += ":" + hashlib.sha256(path.read_bytes()).hexdigest()
            out[str(path.relative_to(root))] = value
    return out


def _plant(hs: HostileRun, path: Path, kind: str, content: str = "") -> None:
    if kind == "file":
        path.write_text(content)
    elif kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(content)
    hs.traps.append(Trap(str(path), kind, content))


def plant_in(hs: HostileRun, where: Path, namespace: bool) -> None:
    """Foreign things in one directory of the store: files, a directory (holding a
    file named like a chunk outside any namespace), links to the canaries, a FIFO.

    Nothing planted in a namespace directory has a chunk file's name: a regular
    file named so there is the store's to delete (it cannot tell it apart)."""
    rng = random.Random(str(where))
    chunk_name = "".join(rng.choice(_HEX) for _ in range(64)) + ".kv"
    canary_ns = next(p for p in hs.canary.iterdir() if p.is_dir())
    _plant(hs, where / "foreign-notes.txt", "file", f"planted in {where.name}\n")
    sub = where / "foreign-dir"
    _plant(hs, sub, "dir")
    _plant(hs, sub / chunk_name, "file", "not a chunk of any namespace\n")
    _plant(hs, where / "link-to-canary-file", "symlink", str(hs.canary / "canary.txt"))
    _plant(hs, where / "link-to-canary-dir", "symlink", str(hs.canary))
    _plant(hs, where / "foreign-fifo", "fifo")
    if namespace:
        # A link named like a chunk, to a file outside: a read, write or delete
        # that followed it would touch the canary.
        _plant(hs, where / chunk_name, "symlink", str(hs.canary / "canary.txt"))
    else:
        # Named like a namespace, linking to a directory of chunk-named files.
        fake_ns = "".join(rng.choice(_HEX) for _ in range(16))
        _plant(hs, where / fake_ns, "symlink", str(canary_ns))
        _plant(hs, where / chunk_name, "file", "a chunk's name outside any namespace\n")
    hs.trapped.add(str(where))


def plant_traps(hs: HostileRun) -> int:
    """Plant in the store, its ``v1`` and every namespace not yet planted in; how many new."""
    before = len(hs.trapped)
    v1 = hs.store / "v1"
    for where in (hs.store, v1):
        if str(where) not in hs.trapped and where.is_dir():
            plant_in(hs, where, namespace=False)
    if v1.is_dir():
        for entry in sorted(v1.iterdir()):
            planted = any(t.path == str(entry) for t in hs.traps)
            is_ns = re.fullmatch(r"[0-9a-f]{16}", entry.name) and not entry.is_symlink()
            if is_ns and not planted and str(entry) not in hs.trapped:
                with contextlib.suppress(FileNotFoundError):  # removed by a flush meanwhile
                    plant_in(hs, entry, namespace=True)
    return len(hs.trapped) - before


def trap_problems(hs: HostileRun) -> list[str]:
    """Every planted thing that is gone or changed, and any change to the canaries."""
    problems = []
    for trap in hs.traps:
        path = Path(trap.path)
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            problems.append(f"{trap.kind} {trap.path} is gone")
            continue
        kinds = {
            "file": stat.S_ISREG,
            "dir": stat.S_ISDIR,
            "symlink": stat.S_ISLNK,
            "fifo": stat.S_ISFIFO,
        }
        if not kinds[trap.kind](mode):
            problems.append(f"{trap.path} is no longer a {trap.kind}")
        elif trap.kind == "file" and path.read_text() != trap.content:
            problems.append(f"{trap.path} was rewritten")
        elif trap.kind == "symlink" and os.readlink(path) != trap.content:
            problems.append(f"{trap.path} points elsewhere")
    now = digest_tree(hs.canary)
    if now != hs.canary_digest:
        diff = sorted(set(now.items()) ^ set(hs.canary_digest.items()))
        problems.append(f"canaries outside the store changed: {diff[:4]}")
    return problems


async def trap_task(run: soak.RunState) -> None:
    """Plant traps in every namespace directory as it appears (flushes keep coming)."""
    hs: HostileRun = run.hostile
    while True:
        new = plant_traps(hs)
        if new:
            print(f"[soak] {run.now():6.0f}s planted traps in {new} more store directories")
        if await wait_or_stop(run, hs.profile.trap_every_s):
            return


# ---- the stall probe -----------------------------------------------------------------------
async def stall_once(
    run: soak.RunState, client: httpx.AsyncClient, model: str
) -> soak.RequestRecord:
    body = {
        "model": model,
        "prompt": STALL_PROMPT,
        "max_tokens": STALL_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    rec = run.new_record("stall_probe", "stall_probe", model, "/v1/completions", False)
    rec.case = run.hostile.phase
    await soak.send(run, client, rec, body)
    return rec


async def stall_task(run: soak.RunState) -> None:
    """The small probe, models in turn, all through the load."""
    hs: HostileRun = run.hostile
    names = list(run.facts)
    async with client_for(run) as c:
        i = 0
        while not await wait_or_stop(run, hs.profile.stall_every_s):
            await stall_once(run, c, names[i % len(names)])
            i += 1


# ---- phases ---------------------------------------------------------------------------------
def extra_sources(root: Path) -> tuple[str, str]:
    """The extra model (tiny, one layer: 256 B of KV a token) and a model folder
    whose weights could never fit (their header only)."""
    from bench.tiny_models import make_tiny_model_dir
    from radixmux.model_runners.fetch import cache_root

    tiny = Path(soak.model_sources(True)[0])
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


async def before_load(run: soak.RunState) -> None:
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


async def idle_samples(run: soak.RunState, client: httpx.AsyncClient, phase: str) -> None:
    """The stall probe on the idle server, every model in turn."""
    run.hostile.phase = phase
    await soak.wait_idle(run, soak.IDLE_TIMEOUT_S, serving=False)
    for i in range(run.hostile.profile.stall_idle_samples * len(run.facts)):
        await stall_once(run, client, list(run.facts)[i % len(run.facts)])


async def hostile_window(run: soak.RunState) -> None:
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


def hostile_tasks(run: soak.RunState) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
    n = run.hostile.profile.slow_readers
    return [
        ("bounds", lambda: bounds_task(run)),
        ("cross_site", lambda: cross_site_task(run)),
        *((f"slow_reader-{i}", lambda i=i: slow_reader_task(run, i)) for i in range(n)),
        ("model_cycle", lambda: model_cycle_task(run)),
        ("traps", lambda: trap_task(run)),
        ("stall_probe", lambda: stall_task(run)),
    ]


def load_tasks(run: soak.RunState) -> list[Callable[[], Awaitable[None]]]:
    """The hostile clients, run beside the soak's own load (and stopped with it)."""
    run.hostile.stop, run.hostile.phase = run.stop, "load"
    return [make for _, make in hostile_tasks(run)]


async def after_load(run: soak.RunState) -> None:
    """The idle server after the soak's end phase: plant again, the last state check."""
    plant_traps(run.hostile)
    await state_check(run, "after")


async def restart_phase(run: soak.RunState) -> None:
    """Start the server again on the same store (its start-up scan meets every
    trap), serve, flush, stop; then look at every trap and canary."""
    hs: HostileRun = run.hostile
    log = run.config.log.with_name(run.config.log.stem + "-restart.log")
    print(f"[soak] restarting the server on the same disk store (log {log})", flush=True)
    server = soak.SoakServer(run.server.cmd, run.config.port, log)
    info: dict[str, Any] = {"log": str(log)}
    try:
        await server.wait_ready(run.config.profile.start_timeout_s)
        info["ready"] = True
        async with httpx.AsyncClient(trust_env=False, timeout=120) as c:
            sched = await soak.server_info(c, server.url)
            info["store_chunks_after_scan"] = (sched.get("disk") or {}).get("store_chunks")
            info["traps_after_scan"] = trap_problems(hs)
            for model in run.facts:
                body = {"model": model, "prompt": STALL_PROMPT, "max_tokens": 4}
                resp = await c.post(server.url + "/v1/completions", json=body)
                info[f"serve_{model}"] = resp.status_code
            info["get_flush"] = (await c.get(server.url + "/flush_cache")).status_code
            info["flush"] = (await c.post(server.url + "/flush_cache")).status_code
            sched = await soak.server_info(c, server.url)
            info["store_chunks_after_flush"] = (sched.get("disk") or {}).get("store_chunks")
    except (soak.ServerFailed, httpx.HTTPError) as exc:
        info["ready"] = info.get("ready", False)
        info["error"] = str(exc)[:500]
    finally:
        info["exit_code"] = server.stop()
    hs.restart = info
    hs.trap_problems = trap_problems(hs)
    print(f"[soak] restart: {info}", flush=True)


def cleanup(run: soak.RunState, passed: bool) -> None:
    """Remove the run's directory (store, canaries) after a run that passed."""
    if not passed:
        print(f"[soak] kept {run.config.hostile_dir} (store, traps, canaries) for a look")
        return
    shutil.rmtree(run.config.hostile_dir, ignore_errors=True)


# ---- checks -------------------------------------------------------------------------------------
def _mine(run: soak.RunState, *kinds: str) -> list[soak.RequestRecord]:
    return [r for r in run.records if r.kind in kinds]


def _examples(bad: Sequence[str]) -> str:
    return f"{len(bad)} wrong: " + "; ".join(bad[:3])


def bounds_check(run: soak.RunState) -> soak.CheckResult:
    """Past every bound: the 400 naming the field (admission: 400 / 507 naming it)."""
    recs = _mine(run, "bound_past", "admission")
    bad = []
    for rec in recs:
        problems = soak.bad_input_problems(rec)
        if not problems and rec.error_param != rec.expected_param:
            problems = [("", f"{rec.case}: names {rec.error_param!r}, want {rec.expected_param!r}")]
        bad += [why for _, why in problems]
    cases = Counter(r.case for r in recs)
    endpoints = sorted({r.endpoint for r in recs})
    ok = not bad and {"bound_past", "admission"} <= {r.kind for r in recs}
    detail = (
        f"{len(recs)} requests past a bound ({len(cases)} cases on {', '.join(endpoints)}): "
        f"each its 4xx naming the field; statuses {dict(Counter(r.status for r in recs))}"
    )
    return soak.CheckResult("hostile_bounds_refused", ok, detail if not bad else _examples(bad))


def at_bound_check(run: soak.RunState) -> soak.CheckResult:
    """At every bound: served (or the one documented answer past the bound's check)."""
    windows = soak.outages(run)
    recs = _mine(run, "bound_at")
    bad, served, unavailable = [], 0, 0
    for rec in recs:
        if rec.expected_status is not None:
            bad += [why for _, why in soak.bad_input_problems(rec)]
        elif rec.outcome == "ok":
            served += 1
        elif code_of(rec) == 503 and soak.in_outage(rec, windows):
            unavailable += 1
        else:
            bad.append(
                f"{rec.case}: {rec.status} {rec.outcome} {rec.error_param} {rec.detail[:80]}"
            )
    ok = served > 0 and not bad
    detail = (
        f"{served} of {len(recs)} at-bound requests served, "
        f"{len(recs) - served - unavailable} answered as documented past the bound's check "
        f"(a 1,024-character model name: 404; 4,096 messages: over the context), "
        f"{unavailable} 503 while their model restarted"
    )
    return soak.CheckResult("hostile_at_bound_served", ok, detail if not bad else _examples(bad))


def no_5xx_check(run: soak.RunState) -> soak.CheckResult:
    """No hostile request got a 5xx but the documented ones: 503 while its model was
    down or draining, 507 for a load that cannot fit."""
    windows = soak.outages(run)
    recs = _mine(run, *HOSTILE_KINDS)
    bad, documented = [], Counter()
    for rec in recs:
        code = code_of(rec)
        if code is None or code < 500:
            continue
        if (code == 503 and soak.in_outage(rec, windows)) or (
            code == 507 and rec.kind == "admission"
        ):
            documented[code] += 1
            continue
        bad.append(f"{rec.kind} {rec.case or rec.endpoint}: {code} {rec.detail[:100]}")
    detail = f"{len(recs)} hostile requests; 5xx only as documented: {dict(documented)}"
    return soak.CheckResult(
        "hostile_no_5xx", bool(recs) and not bad, detail if not bad else _examples(bad)
    )


def cross_site_check(run: soak.RunState) -> soak.CheckResult:
    """Every cross-site shape refused with its status naming the field, and none
    changed any state on the idle server."""
    hs: HostileRun = run.hostile
    recs = _mine(run, "cross_site")
    bad = [why for rec in recs for _, why in soak.bad_input_problems(rec)]
    for s in hs.states:
        if s.changed:
            bad.append(f"state changed ({s.when}): {json.dumps(s.changed)[:200]}")
        if not s.settled:
            bad.append(f"state never settled before the check ({s.when})")
    ok = bool(recs) and len(hs.states) == 2 and not bad
    shapes = Counter(r.case for r in recs)
    detail = (
        f"{len(recs)} requests of {len(shapes)} shapes, statuses "
        f"{dict(sorted(Counter(r.status for r in recs).items()))}; state unchanged by every shape "
        f"before and after the load ({', '.join(s.when for s in hs.states)}: cached tokens, "
        "evictions, pins, requests served, models, disk files)"
    )
    return soak.CheckResult("hostile_cross_site_refused", ok, detail if not bad else _examples(bad))


def slow_reader_check(run: soak.RunState) -> soak.CheckResult:
    """Slow readers: each served (or held and hung up on by its client); a stream read
    to its end complete, its ``/generate`` logprobs deltas adding up to the answer."""
    hs: HostileRun = run.hostile
    windows = soak.outages(run)
    recs = _mine(run, "slow_reader")
    bad = []
    for rec in recs:
        fine = rec.outcome in ("ok", "abandoned") or (
            code_of(rec) == 503 and soak.in_outage(rec, windows)
        )
        if not fine:
            bad.append(f"{rec.case} {rec.model} {rec.endpoint}: {rec.outcome} {rec.detail[:80]}")
    for s in hs.streams:
        if s.logprob_entries != s.tokens or s.widest_top > TOP:
            bad.append(
                f"/generate {s.rid}: {s.logprob_entries} logprob entries for {s.tokens} tokens"
                f" (widest top {s.widest_top})"
            )
    modes = Counter(f"{r.case}:{r.outcome}" for r in recs)
    per_token = [s.bytes / s.tokens for s in hs.streams if s.tokens]
    ok = bool(hs.streams) and not bad and {"never", "trickle", "slow"} <= {r.case for r in recs}
    detail = (
        f"{len(recs)} slow readers {dict(sorted(modes.items()))}; {len(hs.streams)} /generate "
        f"streams with {TOP} alternatives read to the end, logprobs as deltas adding up to the "
        f"tokens, {statistics.median(per_token) / 1024 if per_token else 0:.1f} KiB a token"
    )
    if not hs.streams:
        detail += "; no /generate logprob stream was read to its end"
    return soak.CheckResult("hostile_slow_readers", ok, detail if not bad else _examples(bad))


def drain_check(run: soak.RunState) -> soak.CheckResult:
    """Every reload and unload under streams that are never read ends within the
    drain timeout plus slack; every held stream ends; the extra model is gone."""
    hs: HostileRun = run.hostile
    limit = hs.profile.drain_timeout_s + DRAIN_SLACK_S
    bad = []
    drained = [c for c in hs.changes if c.op in ("reload", "unload")]
    for c in hs.changes:
        if c.status != 200:
            bad.append(f"{c.op} at {c.t:.0f} s: {c.status}")
        elif c.op != "load" and c.seconds > limit:
            bad.append(f"{c.op} at {c.t:.0f} s took {c.seconds:.0f} s > {limit:g} s")
    readers = _mine(run, "drain_reader")
    windows = soak.outages(run)
    for rec in readers:
        if not (
            rec.outcome in ("ok", "drain_cut")
            or (code_of(rec) == 503 and soak.in_outage(rec, windows))
        ):
            bad.append(f"held stream {rec.endpoint}: {rec.outcome} {rec.detail[:80]}")
    served = hs.states[-1].served if hs.states else None
    if served is None or EXTRA in served:
        bad.append(f"{EXTRA} still served at the end")
    # Not vacuous: some drain must have met held streams still in flight and ended them.
    timed_out = [c for c in drained if c.aborted]
    ok = bool(timed_out) and not bad
    ends = Counter(r.outcome if r.outcome != "stream_error" else "503 event" for r in readers)
    secs = [round(c.seconds, 1) for c in drained]
    detail = (
        f"{len(drained)} reloads and unloads of {EXTRA} under {len(readers)} streams that never "
        f"read (drain timeout {hs.profile.drain_timeout_s:g} s): each ended in {min(secs or [0])}-"
        f"{max(secs or [0])} s (limit {limit:g} s), {len(timed_out)} after their drain timed out "
        f"(aborted {sum(c.aborted or 0 for c in drained)}); the streams ended: {dict(ends)}"
    )
    if not timed_out:
        detail += "; no drain met a stream still in flight"
    return soak.CheckResult("hostile_drains_end", ok, detail if not bad else _examples(bad))


def disk_trap_check(run: soak.RunState) -> soak.CheckResult:
    """Everything planted in the store, and the canaries outside it, are intact
    after flushes, evictions, a restart's scan and a last flush."""
    hs: HostileRun = run.hostile
    r = hs.restart
    namespaces = len(hs.trapped) - 2  # the store and v1 themselves
    bad = list(hs.trap_problems)
    bad += [f"after the restart's scan: {p}" for p in r.get("traps_after_scan") or []]
    if not r.get("ready"):
        bad.append(f"the restart on the same store failed: {r.get('error')}")
    else:
        for key in ("flush", *(f"serve_{m}" for m in run.facts)):
            if r.get(key) != 200:
                bad.append(f"after the restart: {key} {r.get(key)}")
        if r.get("get_flush") != 405:
            bad.append(f"after the restart: GET /flush_cache {r.get('get_flush')}")
    if r.get("exit_code") != 0:
        bad.append(f"the restarted server stopped with {r.get('exit_code')}")
    if namespaces < 1:
        bad.append("no namespace directory appeared to plant in")
    flushes = sum(1 for rec in run.records if rec.kind == "flush" and rec.outcome == "ok")
    detail = (
        f"{len(hs.traps)} things planted (files, directories, FIFOs, links to canaries) in the "
        f"store, v1 and {namespaces} namespace directories; after {flushes} flushes during the "
        f"load, disk evictions, a restart (its scan found {r.get('store_chunks_after_scan')} "
        f"chunks) and a flush: all intact, canaries unchanged"
    )
    return soak.CheckResult(
        "hostile_disk_traps_intact", not bad, detail if not bad else _examples(bad)
    )


def stall_figures(run: soak.RunState) -> dict[str, Any]:
    """The stall probe's latency (median, p90, count) per phase: idle before and
    after the hostile window, beside the hostile clients alone, under the whole
    load (restart windows excluded). The idle figure is the lower of the two idle
    medians: the machine's other work (a shared machine) only ever adds latency."""
    windows = soak.outages(run)
    probes = [r for r in _mine(run, "stall_probe") if r.outcome == "ok"]
    out: dict[str, Any] = {}
    for phase in ("idle", "idle_after", "hostile", "load"):
        e2e = [r.e2e for r in probes if r.case == phase and not soak.in_outage(r, windows)]
        if e2e:
            out[phase] = {
                "n": len(e2e),
                "median_ms": round(1e3 * statistics.median(e2e), 1),
                "p90_ms": round(1e3 * soak.percentile(e2e, 0.9), 1),
            }
    idles = [out[k]["median_ms"] for k in ("idle", "idle_after") if k in out]
    if idles:
        out["idle_ms"] = min(idles)
        for phase in ("hostile", "load"):
            if phase in out:
                out[phase]["x_idle"] = round(out[phase]["median_ms"] / out["idle_ms"], 2)
    return out


def stall_check(run: soak.RunState) -> soak.CheckResult:
    """The small probe's median latency beside the hostile clients within 3x of the
    idle server's (under the soak's own load as well: reported, not judged, since
    a dozen ordinary clients sharing two cores cost more than that by themselves)."""
    f = stall_figures(run)
    if "idle_ms" not in f or "hostile" not in f:
        return soak.CheckResult("hostile_stall_ratio", False, f"too few probes answered: {f}")
    hostile, load = f["hostile"], f.get("load")
    idles = ", ".join(
        f"{k.replace('_', ' ')} {f[k]['median_ms']:.0f} ms ({f[k]['p90_ms']:.0f}, {f[k]['n']})"
        for k in ("idle", "idle_after")
        if k in f
    )
    detail = (
        f"{STALL_TOKENS}-token greedy probe, median (p90, n): {idles}; beside the hostile "
        f"clients alone {hostile['median_ms']:.0f} ms ({hostile['p90_ms']:.0f}, {hostile['n']}) = "
        f"{hostile['x_idle']:.2f}x idle (limit {STALL_LIMIT:g}x)"
    )
    if load:
        detail += (
            f"; with the soak's load too {load['median_ms']:.0f} ms ({load['p90_ms']:.0f}, "
            f"{load['n']}) = {load['x_idle']:.2f}x"
        )
    return soak.CheckResult("hostile_stall_ratio", hostile["x_idle"] < STALL_LIMIT, detail)


def checks(run: soak.RunState) -> list[soak.CheckResult]:
    return [
        bounds_check(run),
        at_bound_check(run),
        no_5xx_check(run),
        cross_site_check(run),
        slow_reader_check(run),
        drain_check(run),
        disk_trap_check(run),
        stall_check(run),
    ]


def report(run: soak.RunState) -> dict[str, Any]:
    """The hostile part of the JSON report."""
    hs: HostileRun = run.hostile
    recs = _mine(run, *HOSTILE_KINDS)
    by_kind: dict[str, dict[str, int]] = {}
    for kind in HOSTILE_KINDS:
        by_kind[kind] = soak.by_status([r for r in recs if r.kind == kind])
    return {
        "profile": dataclasses.asdict(hs.profile),
        "requests_by_kind_and_status": by_kind,
        "cases": dict(sorted(Counter(f"{r.kind} {r.case}" for r in recs).items())),
        "stall": stall_figures(run),
        "changes": [dataclasses.asdict(c) for c in hs.changes],
        "state_checks": [dataclasses.asdict(s) for s in hs.states],
        "generate_logprob_streams": [dataclasses.asdict(s) for s in hs.streams],
        "traps": len(hs.traps),
        "trapped_directories": sorted(hs.trapped),
        "trap_problems": hs.trap_problems,
        "restart": hs.restart,
    }
