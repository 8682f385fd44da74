"""A server in a subprocess of its own: output to a log file, ready when ``/health`` says 200."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
STOP_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 10.0  # one /health request


# Where ports are drawn from: below the kernel's ephemeral range (Linux's
# default starts at 32768), so no process's outgoing connection takes a port
# between free_port and the server's bind. A port the OS handed out from the
# ephemeral range was taken that way in a full test run (two workers, each
# with clients connecting out): the server then could not listen.
PORT_FLOOR = 10000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, outside the ephemeral range where it is known."""
    low = _ephemeral_low()
    if low > PORT_FLOOR + 1000:
        draw = random.SystemRandom()
        for _ in range(100):
            port = draw.randrange(PORT_FLOOR, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue  # in use (or lingering): draw again
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class ServerFailed(RuntimeError):
    """A server exited or never became healthy."""


class ServerProcess:
    """``cmd`` in a session of its own, stdout and stderr to ``log_path``.

    A session of its own: a Ctrl-C at the terminal reaches only the bench, which
    then stops the server in order (``stop``).
    """

    def __init__(
        self,
        cmd: list[str],
        port: int,
        log_path: Path,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``host``: where this machine reaches the server (its bound address);
        ``env``: variables set for it on top of this process's environment."""
        self.cmd = cmd
        self.port = port
        self.base_url = http_url(host, port)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=None if env is None else {**os.environ, **env},
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 8) -> str:
        """The log's last ``n`` lines on one line."""
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return " | ".join(lines[-n:])

    def _raise_if_exited(self) -> None:
        if self.proc.poll() is not None:
            raise ServerFailed(f"exited with {self.proc.returncode}: {self.log_tail()}")

    def _timed_out(self, timeout: float) -> ServerFailed:
        return ServerFailed(f"not healthy after {timeout:.0f} s: {self.log_tail()}")

    def wait_healthy(self, timeout: float, poll_s: float = 0.5) -> None:
        """Poll ``/health`` until 200 (503 "starting" means not yet); ServerFailed
        if the server exits or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=HEALTH_TIMEOUT_S, trust_env=False) as client:
            while time.monotonic() < deadline:
                self._raise_if_exited()
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.base_url + "/health").status_code == 200:
                        return
                time.sleep(poll_s)
        raise self._timed_out(timeout)

    async def wait_healthy_async(self, timeout: float, poll_s: float = 1.0) -> None:
        """``wait_healthy`` for a caller inside an event loop."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S, trust_env=False) as client:
            while time.monotonic() < deadline:
                self._raise_if_exited()
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.base_url + "/health")).status_code == 200:
                        return
                await asyncio.sleep(poll_s)
        raise self._timed_out(timeout)

    def stop(self) -> int | None:
        """SIGINT (the launcher stops everything in order), then SIGKILL if it lingers.

        Returns the exit code, or None when it had to be killed. Idempotent.
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


def launch_radixmux(args: Sequence[str], log_path: Path, timeout: float = 600.0) -> ServerProcess:
    """``launch.py ARGS`` on a free port, healthy (stopped again if it never gets there)."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "launch.py"), "--port", str(port), *args]
    server = ServerProcess(cmd, port, log_path)
    try:
        server.wait_healthy(timeout)
    except BaseException:
        server.stop()
        raise
    return server
