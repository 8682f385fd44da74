"""What a launcher killed with SIGKILL leaves behind, and what the next start does about it.

* Every child asks for the parent-death signal before its first heavy import,
  so a launcher killed while its children still import torch leaves no orphan.
* The next start removes the arena and runtime directory of dead launchers,
  and nothing else: not a live server's, not a reused pid's look-alike of
  another namespace, not a file that is not ours.
* ``--runtime-dir`` gets a private subdirectory; the directory itself keeps its mode.

Real launchers (``launch.py`` subprocesses and an in-process ``Launcher``),
real kills; processes are found through /proc (psutil is not a dependency).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.tiny_models import make_tiny_model_dir
from radixmux.common.ipc import OWNER_FILE, RUNTIME_PREFIX, remove_stale_runtime_dirs
from radixmux.common.os_process import PARENT_GONE, child_command
from radixmux.common.owner import Owner, remove_stale_arenas
from radixmux.common.server_args import ServerArgs
from radixmux.memory.arena import ARENA_PREFIX, default_arena_dir
from radixmux.protocol import ModelArg
from radixmux.runtime.launcher import Launcher

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(kv_cache_bytes=8 << 20, kv_block_bytes=64 << 10, port=0, runner_threads=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("hygiene") / "tiny", seed=0)


@pytest.fixture
def base() -> Iterator[Path]:
    """A short (socket paths are limited to ~107 bytes) world-readable 0755 directory."""
    path = Path(tempfile.mkdtemp(prefix="rmx-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---- /proc ---------------------------------------------------------------------------
def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # from field 3 (state) on


def alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None and int(fields[1]) == pid:
                kids.append(int(entry))
    return kids


TOKENIZING = r"radixmux\.runtime\.(tokenizer_worker|detokenizer)\b"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def has_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return True  # gone: it cannot count as "still importing"


def c_heap(pid: int) -> bool:
    """Whether the process runs with PYTHONMALLOC=malloc."""
    return b"PYTHONMALLOC=malloc" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def wait_until(check, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# ---- launchers -----------------------------------------------------------------------
def launch(tiny: Path, runtime_dir: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "launch.py"), "--model", f"{tiny},name=tiny"]
    cmd += ["--kv-cache-bytes", str(8 << 20), "--kv-block-bytes", str(64 << 10), "--port", "0"]
    cmd += ["--runner-threads", "1", "--runtime-dir", str(runtime_dir), "--runner-start", "zygote"]
    with open(log, "w") as err:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)


def leftovers(log: Path) -> tuple[Path, Path]:
    """The runtime dir and arena file a launcher logged."""
    m = re.search(r"runtime dir (\S+), arena (\S+)", log.read_text())
    assert m, log.read_text()
    return Path(m[1]), Path(m[2])


def kill_during_start(tiny: Path, runtime_dir: Path, log: Path) -> tuple[list[int], list[int]]:
    """Start a launcher, SIGKILL it as soon as the scheduler and the runner
    run; returns (its children, those of them still importing torch then)."""
    proc = launch(tiny, runtime_dir, log)
    try:
        wait_until(lambda: len(children_of(proc.pid)) >= 2, "no children started", 120)
        kids = children_of(proc.pid)
        importing = [k for k in kids if not has_torch(k)]
        proc.kill()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return kids, importing


def reap(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


# ---- tests ---------------------------------------------------------------------------
def test_a_child_whose_parent_died_before_it_asked_never_runs() -> None:
    # The race the getppid check closes: the launcher gone before the prctl.
    data = '{"x": 1}'
    for parent, code, out in ((os.getpid(), 0, '"x": 1'), (1, PARENT_GONE, "")):
        cmd = child_command("json.tool")
        cmd[cmd.index(str(os.getpid()))] = str(parent)
        done = subprocess.run(cmd, input=data, capture_output=True, text=True, timeout=60)
        assert done.returncode == code and out in done.stdout, done
        assert bool(done.stdout) == bool(out)


@pytest.mark.timeout(300)
def test_children_die_with_a_launcher_killed_during_start(tiny: Path, base: Path) -> None:
    kids, importing = kill_during_start(tiny, base, base / "launcher.log")
    try:
        assert importing, "killed too late: every child had imported torch already"
        # Generous on a loaded machine: a child killed mid-import dies at once.
        wait_until(lambda: not any(alive(k) for k in kids), f"orphans: {kids}", 30)
    finally:
        reap(kids)


# Alone: a dead launcher's arena sits in the shared /dev/shm, which any other
# test's launcher start sweeps (remove_stale_arenas) before this one looks.
@pytest.mark.alone
@pytest.mark.timeout(300)
def test_children_die_with_a_launcher_killed_while_serving(tiny: Path, base: Path) -> None:
    # Every process runs its own signal handling by now: the death of the
    # parent must end each all the same (a SIGTERM turned into KeyboardInterrupt
    # was lost in a finaliser and left the detokenizer running on).
    live = launch(tiny, base, base / "launcher.log")
    kids: list[int] = []
    try:
        banner = live.stdout.readline()
        assert banner.startswith("radixmux serving"), (base / "launcher.log").read_text()
        kids = children_of(live.pid)
        assert len(kids) == 5  # scheduler, zygote, detokenizer, tokenizer-0, front
        # The runner is the zygote's child (common/zygote.py), named by its id.
        zygote = [k for k in kids if comm(k) == "zygote"]
        assert len(zygote) == 1 and has_torch(zygote[0])
        runners = children_of(zygote[0])
        assert [comm(r) for r in runners] == ["tiny#0"] and has_torch(runners[0])
        # The processes that only tokenize never load torch (~2 CPU-s each a start),
        # and allocate through the C heap, which gives a dropped tokenizer's memory
        # back (process.TOKENIZER_ENV); the others keep Python's own allocator.
        tokenizing = [k for k in kids if re.search(TOKENIZING, cmdline(k))]
        assert len(tokenizing) == 2 and not any(has_torch(k) for k in tokenizing)
        assert all(c_heap(k) for k in tokenizing)
        assert not any(c_heap(k) for k in kids if k not in tokenizing)
        kids += runners
        live.kill()
        live.wait(30)
        wait_until(lambda: not any(alive(k) for k in kids), f"orphans: {kids}", 30)
        # What it left, the next start removes (here: the calls it makes).
        runtime_dir, arena = leftovers(base / "launcher.log")
        assert runtime_dir.is_dir() and arena.is_file()
        assert remove_stale_runtime_dirs(str(base)) == [str(runtime_dir)]
        assert arena.name in remove_stale_arenas()
        assert not runtime_dir.exists() and not arena.exists()
    finally:
        if live.poll() is None:
            live.kill()
        reap(kids)


# Alone: a dead launcher's arena sits in the shared /dev/shm, which any other
# test's launcher start sweeps (remove_stale_arenas) before this one looks.
@pytest.mark.alone
@pytest.mark.timeout(600)
def test_a_start_removes_only_what_dead_launchers_left(tiny: Path, base: Path) -> None:
    shm = Path(default_arena_dir())
    me = Owner.this_process()
    reused = Owner(me.pid, me.start + 1, me.host)  # this pid, another start: a dead owner
    elsewhere = Owner(999_999_999, 1, "0badc0de")  # another boot or pid namespace: unknown
    made: list[Path] = []

    def arena_like(name: str, target: Path | None = None) -> Path:
        path = shm / name
        if target is None:
            path.write_bytes(b"kv")
        else:
            path.symlink_to(target)
        made.append(path)
        return path

    def runtime_like(name: str, owner: Owner | None, extra: str | None = None) -> Path:
        path = base / name
        path.mkdir(mode=0o700)
        if owner is not None:
            (path / OWNER_FILE).write_text(owner.token + "\n")
        if extra is not None:
            (path / extra).write_text("the user's")
        return path

    live = launch(tiny, base, base / "live.log")
    kids: list[int] = []
    try:
        banner = live.stdout.readline()
        assert banner.startswith("radixmux serving"), (base / "live.log").read_text()
        live_rt, live_arena = leftovers(base / "live.log")
        kids, _ = kill_during_start(tiny, base, base / "dead.log")
        dead_rt, dead_arena = leftovers(base / "dead.log")
        assert dead_rt.is_dir() and dead_arena.is_file()  # what SIGKILL leaves behind

        victim = shm / "victim-of-a-link"
        victim.write_bytes(b"not ours")
        made.append(victim)
        gone = [
            arena_like(f"{ARENA_PREFIX}{reused.token}-0123abcd"),
            runtime_like(f"{RUNTIME_PREFIX}reused00", reused),
        ]
        user_files = runtime_like(f"{RUNTIME_PREFIX}userfile", reused, extra="notes.txt")
        kept = [
            live_rt,
            live_arena,
            arena_like(f"{ARENA_PREFIX}{elsewhere.token}-0123abcd"),
            arena_like(f"{ARENA_PREFIX}{reused.token}-notours!"),
            arena_like(f"{ARENA_PREFIX}{reused.token}-4567abcd", target=victim),
            victim,
            runtime_like(f"{RUNTIME_PREFIX}elsewher", elsewhere),
            runtime_like(f"{RUNTIME_PREFIX}noowner0", None),
            user_files,
            runtime_like("unrelated-dir", reused),
        ]

        args = ServerArgs(models=[ModelArg(str(tiny), "t")], runtime_dir=str(base), **SMALL)
        launcher = Launcher(args)
        try:
            launcher.start()
            own = Path(launcher.endpoints.runtime_dir)
            for path in (dead_rt, dead_arena, *gone):
                assert not os.path.lexists(path), f"{path} left behind"
            for path in kept:
                assert os.path.lexists(path), f"{path} removed"
            assert (user_files / "notes.txt").read_text() == "the user's"
            # --runtime-dir: a private subdirectory, the directory itself untouched.
            assert own.parent == base and stat.S_IMODE(own.stat().st_mode) == 0o700
            assert stat.S_IMODE(base.stat().st_mode) == 0o755
            assert stat.S_ISSOCK((own / "scheduler").stat().st_mode)
        finally:
            launcher.stop()
        assert not own.exists() and stat.S_IMODE(base.stat().st_mode) == 0o755
        assert live.poll() is None and live_rt.is_dir()  # the live server was not disturbed
        live.send_signal(signal.SIGINT)
        assert live.wait(60) == 0
        assert not live_rt.exists() and not live_arena.exists()
    finally:
        if live.poll() is None:
            live.kill()
        reap(kids)
        for path in made:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
