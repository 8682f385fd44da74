"""Soak and chaos harness: the real two-model server under mixed, hostile load.

Starts ``launch.py`` with two models (``a`` and ``b``) on a small KV arena, so
eviction and retraction happen all the time, and for ``--minutes`` drives it
from several asyncio client tasks with fixed seeds:

- ``shared_prefix``: a few long system prompts x questions, both models, every
  API (OpenAI completions and chat, SGLang ``/generate``), streamed or not;
- ``multi_turn``: conversations growing turn by turn (chat where the model has a
  template, the conversation as plain text otherwise);
- ``abandon``: streams closed after a random number of events;
- ``burst``: now and then a dozen long greedy streams at once, whose decodes
  outgrow the arena (retraction);
- ``disconnect``: a long prompt sent on a raw socket that is closed at once,
  while the server is still tokenizing it;
- ``bad_input``: malformed and out-of-range requests, each expecting one 4xx
  JSON error that names the field;
- ``invalidate`` / ``flush``: per-model cache invalidations and whole-cache flushes;
- the killer: SIGKILL to one model's runner every ``--kill-every`` seconds,
  models in turn;
- ``probe``: one fixed greedy prompt per model before, during and after the load.

Meanwhile it samples the resident memory of every server process and the
models' states. At the end it stops the load, waits until the server is idle
and checks (one PASS/FAIL line each):

- every answer: 200 and complete, a 4xx JSON error naming the field for bad
  input, 429, or a 503 JSON error while its model was down; no other status,
  no hang past the request timeout, no stream cut without an error event, no
  connection error, no exception text or path in an error message;
- the greedy probe answers identical before, during and after the load;
- nothing running for nobody: idle right after the load, and right after
  clients hang up during tokenization on the idle server;
- every model serving; the scheduler's invariant check "ok"; zero locks and
  zero request-owned slots; after ``/flush_cache`` every arena block free;
- RSS growth < 5% from minute 2 (the halfway point of runs under 4 minutes)
  to the end for every process that lived through it warm;
- runner restarts equal kills, per model, and every killed model back serving;
- the launcher alive throughout and stopping cleanly;
- the load exercised what it claims (every kind of request, eviction, retraction).

``--hostile`` adds hostile clients beside this load (``bench/soak_hostile.py``:
lists at and past every bound, slow and stalled readers, model changes under
them, cross-site request shapes, traps planted in the disk tier's store) and
their checks.

It writes ``bench/results/soak.json`` (checks, summaries, every request),
``soak.png`` (requests by status and TTFT p50/p99 per minute, RSS per process,
kill markers) and ``soak-server.log``, and exits 1 when a check fails.

    .venv/bin/python -m bench.soak --minutes 30                # the README run (real models)
    .venv/bin/python -m bench.soak --minutes 2 --tiny          # what tests/test_soak.py runs
    .venv/bin/python -m bench.soak --minutes 30 --hostile      # with hostile clients
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import soak_hostile
from bench.bench_serving import chat_messages, completion_prompt
from bench.workloads import WordSource, resolve_tokenizer, vocabulary_words

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
MODEL_NAMES = ("a", "b")
REAL_SOURCES = ("smollm2", "gemma3-270m")

HEALTH_EVERY_S = 2.0  # model-state timeline resolution (outage windows)
PROGRESS_EVERY_S = 10.0
RSS_EVERY_S = 5.0
RSS_GROWTH_LIMIT = 0.05  # the issue: < 5% between minute 2 and the end
RSS_BASELINE_S = 120.0  # "minute 2"; runs shorter than 4 minutes use their halfway point
RSS_MIN_WINDOW_S = 60.0  # a process is compared over at least this long, or listed apart
OUTAGE_GRACE_S = 3.0  # a 503 this close to an outage still belongs to it (polling lag)
# A killed runner must be serving again within this: generous, since on a
# shared 2-core machine a restart may also rebuild the decode kernel.
RESTART_TIMEOUT_S = 300.0
DOWN_FOR_GOOD_S = 15.0  # a model "down" this long after a kill is not coming back
KILL_MARGIN_S = 20.0  # no kill this close to the end of the load
IDLE_GRACE_S = 15.0  # load ended: anything still running after this runs for nobody
IDLE_TIMEOUT_S = 300.0  # then wait this long for idle before checking anyway
QUIET_DISCONNECTS = 3  # end-phase disconnects during tokenization on an idle server
QUIET_SETTLE_S = 3.0
QUIET_IDLE_S = 5.0  # an aborted request is gone in ~1 s; an orphan decodes for much longer
# A burst: this many requests at once over both models, each admitted on a
# reservation of 64 decode tokens, together outgrow the arena as they decode.
BURST_SIZE = 12
STOP_TIMEOUT_S = 60.0
PROBE_PROMPT = "The history of the radix tree begins with a question about memory, and"
PROBE_TOKENS = 16
# What a client must never see in an error message: tracebacks, source paths,
# exception class names.
INTERNALS = re.compile(r"Traceback|File \"|\.py\b|\b[A-Z]\w*(Error|Exception):")
ERROR_TYPE_STATUS = {
    "invalid_request_error": 400,
    "not_found_error": 404,
    "rate_limit_exceeded": 429,
    "server_error": 500,
    "service_unavailable": 503,
}
CONTROL_KINDS = ("invalidate", "flush")
SERVER_INFO_FIELDS = ("invariants", "locks_held", "request_owned_slots")
MODEL_INFO_FIELDS = ("state", "runner_pids", "restarts")


# Every kind of request the load makes; a run that made none of one proves nothing about it.
REQUEST_KINDS = (
    "shared_prefix",
    "multi_turn",
    "abandon",
    "burst",
    "disconnect",
    "bad_input",
    "invalidate",
    "flush",
    "probe",
)


# ---- configuration --------------------------------------------------------------------
@dataclass(frozen=True)
class Profile:
    """Sizes and pacing of one kind of run (tiny random models or the real ones)."""

    kv_cache_bytes: int
    kv_block_bytes: int
    kill_every_s: float
    request_timeout_s: float
    start_timeout_s: float
    system_words: int  # shared-prefix and multi-turn system prompts
    num_systems: int  # per model
    question_words: int
    max_tokens: tuple[int, int]  # inclusive range of a normal request's output
    burst_every_s: float  # a burst of BURST_SIZE long requests (retraction pressure)
    burst_max_tokens: int
    max_turns: int
    abandon_max_tokens: int
    disconnect_words: int
    disconnect_max_tokens: int  # large: an orphaned request outlives IDLE_GRACE_S
    probe_every_s: float
    cache_op_every_s: float
    disconnect_every_s: tuple[float, float]
    bad_input_every_s: tuple[float, float]


# Tiny models: float32, 2 layers x 2 KV heads x 16 dims = 512 B per token, so
# 1 MiB is 2,048 tokens for both models together: less than the load keeps
# running at once, so decode runs out of KV and retracts.
TINY = Profile(
    kv_cache_bytes=1 << 20,
    kv_block_bytes=32 << 10,
    kill_every_s=40.0,
    request_timeout_s=240.0,  # a hang, not slowness: other work shares the 2 cores
    start_timeout_s=600.0,
    system_words=300,
    num_systems=3,
    question_words=24,
    max_tokens=(4, 24),
    burst_every_s=20.0,
    burst_max_tokens=400,
    max_turns=6,
    abandon_max_tokens=200,
    disconnect_words=600,
    disconnect_max_tokens=1000,
    probe_every_s=15.0,
    cache_op_every_s=12.0,
    disconnect_every_s=(2.0, 5.0),
    bad_input_every_s=(0.3, 1.0),
)
# Real models in bfloat16: SmolLM2 23 KiB and Gemma 3 270M 18 KiB per token, so
# 32 MiB is about 1,450-1,800 tokens (less than the load keeps running at once);
# float32 doubles the arena to hold as many tokens (``arena_bytes``). 1.5 MiB
# blocks are a multiple of both models' K rows in either dtype.
REAL = Profile(
    kv_cache_bytes=32 << 20,
    kv_block_bytes=1536 << 10,
    kill_every_s=180.0,
    request_timeout_s=300.0,
    start_timeout_s=1200.0,
    system_words=300,
    num_systems=3,
    question_words=24,
    max_tokens=(4, 16),
    burst_every_s=60.0,
    burst_max_tokens=160,
    max_turns=5,
    abandon_max_tokens=64,
    disconnect_words=500,
    disconnect_max_tokens=400,
    probe_every_s=30.0,
    cache_op_every_s=30.0,
    disconnect_every_s=(5.0, 10.0),
    bad_input_every_s=(2.0, 5.0),  # cheap to answer: keep them from dominating the counts
)


@dataclass(frozen=True)
class SoakConfig:
    """One soak run."""

    minutes: float
    tiny: bool
    kill_every_s: float
    seed: int
    port: int
    out: Path
    runner_timeout_s: float  # 0: do not pass --runner-timeout (older servers)
    server_args: tuple[str, ...]
    profile: Profile
    dtype: str = "float32"  # the models' dtype ("": the server's default)
    hostile: bool = False  # hostile clients beside the load (bench/soak_hostile.py)
    hostile_dir: str = ""  # their temporary directory: the disk store, canaries

    @property
    def load_s(self) -> float:
        return self.minutes * 60.0

    @property
    def png(self) -> Path:
        return self.out.with_suffix(".png")

    @property
    def log(self) -> Path:
        return self.out.with_name(self.out.stem + "-server.log")


# ---- records ---------------------------------------------------------------------------
@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the load's start.

    ``outcome``: ok (200, complete), error (non-200 with a JSON error body),
    stream_error (an error event, then ``[DONE]``), abandoned / disconnected (the
    client hung up on purpose), timeout, transport (connection failed), incomplete
    (no finish reason, or a stream cut without ``[DONE]``), bad_body (an answer
    that is not the documented JSON), drain_cut (a stream whose client stopped
    reading, cut when an unload's drain timed out, as documented).
    """

    task: str
    kind: str
    model: str
    endpoint: str
    stream: bool
    t_start: float
    minute: int
    t_end: float = 0.0
    status: int = 0  # HTTP status; 0 when none came
    outcome: str = ""
    ttft: float | None = None
    e2e: float = 0.0
    error_type: str | None = None
    error_code: int | None = None  # HTTP status, or the code of an in-stream error event
    error_param: str | None = None
    detail: str = ""
    rid: str = ""  # the server's X-Request-Id, to find the request in the server log
    case: str = ""  # bad input: which malformed request this is
    expected_status: int | None = None  # bad input: the one status that is right
    expected_param: str | None = None


