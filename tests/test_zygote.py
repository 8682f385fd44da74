"""The zygote (common/zygote.py): runners forked from one process that imported
torch and transformers once.

Real processes: a zygote started as the launcher starts it, runners forked from
it that load a tiny model into a real arena and answer over real ZeroMQ, real
signals. Server-level behaviour (restarts, on-demand loads, a launcher killed
with SIGKILL) runs through the zygote in every server test, as it is the default.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from conftest import SlotPool, reference_logits, seq, tiny_model
from test_runner_process import recv, router, tiny_folder  # noqa: F401 (fixtures)

from radixmux import protocol
from radixmux.common.zygote import MODULE, RUNNER_PRELOAD, Zygote, ZygoteChild
from radixmux.model_runners.runner_process import RUNNER_MODULE, RunnerConfig, spawn_runner

TESTS = Path(__file__).resolve().parent
ENC = msgspec.msgpack.Encoder()


@pytest.fixture
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    z.start()
    try:
        yield z
    finally:
        z.close()


def parent_of(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[1])


def alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] not in "ZX"


def config(folder: Path, arena, endpoint: str, rid: str) -> RunnerConfig:
    return RunnerConfig(str(folder), arena.spec, endpoint, rid, name="tiny", threads=1)


@pytest.fixture
def start(zygote: Zygote, tiny_folder: Path, arena, router):  # noqa: F811
    """Start runner ``rid`` through ``zygote``; returns it once it said Ready, and its identity."""
    sock, endpoint = router

    def started(rid: str) -> tuple[ZygoteChild, bytes]:
        proc = spawn_runner(config(tiny_folder, arena, endpoint, rid), zygote)
        assert isinstance(proc, ZygoteChild)
        ident, ready = recv(sock)
        assert isinstance(ready, protocol.Ready) and ready.pid == proc.pid
        return proc, ident

    return started


def test_a_forked_runner_serves_and_its_end_is_reported(
    zygote: Zygote,
    start,
    arena,
    router,  # noqa: F811
) -> None:
    sock, _ = router
    proc, ident = start("tiny0")
    assert zygote.forks == 1
    # Its zygote's child, named by its runner id (its command line is the zygote's).
    assert parent_of(proc.pid) == zygote.pid
    assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == "tiny0"
    assert MODULE in Path(f"/proc/{proc.pid}/cmdline").read_text()

    local = tiny_model("llama", seed=5)
    ids = torch.randint(0, 211, (9,)).tolist()
    slots = SlotPool(arena.spec.num_blocks * 4).take(9)
    sock.send_multipart([ident, ENC.encode(protocol.ForwardBatch(1, [seq("a", ids, slots, 0)]))])
    _, res = recv(sock)
    assert res.error is None
    assert res.outputs[0].token_id == int(reference_logits(local.model, ids)[-1].argmax())

    sock.send_multipart([ident, ENC.encode(protocol.Shutdown())])
    assert proc.wait(timeout=30) == 0 and not alive(proc.pid)

    # Killed: the signal's code, as Popen reports it.
    second, _ = start("tiny1")
    second.kill()
    assert second.wait(timeout=30) == -signal.SIGKILL
    # A child whose main returns: its exit code (a bad config: 2).
    bad = zygote.fork(RUNNER_MODULE, ["not json"], "bad")
    assert bad.wait(timeout=30) == 2 and bad.poll() == 2
    assert zygote.forks == 3


def test_a_dead_zygote_takes_its_runners_and_the_next_fork_starts_another(
    zygote: Zygote, start
) -> None:
    proc, _ = start("tiny0")
    first = zygote.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while alive(proc.pid):  # the parent-death signal, not only our bookkeeping
        assert time.monotonic() < deadline, "the runner outlived its zygote"
        time.sleep(0.05)

    again, _ = start("tiny1")
    assert zygote.pid not in (None, first) and parent_of(again.pid) == zygote.pid
    again.kill()
    assert again.wait(timeout=30) == -signal.SIGKILL


def test_a_zygote_with_two_threads_refuses_and_the_runner_starts_anyway(
    monkeypatch: pytest.MonkeyPatch,
    tiny_folder: Path,  # noqa: F811
    arena,
    router,  # noqa: F811
) -> None:
    # A fork copies only the calling thread: a lock another thread held would
    # stay held in the child forever. The zygote checks, and the runner
    # starts as a new process instead.
    monkeypatch.setenv("PYTHONPATH", f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    z = Zygote((*RUNNER_PRELOAD, "zygote_threaded"))
    z.start()
    sock, endpoint = router
    try:
        proc = spawn_runner(config(tiny_folder, arena, endpoint, "tiny0"), z)
        assert not isinstance(proc, ZygoteChild) and z.forks == 0
        assert parent_of(proc.pid) == os.getpid()
        _, ready = recv(sock)
        assert isinstance(ready, protocol.Ready) and ready.pid == proc.pid
        proc.kill()
        proc.wait(30)
    finally:
        z.close()
