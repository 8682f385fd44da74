"""The disk tier's directory: what its store may touch there, and how.

The store owns only what it made. The directory is marked at creation
(``radixmux-kv-store``, with the layout's version); a non-empty directory
without the mark is refused (``NotAStore``), unless every entry in it is one a
store of the unmarked earlier layout makes, which is adopted. Inside, chunk
files live in ``v<FORMAT_VERSION>/<namespace dir>/<key>.kv``; only regular
files with a chunk's (or a chunk's temporary's) name in a directory with a
namespace's name are ever deleted. No symbolic link is followed: every level
is opened with ``O_NOFOLLOW`` relative to its parent's descriptor. A lock
file keeps two servers off one directory (``StoreLocked``), or lets
``--kv-disk-shared`` instances hold it together. The chunk format and the
index are in ``kv_disk_store``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import stat
import time

log = logging.getLogger("radixmux.scheduler")

# The chunk files' format version, also the name of their folder (v1).
FORMAT_VERSION = 1
# The directory layout the mark names: lock, mark, v<FORMAT_VERSION>/<ns>/<key>.kv.
STORE_VERSION = 1

LOCK_NAME = "radixmux.lock"
MARK_NAME = "radixmux-kv-store"
_MARK_TEXT = re.compile(rb"radixmux-kv-store (\d+)\n")

# The names the store makes; nothing else is ever deleted.
NS_DIR = re.compile(r"[0-9a-f]{16}")
CHUNK_NAME = re.compile(r"[0-9a-f]{64}\.kv")
# A temporary: "<name>.<random hex>.tmp" (before the random names: "<name>.<pid>.tmp").
CHUNK_TEMPORARY = re.compile(r"[0-9a-f]{64}\.kv\.[0-9a-f]+\.tmp")
_MARK_TEMPORARY = re.compile(r"radixmux-kv-store\.[0-9a-f]+\.tmp")

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW
# O_NONBLOCK: a FIFO planted under a chunk's name must not hang the I/O thread
# in open(); a regular file ignores it.
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW
# O_EXCL: a name that exists (a link there included) is never opened.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
LINK_ERRNOS = (errno.ELOOP, errno.ENOTDIR)  # O_NOFOLLOW met a link, or not a directory
REFUSE_HINT = "point --kv-disk-dir at an empty or new directory"

# How long a shared store waits for an instance that holds the directory alone
# while it scans it at start (a scan lists files: well under this).
SHARED_LOCK_WAIT_SECONDS = 10.0


class StoreRefused(RuntimeError):
    """The directory cannot be this server's store: a start-up error, not a tier
    quietly off (the message names the directory and what to do)."""


class StoreLocked(StoreRefused):
    """Another live server uses this directory."""


class NotAStore(StoreRefused):
    """The directory holds things radixmux did not make (or a link where the
    store's own parts should be)."""


def open_dir(parent: int, name: str, path: str) -> int:
    """``name`` under ``parent`` as a directory descriptor, never through a link
    (OSError ELOOP/ENOTDIR when it is one, or not a directory)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in LINK_ERRNOS:
            raise OSError(
                exc.errno, "a symbolic link or not a directory (not followed)", path
            ) from None
        raise


def our_names(dir_fd: int) -> list[str]:
    """The names in a namespace directory the store made: regular files named
    as a chunk or a chunk's temporary."""
    return [
        e.name
        for e in os.scandir(dir_fd)
        if e.is_file(follow_symlinks=False)
        and (CHUNK_NAME.fullmatch(e.name) or CHUNK_TEMPORARY.fullmatch(e.name))
    ]


def temporary_name(name: str) -> str:
    """A name no one can guess ahead, so no one can plant anything under it."""
    return f"{name}.{secrets.token_hex(8)}.tmp"


def create_temporary(dir_fd: int, name: str, path: str) -> tuple[int, str]:
    """A new file beside ``name``, made with O_EXCL (a name taken, by anything
    at all, is passed over, never opened); returns its descriptor and name."""
    for _ in range(8):
        tmp = temporary_name(name)
        try:
            return os.open(tmp, _CREATE_FLAGS, 0o600, dir_fd=dir_fd), tmp
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "no free temporary name", path)


