"""Supervision where the disk tier and the scheduler's own checks meet.

- a batch held back for a disk save is not timed as the runner's: a save
  slower than ``--runner-timeout`` never gets a healthy runner killed, and a
  disk that makes no progress at all is bounded by ``--kv-disk-timeout`` (a
  503 for what waited on it, the tier turned off, the runner untouched);
- a model that loses its last runner keeps no request anywhere: one loading
  its prefix from disk gets its 503 at once, not never when the restarts run
  out;
- ``/get_server_info`` does not walk the invariants on every call.

The disk tests run the scheduler on a thread of the test process (its runner
is a real process, every socket is real ZeroMQ) so the test can hold the disk
tier's I/O thread inside one file operation for as long as it likes: a disk
exactly as slow as the test says. The call then runs for real.
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from test_scheduler_process import Runtime, hf_greedy

from bench.tiny_models import make_tiny_model_dir
from radixmux import protocol
from radixmux.common.ipc import Endpoints, make_runtime_dir, remove_runtime_dir, socket
from radixmux.common.process import ProcessContext
from radixmux.common.server_args import ServerArgs
from radixmux.memory.arena import KVArena
from radixmux.model_runners.runner_process import RunnerConfig, spawn_runner
from radixmux.protocol import ModelArg
from radixmux.runtime.client.engine import Engine
from radixmux.scheduler import bootstrap
from radixmux.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.timeout(300)

# The tiny model's KV is 512 bytes a token (float32): 8 tokens a 4 KiB block,
# so 40 blocks hold 320 tokens, less than two of these prompts and their output.
ARENA = {"kv_cache_bytes": 40 * 4096, "kv_block_bytes": 4096}
PROMPTS = [list(range(1000 + 300 * i, 1200 + 300 * i)) for i in range(3)]
NEW_TOKENS = 8
GATE_S = 120.0  # a gate left shut by a failing test opens by itself after this


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("supervision") / "a", seed=5)


class Gate:
    """Holds the disk tier's I/O thread at the start of one ``StoreFiles``
    method (``write``: saves, ``read``: loads) until ``open``; then the call
    runs for real."""

    def __init__(self, sched: Scheduler, method: str) -> None:
        assert sched.disk is not None
        files = sched.disk.transfer.files
        real: Callable[..., Any] = getattr(files, method)
        self.opened = threading.Event()
        self.entered = threading.Event()

        def gated(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            self.opened.wait(GATE_S)
            return real(*args, **kwargs)

        setattr(files, method, gated)

    def open(self) -> None:
        self.opened.set()


@dataclass
class InProcess:
    """A scheduler on a thread here, its runner a real process, the test on
    the other sockets (``rt``), playing the launcher too."""

    rt: Runtime
    sched: Scheduler
    runner: subprocess.Popen


@contextlib.contextmanager
def in_process(model: Path, **flags: object) -> Iterator[InProcess]:
    rundir = make_runtime_dir()
    ep = Endpoints.in_dir(rundir)
    args = ServerArgs(models=[ModelArg(str(model), "a")], check_invariants=True, **flags)
    arena = KVArena.create(args.kv_cache_bytes // args.kv_block_bytes, args.kv_block_bytes)
    zctx = zmq.Context()
    launcher = socket(zctx, zmq.PULL, ep.launcher, bind=True)
    rt = Runtime(
        ep,
        zctx,
        socket(zctx, zmq.PUSH, ep.scheduler, bind=False),
        socket(zctx, zmq.PULL, ep.detokenizer, bind=True),
        socket(zctx, zmq.PULL, ep.front, bind=True),
        arena.spec,
    )
    ctx = ProcessContext("scheduler", args, ep, arena=arena.spec)
    box: dict[str, Any] = {}
    ready = threading.Event()

    def serve() -> None:
        try:  # the sockets are made and used on this thread only
            sockets, outbox = bootstrap.open_sockets(ctx, zctx)
            roll = bootstrap.wait_for_runners(args, sockets)
            startup = bootstrap.build(args, arena.spec, roll)
            sched = box["sched"] = Scheduler(args, arena.spec, outbox, startup)
            ready.set()
            sched.run(sockets)
        except BaseException as exc:
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=serve, name="scheduler", daemon=True)
    thread.start()
    cfg = RunnerConfig(str(model), arena.spec, ep.runners, "a#0", "a", threads=1)
    runner = spawn_runner(cfg)
    rt.procs.append(runner)
    try:
        assert ready.wait(180), "the runner never came up"
        assert "error" not in box, box.get("error")
        yield InProcess(rt, box["sched"], runner)
    finally:
        rt.to_sched.send(protocol.encode(protocol.ShutdownProcess()))
        thread.join(30)
        for proc in rt.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=20)
            proc.kill()
        launcher.close()
        zctx.destroy(linger=0)
        arena.destroy()
        remove_runtime_dir(rundir)
    assert not thread.is_alive(), "the scheduler did not stop"
    assert "error" not in box, box.get("error")


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def outputs(rt: Runtime, timeout_s: float) -> list[protocol.RequestOutput]:
    """The next batch of outputs the scheduler sends (fails if none within ``timeout_s``)."""
    assert rt.from_sched.poll(int(timeout_s * 1000)), f"no output within {timeout_s:g} s"
    return protocol.decoder(protocol.DetokenizerInbox).decode(rt.from_sched.recv()).outputs


def fresh_check(rt: Runtime) -> protocol.SchedulerStats:
    """The invariant check of the state as it is now (``invariants_current``)."""
    deadline = time.monotonic() + 30
    while True:
        stats = rt.control("check").stats
        assert stats is not None
        if stats.invariants_current:
            return stats
        assert time.monotonic() < deadline, "the invariant check never caught up"
        time.sleep(0.2)


def idle_and_clean(rt: Runtime) -> protocol.SchedulerStats:
    stats = fresh_check(rt)
    assert stats.invariants == "ok", stats.invariants
    assert stats.locks_held == 0 and stats.request_owned_slots == 0
    assert all(m.running == 0 and m.waiting == 0 for m in stats.models), stats.models
    return stats


def disk_flags(tmp_path: Path, **flags: object) -> dict[str, object]:
    return {**ARENA, "kv_disk_bytes": 1 << 30, "kv_disk_dir": str(tmp_path / "kv"), **flags}


def test_a_save_slower_than_the_runner_timeout_kills_no_runner(model, tmp_path) -> None:
    expected = hf_greedy(model, PROMPTS[1], NEW_TOKENS)
    flags = disk_flags(tmp_path, runner_timeout=1.0, kv_disk_timeout=120.0)
    with in_process(model, **flags) as ip:
        rt, sched = ip.rt, ip.sched
        saves = Gate(sched, "write")
        try:
            first = rt.submit("a", PROMPTS[0], max_new=NEW_TOKENS)
            rt.collect({first})
            # The second prompt evicts the first: its chunks go to disk
            # (write-back) and the batch that reuses their blocks is held
            # until the save is done, three runner timeouts here.
            second = rt.submit("a", PROMPTS[1], max_new=NEW_TOKENS)
            wait_for("a batch held for a save", lambda: bool(sched.held))
            wait_for("the save at the disk", saves.entered.is_set)
            time.sleep(3.0)
            assert sched.held, "the held batch went before its save ended"
            assert ip.runner.poll() is None, "a runner waiting on the disk was killed"
        finally:
            saves.open()
        assert rt.collect({second})[second] == expected
        stats = idle_and_clean(rt)
        (m,) = stats.models
        assert m.state == "serving" and m.restarts == 0 and m.error is None
        assert stats.disk is not None and stats.disk.enabled and stats.disk.chunks_written > 0
        assert ip.runner.poll() is None


def test_a_disk_that_makes_no_progress_fails_its_waiters_not_the_runner(model, tmp_path):
    flags = disk_flags(tmp_path, runner_timeout=1.0, kv_disk_timeout=2.0)
    with in_process(model, **flags) as ip:
        rt, sched = ip.rt, ip.sched
        saves = Gate(sched, "write")
        try:
            first = rt.submit("a", PROMPTS[0], max_new=NEW_TOKENS)
            rt.collect({first})
            second = rt.submit("a", PROMPTS[1], max_new=NEW_TOKENS)
            wait_for("a batch held for a save", lambda: bool(sched.held))
            t0 = time.monotonic()
            (out,) = outputs(rt, 60)
            waited = time.monotonic() - t0
            assert out.rid == second and out.status == 503 and out.finish_reason == "error"
            assert "disk" in (out.error or "") and "stalled" in (out.error or "")
            assert waited > 1.5, f"failed after {waited:.1f} s, before --kv-disk-timeout"
            disk = rt.control("stats").stats.disk
            assert disk is not None and not disk.enabled
            assert "--kv-disk-timeout" in (disk.disabled_reason or "")
            assert ip.runner.poll() is None, "the runner paid for the disk"
        finally:
            saves.open()
        # The stuck save ends: its blocks are free again; the server serves
        # from memory, the runner the same process all along.
        wait_for("the stuck save to end", lambda: not sched.disk.transfer.pending)
        third = rt.submit("a", PROMPTS[2], max_new=NEW_TOKENS)
        assert rt.collect({third})[third] == hf_greedy(model, PROMPTS[2], NEW_TOKENS)
        (m,) = idle_and_clean(rt).models
        assert m.state == "serving" and m.restarts == 0


def test_a_request_loading_from_disk_fails_at_once_when_its_model_goes(model, tmp_path):
    with in_process(model, **disk_flags(tmp_path)) as ip:
        rt, sched = ip.rt, ip.sched
        # Three prompts through an arena that holds less than two: the first
        # is evicted to disk.
        for prompt in PROMPTS:
            rid = rt.submit("a", prompt, max_new=NEW_TOKENS)
            rt.collect({rid})
        wait_for(
            "the first prompt saved",
            lambda: rt.control("stats").stats.disk.chunks_written >= 3,
        )
        loads = Gate(sched, "read")
        try:
            loading = rt.submit("a", PROMPTS[0], max_new=NEW_TOKENS)
            wait_for("its prefix loading from disk", lambda: bool(sched.disk.loading))
            # The runner dies; the launcher says it restarts it.
            ip.runner.kill()
            code = ip.runner.wait()
            rt.to_sched.send(protocol.encode(protocol.RunnerDied("a#0", code, restarting=True)))
            # The model has no live runner: the loading request is answered
            # now, not whenever its load ends (nor never, when the restarts
            # run out while it waits in the queue).
            (out,) = outputs(rt, 30)
            assert out.rid == loading and out.status == 503 and out.finish_reason == "error"
            assert "restarting" in (out.error or "") and "a#0" in (out.error or "")
            # New requests are refused at once while it restarts.
            refused = rt.submit("a", PROMPTS[1], max_new=NEW_TOKENS)
            assert rt.front.poll(30_000), "a request to a restarting model was not refused"
            err = protocol.decoder(protocol.FrontInbox).decode(rt.front.recv())
            assert isinstance(err, protocol.RequestError)
            assert err.rid == refused and err.status == 503
        finally:
            loads.open()
        # The load ends after its request was answered: its slots are freed,
        # nothing is answered twice. Then the launcher gives up on the runner.
        wait_for("the load to end", lambda: not sched.disk.loading)
        rt.to_sched.send(protocol.encode(protocol.RunnerDied("a#0", code, restarting=False)))
        stats = idle_and_clean(rt)
        assert stats.models[0].state == "down"
        assert not rt.from_sched.poll(500), "an answered request was answered again"


def model_state(url: str, name: str) -> str | None:
    models = {m["name"]: m for m in server_info(url)["models"]}
    return models[name]["state"] if name in models else None


def test_a_restart_that_cannot_start_a_process_is_retried(model, monkeypatch) -> None:
    """A restart whose process cannot even be made (fork failing for want of
    memory or processes) counts as one more death: the launcher's supervision
    goes on, tells the scheduler and tries again after the next backoff."""
    from radixmux.model_runners import runner_process

    real = runner_process.spawn_runner
    refused: list[str] = []

    def spawn_refused_once(cfg: RunnerConfig, *args: object) -> subprocess.Popen:
        if not refused:
            refused.append(cfg.runner_id)
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        return real(cfg, *args)

    engine = Engine(model=[f"{model},name=a"], runner_threads=1, **ARENA)
    try:
        url = f"http://127.0.0.1:{engine.args.port}"
        monkeypatch.setattr(runner_process, "spawn_runner", spawn_refused_once)
        runner = next(c for c in engine.launcher.children if c.name == "runner a#0")
        runner.proc.kill()
        wait_for("a restart refused", lambda: bool(refused), timeout=30)
        wait_for("the runner back", lambda: model_state(url, "a") == "serving", timeout=120)
        assert refused == ["a#0"] and engine._monitor.is_alive()
        body = {"model": "a", "prompt": "Hello", "max_tokens": 2, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[str]:
    engine = Engine(model=[f"{model},name=a"], runner_threads=1, **ARENA)
    try:
        yield f"http://127.0.0.1:{engine.args.port}"
    finally:
        engine.shutdown()


def server_info(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/get_server_info", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["scheduler"]


def test_get_server_info_does_not_walk_the_invariants_each_call(server) -> None:
    first = server_info(server)
    assert first["invariants"] == "ok" and first["invariants_current"]
    walks = first["invariant_checks"]
    assert walks >= 1
    # Nothing changes on an idle server: every answer is the last walk's.
    for _ in range(50):
        info = server_info(server)
        assert info["invariant_checks"] == walks and info["invariants_current"]
    assert info["invariants_age_s"] >= first["invariants_age_s"]
    # Under traffic a walk runs at most once a second, however often asked.
    body = {"model": "a", "prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True}
    done = threading.Event()

    def traffic() -> None:
        while not done.is_set():
            httpx.post(f"{server}/v1/completions", json=body, timeout=60).raise_for_status()

    thread = threading.Thread(target=traffic)
    thread.start()
    t0 = time.monotonic()
    try:
        calls = 0
        while time.monotonic() - t0 < 3.0:
            server_info(server)
            calls += 1
    finally:
        done.set()
        thread.join(60)
    elapsed = time.monotonic() - t0
    during = server_info(server)["invariant_checks"] - walks
    assert calls > 2 * (elapsed + 2), f"only {calls} calls: the test asked too slowly"
    # At most one a second (fewer when a walk is slow: 1% of the loop at most).
    assert during <= elapsed + 2, f"{during} walks for {calls} calls in {elapsed:.1f} s"
    # Once the traffic is over, the check soon covers the state as it is: within
    # the rate limit, a second or 100 times the last walk, which a busy machine
    # that preempts the walk can stretch to tens of seconds.
    deadline = time.monotonic() + 120
    while not (after := server_info(server))["invariants_current"]:
        assert time.monotonic() < deadline, "the walk never caught up with an idle server"
        time.sleep(0.2)
    assert after["invariants"] == "ok" and after["invariant_checks"] > walks
    assert after["locks_held"] == 0 and after["request_owned_slots"] == 0
