"""The mixed load's client tasks.

Shared prefixes, multi-turn chats, abandons, bursts, disconnects, bad input, cache ops, the
probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from typing import Any

import httpx

from bench.bench_serving import chat_messages, completion_prompt
from bench.soak.client import pause_after, send
from bench.soak.config import BURST_SIZE, PROBE_PROMPT, PROBE_TOKENS, Profile
from bench.soak.records import (
    BadCase,
    Conversation,
    ModelFacts,
    ProbeResult,
    RequestRecord,
    RunState,
)
from bench.workloads import WordSource


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
