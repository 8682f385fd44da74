"""The server under soak: its command line, its model sources, the process that runs it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.soak.config import MODEL_NAMES, REAL_SOURCES, ROOT, STOP_TIMEOUT_S, SoakConfig
from bench.soak.hostile.config import server_flags as hostile_server_flags
from bench.soak.procfs import is_alive, parent_pid, process_role


class ServerFailed(RuntimeError):
    """The server exited or never became ready."""


class SoakServer:
    """``launch.py`` as a subprocess in a session of its own; stderr to a log file."""

    def __init__(self, cmd: list[str], port: int, log_path: Path) -> None:
        self.cmd = cmd
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        # A session of its own: Ctrl-C at the terminal reaches only the harness,
        # which then stops the server in order.
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._roles: dict[int, str] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 8) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return " | ".join(lines[-n:])

    async def wait_ready(self, timeout: float) -> None:
        """Poll ``/health`` until 200 (503 "starting" means not yet)."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ServerFailed(f"exited with {self.proc.returncode}: {self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + "/health")).status_code == 200:
                        return
                await asyncio.sleep(1.0)
        raise ServerFailed(f"not ready after {timeout:.0f} s: {self.log_tail()}")

    def processes(self) -> dict[int, str]:
        """The launcher and its live children, pid -> role (``runner a#0``, ``front``, ...)."""
        found = {self.pid: "launcher"} if is_alive(self.pid) else {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            if parent_pid(pid) != self.pid:
                continue
            if pid not in self._roles:
                self._roles[pid] = process_role(pid)
            found[pid] = self._roles[pid]
        # Forget the dead: a reused pid must not inherit an old role.
        self._roles = {pid: role for pid, role in self._roles.items() if pid in found}
        return found

    def stop(self) -> int | None:
        """SIGINT (the launcher stops everything in order), then SIGKILL if it lingers.

        Returns the launcher's exit code, or None when it had to be killed.
        """
        code: int | None = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                code = self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                code = None
        self._log.close()
        return code


def arena_bytes(config: SoakConfig) -> int:
    """The profile's arena, scaled to the same tokens when the real models run in float32."""
    scale = 2 if config.dtype == "float32" and not config.tiny else 1
    return config.profile.kv_cache_bytes * scale


def server_command(config: SoakConfig, sources: Sequence[str]) -> list[str]:
    """The ``launch.py`` command line for this run."""
    cmd = [sys.executable, str(ROOT / "launch.py")]
    for name, source in zip(MODEL_NAMES, sources, strict=True):
        dtype = f",dtype={config.dtype}" if config.dtype else ""
        cmd += ["--model", f"{source},name={name}{dtype}"]
    cmd += [
        "--kv-cache-bytes",
        str(arena_bytes(config)),
        "--kv-block-bytes",
        str(config.profile.kv_block_bytes),
        "--port",
        str(config.port),
        "--log-level",
        "info",
        "--seed",
        str(config.seed),
    ]
    if config.runner_timeout_s > 0:
        cmd += ["--runner-timeout", f"{config.runner_timeout_s:g}"]
    if config.hostile:
        cmd += hostile_server_flags(config)
    return [*cmd, *config.server_args]


def model_sources(tiny: bool) -> list[str]:
    """Tiny random models (made once under the model cache) or the embedded real ones."""
    if not tiny:
        return list(REAL_SOURCES)
    from bench.tiny_models import make_tiny_model_dir
    from radixmux.model_runners.fetch import cache_root

    base = cache_root() / "soak-tiny"
    # ``b`` has no chat template, like Gemma 3 270M (a base model); the context is
    # long enough for any request the load sends.
    return [
        str(make_tiny_model_dir(base / "a-ctx4096", seed=41, context=4096)),
        str(make_tiny_model_dir(base / "b-ctx4096", seed=42, context=4096, chat_template=False)),
    ]
