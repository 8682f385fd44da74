"""The front over real HTTP and real sockets, with the test playing its peers.

One front serves two models ("chat" with a chat template, "base" without),
with an API key and a small body limit; ``front_harness.Peers`` answers for
the tokenizer, scheduler and detokenizer by a per-test script.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixmux import protocol
from tests.front_harness import (
    RunningFront,
    chat_and_base_front,
    fail,
    running_front,
    served_model,
    stats,
    words,
)

KEY = "sekret"
LIMIT = 4096
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def front() -> Iterator[RunningFront]:
    with chat_and_base_front(api_key=KEY, max_request_bytes=LIMIT) as f:
        yield f


@pytest.fixture
def http(front: RunningFront) -> Iterator[httpx.Client]:
    front.peers.script = words()
    front.peers.stats = stats(["chat", "base"])
    front.peers.control_ok = True
    for q in (front.peers.requests, front.peers.aborts, front.peers.controls):
        while not q.empty():
            q.get_nowait()
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=front.url, headers=headers, timeout=20) as client:
        yield client


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


def next_abort(front: RunningFront, timeout: float = 5.0) -> protocol.AbortRequest:
    return front.peers.aborts.get(timeout=timeout)


def test_neutral_values_and_no_effect_fields_are_accepted(
    front: RunningFront, http: httpx.Client
) -> None:
    """What asks for nothing is served: unsupported fields at their neutral
    value, and the fields that only inform (user, metadata, ...)."""
    user = chat({"role": "user", "content": "x"})
    for path, body in [
        (CMPL, cmpl(echo=False, best_of=1, suffix="", logit_bias={}, user="u-1")),
        (CMPL, cmpl(metadata={"k": "v"}, prompt_cache_key="p", service_tier="auto")),
        (CHAT, {**user, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}),
        (CHAT, {**user, "store": False, "parallel_tool_calls": True, "safety_identifier": "s"}),
        (GEN, {"model": "chat", "text": "x", "logprob_start_len": -1, "log_metrics": True}),
        (CHAT, chat({"role": "assistant", "content": "x", "tool_calls": []}, {"role": "user"})),
    ]:
        r = http.post(path, json=body)
        assert r.status_code == 200, (body, r.text)


def test_n_choices_run_as_one_request_each(front: RunningFront, http: httpx.Client) -> None:
    r = http.post(CMPL, json=cmpl(n=3, best_of=3, max_tokens=2, seed=7))
    assert r.status_code == 200, r.text
    got = r.json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert all(c["text"] == "w0 w1 " and c["finish_reason"] == "length" for c in got["choices"])
    # The prompt is counted once, the completions summed (OpenAI's usage for n).
    assert got["usage"]["completion_tokens"] == 6 and got["usage"]["prompt_tokens"] == 1
    sent = [front.peers.requests.get(timeout=1) for _ in range(3)]
    base = got["id"].removeprefix("cmpl-")
    assert sorted(q.rid for q in sent) == [f"{base}-{i}" for i in range(3)]
    assert sorted(q.params.seed for q in sent) == [7, 8, 9]  # differ, yet repeatable
    # A batch of prompts: prompt i's samples are choices i*n .. i*n+n-1.
    r = http.post(CMPL, json=cmpl(prompt=["a b", "c"], n=2, max_tokens=1))
    got = r.json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    sent = sorted((front.peers.requests.get(timeout=1) for _ in range(4)), key=lambda q: q.rid)
    assert [q.prompt for q in sent] == ["a b", "a b", "c", "c"]
    assert got["usage"]["prompt_tokens"] == 3 and got["usage"]["completion_tokens"] == 4
    # Streamed chat: every choice announces its role, streams, finishes.
    body = {**chat({"role": "user", "content": "x"}), "n": 2, "max_tokens": 2, "stream": True}
    body["stream_options"] = {"include_usage": True}
    r = http.post(CHAT, json=body)
    events = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"]
    for i in (0, 1):
        mine = [c["choices"][0] for c in events if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == "w0 w1 "
        assert mine[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 4


def test_echo_puts_the_prompt_before_each_choice(http: httpx.Client) -> None:
    r = http.post(CMPL, json=cmpl(prompt="a b", echo=True, max_tokens=2, n=2))
    assert [c["text"] for c in r.json()["choices"]] == ["a bw0 w1 "] * 2
    # Token ids are echoed as their text (a tokenizer worker decodes them).
    r = http.post(CMPL, json=cmpl(prompt=[[5, 6], [7]], echo=True, max_tokens=1))
    assert [c["text"] for c in r.json()["choices"]] == ["w5 w6w0 ", "w7w0 "]
    r = http.post(CMPL, json=cmpl(prompt="a b", echo=True, max_tokens=2, stream=True))
    texts = [json.loads(e)["choices"][0]["text"] for e in sse_events(r.text) if e != "[DONE]"]
    assert texts == ["a bw0 ", "w1 "]


def test_native_batches_and_n_answer_a_list(http: httpx.Client) -> None:
    sp = {"max_new_tokens": 2, "n": 2}
    r = http.post(GEN, json={"model": "chat", "text": ["a", "b c"], "sampling_params": sp})
    got = r.json()
    assert isinstance(got, list) and [g["text"] for g in got] == ["w0 w1 "] * 4
    assert [g["meta_info"]["prompt_tokens"] for g in got] == [1, 1, 2, 2]  # prompt i at i*n
    assert len({g["meta_info"]["id"] for g in got}) == 4
    r = http.post(GEN, json={"model": "chat", "input_ids": [[1, 2], [3]], "stream": True})
    chunks = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"]
    assert {c["index"] for c in chunks} == {0, 1} and all(c["text"] for c in chunks)
    one = http.post(GEN, json={"model": "chat", "text": "a"}).json()
    assert isinstance(one, dict) and "index" not in one  # one prompt, one sample: an object


def test_models_list(http: httpx.Client) -> None:
    r = http.get("/v1/models")
    assert r.status_code == 200
    data = r.json()["data"]
    assert [m["id"] for m in data] == ["chat", "base"]
    assert data[0]["max_model_len"] == 2048 and data[0]["object"] == "model"


def test_completion_fields_reach_the_tokenizer(front: RunningFront, http: httpx.Client) -> None:
    body = {
        "model": "chat",
        "prompt": "a b c",
        "max_tokens": 3,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 7,
        "min_p": 0.1,
        "seed": 11,
        "stop": "zz",
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "logit_bias": {"5": 10, "7": -100},
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "text_completion"
    assert got["choices"][0]["text"] == "w0 w1 w2 "
    assert got["choices"][0]["finish_reason"] == "length"
    assert got["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    req = front.peers.requests.get(timeout=1)
    assert got["id"] == f"cmpl-{req.rid}" and r.headers["x-request-id"] == req.rid
    assert req.prompt == "a b c" and req.stop == ["zz"] and req.model == "chat"
    p = req.params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (
        3, 0.0, 0.5, 7, 0.1, 11,
    )  # fmt: skip
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.ignore_eos and not p.logprobs
    assert p.logit_bias == [(5, 10.0), (7, -100.0)]


def test_token_id_prompt_and_logprobs(front: RunningFront, http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions",
        json={"model": "chat", "prompt": [1, 2, 3, 4], "max_tokens": 2, "logprobs": 1},
    )
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["token_id:100", "token_id:101"]
    assert lp["token_logprobs"] == [-0.25, -0.25]
    assert lp["top_logprobs"][0] == {"token_id:100": -0.25}
    req = front.peers.requests.get(timeout=1)
    assert req.input_ids == [1, 2, 3, 4] and req.params.logprobs and req.params.top_logprobs == 1


def test_openai_client(front: RunningFront, http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key=KEY, max_retries=0)
    done = client.completions.create(model="chat", prompt="x y", max_tokens=2, temperature=0)
    assert done.choices[0].text == "w0 w1 " and done.usage.completion_tokens == 2
    assert done.usage.prompt_tokens_details.cached_tokens == 1
    chat = client.chat.completions.create(
        model="chat",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    assert chat.choices[0].message.content == "w0 w1 w2 "
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "length"
    assert [t.token for t in chat.choices[0].logprobs.content] == [
        f"token_id:{i}" for i in (100, 101, 102)
    ]
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    front.peers.requests.get(timeout=1)
    req = front.peers.requests.get(timeout=1)
    assert req.messages == [
        protocol.ChatMessage("system", "be brief"),
        protocol.ChatMessage("user", "hi"),
    ]
    assert req.params.temperature == 1.0  # OpenAI's default when none is sent

    stream = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "w0 w1 "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2

    pieces = client.completions.create(model="chat", prompt="q", max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == "w0 w1 w2 "


def test_native_generate(front: RunningFront, http: httpx.Client) -> None:
    body = {
        "model": "chat",
        "text": "hello there",
        "sampling_params": {"max_new_tokens": 2, "stop_token_ids": [5], "top_k": -1},
        "return_logprob": True,
        "top_logprobs_num": 1,
    }
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["text"] == "w0 w1 " and got["output_ids"] == [100, 101]
    meta = got["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 2}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (2, 2, 1)
    assert meta["output_token_logprobs"] == [[-0.25, 100, None], [-0.25, 101, None]]
    req = front.peers.requests.get(timeout=1)
    assert meta["id"] == req.rid and req.params.stop_token_ids == [5] and req.params.top_k == 0
    assert req.params.temperature == 1.0  # SGLang's default

    r = http.post("/generate", json={**body, "stream": True, "return_logprob": False})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["text"] for e in events[:-1]]
    assert texts == ["w0 ", "w0 w1 "]  # cumulative, as SGLang streams
    last_meta = json.loads(events[-2])["meta_info"]
    assert last_meta["finish_reason"]["type"] == "length"
    assert "output_token_logprobs" not in last_meta  # only when return_logprob


def test_stop_string_finishes_and_aborts(front: RunningFront, http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions", json={"model": "chat", "prompt": "p", "max_tokens": 8, "stop": ["w2"]}
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "w0 w1 " and choice["finish_reason"] == "stop"
    abort = next_abort(front)
    assert abort.reason == "stop" and r.headers["x-request-id"] == abort.rid

    r = http.post(
        "/generate", json={"model": "chat", "text": "p", "sampling_params": {"stop": "w1"}}
    )
    assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": "w1"}
    assert next_abort(front).reason == "stop"


def test_disconnect_mid_stream_aborts(front: RunningFront, http: httpx.Client) -> None:
    front.peers.script = words(delay=0.2)
    body = {"model": "chat", "prompt": "p", "max_tokens": 100, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
        assert first.startswith("data: ")
        rid = r.headers["x-request-id"]
    abort = next_abort(front)
    assert abort.rid == rid and abort.reason == "client disconnected"
    assert not abort.early  # the scheduler had answered: it knows the request

    # Non-streaming: the client gives up waiting; the front notices and aborts too.
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={**body, "stream": False}, timeout=0.5)
    assert next_abort(front).reason == "client disconnected"

    # n choices: a client that leaves stops every one of them, streamed or not.
    with http.stream("POST", "/v1/completions", json={**body, "n": 3}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={**body, "n": 3, "stream": False}, timeout=0.5)
    for _ in range(2):
        aborted = {next_abort(front).rid for _ in range(3)}
        assert len(aborted) == 3 and all(r.rsplit("-", 1)[1] in "012" for r in aborted)


def test_disconnect_before_any_reply_is_an_early_abort(
    front: RunningFront, http: httpx.Client
) -> None:
    # Nothing came back yet (the prompt may still be in a tokenizer worker):
    # the abort says so, so the scheduler can drop the request when it comes.
    front.peers.script = lambda req: iter([5.0])
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"model": "chat", "prompt": "p"}, timeout=0.5)
    abort = next_abort(front)
    assert abort.reason == "client disconnected" and abort.early


CMPL, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"


def cmpl(**kw: object) -> dict:
    return {"model": "chat", "prompt": "x", **kw}


def chat(*messages: dict) -> dict:
    return {"model": "chat", "messages": list(messages)}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (CMPL, cmpl(model="nope"), 404, "model"),
        (CMPL, {"prompt": "x"}, 400, "model"),
        (CMPL, {"model": "chat"}, 400, "prompt"),
        (CMPL, cmpl(n=17), 400, "n"),
        (CMPL, cmpl(n=0), 400, "n"),
        (CMPL, cmpl(n=3, best_of=2), 400, "best_of"),  # best_of below n
        (CMPL, cmpl(max_tokens=-1), 400, "max_tokens"),
        (CMPL, cmpl(max_tokens="9"), 400, "max_tokens"),
        (CMPL, cmpl(temperature=-1), 400, "temperature"),
        (CMPL, cmpl(top_p=0), 400, "top_p"),
        (CMPL, cmpl(top_p=1.5), 400, "top_p"),
        (CMPL, cmpl(top_k=-2), 400, "top_k"),
        (CMPL, cmpl(top_k=1001), 400, "top_k"),  # past the vocabulary (1000)
        (CMPL, cmpl(repetition_penalty=1e9), 400, "repetition_penalty"),
        (
            GEN,
            {"model": "chat", "text": "x", "sampling_params": {"top_k": 5000}},
            400,
            "sampling_params.top_k",
        ),
        (CMPL, cmpl(stop=[""]), 400, "stop"),
        (CMPL, cmpl(prompt=[1, 5000]), 400, "prompt"),
        (CMPL, cmpl(prompt=["a"] * 65), 400, "prompt"),
        (CMPL, cmpl(prompt=["a", ""]), 400, "prompt[1]"),
        (CMPL, cmpl(prompt=[[1], [1, 5000]]), 400, "prompt[1]"),
        (CMPL, cmpl(prompt=["a"] * 5, n=16), 400, "n"),
        (CHAT, chat(), 400, "messages"),
        (CHAT, chat({"role": "bot", "content": "x"}), 400, "messages[0].role"),
        (CHAT, chat({"content": "x"}), 400, "messages[0].role"),
        (GEN, {"model": "chat"}, 400, "text"),
        (
            GEN,
            {"model": "chat", "text": "x", "sampling_params": {"min_p": 2}},
            400,
            "sampling_params.min_p",
        ),
        (GEN, {"model": "chat", "input_ids": [1, "a"]}, 400, "input_ids"),
        # Nothing silently ignored: a field outside the API, or one of the API
        # that is not implemented, is refused by name.
        (CMPL, cmpl(guided_json=[1]), 400, "guided_json"),  # not a schema
        (CMPL, cmpl(logit_bias={"x5": 10}), 400, "logit_bias"),
        (CMPL, cmpl(logit_bias={"5": 101}), 400, "logit_bias"),
        (CMPL, cmpl(logit_bias={"1000": 1}), 400, "logit_bias"),  # past the vocabulary
        (
            GEN,
            {"model": "chat", "text": "x", "sampling_params": {"logit_bias": {"5": -1e9}}},
            400,
            "sampling_params.logit_bias",
        ),
        (CMPL, cmpl(best_of=3, stream=True), 400, "best_of"),  # ranked at the end
        (CMPL, cmpl(best_of=17), 400, "best_of"),
        (GEN, {"model": "chat", "text": "x", "logprob_start_len": -3}, 400, "logprob_start_len"),
        (CMPL, cmpl(suffix="!"), 400, "suffix"),
        (CMPL, cmpl(service_tier="flex"), 400, "service_tier"),
        (CHAT, {**chat({"role": "user", "content": "x"}), "tools": [{}]}, 400, "tools[0].type"),
        (
            CHAT,
            {**chat({"role": "user", "content": "x"}), "response_format": {"type": "yaml"}},
            400,
            "response_format.type",
        ),
        (CHAT, {**chat({"role": "user", "content": "x"}), "store": True}, 400, "store"),
        (CHAT, {**chat({"role": "user", "content": "x"}), "n_choices": 2}, 400, "n_choices"),
        (CHAT, chat({"role": "user", "content": "x", "name": "ann"}), 400, "messages[0].name"),
        (CHAT, chat({"role": "user", "content": "x", "colour": 1}), 400, "messages[0].colour"),
        (
            CHAT,
            {**chat({"role": "user", "content": "x"}), "stream_options": {"continuous": True}},
            400,
            "stream_options.continuous",
        ),
        (GEN, {"model": "chat", "text": "x", "lora_path": "l"}, 400, "lora_path"),
        (GEN, {"model": "chat", "text": "x", "typo": 1}, 400, "typo"),
        (GEN, {"model": "chat", "text": ["a", ""]}, 400, "text"),
        (GEN, {"model": "chat", "input_ids": [[1], 2]}, 400, "input_ids"),
        (GEN, {"model": "chat", "input_ids": [[1], [5000]]}, 400, "input_ids[1]"),
        (
            GEN,
            {"model": "chat", "text": "x", "sampling_params": {"n": 17}},
            400,
            "sampling_params.n",
        ),
        (
            GEN,
            {
                "model": "chat",
                "text": "x",
                "sampling_params": {"regex": ""},
            },
            400,
            "sampling_params.regex",
        ),
        (
            GEN,
            {"model": "chat", "text": "x", "sampling_params": {"max_tokens": 3}},
            400,
            "sampling_params.max_tokens",
        ),
    ],
)
def test_invalid_input(http: httpx.Client, path: str, body: dict, status: int, param: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[-1].split("[")[0] in err["message"]
    if status == 404:
        assert "chat" in err["message"] and "base" in err["message"]


def test_malformed_bodies(http: httpx.Client) -> None:
    as_json = {"content-type": "application/json"}
    r = http.post("/v1/completions", content=b'{"model": "chat", "prompt": ', headers=as_json)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = http.post("/v1/completions", content=b"[1, 2]", headers=as_json)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.get("/no/such/route")
    assert r.status_code == 404 and "error" in r.json()
    # Nested 1,500 deep (under the size limit): the decoder's recursion limit is a 400, not a 500.
    deep = b'{"model": "chat", "prompt": ' + b"[" * 1500 + b"]" * 1500 + b"}"
    r = http.post("/v1/completions", content=deep, headers=as_json)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    # A body declared as something else is refused, not parsed as JSON anyway.
    good = b'{"model": "chat", "prompt": "x", "max_tokens": 1}'
    r = http.post("/v1/completions", content=good, headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["param"] == "content-type"
    r = http.post(
        "/v1/completions", content=good, headers={"content-type": "application/json; charset=utf-8"}
    )
    assert r.status_code == 200


def test_chat_without_template(http: httpx.Client) -> None:
    r = http.post(
        "/v1/chat/completions",
        json={"model": "base", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 400
    assert "no chat template" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 200  # plain prompts still work for a base model


def test_body_limit(http: httpx.Client) -> None:
    big = {"model": "chat", "prompt": "x" * (LIMIT + 10)}
    r = http.post("/v1/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # chunked: no Content-Length to trust
        yield b'{"model": "chat", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_api_key(front: RunningFront) -> None:
    with httpx.Client(base_url=front.url, timeout=10) as anon:
        assert anon.get("/v1/models").status_code == 401
        r = anon.post(
            "/v1/completions",
            json={"model": "chat", "prompt": "x"},
            headers={"Authorization": "Bearer wrong"},
        )
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert anon.get("/health").status_code == 200  # probes need no secret
        assert anon.get("/metrics").status_code == 200


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (400, "prompt of 9000 tokens exceeds the context"),
        (429, "queue full"),
        (503, "runner for chat is down"),
    ],
)
def test_downstream_errors(
    front: RunningFront, http: httpx.Client, status: int, message: str
) -> None:
    front.peers.script = fail(status, message)
    for stream in (False, True):
        r = http.post("/v1/completions", json={"model": "chat", "prompt": "x", "stream": stream})
        assert r.status_code == status and r.json()["error"]["message"] == message
        assert (r.headers.get("retry-after") == "1") == (status == 429)


def test_error_mid_stream(front: RunningFront, http: httpx.Client) -> None:
    def script(req: protocol.GenerateRequest):
        yield protocol.TextBatch([protocol.TextOutput(req.rid, "ok ", [100], 1, 1, 0)])
        yield protocol.TextBatch(
            [
                protocol.TextOutput(
                    req.rid, "", [], 1, 1, 0, "error", error="runner died", status=503
                )
            ]
        )

    front.peers.script = script
    r = http.post(
        "/v1/chat/completions",
        json={"model": "chat", "messages": [{"role": "user", "content": "x"}], "stream": True},
    )
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "runner died"
    r = http.post("/v1/completions", json={"model": "chat", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["message"] == "runner died"


def test_health(front: RunningFront, http: httpx.Client) -> None:
    r = http.get("/health")
    assert r.status_code == 200
    assert r.json()["status"] == "ok"
    assert r.json()["models"] == {"chat": "serving", "base": "serving"}
    front.peers.stats = stats(["chat", "base"], down={"base": "runner exited with code -9"})
    r = http.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "degraded"
    assert r.json()["models"] == {"chat": "serving", "base": "down"}
    assert r.json()["down"] == {"base": "runner exited with code -9"}
    assert "base" in r.json()["error"]["message"]


def test_starting_until_every_process_is_ready() -> None:
    # The front listens before the launcher has heard from every process (a
    # tokenizer worker may still load): until told, it is "starting", and it
    # takes no request, whatever the scheduler says.
    with running_front([served_model("chat")], announce=False) as front:
        client = httpx.Client(base_url=front.url, timeout=10)
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "starting"
        r = client.post("/v1/completions", json={"model": "chat", "prompt": "x"})
        assert r.status_code == 503 and "starting" in r.json()["error"]["message"]
        assert front.peers.requests.empty()
        front.peers.say_ready.set()
        deadline = time.time() + 10
        while client.get("/health").status_code != 200:
            assert time.time() < deadline, "never became ready"
            time.sleep(0.05)
        r = client.post("/v1/completions", json={"model": "chat", "prompt": "x"})
        assert r.status_code == 200, r.text


def test_health_generate(front: RunningFront, http: httpx.Client) -> None:
    r = http.get("/health_generate")
    assert r.status_code == 200, r.text
    probes = [front.peers.requests.get(timeout=1) for _ in range(2)]
    assert sorted(p.model for p in probes) == ["base", "chat"]
    assert all(p.params.max_new_tokens == 1 for p in probes)
    front.peers.script = fail(503, "runner crashed")
    r = http.get("/health_generate")
    assert r.status_code == 503 and "runner crashed" in r.json()["error"]["message"]


def test_metrics(front: RunningFront, http: httpx.Client) -> None:
    assert (
        http.post(
            "/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 2}
        ).status_code
        == 200
    )
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    parsed = [s for fam in text_string_to_metric_families(r.text) for s in fam.samples]
    # Every per-model series carries its version apart from the served name.
    assert all(s.labels.get("version") == "1" for s in parsed if "model" in s.labels)
    samples = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "version"))): s.value
        for s in parsed
    }
    assert samples[("radixmux_scheduler_up", ())] == 1
    assert samples[("radixmux_cache_hit_rate", (("model", "base"),))] == pytest.approx(0.4)
    assert samples[("radixmux_global_cache_hit_rate", ())] == pytest.approx(0.4)
    assert samples[("radixmux_cache_tokens_saved_total", (("model", "chat"),))] == 40
    assert samples[("radixmux_queue_length", (("model", "chat"),))] == 3
    assert samples[("radixmux_running_requests", (("model", "base"),))] == 2
    assert samples[("radixmux_arena_bytes", (("model", "base"),))] == 4096
    assert samples[("radixmux_evicted_tokens_total", (("reason", "capacity"),))] == 12
    per_admitted = ("radixmux_evicted_tokens_per_admitted_token", (("model", "base"),))
    assert samples[per_admitted] == pytest.approx(0.25)
    assert samples[("radixmux_model_state", (("model", "chat"), ("state", "serving")))] == 1
    assert samples[("radixmux_model_state", (("model", "chat"), ("state", "down")))] == 0
    assert (
        samples[("radixmux_requests_total", (("finish_reason", "length"), ("model", "base")))] >= 1
    )
    assert samples[("radixmux_time_to_first_token_seconds_count", (("model", "base"),))] >= 1
    assert samples[("radixmux_inter_token_latency_seconds_count", (("model", "base"),))] >= 1
    assert samples[("radixmux_e2e_request_latency_seconds_count", (("model", "base"),))] >= 1

    front.peers.stats = None  # a scheduler that does not answer
    t0 = time.monotonic()
    r = http.get("/metrics")
    assert r.status_code == 200 and "radixmux_scheduler_up 0.0" in r.text
    assert "radixmux_e2e_request_latency_seconds" in r.text and time.monotonic() - t0 < 5


def test_flush_and_invalidate(front: RunningFront, http: httpx.Client) -> None:
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.json()["ok"] is True
    assert front.peers.controls.get(timeout=1).op == "flush_cache"
    r = http.post("/models/base/invalidate")
    assert r.status_code == 200 and r.json()["model"] == "base"
    ctl = front.peers.controls.get(timeout=1)
    assert (ctl.op, ctl.model) == ("invalidate", "base")
    assert http.post("/models/nope/invalidate").status_code == 404
    front.peers.control_ok = False
    assert http.post("/flush_cache").status_code == 400


def test_dashboard_json_asks_the_scheduler_and_survives_its_silence(
    front: RunningFront, http: httpx.Client
) -> None:
    view = http.get("/dashboard.json").json()
    assert front.peers.controls.get(timeout=1).op == "dashboard"
    assert [m["name"] for m in view["stats"]["models"]] == ["chat", "base"]
    assert view["error"] is None and view["previews"] == []
    front.peers.stats = None  # a scheduler that does not answer: the page says so, no 5xx
    r = http.get("/dashboard.json")
    assert r.status_code == 200 and r.json()["stats"] is None
    assert "did not answer" in r.json()["error"]
    # The lifecycle is the front's own: there still, every served model loaded.
    states = {m["name"]: (m["state"], m["on_demand"]) for m in r.json()["lifecycle"]}
    assert states == {"base": ("loaded", False), "chat": ("loaded", False)}


def test_info_endpoints(http: httpx.Client) -> None:
    info = http.get("/get_model_info").json()
    assert info["model_path"] == "/models/chat" and info["is_generation"] is True
    assert (
        http.get("/get_model_info", params={"model": "base"}).json()["has_chat_template"] is False
    )
    server = http.get("/get_server_info").json()
    assert server["api_key"] == "<set>"  # the secret is never echoed
    assert server["max_request_bytes"] == LIMIT
    assert server["scheduler"]["steps"] == 77
    assert [m["name"] for m in server["served_models"]] == ["chat", "base"]


def test_single_model_front_and_clean_exit() -> None:
    with running_front([served_model("only")]) as f, httpx.Client(base_url=f.url, timeout=10) as c:
        r = c.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200 and r.json()["text"] == "w0 "  # model optional with one served
        req = f.peers.requests.get(timeout=1)
        assert req.model == "only"
        assert f.stop() == 0  # SIGTERM: a clean exit
        with pytest.raises(queue.Empty):
            f.peers.aborts.get_nowait()


def test_concurrent_requests_route_by_rid(front: RunningFront) -> None:
    front.peers.script = words(delay=0.01)

    async def main() -> list[tuple[str, str]]:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=front.url, headers=headers, timeout=30) as c:

            async def one(i: int) -> tuple[str, str]:
                model = ("chat", "base")[i % 2]
                body = {
                    "model": model,
                    "prompt": "x",
                    "max_tokens": 1 + i % 7,
                    "stream": i % 3 == 0,
                }
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                if body["stream"]:
                    events = [json.loads(e) for e in sse_events(r.text)[:-1]]
                    return model, "".join(e["choices"][0]["text"] for e in events)
                return model, r.json()["choices"][0]["text"]

            return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(main())
    for i, (model, text) in enumerate(results):
        assert model == ("chat", "base")[i % 2]
        assert text == "".join(f"w{k} " for k in range(1 + i % 7))
    with httpx.Client(base_url=front.url, headers={"Authorization": f"Bearer {KEY}"}) as c:
        assert c.get("/v1/models/base").json()["id"] == "base"
        assert c.get("/v1/models/nope").status_code == 404
