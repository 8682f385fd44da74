"""Structured output and tool calls over real HTTP, on a tiny random model at
temperature 1 (so only the grammar makes the output valid): OpenAI's
``response_format`` and ``tools``, SGLang's and vLLM's fields, streamed and
not, ``n`` > 1, the official ``openai`` client's ``parse``; and every malformed
field a 400 naming it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from bench.tiny_models import make_tiny_model_dir
from tests.conftest import tiny_server

pytestmark = pytest.mark.timeout(600)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "sunny": {"type": "boolean"},
        "temp": {"type": "integer", "minimum": -20, "maximum": 45},
    },
    "required": ["city", "sunny", "temp"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city", "parameters": SCHEMA},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
HOT = {"temperature": 1.0, "max_tokens": 120}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder: Path = make_tiny_model_dir(tmp_path_factory.mktemp("structured-api") / "m", seed=11)
    with tiny_server(folder, "tiny") as base:
        yield base


def chat(url: str, **body) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def completion(url: str, **body) -> httpx.Response:
    body = {"model": "tiny", "prompt": "Weather:", **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def stream_chat(url: str, **body) -> list[dict]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
        **body,
    }
    chunks = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def json_format(strict: bool = True) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "weather", "schema": SCHEMA, "strict": strict},
    }


def test_chat_response_format_json_schema_many_seeds_and_n(url: str) -> None:
    for seed in range(4):
        r = chat(url, response_format=json_format(), seed=seed, n=2, **HOT)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_streamed_chat_json_schema_is_valid_when_joined(url: str) -> None:
    chunks = stream_chat(url, response_format=json_format(False), seed=3, **HOT)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_json_object_is_json(url: str) -> None:
    r = chat(url, response_format={"type": "json_object"}, seed=1, temperature=1.0, max_tokens=400)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":  # a random model may write one long string
        json.loads(choice["message"]["content"])
    else:
        assert choice["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"regex": r"(yes|no), [0-9]{2}"}, lambda t: re.fullmatch(r"(yes|no), [0-9]{2}", t)),
        ({"guided_regex": r"[a-c]{4}"}, lambda t: re.fullmatch(r"[a-c]{4}", t)),
        ({"guided_choice": ["red", "blue"]}, lambda t: t in ("red", "blue")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"json_schema": json.dumps(SCHEMA)}, lambda t: json.loads(t)["city"] in "ParisRomeOslo"),
        ({"response_format": json_format()}, lambda t: json.loads(t)["temp"] <= 45),
        ({"ebnf": 'root ::= "A" [0-9] [0-9]'}, lambda t: re.fullmatch(r"A[0-9]{2}", t)),
    ],
)
def test_completions_fields(url: str, fields: dict, check) -> None:
    r = completion(url, seed=5, **HOT, **fields)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


def test_a_grammar_max_tokens_cannot_finish_ends_with_length(url: str) -> None:
    long = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 300}},
        "required": ["s"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "long", "schema": long}}
    r = chat(url, response_format=fmt, max_tokens=12, temperature=1.0, seed=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].startswith('{"s": "')
    assert r.json()["usage"]["completion_tokens"] == 12


def test_generate_sampling_params(url: str) -> None:
    for sp, pattern in (
        ({"regex": r"[0-9]{3}-[0-9]{2}"}, r"[0-9]{3}-[0-9]{2}"),
        ({"ebnf": 'root ::= "x" | "y"'}, r"x|y"),
        ({"json_schema": json.dumps(SCHEMA)}, None),
    ):
        body = {"text": "Go:", "sampling_params": {"temperature": 1.0, "max_new_tokens": 120, **sp}}
        r = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        if pattern:
            assert re.fullmatch(pattern, out["text"]), out["text"]
        else:
            jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_tool_choice_required_and_named_produce_valid_calls(url: str) -> None:
    schemas = {"get_weather": SCHEMA, "get_time": TIME["function"]["parameters"]}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        for seed in range(3):
            # One call per answer: a random model would otherwise add calls until max_tokens.
            r = chat(
                url,
                tools=[WEATHER, TIME],
                tool_choice=choice,
                parallel_tool_calls=False,
                seed=seed,
                **HOT,
            )
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
            calls = c["message"]["tool_calls"]
            assert calls and len({call["id"] for call in calls}) == len(calls)
            for call in calls:
                assert call["type"] == "function" and call["id"].startswith("call_")
                name = call["function"]["name"]
                if isinstance(choice, dict):
                    assert name == "get_time"
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])


def test_streamed_tool_call(url: str) -> None:
    chunks = stream_chat(
        url, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, seed=2, **HOT
    )
    calls = [
        tc
        for c in chunks
        if c["choices"]
        for tc in c["choices"][0]["delta"].get("tool_calls") or []
    ]
    assert calls and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMA)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_tool_calls_carry_the_logprobs_of_their_tokens(url: str) -> None:
    """The held text's logprobs come with the delta that sends the calls, as
    many as the non-streamed answer has, for each of n choices."""
    ask = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    ask |= {"seed": 6, "n": 2, "logprobs": True, "top_logprobs": 2, **HOT}
    full = chat(url, **ask).json()["choices"]
    streamed: dict[int, list[dict]] = {}
    for c in stream_chat(url, **ask):
        for choice in c["choices"]:
            if choice["logprobs"]:
                streamed.setdefault(choice["index"], []).extend(choice["logprobs"]["content"])
    assert sorted(streamed) == [0, 1]
    for choice in full:
        assert choice["finish_reason"] == "tool_calls", choice
        assert len(streamed[choice["index"]]) == len(choice["logprobs"]["content"]) > 0


def test_openai_client_parse_with_pydantic(url: str) -> None:
    from typing import Literal

    import openai
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: Literal["Paris", "Rome"]
        sunny: bool

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    done = client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "Weather?"}],
        response_format=Weather,
        temperature=1.0,
        seed=4,
        max_tokens=60,
    )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Weather) and parsed.city in ("Paris", "Rome")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_object", "json_schema": {"schema": {}}}},
            "response_format.json_schema",
        ),
        (
            {"response_format": {"type": "text", "json_schema": {"schema": {}}}},
            "response_format.json_schema",
        ),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
        ({"regex": "[a-"}, "regex"),
        ({"ebnf": "root ::= nothing"}, "ebnf"),
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [WEATHER]}, "tool_choice"),  # auto: SmolLM2's template declares no tools
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ],
)
def test_bad_structured_fields_are_400s_naming_the_field(url: str, body: dict, param: str) -> None:
    r = chat(url, max_tokens=8, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err


def test_streamed_generate_with_n_2_keeps_each_choice_in_the_regex(url: str) -> None:
    sampling = {"regex": r"(yes|no)-[0-9]{2}", "temperature": 1.0, "max_new_tokens": 16, "n": 2}
    body = {"text": "Go:", "sampling_params": {**sampling, "seed": 7}, "stream": True}
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                texts[chunk["index"]] = chunk["text"]  # cumulative
                if chunk["meta_info"]["finish_reason"]:
                    reasons[chunk["index"]] = chunk["meta_info"]["finish_reason"]["type"]
    assert sorted(texts) == [0, 1] and set(reasons.values()) == {"stop"}
    for text in texts.values():
        assert re.fullmatch(r"(yes|no)-[0-9]{2}", text), text


def test_choices_with_quotes_backslashes_and_spaces_come_back_verbatim(url: str) -> None:
    choices = ['say "hi"', "a\\b", "two words", "é"]
    for seed in range(3):
        r = completion(url, guided_choice=choices, seed=seed, n=2, **HOT)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop" and choice["text"] in choices, choice
