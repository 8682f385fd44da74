"""Every bounded list and string of every API, just past its bound (a 400) and at it (served)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import httpx

from bench.soak.client import send
from bench.soak.hostile.client import call, client_for, stopped, wait_or_stop
from bench.soak.hostile.records import HostileRun
from bench.soak.records import ModelFacts, RequestRecord, RunState
from bench.sse import finish_reason
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


def bound_cases(facts: dict[str, ModelFacts]) -> list[BoundCase]:
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


def admission_cases(run: RunState) -> list[BoundCase]:
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
    run: RunState,
    client: httpx.AsyncClient,
    case: BoundCase,
    kind: str,
    task: str,
    stream: bool,
) -> RequestRecord:
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
            finishes = {finish_reason(item) for item in items}
            if items and finishes <= {"stop", "length"}:
                rec.outcome = "ok"
            else:
                rec.outcome = "incomplete"
                rec.detail = f"finish reasons {sorted(map(str, finishes))}"
    else:
        await send(run, client, rec, body)
    return rec


async def bounds_task(run: RunState) -> None:
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
