"""The disk tier's store: KV chunks as files, keyed by a hash chain, bounded by LRU.

A *chunk* is the KV of ``chunk_tokens`` consecutive tokens (a whole number of
pages) at an aligned position of a prompt. Its key is a hash chain: the key of
chunk ``i`` hashes the key of chunk ``i - 1`` with chunk ``i``'s tokens, and
chunk 0 starts from the *namespace*: the KV-share key (weights fingerprint and
KV dtype), the KV layout, the chunk size and the file format version. So a
chunk is found only for the same tokens after the same prefix under the same
weights: replicas and aliases share files, models whose weights differ (or a
reload with new weights) never match each other's.

A file holds one chunk: a fixed header (magic, format version, key, token
count, payload size, XXH3-64 checksum of the payload), the namespace, then the payload
(``[tokens, layers, 2, kv_heads x head_dim x itemsize]`` bytes, independent of
the arena's block geometry). A file is written under a temporary name and
renamed, so a crash leaves no half file under a real name; a reader still
checks everything and drops a file that disagrees.

The store owns only what it made, and follows no link under its directory:
how it claims, locks and opens that directory is ``kv_disk_dir``.

``DiskKVStore`` is the index (which keys exist, their sizes, recency) and is
owned by one thread, the scheduler's loop; reading and writing the files is
done by ``kv_transfer`` on its I/O thread through ``StoreFiles``, whose
operations touch nothing but the file they are given.

**Shared** (``--kv-disk-shared``): instances on one host serving the same
weights share one directory. Each holds a shared ``flock`` (an unshared
server's exclusive one keeps both kinds apart), indexes only the chunks it
wrote (its *own*: what it counts against its capacity and ever evicts) and
finds the others' by their content names on disk (``has``: one ``stat``). A
chunk is published with ``link(2)``, which never replaces a name: of two
instances saving one chunk at once exactly one owns the file, the other's
copy is dropped. A reader opens a whole file or none (a deleted file stays
readable through an open descriptor, a missing one is recomputed). The
instance that finds the directory free at its start adopts every chunk in it
and cleans interrupted writes; one that joins live ones deletes only
temporaries too old to be a write in progress. An instance that stops hands
its own chunks over (a ``handover.<hex>.list`` of their names); the next one
to start claims the list by renaming it and owns them from then on (bounded
by its capacity), so a rolling restart leaves no chunk owned by no one. A
killed instance hands nothing over: its chunks stay until a start that finds
the directory free.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import stat
import struct
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import xxhash

from radixmux.memory.kv_disk_dir import (
    CHUNK_NAME,
    CHUNK_TEMPORARY,
    FORMAT_VERSION,
    LINK_ERRNOS,
    NS_DIR,
    READ_FLAGS,
    REFUSE_HINT,
    NotAStore,
    claim_directory,
    create_temporary,
    expect_file_or_nothing,
    lock_directory,
    open_dir,
    our_names,
    share_lock,
    temporary_name,
)
from radixmux.memory.layout import KVLayout

log = logging.getLogger("radixmux.scheduler")

# write_back: save KV when it is evicted; write_through: as soon as it is cached.
WRITE_POLICIES = ("write_back", "write_through")
MAGIC = b"RMXKVCHK"
# magic, version, tokens, payload bytes, checksum of payload, namespace bytes, key.
# XXH3-64: 15x faster than CRC-32 here, so checking a load costs well under 1 ms.
_HEADER = struct.Struct("<8sIIQQI32s")
SUFFIX = ".kv"
# Disk errors that mean "this directory cannot take more": the tier turns off.
FATAL_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM}

# A shared store's list of the chunks an instance that stopped leaves to the next
# (``.tmp``: being written, or claimed), and one line of it.
_HANDOVER = re.compile(r"handover\.[0-9a-f]{16}\.(list|tmp)")
_HANDOVER_LINE = re.compile(rb"([0-9a-f]{16})/([0-9a-f]{64})")

# A temporary this old in a shared store is no write in progress (a chunk takes
# milliseconds): a crashed instance left it.
STALE_TEMPORARY_SECONDS = 600.0


def check_settings(chunk_tokens: int, page_size: int, write_policy: str) -> None:
    """Raise ValueError for a chunk size or write policy the tier cannot use."""
    if chunk_tokens <= 0 or chunk_tokens % page_size:
        raise ValueError(
            f"--kv-disk-chunk-tokens {chunk_tokens} must be a positive multiple "
            f"of --page-size {page_size}"
        )
    if write_policy not in WRITE_POLICIES:
        raise ValueError(
            f"--kv-disk-write-policy {write_policy!r}: choose one of {list(WRITE_POLICIES)}"
        )


def namespace(pool: str, layout: KVLayout, chunk_tokens: int) -> bytes:
    """Everything that must be equal for two chunks' bytes to be interchangeable."""
    return (
        f"radixmux-kv/v{FORMAT_VERSION}/{pool}/{layout.num_layers}x{layout.num_kv_heads}"
        f"x{layout.head_dim}/{layout.dtype}/{chunk_tokens}"
    ).encode()


