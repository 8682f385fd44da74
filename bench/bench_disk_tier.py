"""Disk tier benchmarks (``--kv-disk-bytes``): chat beyond the arena, restarts, raw load speed.

Every configuration starts its own in-process server (``runtime.engine.Engine``,
the real processes on a free port) and stops it gracefully before the next
one starts, so no two share the cores. Each tier run gets a fresh temporary
``--kv-disk-dir`` (removed afterwards).

- ``chat``: multi-turn conversations to two models (``a`` and ``b``) whose
  KV working set (every conversation's final context) is ``--chat-ratio``
  (4) times the arena. Turns are sent round-robin over the conversations, at
  most ``concurrency`` at a time, so a conversation comes back only after all
  the others have had a turn: without the tier its history was evicted and is
  prefilled again; with it the history is loaded from disk. Same workload
  with and without ``--kv-disk-bytes``: output and request throughput, TTFT
  p50/p99, prompt tokens computed and tokens loaded from disk (the server's
  own counters). Target (the issue): tier >= 1.5x the throughput without.
- ``restart``: a 2,000-token system prompt is sent once (plus a short
  question) to a server with the tier, which is stopped gracefully (the tier
  saves the arena on stop); a new server on the same directory answers the
  same system prompt with another question: its TTFT (streamed, disk-warm)
  against the first server's first TTFT for it (cold, a fresh directory) and
  a memory-warm TTFT (the first server's second request). Medians over
  ``--restart-reps`` repetitions, each on a fresh directory.
- ``raw``: per prefix length, the prefill time (TTFT of a prompt whose prefix
  is cached nowhere: fresh random tokens) against the load time of the same
  prefix when it is on disk only (the server is restarted on the same
  directory, so memory is empty; the load time is the scheduler's
  ``load_seconds`` delta over ``loads`` delta for that request). Also the
  disk-warm TTFT and whether the greedy output matches the cold one. The
  speedup prefill / load at 1,000 tokens (interpolated); target >= 20x. One
  prefix of the largest length is loaded first, unmeasured: the tier's read
  buffer grows once, as on a server that has been loading for a while.

Every server gets the same warm-up first (short prompts and one of 512
random tokens, none long enough to load from disk).

Files read back were just written, so they come from the OS page cache: the
figures are the tier's own cost (read, checksum, scatter), not a cold disk's.

Writes one JSON (default ``bench/results/disk_tier-<time>.json``, ``--out``)
and a PNG beside it, prints the tables and the targets; progress on stderr.

    .venv/bin/python -m bench.bench_disk_tier --quick                # the smoke test
    .venv/bin/python -m bench.bench_disk_tier --bench chat restart raw   # the full run
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
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.bench_serving import (
    RESULTS_DIR,
    BenchConfig,
    BenchResult,
    RequestRecord,
    scrape_samples,
    scrape_servers,
    send_request,
    summarise,
    write_json,
)
from bench.sse import SSE_DONE, sse_message
from bench.verdicts import verdict_line, verdict_of
from bench.workloads import (
    MultiTurnParams,
    Session,
    multi_turn,
    resolve_tokenizer,
    vocabulary_words,
    warmup_sessions,
)

ROOT = Path(__file__).resolve().parents[1]

BENCHES = ("chat", "restart", "raw")
DEFAULT_MODELS = ("smollm2,name=a", "gemma3-270m,name=b")
CHAT_TARGET = 1.5  # tier / no-tier output throughput
RAW_TARGET = 20.0  # prefill / load time at RAW_AT tokens
RAW_AT = 1000
TEMPLATE_TOKENS = 12  # "User: ...\nAssistant:" and separators per turn (estimate)
REQUEST_TIMEOUT_S = 600.0
T_START = time.monotonic()


def log(msg: str) -> None:
    print(f"[disk-bench {time.monotonic() - T_START:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ---- sizes ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """Every workload size; ``QUICK`` is the smoke test's."""

    chat: MultiTurnParams  # per model; num_groups == num_conversations (own histories)
    chat_concurrency: int  # requests in flight, both models together
    chat_ratio: float  # KV working set / arena
    restart_system_tokens: int
    restart_question_tokens: int
    restart_reps: int
    raw_lengths: tuple[int, ...]
    raw_reps: int
    warmup: int  # short unrelated requests per model before measuring


FULL = Sizes(
    chat=MultiTurnParams(12, 4, 12, 768, 32, 16),
    chat_concurrency=4,
    chat_ratio=4.0,
    restart_system_tokens=2000,
    restart_question_tokens=16,
    restart_reps=3,
    raw_lengths=(64, 128, 256, 512, 1024, 2048),
    raw_reps=3,
    warmup=2,
)
QUICK = Sizes(
    chat=MultiTurnParams(4, 3, 4, 256, 16, 8),
    chat_concurrency=2,
    chat_ratio=4.0,
    restart_system_tokens=2000,
    restart_question_tokens=16,
    restart_reps=1,
    raw_lengths=(64, 256, 1024),
    raw_reps=1,
    warmup=1,
)


