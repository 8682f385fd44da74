"""Fast tests of the benchmark's peers: the transformers baseline server, and errors.

vLLM and llama.cpp are never installed here (minutes of downloads and a source
build); ``python -m bench.peers install all`` does that by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench import compare, peers
from bench.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("peers") / "tiny")


@pytest.fixture(scope="module")
def tiny_server(tiny_model: Path) -> Iterator[object]:
    """The transformers peer serving the tiny model, stopped after the module."""
    server = peers.start_peer("transformers", model=str(tiny_model), timeout=180, progress=False)
    try:
        yield server
    finally:
        server.stop()


def test_unknown_peer_is_unavailable_with_reason() -> None:
    with pytest.raises(peers.PeerUnavailable) as info:
        peers.start_peer("nonexistent")
    msg = str(info.value)
    assert "nonexistent" in msg and "vllm" in msg and "transformers" in msg
    with pytest.raises(peers.PeerUnavailable):
        peers.ensure_installed("nonexistent", progress=False)


def test_vllm_cli_needs_the_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's own CLI (vs_vllm's benchmark client) runs only from the peer venv.
    monkeypatch.setattr(peers, "is_installed", lambda kind: False)
    with pytest.raises(peers.PeerUnavailable, match="install vllm"):
        peers.vllm_cli_command(["bench", "serve"])
    monkeypatch.setattr(peers, "is_installed", lambda kind: kind == "vllm")
    cmd = peers.vllm_cli_command(["bench", "serve", "--help"])
    assert cmd[0].endswith("/vllm/bin/python") and cmd[1].endswith("peers.py")
    assert cmd[2:] == [peers.VLLM_CLI, "bench", "serve", "--help"]


def test_transformers_peer_lists_model(tiny_server) -> None:
    resp = httpx.get(f"{tiny_server.base_url}/v1/models", timeout=10)
    assert resp.status_code == 200
    assert [m["id"] for m in resp.json()["data"]] == [tiny_server.served_model] == ["tiny"]
    assert httpx.get(f"{tiny_server.base_url}/health", timeout=10).status_code == 200


def test_transformers_peer_completion(tiny_server) -> None:
    body = {
        "model": "tiny",
        "prompt": "The capital of France is",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    url = f"{tiny_server.base_url}/v1/completions"
    first = httpx.post(url, json=body, timeout=60).json()
    again = httpx.post(url, json=body, timeout=60).json()
    assert first["object"] == "text_completion"
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 6
    assert first["usage"]["prompt_tokens"] > 0
    # temperature 0 is greedy: the same prompt gives the same text.
    assert first["choices"][0]["text"] == again["choices"][0]["text"]


def test_transformers_peer_streams_with_usage(tiny_server) -> None:
    body = {
        "prompt": "The capital of France is",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events: list[dict] = []
    with httpx.stream(
        "POST", f"{tiny_server.base_url}/v1/completions", json=body, timeout=60
    ) as resp:
        assert resp.status_code == 200
        done = False
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            events.append(json.loads(line[len("data: ") :]))
    assert done
    tokens = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"] is None]
    assert len(tokens) == 5  # one chunk per generated token
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 5
    # Streaming and not give the same greedy text.
    plain = httpx.post(
        f"{tiny_server.base_url}/v1/completions", json={**body, "stream": False}, timeout=60
    ).json()
    streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert streamed == plain["choices"][0]["text"]


def test_transformers_peer_rejects_bad_request(tiny_server) -> None:
    url = f"{tiny_server.base_url}/v1/completions"
    resp = httpx.post(url, json={"prompt": "x", "max_tokens": 10**6}, timeout=10)
    assert resp.status_code == 400
    assert "context" in resp.json()["error"]["message"]


def test_stop_is_idempotent_and_reaches_the_group() -> None:
    # A stand-in server: the shell dies on SIGINT, but its background child
    # ignores SIGINT (as sh sets up), like a worker a server leaves behind.
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    time.sleep(0.3)
    server = peers.PeerServer("fake", "http://127.0.0.1:9", "fake", proc, "/dev/null")
    server.stop()
    assert proc.poll() is not None
    server.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the orphan is reaped by init, soon
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("a process of the stopped server's group is still alive")


def test_one_peer_per_model_with_pinned_cores(tmp_path: Path) -> None:
    """compare's mode 5 machinery on the transformers peer: one server per model,
    each pinned to its own core, the workload routed by model."""
    folders = [make_tiny_model_dir(tmp_path / n, seed=s) for n, s in (("a", 1), ("b", 2))]
    setup = compare.Setup(
        tuple(map(str, folders)), "float32", compare.QUICK, 0, tmp_path / "logs", progress=False
    )
    out = compare.run_peer_per_model(
        setup,
        peers,
        "transformers",
        compare.shift_config(setup),
        1 << 20,
        compare.ConfigResult("transformers x2", "transformers", []),
    )
    assert out.unavailable is None, out.unavailable
    r = out.result
    assert r is not None and r.errors == 0, r and r.error_samples
    assert set(r.per_model) == {"a", "b"}
    assert all(f.requests > 0 for f in r.per_model.values())
    cmd, _ = peers.peer_command("transformers", str(folders[0]), 1, "float32", 0, [1])
    assert cmd[:3] == ["taskset", "-c", "1"] and cmd[cmd.index("--threads") + 1] == "1"


@pytest.mark.skipif(not peers.is_installed("vllm"), reason="vLLM peer not installed")
def test_vllm_attention_kernel_runs_the_prefill_compared() -> None:
    """bench_decode_attention's ``--parts vllm``: vLLM's own kernel, in its venv,
    computes the causal attention radixmux's kernel is compared on, prefills and
    a decode batch (against plain attention over the same K/V), and is timed."""
    from bench import bench_decode_attention as bda

    got = bda.measure_peer(["64@448", "37@0", "1@99x3"], threads=1)
    assert set(got) == {"64@448", "37@0", "1@99x3"}
    assert all(ms > 0 and isa for ms, isa in got.values()), got
