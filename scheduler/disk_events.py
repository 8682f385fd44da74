"""KV events of the disk tier: which chunks are on disk, as tree events of the
``disk`` tier (published with vLLM's medium ``STORAGE``).

The disk store knows chunks by key only; this remembers, for each chunk
saved while KV events are on, its pool, the token path it ends and where it
starts, so its save and its removal (capacity, a failed read, a flush) can be
reported by tokens like the tree's own events. Chunks found on disk at start
(a previous run's) have no known tokens and are not reported.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from radixmux.memory.radix_cache import RadixCache
from radixmux.memory.tree_events import TreeEventKind, TreeEventLog


@dataclass(frozen=True)
class _Chunk:
    pool: str
    tokens: bytes  # the whole path its save wrote from (shared by its chunks)
    start: int  # first token of the chunk
    end: int
    # The pool's models when the save was queued: a model unloaded since
    # (its KV saved as it went) is still the one the chunk is for.
    models: tuple[str, ...]


class DiskEvents:
    """Report disk chunks into the tree's event log (``cache.events``)."""

    def __init__(self, cache: RadixCache, log: TreeEventLog, chunk_tokens: int) -> None:
        self.cache = cache
        self.log = log
        self.chunk = chunk_tokens
        self._queued: dict[bytes, _Chunk] = {}
        self._on_disk: dict[bytes, _Chunk] = {}

    def queued(self, pool: str, tokens: bytes, keys: list[bytes], indices: list[int]) -> None:
        """Chunks ``indices`` of ``tokens`` (keys ``keys``) are being saved."""
        c = self.chunk
        models = self._models(pool)
        for key, i in zip(keys, indices, strict=True):
            self._queued[key] = _Chunk(pool, tokens, i * c, (i + 1) * c, models)

    def written(self, keys: Iterable[bytes]) -> None:
        """These chunks are on disk now."""
        for key in keys:
            chunk = self._queued.pop(key, None)
            if chunk is not None and key not in self._on_disk:
                self._on_disk[key] = chunk
                self._add("stored", chunk)

    def failed(self, keys: Iterable[bytes]) -> None:
        """These chunks' saves failed: nothing was stored."""
        for key in keys:
            self._queued.pop(key, None)

    def dropped(self, keys: Iterable[bytes]) -> None:
        """These chunks left the disk (capacity, a bad read)."""
        for key in keys:
            chunk = self._on_disk.pop(key, None)
            if chunk is not None:
                self._add("removed", chunk)

    def cleared(self) -> None:
        """Every chunk left the disk (``/flush_cache``)."""
        self.dropped(list(self._on_disk))

    def _models(self, pool: str) -> tuple[str, ...]:
        return tuple(sorted(m for m in self.cache.models if self.cache.pool_of(m) == pool))

    def _add(self, kind: TreeEventKind, chunk: _Chunk) -> None:
        models = self._models(chunk.pool) or chunk.models
        self.log.add(kind, models, chunk.tokens[: chunk.end * 4], chunk.start, tier="disk")