def namespace_dir(ns: bytes) -> str:
    """The subdirectory a namespace's files live in (so one model's files can go at once)."""
    return hashlib.sha256(ns).hexdigest()[:16]


def chunk_keys(ns: bytes, tokens: bytes, chunk_tokens: int) -> list[bytes]:
    """The keys of every whole chunk of ``tokens`` (packed int32), first to last."""
    step = 4 * chunk_tokens
    h = hashlib.sha256(ns).digest()
    keys = []
    for end in range(step, len(tokens) + 1, step):
        h = hashlib.sha256(h + tokens[end - step : end]).digest()
        keys.append(h)
    return keys


def file_bytes(ns: bytes, payload_bytes: int) -> int:
    """The size of a chunk file in namespace ``ns`` (what it counts against the capacity)."""
    return _HEADER.size + len(ns) + payload_bytes


def checksum(payload: memoryview | bytes) -> int:
    """The payload checksum a chunk file carries (XXH3, 64 bits)."""
    return xxhash.xxh3_64_intdigest(payload)


@dataclass(frozen=True)
class ChunkRef:
    """One chunk file: its key and its namespace's directory."""

    key: bytes
    ns_dir: str

    @property
    def name(self) -> str:
        return self.key.hex() + SUFFIX


@dataclass
class _Scan:
    found: list[tuple[float, ChunkRef, int]] = field(default_factory=list)  # mtime, ref, size
    temporaries: int = 0  # writes a crash interrupted (deleted)
    left_alone: int = 0  # entries not ours (links, other files and directories)
    examples: list[str] = field(default_factory=list)  # a few of them, for the log

    def leave(self, name: str) -> None:
        self.left_alone += 1
        if len(self.examples) < 5:
            self.examples.append(name)


