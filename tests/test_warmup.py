"""Warm-up and pins end to end: real launcher, processes, sockets and HTTP.

One tiny random-weight model (SmolLM2's real tokenizer and chat template) in
a small arena (2,048 tokens of KV), so a few long prompts evict everything
that is not pinned. The scheduler checks its invariants after every step.
Two servers (a server start is most of this module's time): one started with
``--warmup FILE`` for the tests that read what the file left (they never
flush), one for the tests that pin, flush and evict. Each test passes alone
and in any order.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.tiny_models import make_tiny_model_dir
from radixmux.runtime.client.engine import Engine
from radixmux.runtime.launcher import LaunchError

pytestmark = pytest.mark.timeout(120)

SYSTEM = "You are the warm-up test assistant. Answer briefly and kindly. " * 6
OTHER_SYSTEM = "You are a second assistant, warmed over HTTP. Be terse. " * 6
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x K/V x kv heads x head dim x float32
ARENA_TOKENS = 2048


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("warmup_models") / "a", seed=21)


def start(model_dir: Path, **flags: object) -> Engine:
    base = dict(
        model=[f"{model_dir},name=a"],
        kv_cache_bytes=ARENA_TOKENS * BYTES_PER_TOKEN,
        kv_block_bytes=32 * BYTES_PER_TOKEN,
        runner_threads=1,
        check_invariants=True,
        dtype="float32",
        max_pinned_fraction=0.25,  # 512 tokens
    )
    return Engine(**{**base, **flags})


@pytest.fixture(scope="module")
def warmed(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server started with a warm-up file pinning ``SYSTEM``; nothing flushes it."""
    path = tmp_path_factory.mktemp("warmup_file") / "warm.jsonl"
    line = {"model": "a", "messages": [{"role": "system", "content": SYSTEM}], "pin": True}
    path.write_text("# system prompts\n" + json.dumps(line) + "\n\n")
    engine = start(model_dir, warmup=str(path))
    try:
        yield f"http://127.0.0.1:{engine.args.port}"
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def url(model_dir: Path) -> Iterator[str]:
    """A server for the tests that pin, flush and evict."""
    engine = start(model_dir)
    try:
        yield f"http://127.0.0.1:{engine.args.port}"
    finally:
        engine.shutdown()


def warmup(url: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/cache/warmup", json={"model": "a", **body}, timeout=60)


def chat(url: str, system: str, question: str) -> dict:
    body = {
        "model": "a",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 2,
        "temperature": 0,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def cached_tokens(url: str, ids: list[int]) -> int:
    """Prompt tokens a completion of ``ids`` finds in the cache."""
    body = {"model": "a", "prompt": ids, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def scheduler(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["scheduler"]


def pinned_metric(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(r'^radixmux_pinned_tokens\{model="a",version="1"\} (\S+)$', text, re.M)
    assert match, "radixmux_pinned_tokens missing from /metrics"
    return float(match.group(1))


def random_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_warmup_file_made_the_first_request_hit(warmed: str) -> None:
    """Ready (/health 200) only after the file's warm-up: the first chat hits it."""
    url = warmed
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    pinned = pinned_metric(url)
    assert pinned > 60
    usage = chat(url, SYSTEM, "And three plus three?")["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= pinned
    sched = scheduler(url)
    assert sched["invariants"] == "ok" and sched["locks_held"] == sched["pins"] == 1


def test_warmed_system_prompt_is_hit_by_the_first_chat(warmed: str) -> None:
    url = warmed
    r = warmup(url, messages=[{"role": "system", "content": OTHER_SYSTEM}])
    assert r.status_code == 200, r.text
    item = r.json()["items"][0]
    assert item["cached_tokens"] == item["prompt_tokens"] > 60
    # The template's opening is shared with the file's system prompt: cached already.
    assert 60 < item["computed_tokens"] < item["prompt_tokens"]
    assert item["pinned_tokens"] == 0
    usage = chat(url, OTHER_SYSTEM, "What is two plus two?")["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= item["cached_tokens"]


def test_pinned_prefix_survives_an_eviction_storm_unpinned_does_not(url: str) -> None:
    httpx.post(f"{url}/flush_cache", timeout=30)
    pinned, loose = random_ids(1, 300), random_ids(2, 300)
    r = warmup(url, token_ids=[pinned], pin=True)
    assert r.status_code == 200, r.text
    assert r.json()["pinned_tokens"] == 300
    assert warmup(url, token_ids=[loose]).json()["cached_tokens"] == 300
    assert pinned_metric(url) == 300
    for i in range(8):  # 8 x 500 new tokens through a 2,048-token arena
        cached_tokens(url, random_ids(100 + i, 500))
    assert scheduler(url)["evicted_tokens"]["capacity"] > 0
    assert cached_tokens(url, [*pinned, 7]) == 300
    assert cached_tokens(url, [*loose, 7]) < 300
    sched = scheduler(url)
    assert sched["invariants"] == "ok", sched["invariants"]
    assert sched["pins"] == 1 and sched["locks_held"] == 1  # idle: exactly the pin's lock
    assert sched["pinned_bytes"] == 300 * BYTES_PER_TOKEN


def test_pin_over_the_cap_is_refused_naming_the_field(url: str) -> None:
    before = scheduler(url)["pins"]
    r = warmup(url, token_ids=[random_ids(3, 600)], pin=True)  # cap: 512 tokens in all
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "pin" and "--max-pinned-fraction" in error["message"]
    assert scheduler(url)["pins"] == before


def test_unpin_and_flush_drop_pins(url: str) -> None:
    ids = random_ids(4, 200)
    assert warmup(url, token_ids=[ids], pin=True).json()["pinned_tokens"] == 200
    assert warmup(url, token_ids=[ids], pin=True).json()["pinned_tokens"] == 200  # idempotent
    pins = scheduler(url)["pins"]
    r = warmup(url, token_ids=[ids], pin=False)  # the same prefix again, unpinned
    assert r.status_code == 200 and r.json()["pinned_tokens"] == 0
    assert scheduler(url)["pins"] == pins - 1
    assert warmup(url, token_ids=[ids], pin=True).status_code == 200
    flushed = httpx.post(f"{url}/flush_cache", timeout=30).json()
    assert "pins dropped" in flushed["message"]
    sched = scheduler(url)
    assert sched["pins"] == 0 and sched["locks_held"] == 0 and sched["invariants"] == "ok"
    assert pinned_metric(url) == 0
    assert cached_tokens(url, [*ids, 7]) == 0  # flushed, pinned or not


def test_bad_bodies_are_refused(url: str) -> None:
    r = warmup(url, prompts=["x"], token_ids=[[1, 2]])
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompts"
    r = warmup(url, token_ids=[[1, 10**9]])
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("token_ids")
    r = warmup(url, promts=["x"])
    assert r.status_code == 400 and "promts" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/cache/warmup", json={"model": "zz", "prompts": ["x"]}, timeout=30)
    assert r.status_code == 404


def test_bad_warmup_file_line_fails_the_start(model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompts": ["fine"]}\n{"model": "a", "promts": ["typo"]}\n')
    with pytest.raises(LaunchError, match=r"line 2: .*promts"):
        start(model_dir, warmup=str(path))
