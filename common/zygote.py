"""The zygote: one process that imports the runners' heavy modules once and
forks every runner from itself.

Most of a runner's start is imports: torch and transformers' modeling code
took 3.5 of a tiny model's 4.6 CPU-seconds (the AMX host), and every model
loaded on demand, every restart of a killed runner and every replica paid them
again, on cores that were serving. The launcher starts the zygote first (its
imports overlap the launcher's own start-up) and asks it for each runner; a
fork shares the imported code and data copy-on-write, so a runner only loads
its model.

A fork is safe only from a process with one thread (another thread may hold a
lock the child would inherit held): the zygote checks ``/proc/self/task``
before every fork and refuses otherwise; ``spawn_runner`` then starts the
runner as a fresh process, as it does when the zygote is gone or was turned
off (``--runner-start spawn``). The zygote never runs a torch operator, so no
OpenMP thread pool exists to be lost in a child.

Wire (one ``SOCK_SEQPACKET`` socket pair, one msgpack message a packet): the
zygote sends ``ZygoteReady`` once its imports are done; the launcher sends
``Fork`` (a module whose ``main(args)`` the child runs), the zygote answers
``Forked`` (the pid, or why not), and ``Exited`` when a child ends. A forked
child asks for the parent-death signal first, as every process of ours does
(``os_process``): a dead zygote takes its runners with it, and a dead
launcher its zygote. ``ZygoteChild`` gives the launcher the ``Popen`` calls it
supervises with (``pid``, ``poll``, ``send_signal``, ``kill``, ``wait``);
signals go through a pidfd, so a recycled pid is never signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

import msgspec

from radixmux.common.os_process import child_command, exit_now, tie_to_parent

log = logging.getLogger("radixmux.zygote")

MODULE = "radixmux.common.zygote"
NAME = "zygote"  # its process name; a child's is the one its Fork gives
# What every runner imports before it reads a weight (measured with
# ``python -X importtime``): torch, transformers' modeling machinery and the
# Llama family's module (the default model's; other families share most of
# its imports), and our runner's own modules.
RUNNER_PRELOAD = (
    "torch",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "radixmux.model_runners.loader",
    "radixmux.model_runners.model_runner",
)
READY_TIMEOUT_S = 120.0  # the imports, on a loaded machine
REPLY_TIMEOUT_S = 10.0  # a fork
# Messages are read into one buffer per socket end: a fresh 1 MiB bytes object
# per read (the launcher reads every 250 ms) fragmented its heap to a GiB.
MAX_PACKET = 64 << 10
PR_SET_NAME = 15


class Fork(msgspec.Struct, tag=True):
    """Fork a child that runs ``importlib.import_module(module).main(args)``;
    ``name`` is its process name (``/proc/PID/comm``, 15 bytes at most): the
    command line a child shows is its zygote's."""

    module: str
    args: list[str]
    name: str


class ZygoteReady(msgspec.Struct, tag=True):
    pid: int
    import_seconds: float


class Forked(msgspec.Struct, tag=True):
    pid: int = 0  # 0: not forked, ``error`` says why
    error: str = ""


class Exited(msgspec.Struct, tag=True):
    pid: int
    code: int  # as ``Popen.returncode``: negative for a signal


_Message = Fork | ZygoteReady | Forked | Exited
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Message)


class ZygoteUnavailable(OSError):
    """The zygote cannot fork now (not started, gone, or refused)."""


def _read_message(sock: socket.socket, buf: bytearray) -> _Message | None:
    """The next message (None: the other end closed); raises what ``recv`` raises."""
    n = sock.recv_into(buf)
    return _decoder.decode(memoryview(buf)[:n]) if n else None


