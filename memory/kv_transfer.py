"""The disk tier's I/O thread: copies KV between the shared arena and chunk files.

The scheduler's loop never waits on a disk: it submits jobs and polls
``fileno()`` (a pipe that gets a byte per finished job) with its other
sockets. One thread, first in first out, so the order of jobs is the order of
their effects on the arena: a save submitted before a load reads its slots
before the load can overwrite them. Copies go straight between the arena's
shared memory and the file (one gather into a buffer, one write; one read,
one scatter); torch and file I/O release the GIL, so the loop keeps running.

The arena is seen as bytes (``[blocks, layers, 2, slots_per_block, kv_heads,
head]`` with ``head = head_dim x itemsize``, a view of the head-major blocks:
``layout.py``), so any KV dtype copies the same way and no tensor dtype
crosses into numpy. A chunk file holds its tokens slot-major (``[tokens,
layers, 2, kv_heads, head]``), whatever the arena's order. On a CUDA arena the same jobs
would stage through pinned host memory; the job interface does not change.

Files are reached only through the store's ``StoreFiles`` (relative to the
store's directory, no link followed) and only chunk files are deleted.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from radixmux.memory.kv_disk_store import FATAL_ERRNOS, ChunkRef, StoreFiles
from radixmux.memory.layout import BlockGeometry, slot_major

if TYPE_CHECKING:
    # Imported where used: a scheduler without a disk tier never loads torch
    # (a second of every server start).
    import torch


@dataclass
class SaveJob:
    """Write whole chunks; ``slots[i * chunk_tokens:]`` hold chunk ``i``'s KV."""

    view: torch.Tensor
    slots: np.ndarray
    chunks: list[ChunkRef]
    ns: bytes
    chunk_tokens: int
    job_id: int = 0


@dataclass
class LoadJob:
    """Read chunks into ``slots``; the first chunk's first ``skip`` tokens are
    already in memory and are not copied."""

    view: torch.Tensor
    slots: np.ndarray
    chunks: list[ChunkRef]
    ns: bytes
    chunk_tokens: int
    skip: int = 0
    job_id: int = 0


@dataclass
class DeleteJob:
    """Delete chunk files (capacity victims); anything else under their names stays."""

    chunks: list[ChunkRef]
    job_id: int = 0


@dataclass
class ClearJob:
    """Delete every chunk file of the store (a flush); nothing else."""

    job_id: int = 0


Job = SaveJob | LoadJob | DeleteJob | ClearJob


@dataclass
class JobResult:
    """What a job did. For a load, ``tokens`` is how many leading tokens of
    ``slots`` now hold valid KV (up to the first bad chunk)."""

    job: Job
    nbytes: int = 0
    tokens: int = 0
    written: list[tuple[bytes, int]] = field(default_factory=list)  # (key, file size)
    present: list[bytes] = field(default_factory=list)  # a shared store's other instance has it
    bad: list[tuple[bytes, str]] = field(default_factory=list)  # (key, why)
    fatal: str | None = None  # the disk cannot take writes: turn the tier off


