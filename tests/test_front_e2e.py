"""The front with the whole real runtime (launcher, tokenizer, scheduler, runners, detokenizer).

One tiny random-weight model with a real tokenizer and chat template; checks the
contracts between the front and its real peers: cache hits reported in usage
and /metrics, stop strings, errors from the tokenizer, client disconnects
freeing the request at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from bench.tiny_models import make_tiny_model_dir

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("front_e2e") / "m", seed=0)


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[str]:
    from radixmux.runtime.client.engine import Engine

    engine = Engine(
        model=[f"{folder},name=m"],
        kv_cache_bytes=8 << 20,
        kv_block_bytes=64 << 10,
        port=0,
        runner_threads=1,
        dtype="float32",  # prompt logprobs are compared with a float32 reference
    )
    try:
        yield f"http://127.0.0.1:{engine.launcher.args.port}"
    finally:
        engine.shutdown()


def scheduler_load(http: httpx.Client) -> tuple[int, int]:
    models = http.get("/get_server_info").json()["scheduler"]["models"]
    return sum(m["running"] for m in models), sum(m["waiting"] for m in models)


def test_openai_chat_cache_hits_and_metrics(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    system = {"role": "system", "content": "You answer in one short sentence. " * 8}
    usages = []
    for question in ("What is a cache?", "What is a tree?"):
        done = client.chat.completions.create(
            model="m",
            messages=[system, {"role": "user", "content": question}],
            max_tokens=4,
            temperature=0,
        )
        assert done.choices[0].finish_reason in ("length", "stop")
        usages.append(done.usage)
    assert usages[0].prompt_tokens > 40
    assert usages[1].prompt_tokens_details.cached_tokens >= 40  # the shared system prompt

    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=[system, {"role": "user", "content": "And a prefix?"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 4

    text = httpx.get(f"{server}/metrics").text
    hit_rate = 'radixmux_cache_hit_rate{model="m",version="1"}'
    rate = next(ln for ln in text.splitlines() if ln.startswith(hit_rate))
    assert float(rate.split()[-1]) > 0
    assert 'radixmux_requests_total{finish_reason="length",model="m",version="1"}' in text


def test_stop_string_and_errors(server: str) -> None:
    with httpx.Client(base_url=server, timeout=60) as http:
        body = {
            "model": "m",
            "text": "Hello",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        }
        full = http.post("/generate", json=body).json()["text"]
        assert len(full) > 4
        stop = full[2:4]
        body["sampling_params"]["stop"] = [stop]
        got = http.post("/generate", json=body).json()
        assert got["text"] == full[: full.index(stop)]
        assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}

        r = http.post(
            "/v1/completions", json={"model": "m", "prompt": "x " * 3000, "max_tokens": 4}
        )
        assert r.status_code == 400 and "context" in r.json()["error"]["message"]
        health = http.get("/health").json()
        assert (health["status"], health["models"]) == ("ok", {"m": "serving"})
        assert http.get("/health_generate").status_code == 200
        assert scheduler_load(http) == (0, 0)  # nothing leaked by any of the above


def test_disconnect_frees_the_request(server: str) -> None:
    with httpx.Client(base_url=server, timeout=60) as http:
        body = {"model": "m", "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            # Hold the line iterator: dropping it closes the stream, which is a
            # real disconnect (the server then rightly frees the request early).
            lines = r.iter_lines()
            next(lines)
            assert scheduler_load(http)[0] == 1
        deadline = time.monotonic() + 5
        while scheduler_load(http) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert scheduler_load(http) == (0, 0)


def reference_logprobs(folder: Path, ids: list[int]) -> list[float]:
    """Each prompt token's logprob under plain transformers (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_echo_and_logprob_start_len_score_the_prompt_like_transformers(
    server: str, folder: Path
) -> None:
    """``echo`` + ``logprobs`` (OpenAI client, plain and streamed) and SGLang's
    ``logprob_start_len`` give each prompt token's logprob as transformers
    does, also when the prompt is already cached (the scored positions are
    computed, not taken from the cache)."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    ids = httpx.post(f"{server}/tokenize", json={"model": "m", "prompt": prompt}).json()["tokens"]
    want = reference_logprobs(folder, ids)
    n = len(ids)
    args = {"model": "m", "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2}
    plain = client.completions.create(**args).choices[0]
    for _ in range(2):  # the second time the whole prompt is in the cache
        choice = client.completions.create(**args, echo=True).choices[0]
        lp = choice.logprobs
        assert choice.text == prompt + plain.text
        assert len(lp.tokens) == n + 3 and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None and len(lp.top_logprobs[1]) == 2
        assert all(
            math.isclose(a, b, abs_tol=1e-3)
            for a, b in zip(lp.token_logprobs[1:n], want, strict=True)
        )
        # Bit-equal where linear layers' per-row results do not depend on the
        # row count (packed, widened); torch's plain float32 product (below
        # AVX-512) may round the echoed call's last rows otherwise.
        assert all(
            math.isclose(a, b, abs_tol=1e-5)
            for a, b in zip(lp.token_logprobs[n:], plain.logprobs.token_logprobs, strict=True)
        )
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed: list[float | None] = []
    text = ""
    for chunk in client.completions.create(**args, echo=True, stream=True):
        if chunk.choices:
            text += chunk.choices[0].text
            streamed += (
                chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else []
            )
    assert text == choice.text and streamed == lp.token_logprobs

    body = {
        "text": prompt,
        "return_logprob": True,
        "logprob_start_len": 4,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    }
    meta = httpx.post(f"{server}/generate", json=body, timeout=60).json()["meta_info"]
    got = [v for v, _, _ in meta["input_token_logprobs"]]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids[4:]
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(got, want[3:], strict=True))
    assert len(meta["output_token_logprobs"]) == 2
    bad = httpx.post(f"{server}/generate", json={**body, "logprob_start_len": -2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprob_start_len"


def test_best_of_returns_the_samples_of_highest_mean_logprob(server: str) -> None:
    """``best_of`` draws that many samples per prompt (seeded: sample ``j`` with
    ``seed + j``, as ``n`` does) and answers with the ``n`` whose mean token
    logprob is highest, every sample billed; logprobs only if asked."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    args = {"model": "m", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 1.5}
    args |= {"seed": 7, "extra_body": {"ignore_eos": True}}
    drawn = client.completions.create(**args, n=4, logprobs=0)
    mean = [sum(c.logprobs.token_logprobs) / 5 for c in drawn.choices]
    ranked = sorted(range(4), key=lambda k: -mean[k])
    assert len({c.text for c in drawn.choices}) > 1  # the samples differ: ranking matters
    one = client.completions.create(**args, best_of=4)
    assert [c.text for c in one.choices] == [drawn.choices[ranked[0]].text]
    assert one.choices[0].logprobs is None and one.choices[0].index == 0
    assert one.usage.completion_tokens == 20  # all four samples
    two = client.completions.create(**args, n=2, best_of=4, logprobs=1)
    assert [c.text for c in two.choices] == [drawn.choices[k].text for k in ranked[:2]]
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].logprobs is not None
    for bad in ({"n": 3, "best_of": 2}, {"best_of": 17}, {"best_of": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**args, **bad)
        assert err.value.body["param"] == "best_of", err.value.body
