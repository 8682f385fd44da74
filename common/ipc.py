"""ZeroMQ plumbing: the private runtime directory, endpoints and sockets.

All sockets are ``ipc://`` files in one directory created with mode 0700, so
no other user can connect to a runtime's internals. The directory is always a
new one (``radixmux-rt-XXXXXXXX``) inside a parent: the temp directory, or
``--runtime-dir``, whose own mode is never touched (it may be ``/tmp``). An
``owner`` file in it names the launcher (``owner.Owner``), so a start
can remove the directories that launchers killed with SIGKILL left behind,
and nothing else. Who binds what:

================  ==========  ===============================================
endpoint          bound by    connected by
================  ==========  ===============================================
``launcher``      launcher    every process (PUSH ProcessReady/Failed)
``tokenizer``     front       tokenizer workers (PULL; PUSH round-robins)
``scheduler``     scheduler   tokenizer workers, front, launcher (PUSH)
``runners``       scheduler   runners (ROUTER/DEALER, identity = runner id)
``detokenizer``   detokenizer scheduler (PUSH)
``front``         front       tokenizer workers, scheduler, detokenizer (PUSH)
``models``        launcher    tokenizer workers (SUB: the table of loaded models)
``client``        front       the Python ZMQ client (ROUTER/DEALER)
================  ==========  ===============================================
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import tempfile

import msgspec
import zmq

from radixmux.common.owner import Owner

log = logging.getLogger("radixmux.ipc")

RUNTIME_PREFIX = "radixmux-rt-"
OWNER_FILE = "owner"
# tempfile.mkdtemp's random part: 8 of [a-z0-9_].
_RUNTIME_NAME = re.compile(rf"{RUNTIME_PREFIX}[a-z0-9_]{{8}}")


class Endpoints(msgspec.Struct, frozen=True):
    """Addresses of every socket of one runtime."""

    runtime_dir: str
    launcher: str
    tokenizer: str
    scheduler: str
    runners: str
    detokenizer: str
    front: str
    models: str
    client: str

    @classmethod
    def in_dir(cls, runtime_dir: str, client: str | None = None) -> Endpoints:
        def ipc(name: str) -> str:
            return f"ipc://{os.path.join(runtime_dir, name)}"

        return cls(
            runtime_dir=runtime_dir,
            launcher=ipc("launcher"),
            tokenizer=ipc("tokenizer"),
            scheduler=ipc("scheduler"),
            runners=ipc("runners"),
            detokenizer=ipc("detokenizer"),
            front=ipc("front"),
            models=ipc("models"),
            client=client or ipc("client"),
        )


# The sockets a runtime dir may hold (besides its owner file): Endpoints' fields.
_SOCKET_NAMES = frozenset(Endpoints.__struct_fields__) - {"runtime_dir"}


def make_runtime_dir(parent: str | None = None) -> str:
    """Create a new private (0700) directory for the runtime's sockets inside
    ``parent`` (default: the temp directory), after removing the ones dead
    launchers left there. ``parent`` is made (0700) if missing, never chmod-ed."""
    parent = parent or tempfile.gettempdir()
    os.makedirs(parent, mode=0o700, exist_ok=True)
    remove_stale_runtime_dirs(parent)
    path = tempfile.mkdtemp(prefix=RUNTIME_PREFIX, dir=parent)
    fd = os.open(
        os.path.join(path, OWNER_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600
    )
    with os.fdopen(fd, "w") as f:
        f.write(Owner.this_process().token + "\n")
    return path


def remove_runtime_dir(path: str) -> None:
    """Remove a runtime directory this process made (everything in it is ours)."""
    shutil.rmtree(path, ignore_errors=True)


def _stale_owner(path: str) -> Owner | None:
    """The dead owner of runtime directory ``path``, or None unless it is
    provably ours and its owner provably dead: a real directory (not a link)
    of this user, with an owner file (a regular file) naming a dead process."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return None
    owner_file = os.path.join(path, OWNER_FILE)
    if not stat.S_ISREG(os.lstat(owner_file).st_mode):  # no FIFO or device is opened
        return None
    with os.fdopen(os.open(owner_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        owner = Owner.parse(f.read(64))
    return owner if owner is not None and owner.is_dead() else None


def _is_ours(path: str, name: str) -> bool:
    """Whether entry ``name`` of a runtime dir is one a runtime makes."""
    if name == OWNER_FILE:
        return True
    return name in _SOCKET_NAMES and stat.S_ISSOCK(os.lstat(os.path.join(path, name)).st_mode)


def remove_stale_runtime_dirs(parent: str) -> list[str]:
    """Remove the runtime directories in ``parent`` whose launcher is dead
    (killed with SIGKILL, say). Only our sockets and owner file are deleted,
    then the directory: anything else in one keeps it whole. Returns the
    directories removed."""
    removed = []
    with contextlib.suppress(OSError), os.scandir(parent) as entries:
        for entry in entries:
            if not _RUNTIME_NAME.fullmatch(entry.name):
                continue
            with contextlib.suppress(OSError):
                owner = _stale_owner(entry.path)
                if owner is None:
                    continue
                names = os.listdir(entry.path)
                foreign = [n for n in names if not _is_ours(entry.path, n)]
                if foreign:
                    log.warning("stale runtime dir %s holds %s: kept", entry.path, foreign)
                    continue
                # The owner file goes last: until then the directory says whose it is.
                for name in sorted(names, key=lambda n: n == OWNER_FILE):
                    os.unlink(os.path.join(entry.path, name))
                os.rmdir(entry.path)
                removed.append(entry.path)
                log.info("removed the runtime dir %s of dead process %d", entry.path, owner.pid)
    return removed


def socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    """A socket bound or connected to ``endpoint``; LINGER is short so exits never hang."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 500)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock
