"""An advisory lock between processes on one machine, for filling a shared cache once.

Two processes that find the same cache entry missing (a converted model, a
compiled kernel) would otherwise both build it and race to put it in place.
Holding :func:`held` around "check again, build, rename into place" makes the
second wait and then find the finished entry.

``flock`` locks belong to the open file description, so the kernel drops one
when its holder dies, SIGKILL included: a crashed builder never leaves a lock
behind that stalls the next one. The lock file itself stays (a few bytes):
deleting it while another process waits on it would let a third lock a new
file of the same name and build beside the first.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def held(
    path: Path, shared: bool = False, on_wait: Callable[[], None] | None = None
) -> Iterator[None]:
    """Hold an exclusive (or ``shared``) lock on ``path``, creating the file if missing.

    ``on_wait`` is called once, before blocking, when another process holds a
    conflicting lock (to tell the user why nothing seems to happen).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # releases the lock