@dataclass(frozen=True)
class Setup:
    """What every benchmark shares."""

    models: tuple[str, ...]  # --model strings (SOURCE[,name=N])
    dtype: str
    sizes: Sizes
    disk_bytes: int
    chunk_tokens: int
    write_policy: str
    disk_root: str | None  # parent of the temporary --kv-disk-dir folders
    seed: int
    keep_dirs: bool

    def names(self) -> list[str]:
        return [model_arg(m).name for m in self.models]


def model_arg(text: str) -> Any:
    from radixmux.common.server_args import parse_model_arg

    return parse_model_arg(text)


def model_folder(source: str) -> Path:
    return resolve_tokenizer(source)  # an embedded short name is fetched once, else a folder


def kv_bytes_per_token(source: str, dtype: str) -> int:
    """One token's K and V over every layer, from the model's config.json."""
    c = json.loads((model_folder(source) / "config.json").read_text())
    c = c.get("text_config", c)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * kv_heads * head_dim * (4 if dtype == "float32" else 2)


def block_bytes_for(arena: int, per_token: int) -> int:
    """Blocks small enough that each model's share is many of them, at least 16
    tokens: a multiple of 12 KiB (3 KiB, which every embedded model's K row
    divides, and the arena's 4 KiB block alignment)."""
    unit = 12288
    block = max(16 * per_token, arena // 48)
    return max(unit, block // unit * unit)


# ---- servers --------------------------------------------------------------------------
class Server:
    """An in-process ``Engine`` with its base URL; ``stop()`` is graceful."""

    def __init__(self, label: str, **flags: Any) -> None:
        from radixmux.runtime.client.engine import Engine

        self.label = label
        shown = {k: v for k, v in flags.items() if k not in ("log_level",)}
        log(f"{label}: starting server {shown}")
        t0 = time.monotonic()
        self.engine = Engine(log_level="warning", **flags)
        self.start_s = time.monotonic() - t0
        self.base_url = f"http://127.0.0.1:{self.engine.args.port}"
        self.stop_s: float | None = None
        log(f"{label}: serving {self.engine.models} at {self.base_url} ({self.start_s:.1f} s)")

    def stop(self) -> None:
        if self.stop_s is None:
            t0 = time.monotonic()
            self.engine.shutdown()
            self.stop_s = time.monotonic() - t0
            log(f"{self.label}: stopped in {self.stop_s:.1f} s")


@contextlib.contextmanager
def serving(label: str, **flags: Any) -> Iterator[Server]:
    server = Server(label, **flags)
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def disk_dir(setup: Setup, tag: str) -> Iterator[str]:
    """A fresh, empty ``--kv-disk-dir`` for one configuration."""
    if setup.disk_root:
        os.makedirs(setup.disk_root, exist_ok=True)
    path = tempfile.mkdtemp(prefix=f"radixmux-disk-{tag}-", dir=setup.disk_root)
    try:
        yield path
    finally:
        if setup.keep_dirs:
            log(f"kept {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


def tier_flags(setup: Setup, path: str) -> dict[str, Any]:
    return {
        "kv_disk_bytes": setup.disk_bytes,
        "kv_disk_dir": path,
        "kv_disk_chunk_tokens": setup.chunk_tokens,
        "kv_disk_write_policy": setup.write_policy,
    }


def scheduler_info(base_url: str) -> dict[str, Any]:
    """``/get_server_info``'s ``scheduler`` (with the invariant check)."""
    resp = httpx.get(base_url + "/get_server_info", timeout=60, trust_env=False)
    resp.raise_for_status()
    info = resp.json()
    if info.get("scheduler") is None:
        raise RuntimeError(f"no scheduler stats: {info.get('scheduler_error')}")
    return info["scheduler"]


def disk_counters(sched: dict[str, Any]) -> dict[str, float]:
    """The counters of ``scheduler.disk`` (zeros without a tier) and prompt tokens computed."""
    d = sched.get("disk") or {}
    return {
        "prompt_tokens_computed": sched.get("prompt_tokens_computed", 0),
        "tokens_loaded": sum((d.get("tokens_loaded") or {}).values()),
        "loads": d.get("loads", 0),
        "load_seconds": d.get("load_seconds", 0.0),
        "bytes_read": d.get("bytes_read", 0),
        "bytes_written": d.get("bytes_written", 0),
        "chunks_written": d.get("chunks_written", 0),
        "chunks_dropped": d.get("chunks_dropped", 0),
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0) for k in after}


class BenchFailure(RuntimeError):
    """A request failed: the benchmark cannot measure what it meant to."""


def stream_completion(
    base_url: str, model: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    """One streamed greedy ``/v1/completions`` request: TTFT, E2E, text, usage."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first_event = first_text = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    with httpx.stream(
        "POST",
        base_url + "/v1/completions",
        json=body,
        timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30),
        trust_env=False,
    ) as resp:
        if resp.status_code != 200:
            raise BenchFailure(f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')}")
        for line in resp.iter_lines():
            msg = sse_message(line)
            if msg is None:
                continue
            if msg is SSE_DONE:
                break
            if "error" in msg:
                raise BenchFailure(f"stream error: {msg['error']}")
            choices = msg.get("choices") or []
            if choices:
                now = time.perf_counter() - t0
                first_event = now if first_event is None else first_event
                text = choices[0].get("text") or ""
                if text and first_text is None:
                    first_text = now
                parts.append(text)
            if msg.get("usage"):
                usage = msg["usage"]
    if first_event is None:
        raise BenchFailure("empty stream")
    return {
        "ttft_s": first_text if first_text is not None else first_event,
        "e2e_s": time.perf_counter() - t0,
        "text": "".join(parts),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    }


def random_ids(rng: random.Random, n: int) -> list[int]:
    """``n`` ordinary token ids (clear of every embedded model's special tokens)."""
    return [rng.randrange(1000, 30000) for _ in range(n)]


def warm_up(base_url: str, model: str, rng: random.Random, n: int) -> None:
    """Unrelated requests (short ones and one of 512 tokens): the first forward
    passes' costs, not the measured prefixes. Too short to load from disk."""
    for _ in range(n):
        stream_completion(base_url, model, random_ids(rng, 24), 2)
    stream_completion(base_url, model, random_ids(rng, 512), 2)


def median(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ---- 1. chat --------------------------------------------------------------------------
@dataclass
class ChatRun:
    label: str
    disk: bool
    kv_cache_bytes: int
    result: BenchResult | None = None
    counters: dict[str, float] = field(default_factory=dict)  # deltas over the measured run
    # /metrics radixmux_disk_* at the end: {name: {model label or "*": value}}
    disk_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    invariants: str | None = None
    locks_held: int | None = None
    start_s: float = 0.0
    stop_s: float | None = None
    replies: dict[str, str] = field(default_factory=dict)  # "session/turn" -> text
    unavailable: str | None = None


def chat_sessions(setup: Setup, words: Sequence[str]) -> list[Session]:
    """Both models' conversations, interleaved (a0, b0, a1, b1, ...)."""
    p = setup.sizes.chat
    per_model = [
        multi_turn(words, name, p, setup.seed + 1000 * i) for i, name in enumerate(setup.names())
    ]
    return [s for group in zip(*per_model, strict=True) for s in group]


def estimate_tokens(setup: Setup, sessions: Sequence[Session]) -> dict[str, int]:
    """Each model's KV working set in tokens: every conversation's final context."""
    from transformers import AutoTokenizer

    out: dict[str, int] = {}
    for text in setup.models:
        arg = model_arg(text)
        tok = AutoTokenizer.from_pretrained(str(model_folder(arg.source)))
        total = 0
        for s in sessions:
            if s.model != arg.name:
                continue
            total += len(tok(s.system + " " + " ".join(s.turns))["input_ids"])
            total += len(s.turns) * (s.max_tokens + TEMPLATE_TOKENS)
        out[arg.name] = total
    return out


async def drive_chat(
    config: BenchConfig, sessions: Sequence[Session], concurrency: int
) -> tuple[list[RequestRecord], BenchResult, dict[str, dict[str, float]]]:
    """Turns round-robin over the conversations (every turn 0, then every turn 1,
    ...), at most ``concurrency`` in flight; a conversation's turn waits for its
    previous one, and a failed turn ends its conversation."""
    jobs = [
        (i, t)
        for t in range(max(len(s.turns) for s in sessions))
        for i, s in enumerate(sessions)
        if t < len(s.turns)
    ]
    replies: list[list[str]] = [[] for _ in sessions]
    done = [[asyncio.Event() for _ in s.turns] for s in sessions]
    broken = [False] * len(sessions)
    records: list[RequestRecord] = []
    next_job = 0
    step = max(1, len(jobs) // 10)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        before = await scrape_servers(client, [config.base_url], config.models)
        t0 = time.perf_counter()

        async def worker() -> None:
            nonlocal next_job
            while next_job < len(jobs):
                i, t = jobs[next_job]
                next_job += 1
                if t:
                    await done[i][t - 1].wait()
                if not broken[i]:
                    rec = await send_request(client, config, sessions[i], t, replies[i], t0, i)
                    records.append(rec)
                    if rec.ok:
                        replies[i].append(rec.text)
                    else:
                        broken[i] = True
                    n = len(records)
                    if n % step == 0 or n == len(jobs):
                        errors = sum(not r.ok for r in records)
                        log(
                            f"{config.label}: {n}/{len(jobs)} requests, "
                            f"{time.perf_counter() - t0:.1f} s, {errors} errors"
                        )
                done[i][t].set()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        after = await scrape_servers(client, [config.base_url], config.models)
        samples = await scrape_samples(client, config.base_url)
    result = summarise(config, sessions, records, wall, before, after)
    disk_metrics = {k: v for k, v in (samples or {}).items() if k.startswith("radixmux_disk_")}
    return records, result, disk_metrics


async def _warm_chat(config: BenchConfig, words: Sequence[str], n: int) -> None:
    warm = warmup_sessions(words, config.models, n * len(config.models), config.seed)
    async with httpx.AsyncClient(timeout=config.timeout_s, trust_env=False) as client:
        for i, s in enumerate(warm):
            rec = await send_request(client, config, s, 0, [], time.perf_counter(), i)
            if not rec.ok:
                raise BenchFailure(f"warm-up request failed: {rec.error}")


def run_chat_config(
    setup: Setup,
    label: str,
    disk: bool,
    kv: int,
    block: int,
    sessions: Sequence[Session],
    words: Sequence[str],
) -> ChatRun:
    run = ChatRun(label, disk, kv)
    flags: dict[str, Any] = {
        "model": list(setup.models),
        "dtype": setup.dtype,
        "kv_cache_bytes": kv,
        "kv_block_bytes": block,
        "seed": setup.seed,
    }
    config = BenchConfig(
        base_url="",
        models=setup.names(),
        workload="multi-turn",
        api="completions",  # gemma3-270m (a base model) has no chat template
        seed=setup.seed,
        multi_turn=setup.sizes.chat,
        concurrency=setup.sizes.chat_concurrency,
        timeout_s=REQUEST_TIMEOUT_S,
        progress=False,
        label=label,
    )
    with contextlib.ExitStack() as stack:
        if disk:
            flags.update(tier_flags(setup, stack.enter_context(disk_dir(setup, "chat"))))
        try:
            server = stack.enter_context(serving(label, **flags))
        except Exception as exc:  # a server that cannot start is reported, not a crash
            run.unavailable = f"server failed to start: {type(exc).__name__}: {exc}"
            log(f"{label}: {run.unavailable}")
            return run
        run.start_s = server.start_s
        config = dataclasses.replace(config, base_url=server.base_url)
        asyncio.run(_warm_chat(config, words, setup.sizes.warmup))
        c0 = disk_counters(scheduler_info(server.base_url))
        records, run.result, run.disk_metrics = asyncio.run(
            drive_chat(config, sessions, setup.sizes.chat_concurrency)
        )
        sched = scheduler_info(server.base_url)
        run.counters = delta(disk_counters(sched), c0)
        run.invariants = sched.get("invariants")
        run.locks_held = sched.get("locks_held")
        run.replies = {f"{r.session}/{r.turn}": r.text for r in records if r.ok}
        r = run.result
        log(
            f"{label}: {r.output_throughput:.1f} out tok/s, {r.request_throughput:.2f} req/s, "
            f"TTFT p50 {_f(r.ttft_ms.p50, '.0f')} ms, computed "
            f"{run.counters['prompt_tokens_computed']:.0f}, loaded "
            f"{run.counters['tokens_loaded']:.0f} tokens, {r.errors} errors"
        )
    run.stop_s = server.stop_s
    return run


def bench_chat(setup: Setup) -> dict[str, Any]:
    words = vocabulary_words(str(resolve_tokenizer("smollm2")))
    sessions = chat_sessions(setup, words)
    tokens = estimate_tokens(setup, sessions)
    per_token = {
        model_arg(m).name: kv_bytes_per_token(model_arg(m).source, setup.dtype)
        for m in setup.models
    }
    working_set = sum(tokens[n] * per_token[n] for n in tokens)
    kv = int(working_set / setup.sizes.chat_ratio)
    block = block_bytes_for(kv, max(per_token.values()))
    kv = max(block * 4, kv // block * block)
    log(
        f"chat: {len(sessions)} conversations x {setup.sizes.chat.turns} turns, working set "
        f"~{working_set / 2**20:.0f} MiB ({tokens} tokens), arena {kv / 2**20:.1f} MiB "
        f"(blocks of {block} B)"
    )
    runs = [
        run_chat_config(setup, "chat with disk tier", True, kv, block, sessions, words),
        run_chat_config(setup, "chat without disk tier", False, kv, block, sessions, words),
    ]
    on, off = (r.result for r in runs)
    ratio = (
        on.output_throughput / off.output_throughput
        if on and off and off.output_throughput > 0
        else math.nan
    )
    same = [k for k in runs[0].replies if runs[1].replies.get(k) == runs[0].replies[k]]
    first_turns = [k for k in runs[0].replies if k.endswith("/0") and k in runs[1].replies]
    same_first = [k for k in first_turns if k in same]
    errors = any(r.result is None or r.result.errors for r in runs)
    return {
        "sessions": len(sessions),
        "params": dataclasses.asdict(setup.sizes.chat),
        "concurrency": setup.sizes.chat_concurrency,
        "working_set_tokens": tokens,
        "kv_bytes_per_token": per_token,
        "working_set_bytes": working_set,
        "kv_cache_bytes": kv,
        "kv_block_bytes": block,
        "runs": [_chat_run_json(r) for r in runs],
        "throughput_ratio": ratio,
        "identical_replies": {
            "all": f"{len(same)}/{len(runs[0].replies)}",
            "first_turns": f"{len(same_first)}/{len(first_turns)}",
        },
        "target": {
            "name": f"chat: tier >= {CHAT_TARGET}x the output throughput without",
            "measured": f"{ratio:.2f}x",
            "passed": None if errors or math.isnan(ratio) else bool(ratio >= CHAT_TARGET),
        },
    }


def _chat_run_json(run: ChatRun) -> dict[str, Any]:
    out = dataclasses.asdict(run)
    out.pop("replies")
    return out


# ---- 2. restart -----------------------------------------------------------------------
def restart_flags(setup: Setup, path: str, kv: int = 256 << 20) -> dict[str, Any]:
    return {
        "model": [setup.models[0]],
        "dtype": setup.dtype,
        "kv_cache_bytes": kv,
        "seed": setup.seed,
        **tier_flags(setup, path),
    }


def bench_restart(setup: Setup) -> dict[str, Any]:
    sz = setup.sizes
    name = setup.names()[0]
    reps: list[dict[str, Any]] = []
    for rep in range(sz.restart_reps):
        rng = random.Random(setup.seed * 7919 + rep)
        system = random_ids(rng, sz.restart_system_tokens)
        q_cold, q_mem, q_disk = (random_ids(rng, sz.restart_question_tokens) for _ in range(3))
        row: dict[str, Any] = {"rep": rep}
        with disk_dir(setup, "restart") as path:
            flags = restart_flags(setup, path)
            with serving(f"restart {rep + 1}/{sz.restart_reps}: first server", **flags) as s1:
                warm_up(s1.base_url, name, rng, sz.warmup)
                cold = stream_completion(s1.base_url, name, system + q_cold, 4)
                mem = stream_completion(s1.base_url, name, system + q_mem, 4)
                row["start_s"] = s1.start_s
            row["flush_stop_s"] = s1.stop_s
            files = sum(len(fs) for _, _, fs in os.walk(path))
            with serving(f"restart {rep + 1}/{sz.restart_reps}: second server", **flags) as s2:
                warm_up(s2.base_url, name, rng, sz.warmup)
                c0 = disk_counters(scheduler_info(s2.base_url))
                disk = stream_completion(s2.base_url, name, system + q_disk, 4)
                d = delta(disk_counters(scheduler_info(s2.base_url)), c0)
                row["restart_start_s"] = s2.start_s
        row.update(
            {
                "chunk_files_after_stop": files,
                "cold_ttft_ms": cold["ttft_s"] * 1e3,
                "memory_warm_ttft_ms": mem["ttft_s"] * 1e3,
                "disk_warm_ttft_ms": disk["ttft_s"] * 1e3,
                "prompt_tokens": disk["prompt_tokens"],
                "disk_tokens_loaded": d["tokens_loaded"],
                "disk_loads": d["loads"],
                "disk_load_ms": d["load_seconds"] * 1e3,
                "prompt_tokens_computed": d["prompt_tokens_computed"],
                "cached_tokens_reported": disk["cached_tokens"],
            }
        )
        log(
            f"restart {rep + 1}: cold {row['cold_ttft_ms']:.0f} ms, disk-warm "
            f"{row['disk_warm_ttft_ms']:.0f} ms ({d['tokens_loaded']:.0f} tokens loaded in "
            f"{row['disk_load_ms']:.1f} ms), memory-warm {row['memory_warm_ttft_ms']:.0f} ms"
        )
        reps.append(row)
    cold_ms = median([r["cold_ttft_ms"] for r in reps])
    disk_ms = median([r["disk_warm_ttft_ms"] for r in reps])
    mem_ms = median([r["memory_warm_ttft_ms"] for r in reps])
    speedup = cold_ms / disk_ms if cold_ms and disk_ms else math.nan
    loaded_all = all(r["disk_tokens_loaded"] > 0 for r in reps)
    return {
        "system_tokens": sz.restart_system_tokens,
        "question_tokens": sz.restart_question_tokens,
        "reps": reps,
        "median_cold_ttft_ms": cold_ms,
        "median_disk_warm_ttft_ms": disk_ms,
        "median_memory_warm_ttft_ms": mem_ms,
        "median_flush_stop_s": median([r["flush_stop_s"] for r in reps]),
        "speedup": speedup,
        "target": {
            "name": "restart: disk-warm TTFT < cold TTFT (no number in the issue)",
            "measured": f"{speedup:.1f}x ({disk_ms:.0f} vs {cold_ms:.0f} ms)"
            + ("" if loaded_all else "; a restart loaded nothing from disk"),
            "passed": bool(loaded_all and speedup > 1) if not math.isnan(speedup) else None,
        },
    }


# ---- 3. raw ---------------------------------------------------------------------------
def bench_raw(setup: Setup) -> dict[str, Any]:
    sz = setup.sizes
    name = setup.names()[0]
    rng = random.Random(setup.seed + 31337)
    suffix = random_ids(rng, 8)  # the same on both servers: outputs must match
    prefixes = {(n, r): random_ids(rng, n) for r in range(sz.raw_reps) for n in sz.raw_lengths}
    # Loaded first and not measured: the tier's read buffer grows to the
    # largest load once (first-touch page faults), as on a long-running server.
    buffer_warm = random_ids(rng, max(sz.raw_lengths))
    cold: dict[tuple[int, int], dict[str, Any]] = {}
    warm: dict[tuple[int, int], dict[str, Any]] = {}
    with disk_dir(setup, "raw") as path:
        # An arena smaller than every prompt together: the oldest are saved
        # as they are evicted, so the flush on stop stays short.
        flags = restart_flags(setup, path, 128 << 20)
        with serving("raw: prefill server", **flags) as s1:
            warm_up(s1.base_url, name, rng, sz.warmup)
            stream_completion(s1.base_url, name, buffer_warm + suffix, 2)
            for key, prefix in prefixes.items():
                c0 = disk_counters(scheduler_info(s1.base_url))
                cold[key] = stream_completion(s1.base_url, name, prefix + suffix, 4)
                d = delta(disk_counters(scheduler_info(s1.base_url)), c0)
                cold[key]["computed"] = d["prompt_tokens_computed"]
                log(f"raw: prefill {key[0]:>5} tokens: {cold[key]['ttft_s'] * 1e3:.1f} ms")
        files = sum(len(fs) for _, _, fs in os.walk(path))
        with serving("raw: load server (restarted, same dir)", **flags) as s2:
            warm_up(s2.base_url, name, rng, sz.warmup)
            c0 = disk_counters(scheduler_info(s2.base_url))
            stream_completion(s2.base_url, name, buffer_warm + suffix, 2)
            first = delta(disk_counters(scheduler_info(s2.base_url)), c0)
            log(
                f"raw: first load after the restart (not measured): "
                f"{first['tokens_loaded']:.0f} tokens in {first['load_seconds'] * 1e3:.1f} ms"
            )
            for key, prefix in prefixes.items():
                c0 = disk_counters(scheduler_info(s2.base_url))
                warm[key] = stream_completion(s2.base_url, name, prefix + suffix, 4)
                d = delta(disk_counters(scheduler_info(s2.base_url)), c0)
                warm[key].update(d)
                log(
                    f"raw: load {key[0]:>5} tokens: {d['tokens_loaded']:.0f} loaded in "
                    f"{d['load_seconds'] * 1e3:.1f} ms ({d['loads']:.0f} loads), TTFT "
                    f"{warm[key]['ttft_s'] * 1e3:.1f} ms"
                )
    rows = []
    for n in sz.raw_lengths:
        keys = [(n, r) for r in range(sz.raw_reps)]
        loads = [warm[k] for k in keys if warm[k]["loads"] > 0]
        prefill_ms = median([cold[k]["ttft_s"] * 1e3 for k in keys])
        load_ms = median([w["load_seconds"] / w["loads"] * 1e3 for w in loads])
        loaded = median([w["tokens_loaded"] / w["loads"] for w in loads])
        rows.append(
            {
                "tokens": n,
                "prefill_ms": prefill_ms,
                "load_ms": load_ms,
                "tokens_loaded": loaded,
                "disk_warm_ttft_ms": median([warm[k]["ttft_s"] * 1e3 for k in keys]),
                "prefill_tok_s": n / prefill_ms * 1e3 if prefill_ms else None,
                "load_tok_s": loaded / load_ms * 1e3 if load_ms and loaded else None,
                "ratio": prefill_ms / load_ms if prefill_ms and load_ms else None,
                "computed_cold": median([cold[k]["computed"] for k in keys]),
                "computed_warm": median([warm[k]["prompt_tokens_computed"] for k in keys]),
                "outputs_match": sum(cold[k]["text"] == warm[k]["text"] for k in keys),
                "reps": len(keys),
                "loads_seen": len(loads),
            }
        )
    at = interpolate(rows, RAW_AT)
    mismatches = [
        {"tokens": k[0], "rep": k[1], "cold": cold[k]["text"], "disk": warm[k]["text"]}
        for k in prefixes
        if cold[k]["text"] != warm[k]["text"]
    ]
    return {
        "lengths": list(sz.raw_lengths),
        "reps": sz.raw_reps,
        "suffix_tokens": len(suffix),
        "chunk_files_after_stop": files,
        "first_load_after_restart": first,
        "rows": rows,
        "at_1000": at,
        "output_mismatches": mismatches,
        "target": {
            "name": f"raw: prefill / load >= {RAW_TARGET:.0f}x at {RAW_AT} tokens",
            "measured": "n/a"
            if at["ratio"] is None
            else f"{at['ratio']:.1f}x ({at['prefill_ms']:.1f} vs {at['load_ms']:.1f} ms"
            f"{', ' + at['how'] if at['how'] else ''})",
            "passed": None if at["ratio"] is None else bool(at["ratio"] >= RAW_TARGET),
        },
    }


def interpolate(rows: Sequence[dict[str, Any]], n: int) -> dict[str, Any]:
    """Prefill and load ms at ``n`` tokens: linear between the two nearest measured
    lengths (or the nearest one when ``n`` is outside them)."""
    pts = sorted(
        (r["tokens"], r["prefill_ms"], r["load_ms"])
        for r in rows
        if r["prefill_ms"] is not None and r["load_ms"] is not None
    )
    out: dict[str, Any] = {"tokens": n, "prefill_ms": None, "load_ms": None, "ratio": None}
    if not pts:
        return {**out, "how": "no loads measured"}
    below = [p for p in pts if p[0] <= n]
    above = [p for p in pts if p[0] >= n]
    if below and above and below[-1][0] != above[0][0]:
        (x0, p0, l0), (x1, p1, l1) = below[-1], above[0]
        w = (n - x0) / (x1 - x0)
        pf, ld = p0 + w * (p1 - p0), l0 + w * (l1 - l0)
        how = f"interpolated between {x0} and {x1}"
    else:
        x, pf, ld = min(pts, key=lambda p: abs(p[0] - n))
        how = "" if x == n else f"at {x} tokens, the nearest measured"
    return {**out, "prefill_ms": pf, "load_ms": ld, "ratio": pf / ld if ld else None, "how": how}


# ---- output ---------------------------------------------------------------------------
def _f(x: Any, spec: str = ".1f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, spec)


def _table(title: str, head: str, rows: list[str], footer: str) -> str:
    return "\n".join([f"\n== {title}", head, "-" * len(head), *rows, footer])


def format_chat(rep: dict[str, Any]) -> str:
    head = (
        f"{'configuration':<24} {'out tok/s':>9} {'req/s':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'computed':>9} {'loaded':>8} {'loads':>6} {'err':>4}"
    )
    title = (
        f"chat: {rep['sessions']} conversations x {rep['params']['turns']} turns over "
        f"models {', '.join(rep['working_set_tokens'])}, working set "
        f"{rep['working_set_bytes'] / 2**20:.0f} MiB, arena {rep['kv_cache_bytes'] / 2**20:.1f} "
        f"MiB, {rep['concurrency']} in flight"
    )
    lines = []
    for run in rep["runs"]:
        r = run["result"]
        if r is None:
            lines.append(f"{run['label']:<24} unavailable: {run['unavailable']}")
            continue
        c = run["counters"]
        lines.append(
            f"{run['label'][:24]:<24} {r['output_throughput']:>9.1f} "
            f"{r['request_throughput']:>6.2f} {_f(r['ttft_ms']['p50'], '.0f'):>9} "
            f"{_f(r['ttft_ms']['p99'], '.0f'):>9} {c['prompt_tokens_computed']:>9.0f} "
            f"{c['tokens_loaded']:>8.0f} {c['loads']:>6.0f} {r['errors']:>4}"
        )
    footer = (
        f"throughput ratio (tier / none): {_f(rep['throughput_ratio'], '.2f')}x; identical "
        f"greedy replies {rep['identical_replies']['all']} (first turns "
        f"{rep['identical_replies']['first_turns']})"
    )
    return _table(title, head, lines, footer)


def format_restart(rep: dict[str, Any]) -> str:
    head = (
        f"{'rep':>3} {'cold ms':>9} {'disk-warm ms':>13} {'memory-warm ms':>15} "
        f"{'loaded':>7} {'load ms':>8} {'flush+stop s':>12}"
    )
    title = (
        f"restart: {rep['system_tokens']}-token system prompt + "
        f"{rep['question_tokens']}-token question (TTFT, streamed)"
    )
    lines = []
    for r in rep["reps"]:
        lines.append(
            f"{r['rep'] + 1:>3} {r['cold_ttft_ms']:>9.1f} {r['disk_warm_ttft_ms']:>13.1f} "
            f"{r['memory_warm_ttft_ms']:>15.1f} {r['disk_tokens_loaded']:>7.0f} "
            f"{r['disk_load_ms']:>8.1f} {r['flush_stop_s']:>12.1f}"
        )
    footer = (
        f"median: cold {_f(rep['median_cold_ttft_ms'])} ms, disk-warm "
        f"{_f(rep['median_disk_warm_ttft_ms'])} ms, memory-warm "
        f"{_f(rep['median_memory_warm_ttft_ms'])} ms: disk-warm {_f(rep['speedup'])}x faster"
    )
    return _table(title, head, lines, footer)


def format_raw(rep: dict[str, Any]) -> str:
    head = (
        f"{'length':>6} {'prefill ms':>11} {'load ms':>8} {'ratio':>7} {'prefill tok/s':>14} "
        f"{'load tok/s':>11} {'warm TTFT ms':>13} {'same out':>8}"
    )
    title = (
        "raw: prefill (TTFT, nothing cached) vs disk load (scheduler load time), "
        f"median of {rep['reps']}"
    )
    lines = []
    for r in rep["rows"]:
        lines.append(
            f"{r['tokens']:>6} {_f(r['prefill_ms']):>11} {_f(r['load_ms'], '.2f'):>8} "
            f"{_f(r['ratio']):>7} {_f(r['prefill_tok_s'], '.0f'):>14} "
            f"{_f(r['load_tok_s'], '.0f'):>11} {_f(r['disk_warm_ttft_ms']):>13} "
            f"{r['outputs_match']}/{r['reps']:<6}"
        )
    at = rep["at_1000"]
    footer = (
        f"at {at['tokens']} tokens: prefill {_f(at['prefill_ms'])} ms / load "
        f"{_f(at['load_ms'], '.2f')} ms = {_f(at['ratio'])}x"
        + (f" ({at['how']})" if at.get("how") else "")
    )
    return _table(title, head, lines, footer)


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """One panel per benchmark that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [b for b in BENCHES if isinstance(report.get(b), dict) and "error" not in report[b]]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, bench in zip(axes[0], panels, strict=True):
        rep = report[bench]
        if bench == "chat":
            runs = [r for r in rep["runs"] if r["result"]]
            labels = ["tier" if r["disk"] else "no tier" for r in runs]
            ax.bar(labels, [r["result"]["output_throughput"] for r in runs], color="tab:blue")
            ax.set_ylabel("output tokens/s")
            ax2 = ax.twinx()
            ax2.plot(labels, [r["result"]["ttft_ms"]["p50"] for r in runs], "o-", color="tab:red")
            ax2.set_ylabel("TTFT p50 ms", color="tab:red")
            ax.set_title(f"chat ({_f(rep['throughput_ratio'], '.2f')}x)")
        elif bench == "restart":
            labels = ["cold", "disk-warm\n(restarted)", "memory-warm"]
            vals = [
                rep["median_cold_ttft_ms"],
                rep["median_disk_warm_ttft_ms"],
                rep["median_memory_warm_ttft_ms"],
            ]
            ax.bar(labels, [v or 0 for v in vals], color=["tab:gray", "tab:green", "tab:blue"])
            ax.set_ylabel("TTFT ms (median)")
            ax.set_title(f"restart, {rep['system_tokens']}-token system prompt")
        else:
            rows = [r for r in rep["rows"] if r["prefill_ms"] is not None]
            xs = [r["tokens"] for r in rows]
            ax.plot(xs, [r["prefill_ms"] for r in rows], "o-", label="prefill (TTFT)")
            ax.plot(xs, [r["load_ms"] for r in rows], "s-", label="disk load")
            ax.plot(xs, [r["disk_warm_ttft_ms"] for r in rows], "^--", label="disk-warm TTFT")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prefix tokens")
            ax.set_ylabel("ms")
            ax.set_title(f"raw ({_f(rep['at_1000']['ratio'])}x at {RAW_AT} tokens)")
            ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bench", nargs="+", choices=BENCHES, default=list(BENCHES))
    p.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test, ~3-4 min)")
    p.add_argument(
        "--model",
        dest="models",
        action="append",
        default=None,
        help="--model strings for chat (two); restart and raw use the first "
        f"(default: {' '.join(DEFAULT_MODELS)})",
    )
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--disk-bytes", type=int, default=4 << 30, help="--kv-disk-bytes")
    p.add_argument("--chunk-tokens", type=int, default=64, help="--kv-disk-chunk-tokens")
    p.add_argument("--write-policy", choices=("write_back", "write_through"), default="write_back")
    p.add_argument("--disk-root", default=None, help="where the temporary --kv-disk-dir folders go")
    p.add_argument("--keep-dirs", action="store_true", help="keep the disk tier folders")
    p.add_argument("--chat-ratio", type=float, default=None, help="working set / arena (4)")
    p.add_argument("--restart-reps", type=int, default=None)
    p.add_argument("--raw-lengths", type=int, nargs="+", default=None)
    p.add_argument("--raw-reps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path; the PNG goes beside it")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = QUICK if args.quick else FULL
    overrides = {
        "chat_ratio": args.chat_ratio,
        "restart_reps": args.restart_reps,
        "raw_lengths": tuple(args.raw_lengths) if args.raw_lengths else None,
        "raw_reps": args.raw_reps,
    }
    sizes = dataclasses.replace(sizes, **{k: v for k, v in overrides.items() if v is not None})
    setup = Setup(
        models=tuple(args.models or DEFAULT_MODELS),
        dtype=args.dtype,
        sizes=sizes,
        disk_bytes=args.disk_bytes,
        chunk_tokens=args.chunk_tokens,
        write_policy=args.write_policy,
        disk_root=args.disk_root,
        seed=args.seed,
        keep_dirs=args.keep_dirs,
    )
    if "chat" in args.bench and len(setup.models) < 2:
        raise SystemExit("chat needs two --model flags")
    stamp = time.strftime("%Y%m%dT%H%M%S")
    out = args.out or RESULTS_DIR / f"disk_tier-{stamp}.json"
    report: dict[str, Any] = {}
    runners = {"chat": bench_chat, "restart": bench_restart, "raw": bench_raw}
    formats = {"chat": format_chat, "restart": format_restart, "raw": format_raw}
    for bench in args.bench:
        log(f"== {bench}")
        t0 = time.monotonic()
        try:
            report[bench] = runners[bench](setup)
        except (BenchFailure, httpx.HTTPError, RuntimeError, OSError) as exc:
            log(f"{bench} failed: {type(exc).__name__}: {exc}")
            report[bench] = {"error": f"{type(exc).__name__}: {exc}"}
        report[bench]["wall_s"] = time.monotonic() - t0
        log(f"{bench} done in {report[bench]['wall_s']:.0f} s")
    targets = [
        {**report[b]["target"], "bench": b}
        for b in args.bench
        if isinstance(report[b].get("target"), dict)
    ]
    for t in targets:
        t["verdict"] = verdict_of(t["passed"])
    data = {
        "meta": {
            "benches": args.bench,
            "quick": args.quick,
            "models": list(setup.models),
            "dtype": setup.dtype,
            "disk_bytes": setup.disk_bytes,
            "chunk_tokens": setup.chunk_tokens,
            "write_policy": setup.write_policy,
            "sizes": dataclasses.asdict(sizes),
            "cpus": os.cpu_count(),
            "wall_s": time.monotonic() - T_START,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "when": stamp,
        },
        **report,
        "targets": targets,
    }
    write_json(data, out, "disk_tier")
    png = plot(data, out.with_suffix(".png"))
    for bench in args.bench:
        if "error" in report[bench]:
            print(f"\n== {bench}: FAILED: {report[bench]['error']}")
        else:
            print(formats[bench](report[bench]))
    print("\n== targets")
    for t in targets:
        print(verdict_line(t["passed"], f"{t['name']}: {t['measured']}"))
    print(f"\nwrote {out}" + (f" and {png}" if png else ""))
    failed = any("error" in report[b] for b in args.bench)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
