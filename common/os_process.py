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

A launcher killed with SIGKILL still leaves its arena and runtime
directory behind: ``common/owner.py`` names who made them, and the next start
removes a dead owner's.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import runpy
import signal
import sys

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


def tie_to_parent(parent: int) -> None:
    """Ask for the parent-death signal, then exit at once if ``parent`` is no
    longer our parent (it died before the kernel could be asked)."""
    die_with_parent()
    if os.getppid() != parent:
        os._exit(PARENT_GONE)


_RUN_CHILD = "from radixmux.common.os_process import run_child; run_child()"


def child_command(module: str, *args: str) -> list[str]:
    """The command that runs ``python -m module args`` as a child of this
    process, tied to it from its first instruction on (see the module docstring)."""
    return [sys.executable, "-c", _RUN_CHILD, module, str(os.getpid()), *args]


def run_child() -> None:
    """``child_command``'s other end: ``sys.argv`` is ``["-c", module, parent pid, args...]``."""
    module, parent = sys.argv[1], int(sys.argv[2])
    tie_to_parent(parent)
    sys.argv = [module, *sys.argv[3:]]  # runpy puts the module's path in argv[0]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


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