def byte_view(arena_bytes: torch.Tensor, geometry: BlockGeometry) -> torch.Tensor:
    """An arena's ``[blocks, bytes]`` seen as one pool's ``[blocks, layers, 2,
    slots_per_block, kv_heads, head bytes]`` (in words where they fit)."""
    import torch

    lay = geometry.layout
    head = lay.head_dim * lay.itemsize
    used = geometry.slots_per_block * lay.bytes_per_token
    # Wider elements make the gather and scatter several times faster.
    word = torch.int64 if head % 8 == 0 else torch.uint8
    view = arena_bytes[:, :used].view(word)
    *shape, _ = geometry.block_shape
    return slot_major(view.view(-1, *shape, head // view.element_size()))


def _token_shape(view: torch.Tensor, n: int) -> tuple[int, ...]:
    """``n`` tokens of a ``byte_view`` as a chunk holds them."""
    return (n, view.shape[1], view.shape[2], *view.shape[4:])


def _runs(slots: np.ndarray, spb: int) -> list[tuple[int, int, int, int]] | None:
    """``(block, offset, start, end)`` of each run of consecutive slots in one
    block; None when runs are too short to beat one indexed copy."""
    blocks = slots // spb
    cut = np.flatnonzero((np.diff(slots) != 1) | (np.diff(blocks) != 0)) + 1
    if len(cut) + 1 > max(1, len(slots) // 8):
        return None
    starts = [0, *cut.tolist()]
    ends = [*cut.tolist(), len(slots)]
    return [(int(blocks[s]), int(slots[s] % spb), s, e) for s, e in zip(starts, ends, strict=True)]


def gather(view: torch.Tensor, slots: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
    """KV bytes of ``slots`` as one contiguous ``[n, layers, 2, kv_heads, head]``
    tensor (into ``out`` when given).

    Allocated slots mostly come in runs inside a block: a strided copy per run
    is 2-3x faster than an indexed gather of every row."""
    import torch

    spb = view.shape[3]
    slots = np.asarray(slots, dtype=np.int64)
    runs = _runs(slots, spb)
    if runs is None:
        idx = torch.from_numpy(slots)
        rows = view[idx // spb, :, :, idx % spb]
        return rows if out is None else out.copy_(rows)
    if out is None:
        out = torch.empty(_token_shape(view, len(slots)), dtype=view.dtype)
    for block, offset, start, end in runs:
        run = view[block, :, :, offset : offset + end - start]  # [layers, 2, n, heads, head]
        out[start:end].permute(1, 2, 0, 3, 4).copy_(run)
    return out


def scatter(view: torch.Tensor, slots: np.ndarray, rows: torch.Tensor) -> None:
    """Write ``[n, layers, 2, kv_heads, head]`` bytes into ``slots`` of the arena."""
    import torch

    spb = view.shape[3]
    slots = np.asarray(slots, dtype=np.int64)
    runs = _runs(slots, spb)
    if runs is None:
        idx = torch.from_numpy(slots)
        view[idx // spb, :, :, idx % spb] = rows
        return
    for block, offset, start, end in runs:
        run = view[block, :, :, offset : offset + end - start]
        run.copy_(rows[start:end].permute(1, 2, 0, 3, 4))


class KVTransfer:
    """A FIFO of save / load / delete jobs on one store's files, run on one I/O thread."""

    def __init__(self, files: StoreFiles) -> None:
        self.files = files
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._ids = 0
        self.pending = 0
        self._staging: torch.Tensor | None = None
        self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        """Readable when a job finished (poll it with the loop's sockets)."""
        return self._wake_r

    def submit(self, job: Job) -> int:
        self._ids += 1
        job.job_id = self._ids
        self.pending += 1
        self._jobs.put(job)
        return job.job_id

    def results(self) -> list[JobResult]:
        """Finished jobs since the last call (never blocks)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.pending -= len(out)
        return out

    def wait_idle(self, timeout: float) -> list[JobResult]:
        """Results of every submitted job, waiting up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        out = self.results()
        while self.pending and time.monotonic() < deadline:
            try:
                out.append(self._done.get(timeout=min(0.1, max(0.0, deadline - time.monotonic()))))
                self.pending -= 1
            except queue.Empty:
                continue
        return out

    def close(self) -> bool:
        """Stop the thread after the jobs queued; returns whether it ended.
        A thread still stuck on a disk keeps its descriptors (the pipe, the
        store's directory): closed, their numbers could be reused by files it
        would then write to."""
        self._jobs.put(None)
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            return False
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        return True

    # ---- the I/O thread ----------------------------------------------------------
    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            result = JobResult(job)
            try:
                if isinstance(job, SaveJob):
                    self._save(job, result)
                elif isinstance(job, LoadJob):
                    self._load(job, result)
                elif isinstance(job, DeleteJob):
                    for chunk in job.chunks:
                        self.files.remove(chunk)
                else:
                    self.files.clear()
            except Exception as exc:  # never lose a job's answer: the loop waits on it
                result.fatal = result.fatal or f"{type(exc).__name__}: {exc}"
            self._done.put(result)
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")

    def _save(self, job: SaveJob, result: JobResult) -> None:
        c = job.chunk_tokens
        # One chunk at a time through a small reused buffer: it stays in
        # cache between the gather, the checksum and the write.
        rows = self._rows(job.view, c)
        for i, chunk in enumerate(job.chunks):
            if self.files.shared and self.files.has(chunk):
                result.present.append(chunk.key)  # another instance wrote it
                continue
            gather(job.view, job.slots[i * c : (i + 1) * c], out=rows)
            payload = memoryview(rows.numpy()).cast("B")
            try:
                size = self.files.write(chunk, job.ns, c, payload)
            except OSError as exc:
                if exc.errno in FATAL_ERRNOS:
                    result.fatal = f"{self.files.path(chunk)}: {exc.strerror}"
                    return
                result.bad.append((chunk.key, str(exc)))
                continue
            if size is None:  # another instance published it first
                result.present.append(chunk.key)
                continue
            result.written.append((chunk.key, size))
            result.nbytes += size

    def _load(self, job: LoadJob, result: JobResult) -> None:
        c = job.chunk_tokens
        done = 0  # slots filled so far
        rows = self._rows(job.view, c)
        for i, chunk in enumerate(job.chunks):
            # touch: a sound file's mtime is its recency across a restart.
            out = memoryview(rows.numpy()).cast("B")
            why = self.files.read(chunk, job.ns, c, out, touch=True)
            if why is not None:
                result.bad.append((chunk.key, why))
                with contextlib.suppress(OSError):
                    self.files.remove(chunk)  # a chunk file only: a link there stays
                break
            first = job.skip if i == 0 else 0
            scatter(job.view, job.slots[done : done + c - first], rows[first:])
            done += c - first
            result.nbytes += rows.numel() * rows.element_size()
        result.tokens = done

    def _rows(self, view: torch.Tensor, n: int) -> torch.Tensor:
        """The reused ``[n, layers, 2, kv_heads, head]`` staging buffer (a
        fresh one per chunk would page-fault every byte)."""
        import torch

        shape = _token_shape(view, n)
        if (
            self._staging is None
            or self._staging.shape != shape
            or self._staging.dtype != view.dtype
        ):
            self._staging = torch.empty(shape, dtype=view.dtype)
        return self._staging
