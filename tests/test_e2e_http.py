"""The whole runtime end to end: launcher, every process, real HTTP and ZeroMQ.

Two tiny random-weight models with SmolLM2's real tokenizer: ``a`` has a chat
template, ``b`` has none (like Gemma 3 270M, a base model). The scheduler
runs with ``check_invariants`` on, so any leaked or doubly owned KV slot
kills it and fails the tests that follow.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.tiny_models import make_tiny_model_dir
from radixmux.runtime.client.engine import Engine

pytestmark = pytest.mark.timeout(240)

SYSTEM = "You are a careful assistant. " * 12
QUESTIONS = [f"Question {i}: what is {i} plus {i * 3}?" for i in range(16)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e_models")
    return {
        "a": make_tiny_model_dir(root / "a", seed=11),
        "b": make_tiny_model_dir(root / "b", seed=12, chat_template=False),
    }


def start(models: dict[str, Path], **flags: object) -> Engine:
    base = dict(
        model=[f"{models['a']},name=a", f"{models['b']},name=b"],
        kv_cache_bytes=16 << 20,
        kv_block_bytes=64 << 10,
        runner_threads=1,
        check_invariants=True,
        max_request_bytes=64 << 10,
        dtype="float32",  # answers are compared with transformers in float32
    )
    return Engine(**{**base, **flags})


@pytest.fixture(scope="module")
def server(models: dict[str, Path]) -> Iterator[tuple[Engine, str]]:
    engine = start(models)
    try:
        yield engine, f"http://127.0.0.1:{engine.args.port}"
    finally:
        engine.shutdown()


@pytest.fixture(autouse=True)
def no_leaked_kv(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test on the shared server: nothing running, and every KV slot
    is free or in the tree (the scheduler's invariant check)."""
    yield
    if "server" not in request.fixturenames:
        return
    _, url = request.getfixturevalue("server")
    deadline = time.time() + 30
    while True:
        sched = httpx.get(f"{url}/get_server_info", timeout=30).json()["scheduler"]
        if all(m["running"] == 0 and m["waiting"] == 0 for m in sched["models"]):
            break
        assert time.time() < deadline, f"requests left running: {sched['models']}"
        time.sleep(0.2)
    assert sched["invariants"] == "ok", sched["invariants"]