@dataclass
class ProbeResult:
    """One greedy probe answer (``text`` is empty unless ``status`` is 200)."""

    model: str
    phase: str  # before, during, after
    t: float
    status: int
    outcome: str
    text: str


@dataclass
class KillRecord:
    """One SIGKILL of a runner and when its model served again (None: never seen)."""

    model: str
    pid: int
    pid_source: str  # server_info (the contract) or proc (found by scanning /proc)
    t_kill: float
    t_serving: float | None = None


@dataclass
class HealthSample:
    """``/health`` at one moment: HTTP status and each model's state."""

    t: float
    status: int
    states: dict[str, str]


@dataclass
class ProcessSeries:
    """Resident memory of one server process over time (KiB)."""

    pid: int
    role: str
    t: list[float] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)
    anon_kib: list[int] = field(default_factory=list)


@dataclass
class CheckResult:
    """One end-of-run check, printed as one PASS/FAIL line."""

    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class ModelFacts:
    """What the harness needs to know about a served model."""

    name: str
    vocab_size: int
    context_length: int
    has_chat_template: bool


@dataclass(frozen=True)
class BadCase:
    """A malformed or out-of-range request and the one answer that is right for it."""

    name: str
    path: str
    body: dict[str, Any] | bytes
    status: int
    param: str | None  # the field the error must name (None: no particular field)


@dataclass(frozen=True)
class Outage:
    """An interval in which a model was not serving (503s inside it are expected)."""

    model: str
    start: float
    end: float


@dataclass
class Conversation:
    """A multi-turn chat so far."""

    model: str
    system: str
    turns: list[str] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)


@dataclass
class RunState:
    """Everything the tasks of one run share."""

    config: SoakConfig
    server: SoakServer
    facts: dict[str, ModelFacts]
    words: Sequence[str]
    t0: float
    stop: asyncio.Event
    records: list[RequestRecord] = field(default_factory=list)
    probes: list[ProbeResult] = field(default_factory=list)
    kills: list[KillRecord] = field(default_factory=list)
    health: list[HealthSample] = field(default_factory=list)
    rss: dict[int, ProcessSeries] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # latest seen, for progress
    watchers: list[asyncio.Task] = field(default_factory=list)  # kill recovery watchers
    server_exit: tuple[float, int] | None = None  # the launcher died mid-run: (t, code)
    drains: list[Outage] = field(default_factory=list)  # model changes: 503s documented
    hostile: Any = None  # soak_hostile.HostileRun with --hostile

    def now(self) -> float:
        return time.monotonic() - self.t0

    @property
    def url(self) -> str:
        return self.server.url

    def new_record(
        self, task: str, kind: str, model: str, endpoint: str, stream: bool
    ) -> RequestRecord:
        t = self.now()
        rec = RequestRecord(task, kind, model, endpoint, stream, t, math.floor(t / 60.0))
        self.records.append(rec)
        return rec


# ---- the server ------------------------------------------------------------------------
class ServerFailed(RuntimeError):
    """The server exited or never became ready."""


class SoakServer:
    """``launch.py`` as a subprocess in a session of its own; stderr to a log file."""

    def __init__(self, cmd: list[str], port: int, log_path: Path) -> None:
        self.cmd = cmd
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        # A session of its own: Ctrl-C at the terminal reaches only the harness,
        # which then stops the server in order.
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._roles: dict[int, str] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 8) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return " | ".join(lines[-n:])

    async def wait_ready(self, timeout: float) -> None:
        """Poll ``/health`` until 200 (503 "starting" means not yet)."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ServerFailed(f"exited with {self.proc.returncode}: {self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + "/health")).status_code == 200:
                        return
                await asyncio.sleep(1.0)
        raise ServerFailed(f"not ready after {timeout:.0f} s: {self.log_tail()}")

    def processes(self) -> dict[int, str]:
        """The launcher and its live children, pid -> role (``runner a#0``, ``front``, ...)."""
        found = {self.pid: "launcher"} if _alive(self.pid) else {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            if _ppid(pid) != self.pid:
                continue
            if pid not in self._roles:
                self._roles[pid] = _role(pid)
            found[pid] = self._roles[pid]
        # Forget the dead: a reused pid must not inherit an old role.
        self._roles = {pid: role for pid, role in self._roles.items() if pid in found}
        return found

    def stop(self) -> int | None:
        """SIGINT (the launcher stops everything in order), then SIGKILL if it lingers.

        Returns the launcher's exit code, or None when it had to be killed.
        """
        code: int | None = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                code = self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                code = None
        self._log.close()
        return code


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:  # the process exited between listing and reading
        return None


def _alive(pid: int) -> bool:
    stat = _read(f"/proc/{pid}/stat")
    return stat is not None and stat.rsplit(")", 1)[1].split()[0] != "Z"


def _ppid(pid: int) -> int | None:
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]) if fields[0] != "Z" else None


