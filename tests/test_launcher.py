"""The launcher with real processes: start-up failures, monitoring, clean stop.

Every test checks that nothing is left behind: no child process, no runtime
dir (so no socket file), no arena file in /dev/shm.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.tiny_models import make_tiny_model_dir
from radixmux.common.server_args import ServerArgs
from radixmux.memory.arena import default_arena_dir
from radixmux.protocol import ModelArg
from radixmux.runtime.launcher import Launcher, LaunchError

REPO = Path(__file__).resolve().parents[1]
HAVE_SCHEDULER = importlib.util.find_spec("radixmux.scheduler.scheduler") is not None
HAVE_FRONT = importlib.util.find_spec("radixmux.runtime.front.server") is not None
needs_scheduler = pytest.mark.skipif(not HAVE_SCHEDULER, reason="scheduler not in the tree yet")
needs_stack = pytest.mark.skipif(
    not (HAVE_SCHEDULER and HAVE_FRONT), reason="scheduler or front not in the tree yet"
)
SMALL = dict(kv_cache_bytes=8 << 20, kv_block_bytes=64 << 10, port=0, runner_threads=1)


def arena_files(pid: int) -> list[str]:
    return glob.glob(os.path.join(default_arena_dir(), f"radixmux-kv-{pid}-*"))


def assert_nothing_left(launcher: Launcher) -> None:
    assert all(c.proc.poll() is not None for c in launcher.children), "a child still runs"
    if launcher.endpoints is not None:
        assert not os.path.exists(launcher.endpoints.runtime_dir)
    assert arena_files(os.getpid()) == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("launch_models")
    return {
        "a": make_tiny_model_dir(root / "a", seed=0),
        "b": make_tiny_model_dir(root / "b", seed=1, chat_template=False),
    }


@pytest.mark.timeout(30)
def test_bad_model_source_is_a_clear_error(tmp_path):
    launcher = Launcher(ServerArgs(models=[ModelArg(str(tmp_path / "nope"), "x")], **SMALL))
    with pytest.raises(LaunchError, match=r"--model .*nope.* neither a known short name"):
        launcher.start()
    assert launcher.children == []
    assert_nothing_left(launcher)
    with pytest.raises(ValueError, match=r"--attention-backend 'x': choose one of"):
        ServerArgs(models=[ModelArg("smollm2", "s")], attention_backend="x")
    args = ServerArgs(models=[ModelArg("smollm2", "s")], chat_template=str(tmp_path / "t"), **SMALL)
    with pytest.raises(LaunchError, match=r"--chat-template .*: no such file"):
        Launcher(args).start()


@pytest.mark.timeout(30)
def test_failed_start_cleans_runtime_dir_and_arena(tmp_path, tiny):
    model = [ModelArg(str(tiny["a"]), "a")]
    # Not a multiple of 4096: the arena refuses, after the runtime dir exists.
    bad = dict(SMALL, kv_block_bytes=1000)
    fresh = tmp_path / "fresh"
    launcher = Launcher(ServerArgs(models=model, runtime_dir=str(fresh), **bad))
    with pytest.raises(LaunchError, match=r"KV arena: .*--kv-block-bytes"):
        launcher.start()
    assert not fresh.exists()  # created by us: removed
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("user data")
    launcher = Launcher(ServerArgs(models=model, runtime_dir=str(mine), **bad))
    with pytest.raises(LaunchError):
        launcher.start()
    assert sorted(p.name for p in mine.iterdir()) == ["keep.txt"]  # the user's dir: kept
    assert arena_files(os.getpid()) == []


@pytest.mark.timeout(30)
def test_launch_py_bad_source_exits_nonzero_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1
    assert "failed to start: --model" in proc.stderr
    assert "Traceback" not in proc.stderr


@needs_scheduler
@pytest.mark.timeout(60)
def test_failing_runner_names_it(tmp_path):
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    models = [ModelArg(str(bad), "broken")]
    launcher = Launcher(ServerArgs(models=models, **SMALL))
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"broken#0") as err:
        launcher.start()
    assert time.monotonic() - t0 < 45
    assert "no-such-architecture" in str(err.value) or "exited with code" in str(err.value)
    assert_nothing_left(launcher)


@needs_stack
@pytest.mark.timeout(90)
def test_engine_generates_survives_runner_death_stops_on_core_death(tiny):
    from radixmux.runtime.client.engine import Engine

    engine = Engine(model=[f"{tiny['a']},name=a", f"{tiny['b']},name=b"], **SMALL)
    launcher = engine.launcher
    try:
        assert engine.models == ["a", "b"]
        assert [m.source for m in launcher.args.models] == [str(tiny["a"]), str(tiny["b"])]
        names = sorted(c.name for c in launcher.children)
        assert names == sorted(
            ["scheduler", "runner a#0", "runner b#0", "detokenizer", "tokenizer-0", "front"]
        )
        assert stat.S_IMODE(os.stat(launcher.endpoints.runtime_dir).st_mode) == 0o700
        assert len(arena_files(os.getpid())) == 1

        outs = engine.generate(
            ["Hello there", "One two"], {"max_new_tokens": 4, "ignore_eos": True}
        )
        assert [o.completion_tokens for o in outs] == [4, 4]
        again = engine.generate("Hello there", {"max_new_tokens": 4, "ignore_eos": True})
        assert again[0].text == outs[0].text  # greedy
        assert engine.generate(["x"], {"max_new_tokens": 2}, model="b")[0].completion_tokens >= 1

        # A runner's death is survivable: reported to the scheduler, the rest
        # serves, and the runner is restarted: its model comes back.
        url = f"http://127.0.0.1:{engine.args.port}"
        assert httpx.get(f"{url}/health").json()["models"] == {"a": "serving", "b": "serving"}
        runner = next(c for c in launcher.children if c.name == "runner b#0")
        runner.proc.kill()
        deadline = time.monotonic() + 10
        while runner in launcher.children and time.monotonic() < deadline:
            time.sleep(0.1)
        assert runner not in launcher.children and engine._monitor.is_alive()
        assert engine.generate(["Hi"], {"max_new_tokens": 2}, model="a")[0].completion_tokens
        wait_serving(url, "b")
        model_b = next(m for m in server_info(url)["models"] if m["name"] == "b")
        assert model_b["restarts"] == 1 and model_b["runner_pids"] != [runner.proc.pid]
        assert engine.generate(["x"], {"max_new_tokens": 2}, model="b")[0].completion_tokens
        # A core process's death ends the monitor with a non-zero exit code.
        next(c for c in launcher.children if c.name == "detokenizer").proc.kill()
        engine._monitor.join(10)
        assert not engine._monitor.is_alive() and launcher.exit_code == 1
    finally:
        engine.shutdown()
    assert_nothing_left(launcher)


@needs_stack
@pytest.mark.timeout(90)
def test_launch_py_serves_and_stops_on_sigint(tiny, tmp_path):
    # The runtime dir outside tmp_path: socket paths are limited to ~107 bytes,
    # and pytest-xdist's worker folder (popen-gw0/) makes tmp_path too long.
    with tempfile.TemporaryDirectory(prefix="rmx-") as short:
        _launch_py_serves_and_stops_on_sigint(tiny, tmp_path, Path(short) / "rt")


def _launch_py_serves_and_stops_on_sigint(tiny, tmp_path: Path, runtime: Path) -> None:
    cmd = [sys.executable, str(REPO / "launch.py"), "--model", f"{tiny['a']},name=tiny"]
    cmd += ["--kv-cache-bytes", str(8 << 20), "--kv-block-bytes", str(64 << 10), "--port", "0"]
    cmd += ["--runtime-dir", str(runtime)]
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            line = proc.stdout.readline()
            assert (
                re.match(r"radixmux serving http://127.0.0.1:[1-9][0-9]* ", line) and "tiny" in line
            ), line
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 0
            assert proc.stdout.read() == ""  # exactly one line; logs go to stderr
        finally:
            if proc.poll() is None:
                proc.kill()
    pids = [int(p) for p in re.findall(r"started .* \(pid (\d+)\)", log.read_text())]
    assert len(pids) == 5  # scheduler, runner, detokenizer, tokenizer-0, front
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _zombie_or_gone(pid)
    assert not runtime.exists()
    assert arena_files(proc.pid) == []


def server_info(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["scheduler"]


def wait_serving(url: str, model: str, timeout: float = 60.0) -> None:
    """Wait until ``/health`` reports ``model`` serving again."""
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health", timeout=30).json().get("models", {}).get(model) != "serving":
        assert time.monotonic() < deadline, f"{model} never came back"
        time.sleep(0.2)


@needs_stack
@pytest.mark.timeout(300)
def test_runner_death_while_the_rest_starts_is_not_a_failed_start(tiny):
    # The runners are ready, the tokenizer worker and front still loading: a
    # runner that dies now is restarted like any other, not a failed start.
    launcher = Launcher(ServerArgs(models=[ModelArg(str(tiny["a"]), "a")], **SMALL))
    killed: list[int] = []

    def kill_the_runner_once_ready() -> None:
        deadline = time.monotonic() + 180
        while "scheduler" not in launcher._ready and time.monotonic() < deadline:
            time.sleep(0.01)
        runner = next(c for c in launcher.children if c.runner_id == "a#0")
        runner.proc.kill()
        killed.append(runner.proc.pid)

    # start() runs on the main thread: children die with the thread that
    # started them (PR_SET_PDEATHSIG), as they should with the launcher.
    killer = threading.Thread(target=kill_the_runner_once_ready, daemon=True)
    killer.start()
    try:
        launcher.start()
        killer.join(10)
        assert killed, "the runner was not killed during start-up"
        monitor = threading.Thread(target=launcher.wait, daemon=True)
        monitor.start()
        url = f"http://127.0.0.1:{launcher.args.port}"
        wait_serving(url, "a")
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
        r = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert server_info(url)["models"][0]["restarts"] == 1
        launcher.request_stop()
        monitor.join(10)
    finally:
        launcher.stop()
    assert_nothing_left(launcher)


@pytest.mark.timeout(30)
def test_flags_that_cannot_work_are_refused_at_start():
    model = [ModelArg("smollm2", "s")]
    with pytest.raises(ValueError, match=r"--device cuda: .*no tested CUDA path"):
        ServerArgs(models=model, device="cuda")
    for flags, message in (
        ({"kv_block_bytes": 0}, "--kv-block-bytes must be positive"),
        ({"kv_cache_bytes": 1 << 20, "kv_block_bytes": 2 << 20}, "smaller than one block"),
        ({"runner_timeout": float("nan")}, "--runner-timeout must be positive"),
        ({"port": 70000}, "--port 70000"),
        ({"runner_threads": -1}, "--runner-threads"),
        ({"log_level": "loud"}, "--log-level"),
    ):
        with pytest.raises(ValueError, match=message):
            ServerArgs(models=model, **flags)
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "no tested CUDA path" in proc.stderr
    assert "Traceback" not in proc.stderr


def _zombie_or_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_dtype_auto_follows_the_cpu():
    from radixmux.common.cpu import BF16_FLAGS, cpu_flags, resolve_dtype

    native = any(f in cpu_flags() for f in BF16_FLAGS)
    dtype, why = resolve_dtype("auto")
    assert dtype == ("bfloat16" if native else "float32") and why.startswith("auto:")
    assert resolve_dtype("float32") == ("float32", "as asked")
    assert ServerArgs(models=[ModelArg("smollm2", "s")]).dtype == "auto"


@pytest.mark.timeout(60)
def test_a_runtime_dir_that_cannot_hold_sockets_is_a_clear_error(tmp_path, tiny):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("the user's")
    args = ServerArgs(models=[ModelArg(str(tiny["a"]), "a")], runtime_dir=str(not_a_dir), **SMALL)
    launcher = Launcher(args)
    with pytest.raises(LaunchError, match=r"--runtime-dir .*file: .*File exists"):
        launcher.start()
    assert not_a_dir.read_text() == "the user's"
    assert_nothing_left(launcher)
