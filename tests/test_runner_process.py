"""The runner process driven over real ZeroMQ (ROUTER in the test, DEALER in the runner)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import torch
import zmq
from conftest import SlotPool, reference_logits, seq, tiny_model

from radixmux import protocol
from radixmux.model_runners.runner_process import RunnerConfig, spawn_runner

ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder(protocol.RunnerReply)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny Llama saved as a HF folder (weights only) for the runner to load."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", seed=5).model.save_pretrained(path)
    return path


@pytest.fixture
def router(tmp_path):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/sched.sock"
    sock.bind(endpoint)
    yield sock, endpoint
    sock.close()
    ctx.term()


def recv(sock, timeout_s: float = 60.0):
    """(identity, decoded reply) or fail after ``timeout_s``."""
    assert sock.poll(int(timeout_s * 1000)), "no reply from the runner"
    ident, raw = sock.recv_multipart()
    return ident, DEC.decode(raw)


def start(tiny_folder, arena, endpoint, rid="tiny0", **popen):
    cfg = RunnerConfig(str(tiny_folder), arena.spec, endpoint, rid, name="tiny", threads=1)
    return spawn_runner(cfg, **popen)


def test_ready_forward_errors_shutdown(tiny_folder, arena, router):
    sock, endpoint = router
    proc = start(tiny_folder, arena, endpoint)
    try:
        ident, ready = recv(sock)
        assert ident == b"tiny0" and isinstance(ready, protocol.Ready)
        assert ready.pid == proc.pid and ready.threads == 1
        info = ready.info
        assert info.layout.num_layers == 3 and info.layout.num_kv_heads == 2
        assert len(info.kv_share_key) == 32 and info.vocab_size == 211

        # The same weights in this process give the reference answer, and the
        # KV the runner wrote is readable here through the shared arena.
        local = tiny_model("llama", seed=5)
        assert local.info.kv_share_key == info.kv_share_key
        ids = torch.randint(0, 211, (12,)).tolist()
        slots = SlotPool(arena.spec.num_blocks * 4).take(12)
        params = protocol.SamplingParams(logprobs=True, top_logprobs=3, max_new_tokens=4)
        batch = protocol.ForwardBatch(7, [seq("a", ids, slots, 0, params=params)])
        sock.send_multipart([ident, ENC.encode(batch)])
        _, res = recv(sock)
        assert isinstance(res, protocol.ForwardResult) and res.error is None and res.batch_id == 7
        ref = reference_logits(local.model, ids)[-1]
        out = res.outputs[0]
        assert out.token_id == int(ref.argmax())
        assert abs(out.logprob - float(ref.log_softmax(-1).max())) < 1e-4
        assert [t for t, _ in out.top_logprobs] == ref.topk(3).indices.tolist()
        assert res.forward_ms > 0

        # Garbage bytes, then a batch with out-of-range slots: error replies.
        sock.send_multipart([ident, b"\x93not msgpack"])
        _, bad = recv(sock)
        assert bad.error and "malformed" in bad.error
        huge = protocol.ForwardBatch(8, [seq("b", [1, 2], [10**8, 10**8 + 1], 0)])
        sock.send_multipart([ident, ENC.encode(huge)])
        _, bad = recv(sock)
        assert bad.batch_id == 8 and "slot" in bad.error
        # ...and the runner still serves.
        sock.send_multipart(
            [ident, ENC.encode(protocol.ForwardBatch(9, [seq("a", ids[-1:], slots, 11)]))]
        )
        _, again = recv(sock)
        assert again.error is None and again.outputs[0].token_id == out.token_id

        sock.send_multipart([ident, ENC.encode(protocol.Shutdown())])
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_failed_start_reports(arena, router, tmp_path):
    sock, endpoint = router
    cfg = RunnerConfig(str(tmp_path / "nowhere"), arena.spec, endpoint, "bad")
    proc = spawn_runner(cfg)
    _, msg = recv(sock)
    assert isinstance(msg, protocol.Failed) and "nowhere" in msg.error
    assert proc.wait(timeout=30) == 1


def test_exits_when_parent_dies(tiny_folder, arena, router):
    sock, endpoint = router
    cfg = RunnerConfig(str(tiny_folder), arena.spec, endpoint, "orphan", threads=1)
    # A middle process starts the runner, then is killed: the runner must go too.
    code = (
        "import sys, time, msgspec\n"
        "from radixmux.model_runners.runner_process import RunnerConfig, spawn_runner\n"
        "p = spawn_runner(msgspec.json.decode(sys.argv[1], type=RunnerConfig))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    middle = subprocess.Popen(
        [sys.executable, "-c", code, msgspec.json.encode(cfg).decode()], stdout=subprocess.PIPE
    )
    runner_pid = int(middle.stdout.readline())
    _, ready = recv(sock)
    assert isinstance(ready, protocol.Ready) and ready.pid == runner_pid
    middle.send_signal(signal.SIGKILL)
    middle.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(runner_pid, 0)
        except ProcessLookupError:
            break
        # A zombie reparented to init may linger briefly; check its state.
        try:
            with open(f"/proc/{runner_pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        os.kill(runner_pid, signal.SIGKILL)
        pytest.fail("runner outlived its parent")


def test_two_runners_share_kv_through_the_arena(tiny_folder, arena, router):
    """Replicas with one KV-share key: K/V that runner A writes serve runner B."""
    sock, endpoint = router
    procs = [start(tiny_folder, arena, endpoint, rid=r) for r in ("A", "B")]
    try:
        ready = dict(recv(sock) for _ in procs)
        assert set(ready) == {b"A", b"B"}
        assert ready[b"A"].info.kv_share_key == ready[b"B"].info.kv_share_key
        ids = torch.randint(0, 211, (20,)).tolist()
        slots = SlotPool(arena.spec.num_blocks * 4, seed=8).take(20)
        # A prefills the first 15 tokens; B extends with the last 5 on A's slots.
        first = protocol.ForwardBatch(1, [seq("x", ids[:15], slots[:15], 0, sample=False)])
        sock.send_multipart([b"A", ENC.encode(first)])
        assert recv(sock)[1].error is None
        lp = protocol.SamplingParams(logprobs=True)
        rest = protocol.ForwardBatch(2, [seq("x", ids[15:], slots, 15, params=lp)])
        sock.send_multipart([b"B", ENC.encode(rest)])
        ident, res = recv(sock)
        assert ident == b"B" and res.error is None
        ref = reference_logits(tiny_model("llama", seed=5).model, ids)[-1]
        assert res.outputs[0].token_id == int(ref.argmax())
        assert abs(res.outputs[0].logprob - float(ref.log_softmax(-1).max())) < 1e-4
        for name in (b"A", b"B"):
            sock.send_multipart([name, ENC.encode(protocol.Shutdown())])
        assert [p.wait(timeout=30) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