class StoreFiles:
    """The chunk files under the store's ``v<FORMAT_VERSION>`` directory.

    Holds that directory open and does everything relative to its descriptor,
    each level opened with ``O_NOFOLLOW``: a symbolic link anywhere under it
    is never read, written or deleted through, and a rename of the store's
    path after start changes nothing. Used by the I/O thread; the loop uses it
    only at start (the scan) when no I/O thread runs yet.
    """

    def __init__(self, fd: int, path: str, shared: bool = False) -> None:
        self.fd = fd
        self.root = path
        self.shared = shared

    def path(self, ref: ChunkRef) -> str:
        """The file's path, for messages (never opened by path)."""
        return os.path.join(self.root, ref.ns_dir, ref.name)

    @contextlib.contextmanager
    def _namespace(self, ns_dir: str, create: bool = False) -> Iterator[int]:
        """A namespace directory's descriptor (made first with ``create``)."""
        try:
            fd = open_dir(self.fd, ns_dir, os.path.join(self.root, ns_dir))
        except FileNotFoundError:
            if not create:
                raise
            # The namespace's first chunk, or a flush removed its directory
            # after the save was queued.
            with contextlib.suppress(FileExistsError):
                os.mkdir(ns_dir, 0o700, dir_fd=self.fd)
            fd = open_dir(self.fd, ns_dir, os.path.join(self.root, ns_dir))
        try:
            yield fd
        finally:
            os.close(fd)

    def has(self, ref: ChunkRef) -> bool:
        """Whether a regular file is under the chunk's name (one ``stat``; any
        thread). A hint: the read that follows checks the file itself."""
        try:
            st = os.stat(f"{ref.ns_dir}/{ref.name}", dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode)

    def write(self, ref: ChunkRef, ns: bytes, n_tokens: int, payload: memoryview) -> int | None:
        """Write one chunk file atomically (a fresh temporary, then a rename;
        in a shared store a link that never replaces a name); returns its
        size, or None when a shared store already holds the chunk (another
        instance's file: not this one's to count)."""
        header = _HEADER.pack(
            MAGIC, FORMAT_VERSION, n_tokens, payload.nbytes, checksum(payload), len(ns), ref.key
        )
        with self._namespace(ref.ns_dir, create=True) as d:
            fd, tmp = create_temporary(d, ref.name, self.path(ref))
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(header)
                    f.write(ns)
                    f.write(payload)
                if self.shared:
                    # linkat(2) fails on any name that exists (a link there
                    # included): one writer per chunk, the loser's copy goes.
                    try:
                        os.link(tmp, ref.name, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
                    except FileExistsError:
                        return None
                    finally:
                        os.unlink(tmp, dir_fd=d)
                else:
                    # rename(2) replaces the directory entry at the destination and
                    # resolves no link in it: a link there would itself be replaced,
                    # its target never touched. Such a link is not ours, so it is
                    # left alone: the chunk is not saved.
                    expect_file_or_nothing(d, ref.name, self.path(ref))
                    os.replace(tmp, ref.name, src_dir_fd=d, dst_dir_fd=d)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=d)  # made by O_EXCL above: ours
                raise
        return file_bytes(ns, payload.nbytes)

    def read(
        self, ref: ChunkRef, ns: bytes, n_tokens: int, out: memoryview, touch: bool = False
    ) -> str | None:
        """Read a chunk's payload into ``out`` (exactly its size). Returns None
        when the file is sound, else why it is not (missing, a link, truncated,
        another key, namespace or size, bad checksum): the caller drops it and
        recomputes. ``touch`` marks a sound file used (its mtime is its recency
        across restarts)."""
        try:
            with self._namespace(ref.ns_dir) as d:
                fd = os.open(ref.name, READ_FLAGS, dir_fd=d)
        except FileNotFoundError:
            return "file missing"
        except OSError as exc:
            if exc.errno in LINK_ERRNOS:
                return "a symbolic link or not a file (not followed)"
            return f"unreadable: {exc}"
        try:
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return "not a regular file"
                why = _read_into(f, ref.key, ns, n_tokens, out)
                if why is None and touch:
                    os.utime(fd)
                return why
        except OSError as exc:
            return f"unreadable: {exc}"

    def remove(self, ref: ChunkRef) -> bool:
        """Delete a chunk's file; anything else under its name (a link, a
        directory) stays. Returns whether a file went."""
        try:
            with self._namespace(ref.ns_dir) as d:
                if not stat.S_ISREG(os.stat(ref.name, dir_fd=d, follow_symlinks=False).st_mode):
                    return False
                os.unlink(ref.name, dir_fd=d)
                return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno in LINK_ERRNOS:  # the namespace directory is a link: not ours
                return False
            raise

    def clear(self) -> int:
        """Delete every chunk file (and temporary) in every namespace directory,
        then the directories left empty; everything else stays. Best effort: a
        name that cannot go is left. Returns how many files went."""
        removed = 0
        for entry in os.scandir(self.fd):
            if not (NS_DIR.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
                continue
            with contextlib.suppress(OSError), self._namespace(entry.name) as d:
                for name in our_names(d):
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=d)
                        removed += 1
            with contextlib.suppress(OSError):  # not empty: something not ours is in it
                os.rmdir(entry.name, dir_fd=self.fd)
        return removed

    def scan(self, temporaries_older_than: float | None = None) -> _Scan:
        """The chunk files a previous server left; interrupted writes are
        deleted (with ``temporaries_older_than``, a time: only those last
        written before it, the others may be live instances' writes)."""
        out = _Scan()
        for entry in os.scandir(self.fd):
            if _HANDOVER.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                if temporaries_older_than is None:  # every chunk is adopted anyway
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.name, dir_fd=self.fd)
                continue
            if not (NS_DIR.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
                out.leave(entry.name)
                continue
            try:
                d = open_dir(self.fd, entry.name, os.path.join(self.root, entry.name))
            except OSError:  # replaced by a link since the listing
                out.leave(entry.name)
                continue
            try:
                for e in os.scandir(d):
                    regular = e.is_file(follow_symlinks=False)
                    if regular and CHUNK_NAME.fullmatch(e.name):
                        st = e.stat(follow_symlinks=False)
                        ref = ChunkRef(bytes.fromhex(e.name[: -len(SUFFIX)]), entry.name)
                        out.found.append((st.st_mtime, ref, st.st_size))
                    elif regular and CHUNK_TEMPORARY.fullmatch(e.name):
                        cutoff = temporaries_older_than
                        if cutoff is not None and e.stat(follow_symlinks=False).st_mtime >= cutoff:
                            continue
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(e.name, dir_fd=d)
                        out.temporaries += 1
                    else:
                        out.leave(f"{entry.name}/{e.name}")
            finally:
                os.close(d)
        return out

    def hand_over(self, refs: list[ChunkRef]) -> None:
        """Leave these chunks (a shared store's own, at its stop) to the next
        instance that starts: a list written under a temporary name, then renamed."""
        text = b"".join(f"{r.ns_dir}/{r.key.hex()}\n".encode() for r in refs)
        fd, tmp = create_temporary(self.fd, "handover", self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(text)
            final = f"handover.{secrets.token_hex(8)}.list"
            os.rename(tmp, final, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def take_handovers(self) -> list[tuple[float, ChunkRef, int]]:
        """The chunks stopped instances handed over (``hand_over``) whose files
        are still there, as (mtime, ref, size). Each list is claimed by renaming
        it: of instances starting at once, one takes it."""
        found = []
        for entry in os.scandir(self.fd):
            if not (
                entry.name.endswith(".list")
                and _HANDOVER.fullmatch(entry.name)
                and entry.is_file(follow_symlinks=False)
            ):
                continue
            claimed = temporary_name("handover")
            try:
                os.rename(entry.name, claimed, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            except FileNotFoundError:  # another instance took it
                continue
            try:
                with os.fdopen(os.open(claimed, READ_FLAGS, dir_fd=self.fd), "rb") as f:
                    text = f.read()
            except OSError:
                text = b""
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(claimed, dir_fd=self.fd)
            for line in text.splitlines():
                if (m := _HANDOVER_LINE.fullmatch(line)) is None:
                    continue
                ref = ChunkRef(bytes.fromhex(m[2].decode()), m[1].decode())
                try:
                    st = os.stat(f"{ref.ns_dir}/{ref.name}", dir_fd=self.fd, follow_symlinks=False)
                except OSError:  # deleted since (a reader found it bad)
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime, ref, st.st_size))
        return found

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class _Meta:
    ns_dir: str
    size: int


class DiskKVStore:
    """The index of one store directory: which chunks exist, LRU order, capacity.

    Single-threaded (the scheduler loop). Opening a directory claims it (see
    the module's docstring: ``NotAStore`` when it is not the store's to take);
    holding an exclusive ``flock`` on it for the store's life keeps a second
    server from corrupting it (``StoreLocked`` names the other server's pid).
    The path given is resolved once, as given (a link in it is the user's
    choice); nothing under it is followed.

    ``shared``: instances share the directory (see the module's docstring);
    the index holds this instance's own chunks and ``has`` finds the others'.
    """

    def __init__(self, directory: str, capacity_bytes: int, shared: bool = False) -> None:
        if capacity_bytes <= 0:
            raise ValueError("a disk store needs a positive capacity")
        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.capacity_bytes = capacity_bytes
        self.shared = shared
        self.alone = True  # held the directory alone at start (adopted what it found)
        self.root = os.path.join(self.directory, f"v{FORMAT_VERSION}")
        self._lock_fd: int | None = None
        self.files: StoreFiles | None = None
        self._index: OrderedDict[bytes, _Meta] = OrderedDict()
        self.size_bytes = 0
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        top = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            claim_directory(top, self.directory)
            self._lock_fd, self.alone = lock_directory(top, self.directory, shared)
            with contextlib.suppress(FileExistsError):
                os.mkdir(os.path.basename(self.root), 0o700, dir_fd=top)
            try:
                fd = open_dir(top, os.path.basename(self.root), self.root)
            except OSError as exc:
                if exc.errno in LINK_ERRNOS:
                    raise NotAStore(
                        f"{self.root} is a symbolic link or not a directory, and radixmux "
                        f"follows no link in its store: remove it, or {REFUSE_HINT}"
                    ) from None
                raise
            self.files = StoreFiles(fd, self.root, shared)
            self.dropped_at_start = self._scan()
            if shared and self.alone:
                share_lock(self._lock_fd, self.directory)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(top)

    def _scan(self) -> int:
        """Index the files a previous server left, oldest first; drop temporaries.
        Joining live instances on a shared directory: their files are theirs
        (found by ``has``), only stale temporaries go, and what stopped
        instances handed over becomes this one's."""
        assert self.files is not None
        if self.alone:
            found = self.files.scan()
            adopted = found.found
        else:
            found = self.files.scan(time.time() - STALE_TEMPORARY_SECONDS)
            adopted = self.files.take_handovers()
        if found.left_alone:
            log.warning(
                "disk store %s: left alone %d entries it did not make (never read, "
                "written or deleted), e.g. %s",
                self.root,
                found.left_alone,
                ", ".join(found.examples),
            )
        self.left_alone = found.left_alone
        for _, ref, size in sorted(adopted, key=lambda f: f[0]):
            self._index[ref.key] = _Meta(ref.ns_dir, size)
            self.size_bytes += size
        # A restart with a smaller --kv-disk-bytes: the oldest go now.
        victims = self._trim()
        for ref in victims:
            self.files.remove(ref)
        return found.temporaries + len(victims)

    def _trim(self) -> list[ChunkRef]:
        """Forget least recently used chunks until the store fits its capacity
        (one chunk larger than all of it stays); returns them."""
        victims = []
        while self.size_bytes > self.capacity_bytes and len(self._index) > 1:
            victim, meta = self._index.popitem(last=False)
            self.size_bytes -= meta.size
            victims.append(ChunkRef(victim, meta.ns_dir))
        return victims

    def path(self, ns_dir: str, key: bytes) -> str:
        """A chunk file's path (for messages and tests; files are opened by ``files``)."""
        return os.path.join(self.root, ns_dir, key.hex() + SUFFIX)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def has(self, ref: ChunkRef) -> bool:
        """Whether the chunk can be loaded: in the index, or (shared) a file
        another instance wrote under its name."""
        if ref.key in self._index:
            return True
        return self.shared and self.files is not None and self.files.has(ref)

    def __len__(self) -> int:
        return len(self._index)

    def touch(self, key: bytes) -> None:
        """Mark a chunk just used (it goes last when room is needed)."""
        if key in self._index:
            self._index.move_to_end(key)

    def added(self, key: bytes, ns_dir: str, size: int) -> list[ChunkRef]:
        """Record a written chunk; returns the chunks to delete to stay in capacity
        (least recently used first; the caller deletes them off the loop)."""
        old = self._index.pop(key, None)
        if old is not None:
            self.size_bytes -= old.size
        self._index[key] = _Meta(ns_dir, size)
        self.size_bytes += size
        return self._trim()

    def discard(self, key: bytes) -> str | None:
        """Forget a chunk (corrupt, or its namespace dropped); returns its path."""
        meta = self._index.pop(key, None)
        if meta is None:
            return None
        self.size_bytes -= meta.size
        return self.path(meta.ns_dir, key)

    def clear(self) -> list[ChunkRef]:
        """Forget every chunk; returns them (the caller has the I/O thread
        delete the files: ``StoreFiles.clear``, or in a shared store only
        these, its own)."""
        refs = [ChunkRef(key, meta.ns_dir) for key, meta in self._index.items()]
        self._index.clear()
        self.size_bytes = 0
        return refs

    def close(self, keep_files: bool = False) -> None:
        """Release the directory lock and the store's directory (``keep_files``:
        not the directory, which a stuck I/O thread still uses)."""
        if self.files is not None and not keep_files:
            if self.shared and self._index:
                try:
                    self.files.hand_over(self.clear())
                except OSError as exc:  # its chunks stay, owned by none until a lone start
                    log.warning("disk store %s: could not hand its chunks over: %s", self.root, exc)
            self.files.close()
        self.files = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _read_into(f: BinaryIO, key: bytes, ns: bytes, n_tokens: int, out: memoryview) -> str | None:
    """Check an open chunk file against what the index expects and read its
    payload into ``out``; None when sound, else why not."""
    head = f.read(_HEADER.size)
    if len(head) != _HEADER.size:
        return "truncated header"
    magic, version, tokens, size, digest, ns_len, file_key = _HEADER.unpack(head)
    if magic != MAGIC or version != FORMAT_VERSION:
        return "not a chunk file of this format version"
    if file_key != key or tokens != n_tokens or size != out.nbytes:
        return "key or size differs from the index"
    # The length first: a file's header must not size an allocation.
    if ns_len != len(ns) or f.read(ns_len) != ns:
        return "namespace differs"
    if f.readinto(out) != size or f.read(1):
        return "truncated or oversized payload"
    if checksum(out) != digest:
        return "checksum mismatch"
    return None