# ---- the launcher's side ------------------------------------------------------------
class Zygote:
    """The launcher's handle on its zygote process (thread-safe)."""

    def __init__(self, preload: tuple[str, ...] = RUNNER_PRELOAD) -> None:
        self.preload = preload
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self._codes: dict[int, int] = {}  # pid -> exit code, once reported
        self._live: set[int] = set()  # forked pids not yet reported
        self.forks = 0
        self._buf = bytearray(MAX_PACKET)

    @property
    def pid(self) -> int | None:
        """The zygote process's pid (None before ``start``)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the zygote process (returns at once; its imports go on)."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = child_command(MODULE, str(theirs.fileno()), *self.preload)
        try:
            self._proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=_zygote_env())
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock, self._ready = ours, False
        log.info("started zygote (pid %d)", self._proc.pid)

    def fork(self, module: str, args: list[str], name: str) -> ZygoteChild:
        """A child of the zygote running ``module.main(args)``; raises
        ``ZygoteUnavailable`` when the zygote cannot make one (the caller then
        starts the process itself)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._close()
                self._start()
            assert self._sock is not None
            request = _encoder.encode(Fork(module, args, name))
            if len(request) > MAX_PACKET:
                raise ZygoteUnavailable(f"zygote: a {len(request)}-byte request")
            try:
                if not self._ready:
                    ready = self._receive(ZygoteReady, READY_TIMEOUT_S)
                    self._ready = True
                    log.info("zygote ready: imports took %.1fs", ready.import_seconds)
                self._sock.send(request)
                reply = self._receive(Forked, REPLY_TIMEOUT_S)
            except (OSError, msgspec.DecodeError) as exc:
                self._close()
                self._stop_process()  # stuck or broken: the next fork starts another
                raise ZygoteUnavailable(f"zygote: {exc}") from None
            if not reply.pid:
                raise ZygoteUnavailable(f"zygote: {reply.error}")
            self._live.add(reply.pid)
            self.forks += 1
            return ZygoteChild(self, reply.pid, [MODULE, module, *args])

    def _receive(self, kind: type, timeout: float) -> ZygoteReady | Forked:
        """The next message of ``kind``, noting exits that come before it."""
        assert self._sock is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {kind.__name__} in {timeout:g}s")
            self._sock.settimeout(left)
            msg = _read_message(self._sock, self._buf)
            if msg is None:
                raise ConnectionError("the zygote exited")
            if isinstance(msg, Exited):
                self._exited(msg)
            elif isinstance(msg, kind):
                return msg

    def returncode(self, pid: int) -> int | None:
        """``pid``'s exit code once it ended, else None."""
        with self._lock:
            if pid in self._live:
                self._drain()
            return self._codes.pop(pid, None)  # the caller keeps it

    def _drain(self) -> None:
        """Read the exits reported so far, without waiting."""
        if self._sock is None:
            self._lost()
            return
        self._sock.settimeout(0)
        try:
            while msg := _read_message(self._sock, self._buf):
                if isinstance(msg, Exited):
                    self._exited(msg)
            self._close()  # end of stream: the zygote is gone
        except (BlockingIOError, TimeoutError):
            pass
        except (OSError, msgspec.DecodeError):
            self._close()

    def _exited(self, msg: Exited) -> None:
        self._live.discard(msg.pid)
        self._codes[msg.pid] = msg.code

    def _lost(self) -> None:
        """The zygote is gone: its children died with it (parent-death signal)."""
        for pid in self._live:
            self._codes[pid] = -signal.SIGKILL
        self._live.clear()

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._lost()

    def close(self) -> None:
        """Stop the zygote (its children die with it: stop them first)."""
        with self._lock:
            self._close()
            self._stop_process()

    def _stop_process(self, timeout: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class ZygoteChild:
    """A forked child, with the ``subprocess.Popen`` calls the launcher uses."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._zygote = zygote
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # already reaped: its Exited is on the way
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid)
            if self.returncode is not None and self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _zygote_env() -> dict[str, str]:
    """The launcher's environment, and one OpenBLAS thread: numpy's OpenBLAS
    starts a thread per core as it loads (torch imports numpy), which would
    make every fork unsafe, and runners do no BLAS work in numpy. A value the
    user set wins (runners then start as new processes)."""
    return {"OPENBLAS_NUM_THREADS": "1", **os.environ}


# ---- the zygote process -------------------------------------------------------------
def serve(sock: socket.socket, preload: list[str]) -> int:
    """Import ``preload``, then fork on request until the launcher closes its end."""
    t0 = time.perf_counter()
    set_process_name(NAME)
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a child imports what it needs anyway
            print(f"zygote: preloading {name}: {exc}", file=sys.stderr)
    sock.send(_encoder.encode(ZygoteReady(os.getpid(), time.perf_counter() - t0)))
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    buf = bytearray(MAX_PACKET)
    while True:
        for key, _ in sel.select():
            if key.fileobj is not sock:  # a child's pidfd: it ended
                pid = key.data
                sel.unregister(key.fileobj)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                sock.send(_encoder.encode(Exited(pid, os.waitstatus_to_exitcode(status))))
                continue
            msg = _read_message(sock, buf)
            if msg is None:
                return 0  # the launcher is done; our children die with us
            assert isinstance(msg, Fork), msg
            reply = _fork(msg, sel)
            if reply.pid:
                sel.register(os.pidfd_open(reply.pid), selectors.EVENT_READ, reply.pid)
            sock.send(_encoder.encode(reply))


def _fork(msg: Fork, sel: selectors.BaseSelector) -> Forked:
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        return Forked(error=f"{threads} threads in the zygote: not safe to fork")
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError as exc:
        return Forked(error=f"fork: {exc}")
    if pid:
        return Forked(pid)
    code = 1
    try:
        tie_to_parent(parent)
        for key in list(sel.get_map().values()):  # the zygote's socket and pidfds
            os.close(key.fd)
        _become(msg.name)
        code = importlib.import_module(msg.module).main(msg.args)
    except SystemExit as exc:  # SIGTERM unwinds a runner's loop as SystemExit
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    exit_now(code)
    raise AssertionError("unreachable")


def _become(name: str) -> None:
    """What a fresh process would have had different from its zygote."""
    random.seed()  # forks would otherwise draw the same numbers
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed()
    set_process_name(name)


def set_process_name(name: str) -> None:
    """``/proc/PID/comm`` (what ``ps -o comm`` and ``top`` show)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def main(argv: list[str] | None = None) -> int:
    """Entry: ``zygote <socket fd> <module to preload>...``."""
    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    try:
        return serve(sock, argv[1:])
    finally:
        sock.close()


if __name__ == "__main__":
    exit_now(main())
