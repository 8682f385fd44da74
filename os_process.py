"""How every process of ours is tied to its parent and how it leaves.

Low-level on purpose: runners (``model_runners/``) and the runtime's processes
both need it, and neither may import the other.

Every child starts through this module (``child_command``): ``python -c
<run_child> <module> <parent pid> <args>`` asks the kernel for the
parent-death signal before anything else is imported, checks that the parent
is still the one that started it (closing the race with a parent that died
before the request), and only then runs ``<module>`` as ``__main__``, as
``python -m <module> <args>`` would (the module stays the first
``radixmux.`` word of the command line, for tools that read it). A
launcher killed while its children still import torch or load weights so
leaves no orphan behind; a signal asked for after those imports came seconds
too late.

``Owner`` names the process that made a shared file (the KV arena in
``/dev/shm``, a runtime directory): a launcher killed with SIGKILL leaves
both behind, and the next start removes them once their owner is provably
dead (see ``Owner.is_dead``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import re
import runpy
import signal
import sys
from dataclasses import dataclass

PR_SET_PDEATHSIG = 1
# Exit code of a process that found its parent gone (runners use it too).
PARENT_GONE = 3


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits.

    SIGKILL, not SIGTERM: an orphan has no one to report to, and a SIGTERM
    that a process turns into KeyboardInterrupt can be lost (raised inside a
    finaliser it is only printed: the detokenizer of a launcher killed while
    serving was measured running on) or hang in ZeroMQ's teardown. Nothing is
    lost with it: every file we write survives a crash (the next start removes
    a dead launcher's arena and runtime dir; disk-tier chunks are renamed into
    place whole). "Parent" is the thread that started this process: a child
    started from another thread is killed when that thread ends.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


_RUN_CHILD = "from radixmux.os_process import run_child; run_child()"


def child_command(module: str, *args: str) -> list[str]:
    """The command that runs ``python -m module args`` as a child of this
    process, tied to it from its first instruction on (see the module docstring)."""
    return [sys.executable, "-c", _RUN_CHILD, module, str(os.getpid()), *args]


def run_child() -> None:
    """``child_command``'s other end: ``sys.argv`` is ``["-c", module, parent pid, args...]``."""
    module, parent = sys.argv[1], int(sys.argv[2])
    die_with_parent()
    if os.getppid() != parent:  # it died before the kernel could be asked
        os._exit(PARENT_GONE)
    sys.argv = [module, *sys.argv[3:]]  # runpy puts the module's path in argv[0]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


@functools.cache
def _host_key() -> str | None:
    """This boot's and this pid namespace's identity (8 hex digits), or None
    where /proc does not tell. A pid means one process only within both."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return hashlib.blake2b(f"{boot}|{pidns}".encode(), digest_size=4).hexdigest()


def _start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot); None if no such process
    runs (gone, or a zombie: it has exited and only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: count from the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22 of the line: starttime


_OWNER = re.compile(r"(\d+)-(\d+)-([0-9a-f]{8}|unknown)")


@dataclass(frozen=True)
class Owner:
    """The process that made a file: pid, start time and host key, so a
    reused pid or another pid namespace never passes for the owner."""

    pid: int
    start: int
    host: str

    PATTERN = _OWNER.pattern  # ``token``'s shape, for names that embed it

    @classmethod
    def this_process(cls) -> Owner:
        pid = os.getpid()
        return cls(pid, _start_time(pid) or 0, _host_key() or "unknown")

    @classmethod
    def parse(cls, token: str) -> Owner | None:
        m = _OWNER.fullmatch(token.strip())
        return cls(int(m[1]), int(m[2]), m[3]) if m else None

    @property
    def token(self) -> str:
        return f"{self.pid}-{self.start}-{self.host}"

    def is_dead(self) -> bool:
        """True only when the owner provably runs no more: same boot and pid
        namespace as this process (else its pid means nothing here), and no
        live process with its pid and start time. Unsure is alive."""
        here = _host_key()
        if here is None or self.host != here:
            return False
        return _start_time(self.pid) != self.start


def exit_now(code: int) -> None:
    """Exit once this process's own cleanup is done, skipping the interpreter's
    teardown: with torch and transformers imported it takes over a second, and
    a stop waits for it once per process, in order. Our files and sockets are
    closed by then; only buffered log lines remain, so flush them first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