def greedy_text(folder: Path, prompt: str, n: int) -> str:
    """What transformers' own generate says, decoded like the server does."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def complete(
    url: str, model: str, prompt: str | list[int], n: int = 6, **extra: object
) -> httpx.Response:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_32_concurrent_requests_across_two_models(server, models) -> None:
    _, url = server
    prompts = [SYSTEM + q for q in QUESTIONS]
    expected = {m: [greedy_text(models[m], p, 6) for p in prompts[:4]] for m in ("a", "b")}

    async def run() -> list[tuple[str, int, httpx.Response]]:
        async with httpx.AsyncClient(timeout=180) as client:
            jobs = [
                client.post(
                    f"{url}/v1/completions",
                    json={
                        "model": m,
                        "prompt": p,
                        "max_tokens": 6,
                        "ignore_eos": True,
                        "temperature": 0,
                    },
                )
                for m in ("a", "b")
                for p in prompts
            ]
            answers = await asyncio.gather(*jobs)
        keys = [(m, i) for m in ("a", "b") for i in range(len(prompts))]
        return [(m, i, r) for (m, i), r in zip(keys, answers, strict=True)]

    results = asyncio.run(run())
    assert len(results) == 32
    for model, i, resp in results:
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["completion_tokens"] == 6
        if i < 4:
            assert body["choices"][0]["text"] == expected[model][i], (model, i)


def test_cache_on_off_same_greedy_and_hits_in_metrics(server, models) -> None:
    _, url = server
    prompt = SYSTEM + "Tell me about prefix caches."
    cold = complete(url, "a", prompt, 8).json()
    warm = complete(url, "a", prompt, 8).json()
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200
    again = complete(url, "a", prompt, 8).json()
    assert again["choices"][0]["text"] == cold["choices"][0]["text"]
    assert again["choices"][0]["text"] == greedy_text(models["a"], prompt, 8)
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    hits = [
        line
        for line in metrics.splitlines()
        if line.startswith("radixmux_cache_hit_rate") and 'model="a"' in line
    ]
    assert hits and float(hits[0].split()[-1]) > 0


def test_same_system_prompt_second_chat_hits_cache(server) -> None:
    _, url = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    usage = []
    for q in ("What is a radix tree?", "What is a KV cache?"):
        r = client.chat.completions.create(
            model="a",
            max_tokens=4,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
        )
        usage.append(r.usage)
    assert usage[1].prompt_tokens_details.cached_tokens >= 80  # the system prompt


def test_openai_streaming_equals_non_streaming(server) -> None:
    _, url = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Count to five."}]
    full = client.chat.completions.create(model="a", messages=messages, max_tokens=10, seed=1)
    parts = []
    for chunk in client.chat.completions.create(
        model="a", messages=messages, max_tokens=10, seed=1, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    assert "".join(parts) == full.choices[0].message.content
    text = client.completions.create(model="b", prompt="Once upon a time", max_tokens=5)
    assert text.choices[0].text and text.usage.completion_tokens <= 5


def test_zmq_client_through_engine(server) -> None:
    engine, url = server
    prompts = ["The first prompt", "The second prompt"]
    params = {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0}
    outs = engine.generate(prompts, params, model="a")
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.text == complete(url, "a", prompt, 5).json()["choices"][0]["text"]


def test_bad_input_gets_clear_errors(server) -> None:
    _, url = server
    r = complete(url, "nope", "hi")
    assert r.status_code == 404 and "a" in r.json()["error"]["message"]
    r = complete(url, "a", "hi", n=10**6)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = complete(url, "a", "hi", temperature=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(
        f"{url}/v1/completions",
        content=b"{not json",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    r = complete(url, "a", "x" * (70 << 10))
    assert r.status_code == 413
    r = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=30,
        json={"model": "b", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    # The server is still fine, and no request is left holding KV.
    assert complete(url, "a", "still alive?").status_code == 200
    info = httpx.get(f"{url}/get_server_info", timeout=30).json()
    assert "a" in str(info)


def test_n_choices_share_one_prefill(server, models) -> None:
    _, url = server
    prompt = SYSTEM + QUESTIONS[7]
    assert httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200

    def computed() -> int:
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()
        return info["scheduler"]["prompt_tokens_computed"]

    before = computed()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    got = client.completions.create(
        model="a", prompt=prompt, max_tokens=5, temperature=0, n=4, extra_body={"ignore_eos": True}
    )
    # Greedy: every choice is transformers' answer.
    want = greedy_text(models["a"], prompt, 5)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert all(c.text == want for c in got.choices)
    assert got.usage.completion_tokens == 20
    # One prefill: the other three choices found the prompt in the tree.
    prompt_len = got.usage.prompt_tokens
    assert computed() - before <= prompt_len + 3 * 2, (computed() - before, prompt_len)
    # Sampled with a seed: the choices differ from one another yet repeat.
    seeded = dict(model="a", prompt=prompt, max_tokens=8, temperature=1.5, n=3, seed=5)
    first = [c.text for c in client.completions.create(**seeded).choices]
    again = [c.text for c in client.completions.create(**seeded).choices]
    assert first == again and len(set(first)) > 1


def test_logprob_tokens_are_text_with_offsets(server, models) -> None:
    _, url = server
    tok = AutoTokenizer.from_pretrained(models["a"])
    prompt = QUESTIONS[2]
    native = httpx.post(
        f"{url}/generate",
        json={
            "model": "a",
            "text": prompt,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
        timeout=60,
    ).json()
    names = [tok.decode([i], skip_special_tokens=False) for i in native["output_ids"]]
    meta = native["meta_info"]
    assert [t[2] for t in meta["output_token_logprobs"]] == names  # SGLang's text slot
    assert all(isinstance(t[2], str) for top in meta["output_top_logprobs"] for t in top)
    got = complete(url, "a", prompt, logprobs=3).json()["choices"][0]["logprobs"]
    assert got["tokens"] == names
    assert got["text_offset"] == [sum(len(t) for t in names[:i]) for i in range(len(names))]
    assert all(
        len(top) == 3 and not any(k.startswith("token_id:") for k in top)
        for top in got["top_logprobs"]
    )
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": "a",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
        timeout=60,
    ).json()["choices"][0]["logprobs"]["content"]
    for entry in chat:
        if "\ufffd" not in entry["token"]:
            assert bytes(entry["bytes"]).decode() == entry["token"]
        assert len(entry["top_logprobs"]) == 2


def test_echo_returns_prompt_then_completion(server, models) -> None:
    _, url = server
    tok = AutoTokenizer.from_pretrained(models["a"])
    prompt = QUESTIONS[4]
    plain = complete(url, "a", prompt).json()["choices"][0]["text"]
    echoed = complete(url, "a", prompt, echo=True).json()["choices"][0]["text"]
    assert echoed == prompt + plain
    ids = tok(prompt).input_ids
    by_ids = complete(url, "a", ids, echo=True).json()["choices"][0]["text"]
    assert by_ids == tok.decode(ids) + plain


def test_tokenize_detokenize_and_model_cards(server, models) -> None:
    _, url = server
    tok = AutoTokenizer.from_pretrained(models["a"])
    text = SYSTEM + QUESTIONS[3]
    r = httpx.post(f"{url}/tokenize", json={"model": "a", "prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok(text).input_ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["token_strs"] is None
    # Chat: exactly the ids a chat completion is served with (its usage counts them).
    chat = {"model": "a", "messages": [{"role": "user", "content": QUESTIONS[5]}]}
    r = httpx.post(f"{url}/tokenize", json={**chat, "return_token_strs": True}, timeout=30)
    ids = r.json()["tokens"]
    assert r.json()["token_strs"] == tok.convert_ids_to_tokens(ids)
    done = httpx.post(f"{url}/v1/chat/completions", json={**chat, "max_tokens": 1}, timeout=60)
    assert done.json()["usage"]["prompt_tokens"] == len(ids)
    no_gen = httpx.post(
        f"{url}/tokenize", json={**chat, "add_generation_prompt": False}, timeout=30
    ).json()["tokens"]
    assert len(no_gen) < len(ids) and ids[: len(no_gen)] == no_gen
    r = httpx.post(f"{url}/detokenize", json={"model": "a", "tokens": body["tokens"]}, timeout=30)
    assert r.status_code == 200 and r.json()["prompt"] == tok.decode(body["tokens"])
    # Refusals name the field; an unknown model is a 404.
    both = {"model": "a", "prompt": "x", "messages": chat["messages"]}
    for path, bad, status, param in [
        ("/tokenize", both, 400, "prompt"),
        ("/tokenize", {"model": "a", "prompt": ""}, 400, "prompt"),
        ("/tokenize", {**chat, "model": "b"}, 400, "messages"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "a", "tokens": [0, 10**7]}, 400, "tokens"),
        ("/detokenize", {"model": "a", "tokens": "abc"}, 400, "tokens"),
    ]:
        r = httpx.post(f"{url}{path}", json=bad, timeout=30)
        assert r.status_code == status and r.json()["error"]["param"] == param, (bad, r.text)
    # Model cards say what routes a request: context, tokenizer group, KV-share key.
    cards = {c["id"]: c for c in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    card = httpx.get(f"{url}/v1/models/a", timeout=30).json()
    assert card == cards["a"] and card["max_model_len"] == body["max_model_len"]
    assert cards["a"]["tokenizer_group"] == cards["b"]["tokenizer_group"]  # same tokenizer
    assert cards["a"]["kv_share_key"] != cards["b"]["kv_share_key"]  # different weights


def test_hostile_inputs_leave_the_real_server_clean(server) -> None:
    """The fuzz suite's hostile bodies against the real runtime: each refused
    with its status, and (the autouse check) nothing left running or holding KV."""
    from test_api_fuzz import HOSTILE

    _, url = server
    for path, data, headers, status in HOSTILE:
        if status in (401, 413):  # this server has no API key and a larger body limit
            continue
        sent = {"content-type": "application/json", **headers}
        r = httpx.post(f"{url}{path}", content=data.replace(b'"chat"', b'"a"'), headers=sent)
        assert r.status_code == status, (path, data[:80], r.text)
        assert r.json()["error"]["message"]
    assert complete(url, "a", "still serving").status_code == 200


def test_disconnect_mid_stream_frees_the_request(server) -> None:
    _, url = server
    body = {
        "model": "a",
        "prompt": "Go on forever",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # one chunk, then hang up
    deadline = time.time() + 30
    while time.time() < deadline:
        sched = httpx.get(f"{url}/get_server_info", timeout=30).json()["scheduler"]
        running = next(m for m in sched["models"] if m["name"] == "a")["running"]
        if running == 0:
            break
        time.sleep(0.5)
    assert running == 0


def test_faults_api_key_queue_full_and_dead_runner(models) -> None:
    engine = start(models, api_key="sekret", max_queued_requests=1, max_running_requests=1)
    url = f"http://127.0.0.1:{engine.args.port}"
    auth = {"Authorization": "Bearer sekret"}
    try:
        body = {"model": "a", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        bad = {"Authorization": "Bearer wrong"}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=bad).status_code == 401
        assert httpx.post(f"{url}/v1/completions", json=body, headers=auth).status_code == 200

        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=180, headers=auth) as client:
                long = {"model": "a", "prompt": "hello", "max_tokens": 60, "ignore_eos": True}
                return await asyncio.gather(
                    *[client.post(f"{url}/v1/completions", json=long) for _ in range(8)]
                )

        codes = [r.status_code for r in asyncio.run(flood())]
        assert 429 in codes and 200 in codes
        r429 = next(r for r in asyncio.run(flood()) if r.status_code == 429)
        assert r429.headers.get("retry-after") and r429.json()["error"]["message"]

        runner_b = next(c for c in engine.launcher.children if c.runner_id == "b#0")
        runner_b.proc.kill()
        deadline = time.time() + 30
        while time.time() < deadline:
            health = httpx.get(f"{url}/health", headers=auth, timeout=30)
            if health.status_code == 503:
                break
            time.sleep(0.5)
        assert health.status_code == 503 and "b" in health.text
        body_b = {"model": "b", "prompt": "hi", "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", json=body_b, headers=auth, timeout=30)
        assert r.status_code == 503 and "b#0" in r.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json=body, headers=auth).status_code == 200
    finally:
        engine.shutdown()
