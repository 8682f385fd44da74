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

``DiskKVStore`` is the index (which keys exist, their sizes, recency) and is
owned by one thread, the scheduler's loop; reading and writing the files is
done by ``kv_transfer`` on its I/O thread with the functions below, which
touch nothing but the file they are given.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import struct
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from radixmux.memory.layout import KVLayout

FORMAT_VERSION = 1
# write_back: save KV when it is evicted; write_through: as soon as it is cached.
WRITE_POLICIES = ("write_back", "write_through")
MAGIC = b"RMXKVCHK"
# magic, version, tokens, payload bytes, checksum of payload, namespace bytes, key.
# XXH3-64: 15x faster than CRC-32 here, so checking a load costs well under 1 ms.
_HEADER = struct.Struct("<8sIIQQI32s")
SUFFIX = ".kv"
LOCK_NAME = "radixmux.lock"
# Disk errors that mean "this directory cannot take more": the tier turns off.
FATAL_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM}


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


class StoreLocked(RuntimeError):
    """Another live server uses this directory."""


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


def checksum(payload: memoryview | bytes) -> int:
    """The payload checksum a chunk file carries (XXH3, 64 bits)."""
    return xxhash.xxh3_64_intdigest(payload)


def write_chunk(path: str, key: bytes, ns: bytes, n_tokens: int, payload: memoryview) -> int:
    """Write one chunk file atomically (temporary name, then rename); returns its size."""
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, n_tokens, payload.nbytes, checksum(payload), len(ns), key
    )
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        try:
            f = open(tmp, "wb")  # noqa: SIM115 (closed by the with below)
        except FileNotFoundError:
            # The namespace's first chunk, or its directory was deleted (a flush)
            # after the save was queued.
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            f = open(tmp, "wb")  # noqa: SIM115
        with f:
            f.write(header)
            f.write(ns)
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return _HEADER.size + len(ns) + payload.nbytes


def read_chunk(path: str, key: bytes, ns: bytes, n_tokens: int, out: memoryview) -> str | None:
    """Read a chunk's payload into ``out`` (exactly its size). Returns None when
    the file is sound, else why it is not (missing, truncated, another key,
    namespace or size, bad checksum): the caller drops it and recomputes."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
            if len(head) != _HEADER.size:
                return "truncated header"
            magic, version, tokens, size, digest, ns_len, file_key = _HEADER.unpack(head)
            if magic != MAGIC or version != FORMAT_VERSION:
                return "not a chunk file of this format version"
            if file_key != key or tokens != n_tokens or size != out.nbytes:
                return "key or size differs from the index"
            if f.read(ns_len) != ns:
                return "namespace differs"
            if f.readinto(out) != size or f.read(1):
                return "truncated or oversized payload"
    except FileNotFoundError:
        return "file missing"
    except OSError as exc:
        return f"unreadable: {exc}"
    if checksum(out) != digest:
        return "checksum mismatch"
    return None


@dataclass
class _Meta:
    ns_dir: str
    size: int


class DiskKVStore:
    """The index of one store directory: which chunks exist, LRU order, capacity.

    Single-threaded (the scheduler loop). Holding an exclusive ``flock`` on
    the directory for the store's life keeps a second server from corrupting
    it; ``StoreLocked`` names the other server's pid.
    """

    def __init__(self, directory: str, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("a disk store needs a positive capacity")
        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.capacity_bytes = capacity_bytes
        self.root = os.path.join(self.directory, f"v{FORMAT_VERSION}")
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self._lock_fd = _lock_directory(self.directory)
        self._index: OrderedDict[bytes, _Meta] = OrderedDict()
        self.size_bytes = 0
        self.dropped_at_start = self._scan()

    def _scan(self) -> int:
        """Index the files a previous server left, oldest first; drop temporaries."""
        found: list[tuple[float, bytes, _Meta]] = []
        dropped = 0
        for ns_entry in os.scandir(self.root):
            if not ns_entry.is_dir():
                continue
            for entry in os.scandir(ns_entry.path):
                key = _key_of(entry.name)
                if key is None:  # a write a crash interrupted, or not ours
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                    dropped += 1
                    continue
                st = entry.stat()
                found.append((st.st_mtime, key, _Meta(ns_entry.name, st.st_size)))
        for _, key, meta in sorted(found, key=lambda f: f[0]):
            self._index[key] = meta
            self.size_bytes += meta.size
        # A restart with a smaller --kv-disk-bytes: the oldest go now.
        victims = self._trim()
        remove_paths(victims)
        return dropped + len(victims)

    def _trim(self) -> list[str]:
        """Forget least recently used chunks until the store fits its capacity
        (one chunk larger than all of it stays); returns their paths."""
        victims = []
        while self.size_bytes > self.capacity_bytes and len(self._index) > 1:
            victim, meta = self._index.popitem(last=False)
            self.size_bytes -= meta.size
            victims.append(self.path(meta.ns_dir, victim))
        return victims

    def path(self, ns_dir: str, key: bytes) -> str:
        return os.path.join(self.root, ns_dir, key.hex() + SUFFIX)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def touch(self, key: bytes) -> None:
        """Mark a chunk just used (it goes last when room is needed)."""
        if key in self._index:
            self._index.move_to_end(key)

    def added(self, key: bytes, ns_dir: str, size: int) -> list[str]:
        """Record a written chunk; returns the files to delete to stay in capacity
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

    def clear(self) -> list[str]:
        """Forget every chunk; returns the namespace directories to delete."""
        self._index.clear()
        self.size_bytes = 0
        return [e.path for e in os.scandir(self.root) if e.is_dir()]

    def close(self) -> None:
        """Release the directory lock."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def remove_paths(paths: list[str]) -> None:
    """Delete files or directories, ignoring ones already gone."""
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _key_of(name: str) -> bytes | None:
    """The key a chunk file's name holds (None: not a chunk file name)."""
    stem = name[: -len(SUFFIX)]
    if not name.endswith(SUFFIX) or len(stem) != 64:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def _lock_directory(directory: str) -> int:
    path = os.path.join(directory, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StoreLocked(
            f"--kv-disk-dir {directory} is in use by another radixmux server (pid {other}); "
            "give each server its own directory"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd
