"""Model changes that cannot take the server down or hang it, on real servers.

Loads are admitted only within the cores and the memory left (400 for
replicas, 507 for memory, naming the need and what is free); an unload ends
within ``--drain-timeout`` even when a client stops reading its stream; a load
that the launcher times out leaves nothing behind, so the same load works again.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from bench.tiny_models import make_tiny_model_dir
from radixmux import protocol
from radixmux.protocol import ModelArg
from radixmux.runtime.admission import usable_cores
from radixmux.runtime.client.engine import Engine
from radixmux.runtime.front.hub import new_rid
from radixmux.runtime.launcher import Child

pytestmark = pytest.mark.timeout(900)
DRAIN_TIMEOUT_S = 3.0
# A tiny model's runner is ready in 5-10 s on a busy 2-core machine; the
# timed-out load's test waits this long for the launcher to give up.
LOAD_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("admission") / "tiny", seed=4)


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[tuple[str, Engine]]:
    eng = Engine(
        model=[f"{tiny},name=a"],
        kv_cache_bytes=64 << 20,
        kv_block_bytes=256 << 10,
        dtype="float32",
        drain_timeout=DRAIN_TIMEOUT_S,
        model_load_timeout=LOAD_TIMEOUT_S,
    )
    try:
        yield f"http://127.0.0.1:{eng.args.port}", eng
    finally:
        eng.shutdown()


def load(url: str, source: Path, name: str, **fields: object) -> httpx.Response:
    body = {"source": str(source), "name": name, **fields}
    return httpx.post(f"{url}/models", json=body, timeout=LOAD_TIMEOUT_S + 120)


def served(url: str) -> list[str]:
    return sorted(m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"])


def scheduler_models(url: str) -> list[dict]:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["scheduler"]["models"]


def instances(url: str) -> list[str]:
    """Instances the scheduler holds (served or not)."""
    return [m["name"] for m in scheduler_models(url)]


def error(r: httpx.Response) -> dict:
    return r.json()["error"]


def meminfo_bytes(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def huge_model_dir(path: Path, tiny: Path, at_least: int) -> Path:
    """A real Llama folder (config, tokenizer, safetensors) whose float32
    weights take ``at_least`` bytes; the data is a sparse file of zeros, so it
    costs no disk, and nothing but a load would ever read it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (path / f.name).write_bytes(f.read_bytes())
    small = json.loads((tiny / "config.json").read_text())
    hidden = 8192
    per_layer = 4 * (4 * hidden * hidden + 3 * hidden * 2 * hidden)  # attention + MLP, float32
    layers = max(1, math.ceil(at_least / per_layer))
    config = LlamaConfig(
        vocab_size=small["vocab_size"],
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=64,
        max_position_embeddings=2048,
        bos_token_id=small["bos_token_id"],
        eos_token_id=small["eos_token_id"],
        tie_word_embeddings=False,
    )
    config.save_pretrained(path)
    with torch.device("meta"):
        shapes = {k: list(t.shape) for k, t in LlamaForCausalLM(config).state_dict().items()}
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    assert offset >= at_least
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    return path


def test_replicas_are_capped_by_cores(server: tuple[str, Engine], tiny: Path) -> None:
    url, _ = server
    cores = usable_cores()
    r = load(url, tiny, "many", replicas=cores + 1)
    assert r.status_code == 400, r.text
    assert error(r)["param"] == "replicas"
    assert f"[1, {cores}]" in error(r)["message"] and "core" in error(r)["message"]
    assert "many" not in served(url)
    health = httpx.get(f"{url}/health", timeout=30).json()
    assert health["admission"]["max_replicas"] == cores


