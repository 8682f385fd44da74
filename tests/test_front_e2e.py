"""The front with the whole real runtime (launcher, tokenizer, scheduler, runners, detokenizer).

One tiny random-weight model with a real tokenizer and chat template; checks the
contracts between the front and its real peers: cache hits reported in usage
and /metrics, stop strings, errors from the tokenizer, client disconnects
freeing the request at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from tiny_models import make_tiny_model_dir

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    from radixmux.runtime.engine import Engine

    folder = make_tiny_model_dir(tmp_path_factory.mktemp("front_e2e") / "m", seed=0)
    engine = Engine(
        model=[f"{folder},name=m"],
        kv_cache_bytes=8 << 20,
        kv_block_bytes=64 << 10,
        port=0,
        runner_threads=1,
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
    rate = next(
        ln for ln in text.splitlines() if ln.startswith('radixmux_cache_hit_rate{model="m"}')
    )
    assert float(rate.split()[-1]) > 0
    assert 'radixmux_requests_total{finish_reason="length",model="m"}' in text


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
        assert http.get("/health").json() == {"status": "ok", "models": {"m": "serving"}}
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
