"""The disk tier under the arena: KV spilled to chunk files and loaded back.

The scheduler's side of ``memory/kv_disk_store`` (the files and their index)
and ``memory/kv_transfer`` (the I/O thread). It decides what goes to disk and
when a request loads instead of recomputing:

- **write-back** (default): a capacity eviction hands the evicted entry's whole
  chunks to the I/O thread before the slots are reused. The tree frees the
  slots at once (so eviction and admission are unchanged); the physical bytes
  stay intact until a forward pass writes them, so a batch that would write a
  block a pending save still reads is held back until that save finishes
  (``holds_back``). A graceful stop first saves what the arena holds.
- **write-through**: every chunk inserted into the tree is saved at once,
  its path locked in the tree while the I/O thread reads it.
- **unload**: a model unloaded while no other model shares its KV has its
  cache saved the same way as a capacity eviction (``save_unloaded``: most
  recently used paths first, at most the store's capacity), so the next load
  of the same weights loads its prompts' prefixes back.
- **loading**: at admission, beyond the in-memory match, the hash chain of the
  prompt's next chunks is looked up in the index. When the chunks found cover
  at least ``min_load_tokens``, the request gets slots for them, leaves the
  waiting queue while the I/O thread fills them, then is inserted into the
  tree and goes back first in the queue, where its next lookup matches the
  loaded prefix in memory and prefills only the rest. A bad file stops the
  load at that chunk (it is deleted and recomputed, never used).

A disk that is full or read-only turns the tier off with one log line; the
server keeps serving from memory.

In a shared store (``--kv-disk-shared``) a lookup past this instance's own
index looks for the chunk's file by name (one ``stat``, a few microseconds):
chunks other instances wrote after this one started load like its own.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from radixmux.memory.arena import KVArena
from radixmux.memory.kv_disk_store import (
    DiskKVStore,
    check_settings,
    chunk_keys,
    file_bytes,
    namespace,
    namespace_dir,
)
from radixmux.memory.kv_transfer import (
    ChunkRef,
    ClearJob,
    DeleteJob,
    JobResult,
    KVTransfer,
    LoadJob,
    SaveJob,
    byte_view,
)
from radixmux.memory.radix_cache import CacheHandle, RadixCache
from radixmux.protocol import DiskTierStats
from radixmux.scheduler.disk_events import DiskEvents
from radixmux.scheduler.request import Req

if TYPE_CHECKING:  # the scheduler process never imports torch (start-up time)
    import torch

log = logging.getLogger("radixmux.scheduler")

# How long a graceful stop may spend saving the arena (the launcher waits 10 s).
FLUSH_SECONDS = 8.0
# Why a chunk was saved: a capacity eviction spilled it, its model was
# unloaded, write-through saved it on insert, a graceful stop saved the arena.
SAVE_REASONS = ("capacity", "unload", "write_through", "shutdown")


@dataclass(frozen=True)
class _Namespace:
    ns: bytes
    ns_dir: str
    view: torch.Tensor  # the arena's bytes in this pool's layout


@dataclass(frozen=True)
class GroupLoad:
    """A lower layer group's part of a load (scheduler/layer_groups.py): its
    chunks for positions ``[start, end)``, where it holds the prompt up to
    ``start`` (past the top group's when it holds more)."""

    index: int  # which of ``Req.lower``
    chunks: list[ChunkRef]
    start: int
    skip: int  # tokens of its first chunk already in memory
    end: int


@dataclass(frozen=True)
class LoadPlan:
    """Chunks a request can load: positions ``[start, end)`` after its memory
    match (its own layers'; none when only lower groups load), and what each
    lower layer group loads with them."""

    chunks: list[ChunkRef]
    start: int
    end: int
    skip: int  # tokens of the first chunk already in memory
    lower: list[GroupLoad] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.end - self.start

    def lower_ends(self, groups: int) -> list[int]:
        """Per lower group of the request (``groups`` of them), how far it
        holds the prompt once loaded (0: it loads nothing)."""
        ends = [0] * groups
        for g in self.lower:
            ends[g.index] = g.end
        return ends


@dataclass
class _Loading:
    """One request's load: its jobs (one per layer group that loads) end
    before it does. ``ends`` holds, per layer group (the lower ones in
    ``Req.lower``'s order, then the top one), how far it holds the prompt
    once its job is done (what was planned, cut where a job stopped short)."""

    req: Req
    t0: float
    jobs: int
    start: int  # the request's kv_len when the load began
    ends: list[int]
    bad: str | None = None  # why a job stopped at a bad chunk


@dataclass
class _Load:
    """One load job: a layer group's chunks for a request."""

    loading: _Loading
    chunks: list[ChunkRef]
    start: int
    group: int  # index into ``_Loading.ends``


def _group_starts(req: Req) -> list[int]:
    """Where each layer group of ``req`` holds its prompt up to (its lower
    groups in ``Req.lower``'s order, then its own): a load starts there."""
    return [*(max(req.kv_len, p.handle.length) for p in req.lower), req.kv_len]


class DiskTier:
    """Spill, load and flush for one radix cache over one arena."""

    def __init__(
        self,
        cache: RadixCache,
        arena: KVArena,
        store: DiskKVStore,
        chunk_tokens: int,
        write_policy: str = "write_back",
        min_load_tokens: int = 0,
    ) -> None:
        check_settings(chunk_tokens, cache.page_size, write_policy)
        self.cache = cache
        self.arena = arena
        self.store = store
        self.chunk = chunk_tokens
        self.write_policy = write_policy
        self.min_load_tokens = max(min_load_tokens, chunk_tokens)
        assert store.files is not None, "the store is closed"
        self.transfer = KVTransfer(store.files)
        self.disabled: str | None = None
        self._spaces: dict[str, _Namespace] = {}
        self._reading: dict[int, np.ndarray] = {}  # save job -> arena blocks it reads
        self._job_reason: dict[int, str] = {}  # save job -> why it was made
        self._through_locks: dict[int, CacheHandle] = {}
        self._queued: set[bytes] = set()  # keys in save jobs not finished yet
        self._loading_keys: collections.Counter[bytes] = collections.Counter()
        self.loading: dict[int, _Load] = {}
        self.bytes_written = self.bytes_read = self.chunks_written = self.chunks_dropped = 0
        # Chunks written by why their save was made (SAVE_REASONS).
        self.chunks_saved: collections.Counter[str] = collections.Counter()
        self.write_errors = 0
        self.loads = 0
        self.chunks_loaded = self.chunks_shared = 0
        self.load_seconds = 0.0
        self._latencies: collections.deque[float] = collections.deque(maxlen=1024)
        self.tokens_loaded: collections.Counter[str] = collections.Counter()
        self.events: DiskEvents | None = None  # set while KV events are published
        if write_policy == "write_back":
            cache.on_evict = self._spill
        sharing = ""
        if store.shared:
            sharing = " (shared, alone at start)" if store.alone else " (shared, joined)"
        log.info(
            "disk tier: %s%s, %d chunks (%.1f MB of %.1f MB) found, %s, %d-token chunks",
            store.directory,
            sharing,
            len(store),
            store.size_bytes / 1e6,
            store.capacity_bytes / 1e6,
            write_policy,
            chunk_tokens,
        )

    # ---- namespaces ----------------------------------------------------------------
    def _space(self, pool: str) -> _Namespace:
        space = self._spaces.get(pool)
        if space is None:
            geometry = self.cache.allocator.geometry(pool)
            ns = namespace(pool, geometry.layout, self.chunk)
            space = _Namespace(ns, namespace_dir(ns), byte_view(self.arena.bytes, geometry))
            self._spaces[pool] = space
        return space

    def _refs(self, space: _Namespace, keys: list[bytes]) -> list[ChunkRef]:
        return [ChunkRef(k, space.ns_dir) for k in keys]

    # ---- saving ----------------------------------------------------------------------
    def _save(
        self,
        pool: str,
        tokens: bytes,
        slots: np.ndarray,
        reason: str,
        first: int = 0,
        limit: int | None = None,
        hold: bool = False,
    ) -> tuple[int | None, int]:
        """Submit the chunks of ``tokens`` from chunk ``first`` on that the store
        lacks (no more than ``limit``, first ones first: a load needs the chain
        from the start). With ``hold`` the arena blocks the job reads are held
        back from batches until it has read them (their slots are freed now).
        Returns the job id (None when there was nothing to save) and its chunks."""
        if self.disabled:
            return None, 0
        c = self.chunk
        space = self._space(pool)
        keys = chunk_keys(space.ns, tokens, c)
        todo = [
            i
            for i in range(first, len(keys))
            if keys[i] not in self.store and keys[i] not in self._queued
        ][:limit]
        if not todo:
            return None, 0
        chunk_slots = np.concatenate([slots[i * c : (i + 1) * c] for i in todo])
        chosen = [keys[i] for i in todo]
        self._queued.update(chosen)
        if self.events is not None:
            self.events.queued(pool, tokens, chosen, todo)
        job = self.transfer.submit(
            SaveJob(space.view, chunk_slots, self._refs(space, chosen), space.ns, c)
        )
        self._job_reason[job] = reason
        if hold:
            self._reading[job] = np.unique(self.cache.allocator.block_of(pool, chunk_slots))
        return job, len(todo)

    def _spill(self, pool: str, tokens: bytes, slots: np.ndarray, start: int) -> None:
        """The tree is about to free ``slots[start:]``: save the chunks ending there."""
        self._save(pool, tokens, slots, "capacity", start // self.chunk, hold=True)

    def save_unloaded(self, model: str) -> int:
        """``model`` is being unloaded and its cache entries are about to be
        freed: save the chunks of them the store lacks, so that a reload of
        the same weights (same KV-share key, same chunk keys) loads its
        prefixes instead of computing them. Most recently used paths go first,
        and no more than the store's capacity holds (more would only push out
        what this save just wrote); the blocks are held back from batches until
        the I/O thread has read them, as for an eviction's spill, so the unload
        itself never waits on the disk. Returns the chunks queued."""
        if self.disabled:
            return 0
        paths = self.cache.unload_paths(model)
        if not paths:  # nothing cached, or an alias keeps the generation
            return 0
        pool = self.cache.pool_of(model)
        space = self._space(pool)
        payload = self.chunk * self.cache.model(model).layout.bytes_per_token
        budget = self.store.capacity_bytes // file_bytes(space.ns, payload)
        queued = 0
        for tokens, slots in paths:
            if queued >= budget:
                break
            queued += self._save(pool, tokens, slots, "unload", limit=budget - queued, hold=True)[1]
        log.info(
            "disk tier: model %s unloaded: saving %d chunks of its cache (%d paths)",
            model,
            queued,
            len(paths),
        )
        return queued

    def inserted(self, model: str, tokens: np.ndarray) -> None:
        """Write-through: save the whole chunks of a just-inserted prefix, its
        path locked in the tree until the I/O thread has read it."""
        if self.write_policy != "write_through" or self.disabled:
            return
        n = len(tokens) // self.chunk * self.chunk
        if not n:
            return
        m = self.cache.match(model, tokens[:n], record=False)
        if m.length < n:  # invalidated meanwhile: nothing of it is cached any more
            return
        self.cache.lock(m.handle)
        pool = self.cache.pool_of(model)
        job, _ = self._save(pool, tokens[:n].tobytes(), m.slots, "write_through")
        if job is None:
            self.cache.unlock(m.handle)
        else:
            self._through_locks[job] = m.handle

    def holds_back(self, pool: str, written: np.ndarray) -> bool:
        """Whether writing ``written`` slots of ``pool`` now would overwrite KV a
        pending save still has to read (the batch must wait for it)."""
        if not self._reading or not len(written):
            return False
        blocks = np.unique(self.cache.allocator.block_of(pool, written))
        return any(
            np.isin(blocks, busy, assume_unique=True).any() for busy in self._reading.values()
        )

    @property
    def locks(self) -> list[CacheHandle]:
        """Tree locks the tier holds (write-through saves and loads in flight)."""
        return [
            *self._through_locks.values(),
            *(
                h
                for req in self.loading_requests()
                for h in (req.handle, *(p.handle for p in req.lower))
                if h
            ),
        ]

    def loading_requests(self, started_before: float | None = None) -> list[Req]:
        """Requests with a load in flight, each once (a load may be several
        jobs); with ``started_before`` (``time.monotonic()``), only loads
        started before then."""
        loads = {
            id(ld.loading.req): ld.loading.req
            for ld in self.loading.values()
            if started_before is None or ld.loading.t0 < started_before
        }
        return list(loads.values())

    # ---- loading ---------------------------------------------------------------------
    def plan_load(self, req: Req, partial: bool = False) -> LoadPlan | str | None:
        """What of ``req``'s prompt past its memory match (``req.kv_len``) is on
        disk: a plan, ``"wait"`` when another request is loading those chunks
        right now, or None (load nothing).

        A model cut into layer groups loads each group from where it holds
        the prompt. With ``partial`` (its runner restarts the upper layers
        from a lower group's stored hidden states, ``ModelGroups.restart``)
        each lower group loads as far as it has chunks on disk and the top
        group as far as every group will then hold the prompt: where a
        sibling's prompt was spilled, the lower groups come back alone and
        the request is a partial hit (only its own layers computed).
        Otherwise every group loads as far as every group has the chunks
        (the lookup would cut a lower group back to that anyway)."""
        if self.disabled:
            return None
        c = self.chunk
        limit = (req.num_tokens - 1) // c  # whole chunks, leaving a token to compute
        if req.kv_len // c >= limit:
            return None
        names = [*(p.name for p in req.lower), req.model]
        starts = _group_starts(req)
        runs: list[list[ChunkRef]] = []
        reach: list[int] = []  # per group: how far it would hold the prompt after its run
        for name, start in zip(names, starts, strict=True):
            run = self._run(name, req, start // c, limit)
            if run == "wait":
                return "wait"
            assert not isinstance(run, str)
            runs.append(run)
            reach.append(max(start, (start // c + len(run)) * c))
        # Every group holds the prompt this far after the load (whole chunks).
        common = min(reach) // c * c
        if partial:
            ends = [*reach[:-1], max(req.kv_len, common)]
        else:
            ends = [max(start, common) for start in starts]
        if max(e - s for e, s in zip(ends, starts, strict=True)) < self.min_load_tokens:
            return None
        parts = [
            (run[: end // c - start // c], start, start - start // c * c, end)
            for run, start, end in zip(runs, starts, ends, strict=True)
        ]
        *lower_parts, (top_chunks, start, skip, end) = parts
        lower = [
            GroupLoad(i, chunks, start, skip, end)
            for i, (chunks, start, skip, end) in enumerate(lower_parts)
            if end > start
        ]
        return LoadPlan(top_chunks, start, end, skip, lower)

    def _run(self, name: str, req: Req, first: int, limit: int) -> list[ChunkRef] | str:
        """The chunks of ``req``'s prompt in ``name``'s namespace from chunk
        ``first`` on that the store has, in a row (``"wait"``: the first is
        being loaded by another request)."""
        space = self._space(self.cache.pool_of(name))
        if first >= limit:
            return []
        keys = chunk_keys(space.ns, req.tokens[: limit * self.chunk].tobytes(), self.chunk)
        run: list[ChunkRef] = []
        for key in keys[first:]:
            if self._loading_keys[key]:
                return run or "wait"
            ref = ChunkRef(key, space.ns_dir)
            if not self.store.has(ref):
                break
            run.append(ref)
        return run

    def start_load(self, req: Req, plan: LoadPlan) -> None:
        """Fill ``req.slots[plan.start:plan.end]`` and each loading lower
        layer group's slots over its own positions (all reserved) from disk:
        one I/O job per group that loads."""
        top = len(req.lower)
        starts = _group_starts(req)
        loading = _Loading(req, time.monotonic(), 0, req.kv_len, starts)
        parts = [(top, req.model, req.slots, plan.chunks, plan.start, plan.end, plan.skip)]
        for g in plan.lower:
            part = req.lower[g.index]
            parts.append((g.index, part.name, part.slots, g.chunks, g.start, g.end, g.skip))
        for group, name, slots, chunks, start, end, skip in parts:
            if end <= start:
                continue
            space = self._space(self.cache.pool_of(name))
            job = LoadJob(space.view, slots[start:end], chunks, space.ns, self.chunk, skip=skip)
            self._loading_keys.update(ch.key for ch in chunks)
            for ch in chunks:
                self.store.touch(ch.key)
            self.chunks_loaded += len(chunks)
            self.chunks_shared += sum(ch.key not in self.store for ch in chunks)
            loading.jobs += 1
            loading.ends[group] = end
            self.loading[self.transfer.submit(job)] = _Load(loading, chunks, start, group)
        log.info(
            "rid=%s loading %d tokens (%d-%d) from disk%s",
            req.rid,
            plan.tokens,
            plan.start,
            plan.end,
            "".join(f", {req.lower[g.index].name} {g.start}-{g.end}" for g in plan.lower),
        )

    def is_loading(self, req: Req) -> bool:
        return any(ld.loading.req is req for ld in self.loading.values())

    # ---- completions -----------------------------------------------------------------
    def fileno(self) -> int:
        return self.transfer.fileno()

    def poll(self, wait: float = 0.0) -> list[Req]:
        """Handle finished jobs (after waiting up to ``wait`` seconds for every
        pending one); returns requests whose load ended (their ``kv_len`` now
        covers what was loaded)."""
        loaded = []
        results = self.transfer.wait_idle(wait) if wait else self.transfer.results()
        for result in results:
            req = self._finished(result)
            if req is not None:
                loaded.append(req)
        return loaded

    def _finished(self, result: JobResult) -> Req | None:
        job = result.job
        if result.fatal:
            self._disable(result.fatal)
        if isinstance(job, SaveJob):
            for key, why in result.bad:
                self.write_errors += 1
                log.warning("disk tier: could not save chunk %s: %s", key.hex()[:16], why)
            if self.events is not None:
                self.events.failed(key for key, _ in result.bad)
                self.events.failed(result.present)  # another instance's file, not ours
                self.events.written(key for key, _ in result.written)
            self._reading.pop(job.job_id, None)
            handle = self._through_locks.pop(job.job_id, None)
            if handle is not None:
                self.cache.unlock(handle)
            self._queued.difference_update(ch.key for ch in job.chunks)
            ns_dir = namespace_dir(job.ns)
            victims = []
            for key, size in result.written:
                victims += self.store.added(key, ns_dir, size)
            if victims:
                self.transfer.submit(DeleteJob(victims))
                if self.events is not None:
                    self.events.dropped(v.key for v in victims)
            self.bytes_written += result.nbytes
            self.chunks_written += len(result.written)
            self.chunks_saved[self._job_reason.pop(job.job_id)] += len(result.written)
            return None
        if isinstance(job, LoadJob):
            for key, why in result.bad:
                self.chunks_dropped += 1
                self.store.discard(key)
                path = self.store.path(namespace_dir(job.ns), key)
                log.warning("disk tier: dropped chunk %s (%s)", path, why)
                if self.events is not None:
                    self.events.dropped([key])
            load = self.loading.pop(job.job_id)
            for ch in load.chunks:
                self._loading_keys[ch.key] -= 1
                if not self._loading_keys[ch.key]:
                    del self._loading_keys[ch.key]
            self.bytes_read += result.nbytes
            loading = load.loading
            loading.ends[load.group] = min(loading.ends[load.group], load.start + result.tokens)
            if result.bad and loading.bad is None:
                loading.bad = result.bad[0][1]
            loading.jobs -= 1
            if loading.jobs:
                return None
            return self._loaded(loading)
        return None

    def _loaded(self, loading: _Loading) -> Req:
        """Every job of a load ended: the request holds the prompt in its own
        layers as far as every group got (a lower group may hold more: a
        partial hit), and each lower group as far as its own job got."""
        req = loading.req
        *lower, _ = loading.ends
        req.kv_len = max(req.kv_len, min(loading.ends))
        for part, end in zip(req.lower, lower, strict=True):
            part.loaded = end
        seconds = time.monotonic() - loading.t0
        own = req.kv_len - loading.start  # tokens of its own layers that came from disk
        self.loads += 1
        if own:  # a load of lower groups alone brought none of its own layers
            self.tokens_loaded[req.model] += own
        self.load_seconds += seconds
        self._latencies.append(seconds)
        log.info(
            "rid=%s loaded %d tokens from disk in %.1f ms%s%s",
            req.rid,
            own,
            seconds * 1e3,
            "".join(
                f", {p.name} to {end}"
                for p, end in zip(req.lower, lower, strict=True)
                if end > req.kv_len
            ),
            f" (stopped at a bad chunk: {loading.bad})" if loading.bad else "",
        )
        return req

    def turn_off(self, why: str) -> None:
        """Stop all new disk I/O (the scheduler saw the disk hang). Blocks a
        save still reads stay held back until it ends, if it ever does."""
        self._disable(why)

    def _disable(self, why: str) -> None:
        if self.disabled is None:
            self.disabled = why
            self.cache.on_evict = None
            log.error("disk tier off (serving from memory only): %s", why)

    # ---- whole-store operations --------------------------------------------------------
    def clear(self) -> None:
        """Forget and delete every chunk (``flush_cache``); the I/O thread
        deletes only chunk files, never anything else in the directory."""
        own = self.store.clear()
        # A shared directory's other chunks are other instances' to delete.
        self.transfer.submit(DeleteJob(own) if self.store.shared else ClearJob())
        if self.events is not None:
            self.events.cleared()

    def close(self, flush: bool) -> None:
        """Stop the I/O thread; with ``flush`` (a graceful stop under write-back)
        first save every chunk the tree holds that the store lacks."""
        if flush and not self.disabled and self.write_policy == "write_back":
            t0 = time.monotonic()
            for pool, tokens, slots in self.cache.cached_paths():
                self._save(pool, tokens, slots, "shutdown")
            self.poll(wait=FLUSH_SECONDS)
            log.info(
                "disk tier: saved the arena in %.1f s (%d chunks, %.1f MB in the store)",
                time.monotonic() - t0,
                len(self.store),
                self.store.size_bytes / 1e6,
            )
        else:
            self.poll(wait=FLUSH_SECONDS)
        if self.transfer.close():
            self.store.close()
        else:
            log.warning("disk tier: the I/O thread is stuck on the disk; left running at exit")
            self.store.close(keep_files=True)

    def stats(self) -> DiskTierStats:
        lat = sorted(self._latencies)
        return DiskTierStats(
            enabled=self.disabled is None,
            write_policy=self.write_policy,
            disabled_reason=self.disabled,
            store_bytes=self.store.size_bytes,
            store_chunks=len(self.store),
            capacity_bytes=self.store.capacity_bytes,
            bytes_written=self.bytes_written,
            bytes_read=self.bytes_read,
            chunks_written=self.chunks_written,
            chunks_saved={r: self.chunks_saved[r] for r in SAVE_REASONS},
            chunks_dropped=self.chunks_dropped,
            write_errors=self.write_errors,
            loads=self.loads,
            load_seconds=self.load_seconds,
            load_p50_s=lat[len(lat) // 2] if lat else 0.0,
            load_p99_s=lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0,
            tokens_loaded=dict(self.tokens_loaded),
            chunks_loaded=self.chunks_loaded,
            chunks_shared=self.chunks_shared,
            shared=self.store.shared,
        )