def test_a_load_that_does_not_fit_is_refused_with_507(
    server: tuple[str, Engine], tiny: Path, tmp_path: Path
) -> None:
    url, _ = server
    total = meminfo_bytes("MemTotal")
    huge = huge_model_dir(tmp_path / "huge", tiny, 2 * total)
    t0 = time.monotonic()
    r = load(url, huge, "huge")
    assert r.status_code == 507, r.text
    message = error(r)["message"]
    assert "not enough memory" in message and "needs about" in message and "is free" in message
    need_mib = int(message.split("needs about ")[1].split(" MiB")[0].replace(",", ""))
    assert need_mib * (1 << 20) >= 2 * total  # the weights, counted from the file's header
    assert "MemAvailable" in message and "--memory-reserve-bytes" in message
    assert error(r)["param"] == "source"
    assert time.monotonic() - t0 < 60  # refused up front: no runner tried to load it
    assert "huge" not in served(url)

    health = httpx.get(f"{url}/health", timeout=30).json()["admission"]
    assert 0 < health["memory_available_bytes"] <= total
    reserve = health["memory_reserve_bytes"]
    assert reserve == 1 << 30  # the default
    free = health["memory_free_for_models_bytes"]
    assert 0 <= free <= health["memory_available_bytes"] - reserve

    # The same name loads when it fits; a reload to weights that do not fit is
    # refused the same way, and the old version keeps serving.
    r = load(url, tiny, "huge")
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/models/huge/reload", json={"source": str(huge)}, timeout=120)
    assert r.status_code == 507, r.text
    card = httpx.get(f"{url}/v1/models/huge", timeout=30).json()
    assert card["version"] == 1
    assert httpx.delete(f"{url}/models/huge", timeout=120).status_code == 200


def test_memory_reserve_is_kept_free(tiny: Path) -> None:
    """``--memory-reserve-bytes`` as large as the machine: every load is
    refused, with the real need of a real tiny model; start-up only warns."""
    total = meminfo_bytes("MemTotal")
    eng = Engine(
        model=[f"{tiny},name=a"],
        kv_cache_bytes=64 << 20,
        kv_block_bytes=256 << 10,
        dtype="float32",
        memory_reserve_bytes=total,
    )
    url = f"http://127.0.0.1:{eng.args.port}"
    try:
        r = load(url, tiny, "b")
        assert r.status_code == 507, r.text
        message = error(r)["message"]
        assert "only 0 MiB is free" in message, message
        assert f"--memory-reserve-bytes {total / (1 << 20):,.0f} MiB" in message
        health = httpx.get(f"{url}/health", timeout=30).json()
        assert health["status"] == "ok"
        assert health["admission"]["memory_free_for_models_bytes"] == 0
        assert served(url) == ["a"]
    finally:
        eng.shutdown()


