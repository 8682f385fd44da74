"""Who made a shared file, and removing the files of a maker that died.

A launcher killed with SIGKILL leaves its KV arena (a shared-memory file in
``/dev/shm``) and its runtime directory behind. Their names (or an ``owner``
file in them) carry an ``Owner`` token: pid, start time and host key, so a
reused pid or a process of another pid namespace sharing the directory never
passes for the maker. The next start removes what a provably dead owner left
(``Owner.is_dead``); unsure is alive.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import stat
import uuid
from dataclasses import dataclass

from radixmux.memory.arena import ARENA_PREFIX, default_arena_dir

log = logging.getLogger("radixmux.owner")


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



# An arena file's name: who made it (``Owner.token``: pid, start time, host
# key), then a random part. Only names of exactly this shape are ours.
_ARENA_NAME = re.compile(rf"{ARENA_PREFIX}(?P<owner>{Owner.PATTERN})-[0-9a-f]{{8}}")


def arena_file_name() -> str:
    """A new arena file name, owned by this process."""
    return f"{ARENA_PREFIX}{Owner.this_process().token}-{uuid.uuid4().hex[:8]}"


def remove_stale_arenas(directory: str | None = None) -> list[str]:
    """Delete arena files whose creating process is gone (a launcher killed
    with SIGKILL, say), so shared memory does not fill up across crashes.

    Only a regular file of this user with an arena's exact name, whose owner
    is provably dead (``Owner.is_dead``: a reused pid or a file of another pid
    namespace sharing this directory is left alone), is removed; nothing is
    followed. Returns the names removed.
    """
    directory = directory or default_arena_dir()
    removed = []
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            m = _ARENA_NAME.fullmatch(entry.name)
            if m is None:
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                owner = Owner.parse(m["owner"])
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                    continue
                if owner is not None and owner.is_dead():
                    os.unlink(entry.path)
                    removed.append(entry.name)
                    log.info("removed the arena %s of dead process %d", entry.path, owner.pid)
    return removed