def _role(pid: int) -> str:
    """A runtime process's role from its command line: module, then its JSON config."""
    raw = _read(f"/proc/{pid}/cmdline") or ""
    argv = [a for a in raw.split("\0") if a]
    module = next((a for a in argv if a.startswith("radixmux.")), "")
    config: dict[str, Any] = {}
    with contextlib.suppress(ValueError, IndexError):
        config = json.loads(argv[-1])
    if module.endswith("runner_process"):
        return f"runner {config.get('runner_id', '?')}"
    if isinstance(config, dict) and config.get("name"):
        return str(config["name"])
    return module.rsplit(".", 1)[-1] or f"pid {pid}"


def arena_bytes(config: SoakConfig) -> int:
    """The profile's arena, scaled to the same tokens when the real models run in float32."""
    scale = 2 if config.dtype == "float32" and not config.tiny else 1
    return config.profile.kv_cache_bytes * scale


def server_command(config: SoakConfig, sources: Sequence[str]) -> list[str]:
    """The ``launch.py`` command line for this run."""
    cmd = [sys.executable, str(ROOT / "launch.py")]
    for name, source in zip(MODEL_NAMES, sources, strict=True):
        dtype = f",dtype={config.dtype}" if config.dtype else ""
        cmd += ["--model", f"{source},name={name}{dtype}"]
    cmd += [
        "--kv-cache-bytes",
        str(arena_bytes(config)),
        "--kv-block-bytes",
        str(config.profile.kv_block_bytes),
        "--port",
        str(config.port),
        "--log-level",
        "info",
        "--seed",
        str(config.seed),
    ]
    if config.runner_timeout_s > 0:
        cmd += ["--runner-timeout", f"{config.runner_timeout_s:g}"]
    if config.hostile:
        cmd += soak_hostile.server_flags(config)
    return [*cmd, *config.server_args]


def model_sources(tiny: bool) -> list[str]:
    """Tiny random models (made once under the model cache) or the embedded real ones."""
    if not tiny:
        return list(REAL_SOURCES)
    from bench.tiny_models import make_tiny_model_dir
    from radixmux.model_runners.fetch import cache_root

    base = cache_root() / "soak-tiny"
    # ``b`` has no chat template, like Gemma 3 270M (a base model); the context is
    # long enough for any request the load sends.
    return [
        str(make_tiny_model_dir(base / "a-ctx4096", seed=41, context=4096)),
        str(make_tiny_model_dir(base / "b-ctx4096", seed=42, context=4096, chat_template=False)),
    ]


# ---- one request -------------------------------------------------------------------------
def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _error_fields(rec: RequestRecord, body: Any) -> bool:
    """Fill the record's error fields from an OpenAI-style error body; False if not one."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not {"message", "type", "param", "code"} <= err.keys():
        return False
    rec.error_type = str(err["type"])
    rec.error_param = None if err["param"] is None else str(err["param"])
    code = err["code"]
    if isinstance(code, int) and not isinstance(code, bool):
        rec.error_code = code
    elif rec.status != 200:
        rec.error_code = rec.status
    else:  # an in-stream error with a symbolic code: its type says which status it is
        rec.error_code = ERROR_TYPE_STATUS.get(rec.error_type)
    rec.detail = str(err["message"])[:300]
    return True


def _finish_reason(msg: Any) -> str | None:
    """The finish reason of a response or stream event in any of the three APIs."""
    if not isinstance(msg, dict):
        return None
    meta = msg.get("meta_info")
    if isinstance(meta, dict):  # SGLang /generate
        finish = meta.get("finish_reason")
        return finish.get("type") if isinstance(finish, dict) else None
    choices = msg.get("choices") or []
    return choices[0].get("finish_reason") if choices and isinstance(choices[0], dict) else None


def _text(msg: Any) -> str:
    """The text of a response or stream event (``/generate`` streams carry it cumulative)."""
    if not isinstance(msg, dict):
        return ""
    if "meta_info" in msg:
        return str(msg.get("text") or "")
    choices = msg.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    holder = c.get("message") or c.get("delta") or {}
    return holder.get("content") or ""


def _complete(rec: RequestRecord, finish: str | None) -> None:
    """A 200 answer: ok only when it says how it finished (stop or length)."""
    if finish in ("stop", "length"):
        rec.outcome = "ok"
    else:
        rec.outcome = "incomplete"
        rec.detail = f"finish_reason {finish!r}"


async def _read_error(rec: RequestRecord, resp: httpx.Response) -> None:
    body = _json((await resp.aread()).decode(errors="replace"))
    if _error_fields(rec, body):
        rec.outcome = "error"
    else:
        rec.outcome = "bad_body"
        rec.detail = f"HTTP {resp.status_code} without a JSON error body"


async def _plain(client: httpx.AsyncClient, rec: RequestRecord, url: str, body: Any) -> str:
    """A non-streamed request; returns the answer's text."""
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"content-type": "application/json"}
    resp = await client.post(url, headers=headers, **kwargs)
    rec.status = resp.status_code
    rec.rid = resp.headers.get("x-request-id", "")
    if resp.status_code != 200:
        await _read_error(rec, resp)
        return ""
    msg = _json(resp.text)
    if not isinstance(msg, dict):
        rec.outcome, rec.detail = "bad_body", "200 with a body that is not a JSON object"
        return ""
    if rec.kind in CONTROL_KINDS:  # {"ok": true, ...}: no finish reason to look for
        rec.outcome = "ok" if msg.get("ok") is True else "bad_body"
        return ""
    _complete(rec, _finish_reason(msg))
    return _text(msg)


async def _stream(
    client: httpx.AsyncClient, rec: RequestRecord, url: str, body: Any, abandon_after: int | None
) -> str:
    """A streamed request read event by event; returns the text streamed."""
    t_start = time.monotonic()
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"content-type": "application/json"}
    text = ""
    async with client.stream("POST", url, headers=headers, **kwargs) as resp:
        rec.status = resp.status_code
        rec.rid = resp.headers.get("x-request-id", "")
        if resp.status_code != 200:
            await _read_error(rec, resp)
            return ""
        events, finish, errored = 0, None, False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                if errored:
                    rec.outcome = "stream_error"
                else:
                    _complete(rec, finish)
                return text
            msg = _json(data)
            if not isinstance(msg, dict) or errored:  # after an error event: only [DONE]
                rec.outcome, rec.detail = "bad_body", f"unexpected stream event {data[:80]!r}"
                return text
            if "error" in msg:
                errored = _error_fields(rec, msg)
                if not errored:
                    rec.outcome, rec.detail = "bad_body", "error event without the error shape"
                    return text
                continue
            piece = _text(msg)
            if piece and rec.ttft is None:
                rec.ttft = time.monotonic() - t_start
            text = piece if "meta_info" in msg else text + piece
            finish = _finish_reason(msg) or finish
            events += 1
            if abandon_after is not None and events >= abandon_after:
                rec.outcome = "abandoned"  # leaving the block closes the connection
                return text
    rec.outcome = "incomplete"
    rec.detail = "stream ended without [DONE]"
    return text