def _stream_and_never_read(port: int, body: dict) -> socket.socket:
    """Send a streamed request on a raw socket with a small receive buffer; read nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def _read_to_end(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _scheduler_busy(url: str, instance: str) -> bool:
    return any(m["name"] == instance and m["running"] + m["waiting"] for m in scheduler_models(url))


def test_a_client_that_never_reads_does_not_hold_an_unload(
    server: tuple[str, Engine], tiny: Path
) -> None:
    url, eng = server
    assert load(url, tiny, "slow").status_code == 200
    # More stream than the kernel buffers (the sender's grows to tcp_wmem's
    # maximum) and the transport's hold, so the front's writer blocks for good:
    # 16 choices with 20 top logprobs make ~2 KB per token and choice.
    wmem_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    tokens = min(1500, math.ceil((wmem_max + (4 << 20)) / (16 * 1500)))
    body = {
        "model": "slow",
        "messages": [{"role": "user", "content": "Tell me everything."}],
        "max_tokens": tokens,
        "n": 16,
        "logprobs": True,
        "top_logprobs": 20,
        "ignore_eos": True,
        "temperature": 1.0,
        "stream": True,
    }
    sock = _stream_and_never_read(eng.args.port, body)
    try:
        deadline = time.monotonic() + 600
        time.sleep(1.0)
        while _scheduler_busy(url, "slow"):  # every token made: the rest waits on the client
            assert time.monotonic() < deadline, "the generation never finished"
            time.sleep(0.5)

        t0 = time.monotonic()
        r = httpx.delete(f"{url}/models/slow", timeout=120)  # no ?timeout=: --drain-timeout
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["aborted"] == 16
        assert DRAIN_TIMEOUT_S <= took < DRAIN_TIMEOUT_S + 60
        assert "slow" not in served(url)

        # Model changes work again at once.
        assert load(url, tiny, "slow").status_code == 200
        r = httpx.delete(f"{url}/models/slow", timeout=120)
        assert r.status_code == 200 and r.json()["aborted"] == 0, r.text

        # The stalled stream was cut: what the kernel held, then the end of the
        # connection, without the stream's own end.
        data = _read_to_end(sock, 60)
        assert len(data) > 1 << 16
        assert b"data: [DONE]" not in data
    finally:
        sock.close()


def _runner(eng: Engine, rid: str) -> Child | None:
    return next((c for c in list(eng.launcher.children) if c.runner_id == rid), None)


def test_a_load_that_times_out_leaves_nothing_behind(
    server: tuple[str, Engine], tiny: Path
) -> None:
    url, eng = server
    result: dict[str, httpx.Response] = {}
    post = threading.Thread(target=lambda: result.setdefault("r", load(url, tiny, "late")))
    post.start()
    # Freeze the new runner as soon as it exists: it never reports ready.
    deadline = time.monotonic() + 60
    while (child := _runner(eng, "late#0")) is None:
        assert time.monotonic() < deadline, "the runner never started"
        time.sleep(0.01)
    os.kill(child.proc.pid, signal.SIGSTOP)
    post.join(timeout=LOAD_TIMEOUT_S + 150)
    r = result["r"]
    assert r.status_code == 504, r.text
    assert "did not load within" in error(r)["message"]
    assert child.proc.poll() is not None  # killed, though stopped
    assert "late" not in served(url)
    assert httpx.delete(f"{url}/models/late", timeout=60).status_code == 404
    assert "late" not in instances(url)

    # Nothing left registered: the same load works now, and so does its unload.
    r = load(url, tiny, "late")
    assert r.status_code == 200, r.text
    assert "late" in served(url)
    chat = {"model": "late", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).status_code == 200
    assert httpx.delete(f"{url}/models/late", timeout=120).status_code == 200
    assert httpx.delete(f"{url}/models/late", timeout=60).status_code == 404


def _wait(what: str, done: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_the_launcher_undoes_a_load_the_front_gave_up_on(
    server: tuple[str, Engine], tiny: Path
) -> None:
    """What the front sends when a load's answer does not come in time (an
    unload of the instance) undoes it, whether it is still loading or done."""
    url, eng = server
    zctx = zmq.Context()
    launcher = zctx.socket(zmq.PUSH)
    launcher.connect(eng.launcher.endpoints.launcher)

    def command(op: str, name: str) -> None:
        cmd = protocol.ModelCommand(new_rid(), op, ModelArg(str(tiny), name), name, 1)
        launcher.send(protocol.encode(cmd))

    def gone(name: str) -> bool:
        runner = _runner(eng, f"{name}#0")
        lifecycle = eng.launcher.lifecycle
        assert lifecycle is not None
        busy = name in lifecycle.loads or name in lifecycle.unloads
        up = runner is not None and runner.proc.poll() is None
        return not busy and not up and name not in instances(url)

    try:
        # Still loading: cancelled, its runner killed, the scheduler's pending entry dropped.
        command("load", "cancelled")
        _wait("the runner never started", lambda: _runner(eng, "cancelled#0") is not None)
        command("unload", "cancelled")
        _wait("the cancelled load left something behind", lambda: gone("cancelled"))
        time.sleep(1.0)  # a load that went on regardless would register now
        assert "cancelled" not in instances(url)
        r = load(url, tiny, "cancelled")
        assert r.status_code == 200, r.text
        assert httpx.delete(f"{url}/models/cancelled", timeout=120).status_code == 200

        # Loaded behind the front's back (an answer that came too late): unloaded.
        command("load", "late-success")
        _wait("the load never finished", lambda: "late-success" in instances(url))
        assert "late-success" not in served(url)
        assert load(url, tiny, "late-success").status_code == 409  # the state to undo
        command("unload", "late-success")
        _wait("the instance was not unloaded", lambda: gone("late-success"))
        r = load(url, tiny, "late-success")
        assert r.status_code == 200, r.text
        assert httpx.delete(f"{url}/models/late-success", timeout=120).status_code == 200
    finally:
        launcher.close(linger=0)
        zctx.term()