def expect_file_or_nothing(dir_fd: int, name: str, path: str) -> None:
    """Raise unless ``name`` is absent or a regular file (one the rename may replace)."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise OSError(errno.EEXIST, "a link or another non-file is in the way (left alone)", path)


def claim_directory(top: int, directory: str) -> None:
    """Make sure ``directory`` (open as ``top``) is a store: marked, or empty
    or holding only what an unmarked store of the earlier layout makes (then
    marked now). Raises NotAStore otherwise."""
    version = _read_mark(top, directory)
    if version is not None:
        if version != STORE_VERSION:
            raise NotAStore(
                f"--kv-disk-dir {directory} is a store of another radixmux version "
                f"(layout {version}; this one reads layout {STORE_VERSION}): "
                f"run that version on it, or {REFUSE_HINT}"
            )
        return
    names = sorted(os.listdir(top))
    if names and not _made_by_a_store(top, names):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise NotAStore(
            f"--kv-disk-dir {directory} is not empty ({len(names)} entries: {shown}) and is "
            f"not a radixmux KV store (it has no {MARK_NAME} mark). The disk tier deletes "
            f"files in its directory, so it takes only one it made: {REFUSE_HINT}"
        )
    _write_mark(top, directory)
    if names:
        log.info("disk store %s: an unmarked store of the earlier layout, adopted", directory)


def _read_mark(top: int, directory: str) -> int | None:
    """The store layout version the mark names; None when there is no mark."""
    path = os.path.join(directory, MARK_NAME)
    try:
        fd = os.open(MARK_NAME, READ_FLAGS, dir_fd=top)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in LINK_ERRNOS:
            raise NotAStore(
                f"{path} is a symbolic link, not a store's mark: {REFUSE_HINT}"
            ) from None
        raise
    with os.fdopen(fd, "rb") as f:
        text = f.read(64) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    match = _MARK_TEXT.fullmatch(text)
    if match is None:
        raise NotAStore(f"{path} is not a mark radixmux wrote: {REFUSE_HINT}")
    return int(match.group(1))


def _write_mark(top: int, directory: str) -> None:
    """Write the mark atomically (and durably: a mark lost to a crash would
    leave a store its next start refuses)."""
    path = os.path.join(directory, MARK_NAME)
    fd, tmp = create_temporary(top, MARK_NAME, path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"%s %d\n" % (MARK_NAME.encode(), STORE_VERSION))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, MARK_NAME, src_dir_fd=top, dst_dir_fd=top)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=top)
        raise
    with contextlib.suppress(OSError):  # some filesystems cannot sync a directory
        os.fsync(top)


def _made_by_a_store(top: int, names: list[str]) -> bool:
    """Whether every entry is one an unmarked store (the layout before the mark)
    makes: its lock, a mark's temporary, and ``v1`` holding only namespace
    directories of chunk files and their temporaries, none of them a link."""
    for name in names:
        mode = os.stat(name, dir_fd=top, follow_symlinks=False).st_mode
        if name == LOCK_NAME or _MARK_TEMPORARY.fullmatch(name):
            if not stat.S_ISREG(mode):
                return False
        elif name != f"v{FORMAT_VERSION}" or not stat.S_ISDIR(mode):
            return False
    if f"v{FORMAT_VERSION}" not in names:
        return True
    root = open_dir(top, f"v{FORMAT_VERSION}", "")
    try:
        for entry in os.scandir(root):
            if not (NS_DIR.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
                return False
            d = open_dir(root, entry.name, "")
            try:
                if len(our_names(d)) != len(os.listdir(d)):
                    return False
            finally:
                os.close(d)
    finally:
        os.close(root)
    return True


def lock_directory(top: int, directory: str, shared: bool) -> tuple[int, bool]:
    """Lock the store: exclusively, or (``shared``) exclusively when no other
    instance holds it, else shared. Returns the lock's descriptor and whether
    this server holds the directory alone."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | _NOFOLLOW
        fd = os.open(LOCK_NAME, flags, 0o600, dir_fd=top)
    except OSError as exc:
        if exc.errno in LINK_ERRNOS:
            raise NotAStore(
                f"{path} is a symbolic link, not a store's lock: {REFUSE_HINT}"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotAStore(f"{path} is not a regular file, not a store's lock: {REFUSE_HINT}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if shared and _wait_shared(fd):
            return fd, False
        other = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        hint = (
            "it runs without --kv-disk-shared (give this server its own directory)"
            if shared
            else "give each server its own directory, or --kv-disk-shared to every one of them"
        )
        raise StoreLocked(
            f"--kv-disk-dir {directory} is in use by another radixmux server (pid {other}); " + hint
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd, True


def _wait_shared(fd: int) -> bool:
    """Take the lock shared, waiting while a sharing instance scans the directory
    alone at its start; False when it stays held (a server not sharing it)."""
    deadline = time.monotonic() + SHARED_LOCK_WAIT_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def share_lock(fd: int, directory: str) -> None:
    """Turn the exclusive lock held over the start-up scan into a shared one.
    flock(2) converts by release and retake: a server not sharing that took
    the directory in between wins it, and this one stops."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StoreLocked(
            f"--kv-disk-dir {directory} was taken by a radixmux server without "
            "--kv-disk-shared while this one started"
        ) from None