async def send(
    run: RunState,
    client: httpx.AsyncClient,
    rec: RequestRecord,
    body: dict[str, Any] | bytes,
    abandon_after: int | None = None,
) -> str:
    """Send one request, fill ``rec`` (never raises) and return the text answered.

    The whole request (not each read) is bounded by the run's request timeout,
    so a server that trickles bytes forever still counts as a hang.
    """
    url = run.url + rec.endpoint
    t = time.monotonic()
    text = ""
    try:
        work = (
            _stream(client, rec, url, body, abandon_after)
            if rec.stream
            else _plain(client, rec, url, body)
        )
        text = await asyncio.wait_for(work, run.config.profile.request_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        rec.outcome = "timeout"
        rec.detail = f"no complete answer within {run.config.profile.request_timeout_s:g} s"
    except (httpx.HTTPError, OSError) as exc:
        rec.outcome = "transport"
        rec.detail = f"{type(exc).__name__}: {exc}"[:300]
    rec.e2e = time.monotonic() - t
    rec.t_end = run.now()
    return text


async def pause_after(rec: RequestRecord, rng: random.Random, low: float, high: float) -> None:
    """Think time between requests; back off a second after 429/503 as Retry-After asks."""
    backoff = 1.0 if rec.error_code in (429, 503) else 0.0
    await asyncio.sleep(backoff + rng.uniform(low, high))


# ---- load tasks -----------------------------------------------------------------------------
def sampling(rng: random.Random, profile: Profile) -> dict[str, Any]:
    """Output length and sampling of a normal request: greedy or seeded, fixed length."""
    body: dict[str, Any] = {"max_tokens": rng.randint(*profile.max_tokens), "ignore_eos": True}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body |= {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(1 << 30)}
    return body


def api_body(
    endpoint: str, model: str, prompt: str, params: dict[str, Any], stream: bool
) -> dict[str, Any]:
    """``prompt`` with ``params`` in the shape ``endpoint`` takes."""
    if endpoint == "/generate":
        sp = {k: v for k, v in params.items() if k != "max_tokens"}
        sp["max_new_tokens"] = params["max_tokens"]
        return {"model": model, "text": prompt, "sampling_params": sp, "stream": stream}
    if endpoint == "/v1/chat/completions":
        messages = [{"role": "user", "content": prompt}]
        return {"model": model, "messages": messages, "stream": stream, **params}
    return {"model": model, "prompt": prompt, "stream": stream, **params}


def endpoints_for(facts: ModelFacts) -> list[str]:
    """Every API a model can serve (chat only with a chat template)."""
    eps = ["/v1/completions", "/generate"]
    return [*eps, "/v1/chat/completions"] if facts.has_chat_template else eps


async def shared_prefix_task(run: RunState, index: int) -> None:
    """Questions over a few long system prompts per model, through every API."""
    rng = random.Random(run.config.seed * 1009 + index)
    words = WordSource(run.words, random.Random(run.config.seed))  # same systems in every task
    p = run.config.profile
    systems = {m: [words.text(p.system_words) for _ in range(p.num_systems)] for m in run.facts}
    async with httpx.AsyncClient(trust_env=False, timeout=p.request_timeout_s) as client:
        while not run.stop.is_set():
            model = rng.choice(list(run.facts))
            endpoint = rng.choice(endpoints_for(run.facts[model]))
            stream = rng.random() < 0.6
            prompt = rng.choice(systems[model]) + "\n\nQuestion: "
            prompt += " ".join(rng.choice(run.words) for _ in range(p.question_words))
            body = api_body(endpoint, model, prompt, sampling(rng, p), stream)
            if stream and endpoint != "/generate" and rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
            rec = run.new_record(f"shared_prefix-{index}", "shared_prefix", model, endpoint, stream)
            await send(run, client, rec, body)
            await pause_after(rec, rng, 0.0, 0.5)


def turn_body(conv: Conversation, chat: bool, params: dict[str, Any]) -> dict[str, Any]:
    """The next turn of ``conv``: the whole conversation so far, streamed."""
    body: dict[str, Any] = {"model": conv.model, "stream": True, **params}
    if chat:
        body["messages"] = chat_messages(conv.system, conv.turns, conv.replies)
    else:
        body["prompt"] = completion_prompt(conv.system, conv.turns, conv.replies)
    return body


async def multi_turn_task(run: RunState, index: int) -> None:
    """Conversations that grow turn by turn, each turn resending everything before it."""
    rng = random.Random(run.config.seed * 2003 + index)
    words = WordSource(run.words, random.Random(run.config.seed + 1))
    p = run.config.profile
    systems = [words.text(p.system_words // 2) for _ in range(p.num_systems)]
    conv: Conversation | None = None
    async with httpx.AsyncClient(trust_env=False, timeout=p.request_timeout_s) as client:
        while not run.stop.is_set():
            if conv is None or len(conv.turns) >= p.max_turns:
                conv = Conversation(rng.choice(list(run.facts)), rng.choice(systems))
            chat = run.facts[conv.model].has_chat_template
            conv.turns.append(" ".join(rng.choice(run.words) for _ in range(p.question_words)))
            endpoint = "/v1/chat/completions" if chat else "/v1/completions"
            body = turn_body(conv, chat, sampling(rng, p))
            rec = run.new_record(f"multi_turn-{index}", "multi_turn", conv.model, endpoint, True)
            reply = await send(run, client, rec, body)
            if rec.outcome == "ok":
                conv.replies.append(reply)
            else:
                conv.turns.pop()  # resend this turn later, as a client retrying would
            await pause_after(rec, rng, 0.0, 0.5)


async def abandon_task(run: RunState, index: int) -> None:
    """Streams closed by the client after a random number of events."""
    rng = random.Random(run.config.seed * 3001 + index)
    p = run.config.profile
    async with httpx.AsyncClient(trust_env=False, timeout=p.request_timeout_s) as client:
        while not run.stop.is_set():
            model = rng.choice(list(run.facts))
            endpoint = rng.choice(endpoints_for(run.facts[model]))
            prompt = " ".join(rng.choice(run.words) for _ in range(p.question_words * 4))
            params = {"max_tokens": p.abandon_max_tokens, "ignore_eos": True, "temperature": 0}
            body = api_body(endpoint, model, prompt, params, True)
            rec = run.new_record(f"abandon-{index}", "abandon", model, endpoint, True)
            await send(run, client, rec, body, abandon_after=rng.randint(1, 12))
            await pause_after(rec, rng, 0.5, 2.0)


async def burst_task(run: RunState) -> None:
    """Every ``burst_every_s``, ``BURST_SIZE`` long greedy streams at once over both models.

    Admission reserves only part of each request's output, so together their
    decodes outgrow the small arena and the scheduler must retract some, which
    then resume: retraction under chaos, not only eviction.
    """
    rng = random.Random(run.config.seed * 6007)
    p = run.config.profile
    names = list(run.facts)
    params = {"max_tokens": p.burst_max_tokens, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(trust_env=False, timeout=p.request_timeout_s) as client:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run.stop.wait(), p.burst_every_s)
                return
            jobs = []
            for i in range(BURST_SIZE):
                model = names[i % len(names)]
                prompt = " ".join(rng.choice(run.words) for _ in range(p.question_words * 4))
                body = api_body("/v1/completions", model, prompt, params, True)
                rec = run.new_record("burst", "burst", model, "/v1/completions", True)
                jobs.append(send(run, client, rec, body))
            await asyncio.gather(*jobs)


def raw_request(port: int, path: str, body: bytes) -> bytes:
    """An HTTP/1.1 POST as bytes, for clients that hang up mid-request."""
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def disconnect_once(run: RunState, rec: RequestRecord, body: bytes, delay: float) -> None:
    """Send the whole request, wait ``delay`` (the server is tokenizing), then hang up."""
    t = time.monotonic()
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", run.config.port), 30
        )
        writer.write(raw_request(run.config.port, rec.endpoint, body))
        await writer.drain()
        await asyncio.sleep(delay)
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        rec.outcome = "disconnected"
    except (OSError, asyncio.TimeoutError) as exc:
        rec.outcome = "transport"
        rec.detail = f"{type(exc).__name__}: {exc}"[:300]
    rec.e2e = time.monotonic() - t
    rec.t_end = run.now()


def disconnect_body(run: RunState, rng: random.Random, model: str) -> bytes:
    """A long prompt (slow to tokenize) with a long output: an orphan would run for long."""
    p = run.config.profile
    prompt = " ".join(rng.choice(run.words) for _ in range(p.disconnect_words))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": p.disconnect_max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    return json.dumps(body).encode()


async def disconnect_task(run: RunState, index: int) -> None:
    """Clients that hang up while their long prompt is still being tokenized."""
    rng = random.Random(run.config.seed * 4001 + index)
    p = run.config.profile
    while not run.stop.is_set():
        model = rng.choice(list(run.facts))
        rec = run.new_record(f"disconnect-{index}", "disconnect", model, "/v1/completions", False)
        await disconnect_once(run, rec, disconnect_body(run, rng, model), rng.uniform(0, 0.02))
        await asyncio.sleep(rng.uniform(*p.disconnect_every_s))


def bad_cases(facts: dict[str, ModelFacts]) -> list[BadCase]:
    """Malformed and out-of-range requests; each must get exactly this 4xx JSON error."""
    m = next(iter(facts.values()))
    chat_model = next((f for f in facts.values() if f.has_chat_template), None)
    no_template = next((f for f in facts.values() if not f.has_chat_template), None)
    base = {"model": m.name, "prompt": "Hello there", "max_tokens": 4}
    over_vocab = m.vocab_size + 1
    cases = [
        BadCase(
            "temperature -1", "/v1/completions", {**base, "temperature": -1}, 400, "temperature"
        ),
        BadCase("top_k > vocab", "/v1/completions", {**base, "top_k": over_vocab}, 400, "top_k"),
        BadCase("max_tokens 0", "/v1/completions", {**base, "max_tokens": 0}, 400, "max_tokens"),
        BadCase(
            "max_tokens > context",
            "/v1/completions",
            {**base, "max_tokens": 2 * m.context_length},
            400,
            "max_tokens",
        ),
        BadCase("top_p 0", "/v1/completions", {**base, "top_p": 0}, 400, "top_p"),
        BadCase(
            "presence_penalty 5",
            "/v1/completions",
            {**base, "presence_penalty": 5},
            400,
            "presence_penalty",
        ),
        BadCase(
            "max_tokens string",
            "/v1/completions",
            {**base, "max_tokens": "many"},
            400,
            "max_tokens",
        ),
        BadCase(
            "token id out of range",
            "/v1/completions",
            {**base, "prompt": [m.vocab_size + 5]},
            400,
            "prompt",
        ),
        BadCase(
            "unknown model", "/v1/completions", {**base, "model": "no-such-model"}, 404, "model"
        ),
        BadCase("malformed JSON", "/v1/completions", b'{"model": "a", "prompt": ', 400, None),
        BadCase(
            "generate top_k > vocab",
            "/generate",
            {"model": m.name, "text": "Hi", "sampling_params": {"top_k": over_vocab}},
            400,
            "sampling_params.top_k",
        ),
        BadCase(
            "generate n 99",
            "/generate",
            {"model": m.name, "text": "Hi", "sampling_params": {"n": 99}},
            400,
            "sampling_params.n",
        ),
    ]
    if chat_model is not None:
        messages = [{"role": "user", "content": "Hi"}]
        body = {"model": chat_model.name, "messages": messages, "top_k": chat_model.vocab_size + 1}
        cases.append(BadCase("chat top_k > vocab", "/v1/chat/completions", body, 400, "top_k"))
    if no_template is not None:
        body = {"model": no_template.name, "messages": [{"role": "user", "content": "Hi"}]}
        cases.append(
            BadCase("chat without template", "/v1/chat/completions", body, 400, "messages")
        )
    return cases


async def bad_input_task(run: RunState, index: int) -> None:
    """Malformed and out-of-range requests, streamed or not, each expecting its 4xx."""
    rng = random.Random(run.config.seed * 5003 + index)
    cases = bad_cases(run.facts)
    p = run.config.profile
    async with httpx.AsyncClient(trust_env=False, timeout=p.request_timeout_s) as client:
        while not run.stop.is_set():
            case = rng.choice(cases)
            stream = isinstance(case.body, dict) and rng.random() < 0.5
            body = (
                {**case.body, "stream": True}
                if isinstance(case.body, dict) and stream
                else case.body
            )
            model = case.body.get("model", "?") if isinstance(case.body, dict) else "a"
            rec = run.new_record(f"bad_input-{index}", "bad_input", str(model), case.path, stream)
            rec.expected_status, rec.expected_param = case.status, case.param
            rec.case = case.name
            await send(run, client, rec, body)
            await asyncio.sleep(rng.uniform(*p.bad_input_every_s))


async def cache_ops_task(run: RunState) -> None:
    """Invalidate each model in turn and flush everything, every few seconds, in a fixed cycle."""
    cycle = [*(("invalidate", m) for m in run.facts), ("flush", "*")]
    p = run.config.profile
    i = 0
    async with httpx.AsyncClient(trust_env=False, timeout=p.request_timeout_s) as client:
        while not run.stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run.stop.wait(), p.cache_op_every_s)
                return
            kind, model = cycle[i % len(cycle)]
            i += 1
            endpoint = "/flush_cache" if kind == "flush" else f"/models/{model}/invalidate"
            rec = run.new_record("cache_ops", kind, model, endpoint, False)
            await send(run, client, rec, b"")


# ---- probe -----------------------------------------------------------------------------
async def probe_once(run: RunState, client: httpx.AsyncClient, model: str, phase: str) -> None:
    """The fixed greedy prompt to ``model``; its answer must never change."""
    body = {
        "model": model,
        "prompt": PROBE_PROMPT,
        "max_tokens": PROBE_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    rec = run.new_record("probe", "probe", model, "/v1/completions", False)
    text = await send(run, client, rec, body)
    run.probes.append(ProbeResult(model, phase, rec.t_start, rec.status, rec.outcome, text))


async def probe_all(run: RunState, phase: str) -> None:
    async with httpx.AsyncClient(
        trust_env=False, timeout=run.config.profile.request_timeout_s
    ) as c:
        for model in run.facts:
            await probe_once(run, c, model, phase)


async def probe_task(run: RunState) -> None:
    """Probe every model every ``probe_every_s`` while the load runs."""
    every = run.config.profile.probe_every_s
    while True:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(run.stop.wait(), every)
            return
        await probe_all(run, "during")


# ---- server state --------------------------------------------------------------------------
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
                states = model_states(resp.status_code, _json(resp.text), names)
                run.health.append(HealthSample(run.now(), resp.status_code, states))
            except httpx.HTTPError:
                run.health.append(HealthSample(run.now(), 0, dict.fromkeys(names, "unreachable")))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run.stop.wait(), HEALTH_EVERY_S)


# ---- chaos: the killer ---------------------------------------------------------------------
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


# ---- resident memory -----------------------------------------------------------------------
def read_rss(pid: int) -> tuple[int, int] | None:
    """(VmRSS, RssAnon) of ``pid`` in KiB, or None when it is gone."""
    status = _read(f"/proc/{pid}/status")
    if status is None:
        return None
    values = {}
    for line in status.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            values[key] = int(rest.split()[0])
    if "VmRSS" not in values:  # a zombie has no memory lines
        return None
    return values["VmRSS"], values.get("RssAnon", 0)


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


# ---- progress -----------------------------------------------------------------------------
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


# ---- end phase --------------------------------------------------------------------------------
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
            health_status, health_body = resp.status_code, _json(resp.text)
        except httpx.HTTPError:
            health_status, health_body = 0, None
        sched = await server_info(client, run.url)
    flush_status, flushed = await flush_and_read(run)
    sample_rss(run)  # the end point of the memory check
    metrics = await scrape_metrics(run.url)
    return EndState(
        first, final, quiet, health_status, health_body, sched, flush_status, flushed, metrics
    )


# ---- checks -------------------------------------------------------------------------------------
def outages(run: RunState) -> list[Outage]:
    """When each model was not serving: kill to recovery, and every non-serving health sample."""
    end = run.now()
    out = [
        Outage(k.model, k.t_kill, k.t_serving if k.t_serving is not None else end)
        for k in run.kills
    ]
    for sample in run.health:  # the state held somewhere between the neighbouring polls
        for model, state in sample.states.items():
            if state != "serving":
                out.append(Outage(model, sample.t - HEALTH_EVERY_S, sample.t + HEALTH_EVERY_S))
    return out + run.drains


def in_outage(rec: RequestRecord, windows: Sequence[Outage]) -> bool:
    return any(
        w.model == rec.model
        and rec.t_start <= w.end + OUTAGE_GRACE_S
        and rec.t_end >= w.start - OUTAGE_GRACE_S
        for w in windows
    )


def problems(rec: RequestRecord, windows: Sequence[Outage]) -> list[tuple[str, str]]:
    """(check name, why) for everything wrong with ``rec``'s answer; [] when it is fine."""
    stream = " stream" if rec.stream else ""
    where = f"{rec.kind} {rec.model} {rec.endpoint}{stream} @{rec.t_start:.0f}s"
    if rec.outcome in ("abandoned", "disconnected", "drain_cut"):
        return []
    if rec.outcome == "timeout":
        return [("no_hangs", f"{where}: {rec.detail}")]
    if rec.outcome == "transport":
        return [("no_connection_errors", f"{where}: {rec.detail}")]
    if rec.outcome in ("incomplete", "bad_body"):
        return [("complete_answers", f"{where}: {rec.outcome}: {rec.detail}")]
    found = []
    if rec.outcome in ("error", "stream_error") and INTERNALS.search(rec.detail or ""):
        found.append(("no_internals_in_errors", f"{where}: {rec.detail[:160]!r}"))
    if rec.expected_status is not None:
        return found + bad_input_problems(rec)
    code = rec.status if rec.outcome == "error" else rec.error_code
    if rec.outcome == "ok" or code == 429:
        return found
    if code == 503:
        if not in_outage(rec, windows):
            why = f"{where}: 503 while {rec.model} was serving: {rec.detail[:120]}"
            found.append(("503_only_while_down", why))
        return found
    why = f"{where}: {code} {rec.error_type}: {rec.detail[:160]!r}"
    return [*found, ("status_ok_4xx_429_503", why)]


def bad_input_problems(rec: RequestRecord) -> list[tuple[str, str]]:
    """A malformed request must get exactly its 4xx, as a JSON error naming the field."""
    code = rec.status if rec.outcome == "error" else rec.error_code
    if rec.outcome != "error" or rec.status != rec.expected_status:
        got = f"{rec.status} {rec.outcome}" + (f" code {code}" if code else "")
        return [("bad_input_rejected", f"{rec.case}: got {got}, want {rec.expected_status}")]
    if rec.expected_param is not None and rec.expected_param not in (rec.error_param or ""):
        why = f"{rec.case}: error names {rec.error_param!r}, want {rec.expected_param!r}"
        return [("bad_input_rejected", why)]
    return []


RESPONSE_CHECKS = {
    "status_ok_4xx_429_503": "every answer 200, a 4xx for bad input, 429 or 503; no other status",
    "bad_input_rejected": "every malformed or out-of-range request got its 4xx naming the field",
    "503_only_while_down": "503s only while the model was down or restarting",
    "complete_answers": "no truncated stream without an error event, every body well-formed",
    "no_hangs": "no request past its timeout",
    "no_connection_errors": "the server never refused or dropped a connection",
    "no_internals_in_errors": "no exception text, traceback or path in an error message",
}


def response_checks(run: RunState) -> list[CheckResult]:
    """One check per kind of wrong answer, listing up to three examples each."""
    windows = outages(run)
    found: dict[str, list[str]] = {name: [] for name in RESPONSE_CHECKS}
    for rec in run.records:
        for name, why in problems(rec, windows):
            found[name].append(why)
    out = []
    total = len(run.records)
    for name, what in RESPONSE_CHECKS.items():
        bad = found[name]
        detail = (
            f"{what}: {total - len(bad)}/{total} fine"
            if not bad
            else (f"{len(bad)} of {total}: " + "; ".join(bad[:3]))
        )
        out.append(CheckResult(name, not bad, detail))
    return out


def probe_check(run: RunState) -> CheckResult:
    """Greedy probe answers identical before, during and after, per model."""
    issues: list[str] = []
    summary: list[str] = []
    for model in run.facts:
        mine = [p for p in run.probes if p.model == model]
        answered = [p for p in mine if p.status == 200 and p.outcome == "ok"]
        texts = {p.text for p in answered}
        phases = {p.phase for p in answered}
        for phase in ("before", "during", "after"):
            if phase not in phases:
                issues.append(f"{model}: no 200 answer {phase} the load")
        if len(texts) > 1:
            firsts = [repr(t[:40]) for t in sorted(texts)[:3]]
            issues.append(f"{model}: {len(texts)} different answers ({', '.join(firsts)})")
        unavailable = sum(1 for p in mine if p.status == 503)
        summary.append(f"{model}: {len(answered)}/{len(mine)} answered, {unavailable} 503")
    detail = "; ".join(issues) if issues else "identical; " + ", ".join(summary)
    return CheckResult("probe_identical", not issues, detail)


def idle_checks(end: EndState) -> list[CheckResult]:
    """No orphan work after the load; the idle server reaches idle at all."""
    first, final = end.idle_after_load, end.idle_final
    return [
        CheckResult(
            "idle_after_load",
            first.idle,
            f"idle {first.waited_s:.1f} s after the last client finished"
            if first.idle
            else f"still busy {IDLE_GRACE_S:.0f} s after every client finished "
            f"({busy_summary(first.models)}): requests run for nobody",
        ),
        end.quiet,
        CheckResult(
            "idle_at_end",
            final.idle,
            "server idle for the final checks"
            if final.idle
            else f"not idle after {IDLE_TIMEOUT_S:.0f} s: {busy_summary(final.models)}",
        ),
    ]


def contract_check(end: EndState) -> CheckResult:
    """``/get_server_info`` and ``/health`` carry the fields the checks read."""
    missing = [f"scheduler.{k}" for k in SERVER_INFO_FIELDS if k not in end.sched]
    for name, m in info_models(end.sched).items():
        missing += [f"models[{name}].{k}" for k in MODEL_INFO_FIELDS if k not in m]
    body = end.health_body if isinstance(end.health_body, dict) else {}
    if not isinstance(body.get("models"), dict):
        missing.append("/health models")
    ok = not missing and bool(end.sched)
    detail = "every field present" if ok else "missing: " + ", ".join(missing or ["server info"])
    return CheckResult("server_reports_state", ok, detail)


def serving_check(run: RunState, end: EndState) -> CheckResult:
    """Every model serving at the end, by ``/health`` (200, status ok, all serving)."""
    states = model_states(end.health_status, end.health_body, list(run.facts))
    body = end.health_body if isinstance(end.health_body, dict) else {}
    ok = (
        end.health_status == 200
        and body.get("status") == "ok"
        and isinstance(body.get("models"), dict)
        and all(s == "serving" for s in states.values())
    )
    detail = f"/health {end.health_status} {json.dumps(body)[:200]}"
    return CheckResult("models_serving_at_end", ok, detail)


def scheduler_checks(end: EndState) -> list[CheckResult]:
    """The scheduler's own invariant check, zero locks, zero request-owned slots."""
    s = end.sched
    inv = s.get("invariants")
    locks, owned = s.get("locks_held"), s.get("request_owned_slots")
    return [
        CheckResult("invariants_ok", inv == "ok", f"invariants: {inv!r}"),
        CheckResult(
            "no_locks_or_owned_slots_idle",
            locks == 0 and owned == 0,
            f"locks_held {locks!r}, request_owned_slots {owned!r} on the idle server",
        ),
    ]


def arena_check(end: EndState) -> CheckResult:
    """Every block is free or the tree's: after ``/flush_cache`` on the idle server, all free."""
    before, after = end.sched, end.flushed
    total = after.get("arena_total_bytes")
    free = after.get("arena_free_bytes")
    cached = {n: m.get("cached_tokens") for n, m in info_models(after).items()}
    held = sum(int(m.get("arena_bytes") or 0) for m in info_models(before).values())
    accounted = before.get("arena_free_bytes", -1) + held == before.get("arena_total_bytes")
    ok = (
        end.flush_status == 200
        and total is not None
        and free == total
        and all(c == 0 for c in cached.values())
        and accounted
    )
    detail = (
        f"before flush: free {before.get('arena_free_bytes')} + models {held} of "
        f"{before.get('arena_total_bytes')}; flush {end.flush_status}, then free {free} of "
        f"{total}, cached tokens {cached}"
    )
    return CheckResult("arena_free_or_tree", ok, detail)


def rss_baseline_s(load_s: float) -> float:
    """Minute 2, or the halfway point of a run shorter than four minutes (never vacuous)."""
    return min(RSS_BASELINE_S, load_s / 2)


def rss_growth(series: ProcessSeries, warm_s: float, end_t: float) -> float | None:
    """RSS growth of one process from ``warm_s`` into its own life (never before
    the run's own minute ``warm_s``) to its last sample.

    A runner restarted after a kill is a new process: it is judged over its own
    life, from when it is warm (weights loaded, kernels built) to its death or
    the end. None when that window is shorter than ``RSS_MIN_WINDOW_S``.
    """
    if not series.t:
        return None
    base = max(warm_s, series.t[0] + warm_s)
    last = min(series.t[-1], end_t)
    if last - base < RSS_MIN_WINDOW_S:
        return None
    i = next(i for i, t in enumerate(series.t) if t >= base)
    j = max(i for i, t in enumerate(series.t) if t <= last)
    return series.rss_kib[j] / series.rss_kib[i] - 1.0


def rss_check(run: RunState) -> tuple[CheckResult, dict[str, Any]]:
    """Every process grew < 5% from minute 2 of its life to its end (or the run's);
    processes that lived too short a warm window are listed apart."""
    base = rss_baseline_s(run.config.load_s)
    end_t = max((s.t[-1] for s in run.rss.values() if s.t), default=0.0)
    compared: dict[str, float] = {}
    others: dict[str, str] = {}
    for s in run.rss.values():
        key = f"{s.role} ({s.pid})"
        g = rss_growth(s, base, end_t)
        if g is None:
            others[key] = f"lived {s.t[0]:.0f}-{s.t[-1]:.0f} s" if s.t else "no sample"
        else:
            compared[key] = round(g, 4)
    over = {k: g for k, g in compared.items() if g >= RSS_GROWTH_LIMIT}
    ok = bool(compared) and not over
    shown = ", ".join(f"{k} {g:+.1%}" for k, g in sorted(compared.items()))
    detail = f"from {base:.0f} s into each process's life to its end: {shown}" + (
        f"; over {RSS_GROWTH_LIMIT:.0%}: {sorted(over)}" if over else ""
    )
    if others:
        detail += f"; not compared: {others}"
    return CheckResult("rss_growth_under_5pct", ok, detail), {
        "baseline_s": base,
        "growth": compared,
        "not_compared": others,
    }


def restart_check(run: RunState, end: EndState) -> CheckResult:
    """Runner restarts equal kills, per model, and every killed model came back."""
    restarts = {n: m.get("restarts") for n, m in info_models(end.sched).items()}
    kills = Counter(k.model for k in run.kills)
    unrecovered = [f"{k.model}@{k.t_kill:.0f}s" for k in run.kills if k.t_serving is None]
    expected_kill = run.config.kill_every_s <= run.config.load_s - KILL_MARGIN_S
    ok = (
        all(restarts.get(n) == kills.get(n, 0) for n in run.facts)
        and not unrecovered
        and (bool(run.kills) or not expected_kill)
    )
    back = [round(k.t_serving - k.t_kill, 1) for k in run.kills if k.t_serving is not None]
    detail = f"kills {dict(kills)}, restarts {restarts}, back serving after {back} s"
    if unrecovered:
        detail += f"; never serving again: {unrecovered}"
    if expected_kill and not run.kills:
        detail += "; no kill happened"
    return CheckResult("restarts_equal_kills", ok, detail)


def server_up_check(run: RunState, end: EndState) -> CheckResult:
    """The launcher lived through the run and stopped cleanly (exit 0, no process left)."""
    ok = run.server_exit is None and end.exit_code == 0 and not end.leftover
    detail = f"launcher exit code {end.exit_code}"
    if run.server_exit is not None:
        detail = f"launcher died at {run.server_exit[0]:.0f} s with code {run.server_exit[1]}"
    if end.leftover:
        detail += f"; still alive after stop: {end.leftover}"
    return CheckResult("server_up_and_clean_stop", ok, detail)


def mix_check(run: RunState, end: EndState) -> CheckResult:
    """The run exercised what it claims: every kind of request, eviction and retraction."""
    kinds = Counter(r.kind for r in run.records)
    missing = [k for k in REQUEST_KINDS if not kinds.get(k)]
    evicted = end.sched.get("evicted_tokens") or {}
    pressure = int(evicted.get("capacity", sum(evicted.values()) if evicted else 0))
    retractions = int(end.sched.get("retractions") or 0)
    ok = not missing and pressure > 0 and retractions > 0
    detail = f"requests {dict(kinds)}; capacity evictions {pressure} tokens, "
    detail += f"retractions {retractions}"
    if missing:
        detail += f"; no {missing}"
    return CheckResult("load_mix_exercised", ok, detail)


def all_checks(run: RunState, end: EndState) -> tuple[list[CheckResult], dict[str, Any]]:
    rss, rss_detail = rss_check(run)
    checks = [
        *response_checks(run),
        probe_check(run),
        *idle_checks(end),
        serving_check(run, end),
        contract_check(end),
        *scheduler_checks(end),
        arena_check(end),
        rss,
        restart_check(run, end),
        server_up_check(run, end),
        mix_check(run, end),
    ]
    return checks, rss_detail


# ---- report -------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def per_minute(run: RunState) -> list[dict[str, Any]]:
    """Requests by status and TTFT p50/p99 (streams that got a token) per minute of load."""
    last = math.ceil(run.config.load_s / 60.0)  # later records are the end phase's
    minutes = sorted({r.minute for r in run.records if 0 <= r.minute < last})
    rows = []
    for m in minutes:
        recs = [r for r in run.records if r.minute == m]
        ttft = [r.ttft for r in recs if r.ttft is not None]
        row = {"minute": m, "requests": by_status(recs), "ttft_n": len(ttft)}
        row["ttft_p50_ms"] = None if not ttft else round(1000 * percentile(ttft, 0.5), 1)
        row["ttft_p99_ms"] = None if not ttft else round(1000 * percentile(ttft, 0.99), 1)
        rows.append(row)
    return rows


def report(
    run: RunState, end: EndState, checks: list[CheckResult], rss_detail: dict[str, Any]
) -> dict[str, Any]:
    """The JSON report: config, checks, summaries, and every record."""
    return {
        "passed": all(c.passed for c in checks),
        "checks": [dataclasses.asdict(c) for c in checks],
        "config": {
            **{k: v for k, v in dataclasses.asdict(run.config).items() if k != "out"},
            "out": str(run.config.out),
        },
        "server_cmd": run.server.cmd,
        "models": {n: dataclasses.asdict(f) for n, f in run.facts.items()},
        "load_s": run.config.load_s,
        "requests_by_status": by_status(run.records),
        "requests_by_kind": dict(Counter(r.kind for r in run.records)),
        "kills": [dataclasses.asdict(k) for k in run.kills],
        "restarts": {n: m.get("restarts") for n, m in info_models(end.sched).items()},
        "per_minute": per_minute(run),
        "rss": rss_detail,
        "rss_series": [dataclasses.asdict(s) for s in run.rss.values()],
        "probes": [dataclasses.asdict(p) for p in run.probes],
        "health": [dataclasses.asdict(h) for h in run.health],
        "scheduler_idle": end.sched,
        "scheduler_after_flush": end.flushed,
        "metrics": end.metrics,
        "records": [dataclasses.asdict(r) for r in run.records],
    }


def plot(data: dict[str, Any], path: Path) -> None:
    """Requests by status and TTFT per minute, RSS per process over time, kill markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["per_minute"]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 11), sharex=True)
    minutes = [r["minute"] for r in rows]
    labels = sorted({k for r in rows for k in r["requests"]})
    bottom = [0] * len(rows)
    for label in labels:
        counts = [r["requests"].get(label, 0) for r in rows]
        # Minute m spans [m, m + 1) on the shared time axis.
        ax1.bar([m + 0.5 for m in minutes], counts, bottom=bottom, label=label, width=0.9)
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax1.set_ylabel("requests")
    ax1.set_title("requests by status per minute")
    ax1.legend(fontsize=7, ncol=4)
    for key, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "s--")):
        pts = [(r["minute"] + 0.5, r[key]) for r in rows if r[key] is not None]
        if pts:
            ax2.plot(*zip(*pts, strict=True), style, label=key.replace("_ms", "").replace("_", " "))
    ax2.set_yscale("log")
    ax2.set_ylabel("ms")
    ax2.set_title("time to first token per minute (streams)")
    ax2.legend(fontsize=8)
    for s in data["rss_series"]:
        ax3.plot(
            [t / 60 for t in s["t"]],
            [k / 1024 for k in s["rss_kib"]],
            label=f"{s['role']} ({s['pid']})",
        )
    ax3.set_ylabel("RSS (MiB)")
    ax3.set_xlabel("minute")
    ax3.set_title("resident memory per process")
    ax3.legend(fontsize=7, ncol=3)
    for k in data["kills"]:
        for ax in (ax1, ax2, ax3):
            ax.axvline(k["t_kill"] / 60, color="red", linestyle=":", linewidth=1)
    for ax in (ax1, ax2, ax3):
        ax.axvline(data["load_s"] / 60, color="gray", linestyle="--", linewidth=1)
    ax1.text(
        0.01,
        0.95,
        "red dotted: runner SIGKILL; gray dashed: load stopped",
        transform=ax1.transAxes,
        fontsize=7,
        va="top",
        color="red",
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_summary(data: dict[str, Any], checks: Sequence[CheckResult]) -> None:
    print("\n== soak summary")
    print(f"requests by status: {data['requests_by_status']}")
    print(f"requests by kind:   {data['requests_by_kind']}")
    print(f"kills: {len(data['kills'])}, restarts: {data['restarts']}")
    for row in data["per_minute"]:
        print(
            f"  minute {row['minute']:>3}: TTFT p50 {row['ttft_p50_ms']} ms, "
            f"p99 {row['ttft_p99_ms']} ms, {row['requests']}"
        )
    print("\n== checks")
    for c in checks:
        print(f"[{'PASS' if c.passed else 'FAIL'}] {c.name}: {c.detail}")
    failed = [c.name for c in checks if not c.passed]
    verdict = "PASS" if not failed else f"FAIL ({len(failed)} of {len(checks)}: {failed})"
    print(f"\nsoak: {verdict}", flush=True)


# ---- the run ----------------------------------------------------------------------------------
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
        *(soak_hostile.load_tasks(run) if run.config.hostile else []),
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
    await server.wait_ready(config.profile.start_timeout_s)
    facts = await model_facts(server.url, MODEL_NAMES)
    words = vocabulary_words(str(resolve_tokenizer(sources[0])))
    run = RunState(config, server, facts, words, time.monotonic(), asyncio.Event())
    print(f"[soak] server ready: {server.url}; load for {config.minutes:g} min", flush=True)
    sample_rss(run)
    await probe_all(run, "before")
    if config.hostile:
        await soak_hostile.before_load(run)
    shift_origin(run)
    await drive(run)
    end = await end_phase(run)
    if config.hostile:
        await soak_hostile.after_load(run)
    procs = list(server.processes())
    end.exit_code = server.stop()
    end.leftover = [p for p in procs if p != server.pid and _alive(p)]
    if config.hostile:
        await soak_hostile.restart_phase(run)
    checks, rss_detail = all_checks(run, end)
    checks += soak_hostile.checks(run) if config.hostile else []
    data = report(run, end, checks, rss_detail)
    if config.hostile:
        data["hostile"] = soak_hostile.report(run)
    print_summary(data, checks)  # first: a half-hour's verdict must not hang on a file write
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(data, indent=1) + "\n")
    plot(data, config.png)
    print(f"[soak] wrote {config.out} and {config.png}; server log {config.log}")
    if config.hostile:
        soak_hostile.cleanup(run, data["passed"])
    return 0 if data["passed"] else 1


def parse_args(argv: Sequence[str] | None = None) -> SoakConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    p.add_argument("--tiny", action="store_true", help="two tiny random-weight models (tests)")
    p.add_argument(
        "--kill-every",
        type=float,
        default=None,
        help=f"seconds between runner kills (default {TINY.kill_every_s:g} tiny, "
        f"{REAL.kill_every_s:g} real)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one)")
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR / "soak.json",
        help="JSON path (or a folder: soak.json in it); the PNG and the server log go beside it",
    )
    p.add_argument(
        "--runner-timeout",
        type=float,
        default=60.0,
        help="the server's --runner-timeout (0: do not pass it, for older servers)",
    )
    p.add_argument("--server-args", default="", help="extra launch.py flags, one string")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default=None,
        help="the models' dtype (default float32): the greedy probe holds the correctness "
        "contract, which is float32's; in bfloat16 a prefix prefilled in other chunks, or a "
        "decode in another cascade group, rounds differently and near-ties flip (README), "
        "the more often in the tiny random-weight models",
    )
    p.add_argument(
        "--hostile",
        action="store_true",
        help="hostile clients beside the load, with the disk tier on (bench/soak_hostile.py)",
    )
    a = p.parse_args(argv)
    profile = TINY if a.tiny else REAL
    port = a.port or free_port()
    return SoakConfig(
        minutes=a.minutes,
        tiny=a.tiny,
        kill_every_s=a.kill_every or profile.kill_every_s,
        seed=a.seed,
        port=port,
        out=a.out / "soak.json" if a.out.is_dir() else a.out,  # a folder: soak.json in it
        runner_timeout_s=a.runner_timeout,
        server_args=tuple(a.server_args.split()),
        profile=profile,
        dtype=a.dtype or "float32",
        hostile=a.hostile,
    )


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    if config.hostile:
        config = soak_hostile.prepare(config)
    sources = model_sources(config.tiny)
    cmd = server_command(config, sources)
    print(f"[soak] starting {' '.join(cmd)}", flush=True)
    server = SoakServer(cmd, config.port, config.log)
    # SIGTERM stops the run like Ctrl-C: the finally below then stops the server,
    # which would otherwise outlive us.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return asyncio.run(soak(config, server, sources))
    except ServerFailed as exc:
        print(f"[soak] FAIL: server did not start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("[soak] interrupted", file=sys.stderr)
        return 130
    finally:
        server.stop()  # idempotent: a no-op once the run stopped it


if __name__ == "__main__":
    # Through the package, so bench.soak_hostile and this run share one copy of the module.
    from bench import soak as _soak

    raise SystemExit(_soak.main())
