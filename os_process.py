"""How every process of ours is tied to its parent and how it leaves.

Low-level on purpose: runners (``model_runners/``) and the runtime's processes
both need it, and neither may import the other.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent exits."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


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
