"""vLLM's KV event wire format and block hashes, as vLLM 0.32.0 has them.

``vllm/distributed/kv_events.py`` and ``vllm/v1/core/kv_cache_utils.py`` of
vLLM 0.32.0, field for field (docs/kv-events.md: the layouts of other versions):
a batch encodes to the bytes vLLM's own structs give it. Read for the layout;
the code is radixmux's.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from typing import Any

import msgspec
import numpy as np

# vLLM's media: the arena is what vLLM calls "GPU" (its primary KV cache, whatever
# the device), the disk tier what it calls "STORAGE".
MEDIUM_GPU = "GPU"
MEDIUM_STORAGE = "STORAGE"
MEDIUM_OF_TIER = {"arena": MEDIUM_GPU, "disk": MEDIUM_STORAGE}
# The seed of the first block's parent hash when PYTHONHASHSEED is unset (vLLM's
# DEFAULT_NONE_HASH_SEED for its default, cryptographic hash).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


# ---- the wire format (vLLM 0.32 / 0.33 layout) --------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One batch: the array ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event: a msgpack map whose ``type`` key names its class."""


class BlockStored(KVCacheEvent):
    """Consecutive full pages of one model entered the cache."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    """Pages left the cache (their hashes name the model)."""

    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Forget everything this publisher reported before."""


# ---- block hashes ----------------------------------------------------------------------
def _sha256(value: object) -> bytes:
    """vLLM's default ``sha256``: SHA-256 of the highest-protocol pickle."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


class BlockHasher:
    """vLLM's chained block hash, ``sha256((parent, block token ids, None))``
    (None: no extra keys, as for a request without LoRA, multimodal input or
    cache salt). The first block's parent is ``sha256(seed)``, the seed being
    PYTHONHASHSEED, else vLLM's fixed default. Published as the low 64 bits of
    the big-endian digest (vLLM's default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
    or as the 32 raw bytes when that variable is 0."""

    CACHE_ENTRIES = 4096

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.none_hash = _sha256(os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED))
        self.as_int = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"
        # (prefix length, prefix digest) -> the hash of the prefix's last page,
        # so a store extending a path already hashed starts from there.
        self._chain: OrderedDict[tuple[int, bytes], bytes] = OrderedDict()

    def external(self, digest: bytes) -> int | bytes:
        return int.from_bytes(digest, "big") & ((1 << 64) - 1) if self.as_int else digest

    def hashes(self, tokens: bytes, start: int) -> tuple[bytes | None, list[bytes]]:
        """The parent hash of page ``start`` (None at the root) and the hashes of
        the pages from ``start`` to the end of ``tokens`` (packed int32)."""
        ids = np.frombuffer(tokens, dtype=np.int32).tolist()
        parent = self._cached(tokens, start) if start else None
        # Unknown parent: hash the path from the root.
        first = 0 if start and parent is None else start
        prev = parent
        out: list[bytes] = []
        size = self.page_size
        for pos in range(first, len(ids), size):
            block = _sha256((prev or self.none_hash, tuple(ids[pos : pos + size]), None))
            if pos >= start:
                out.append(block)
            elif pos + size == start:
                parent = block
            prev = block
        if out:
            self._remember(tokens, len(ids), out[-1])
        return parent, out

    def _key(self, tokens: bytes, length: int) -> tuple[int, bytes]:
        return length, hashlib.blake2b(tokens[: length * 4], digest_size=16).digest()

    def _cached(self, tokens: bytes, length: int) -> bytes | None:
        key = self._key(tokens, length)
        found = self._chain.get(key)
        if found is not None:
            self._chain.move_to_end(key)
        return found

    def _remember(self, tokens: bytes, length: int, block: bytes) -> None:
        self._chain[self._key(tokens, length)] = block
        if len(self._chain) > self.CACHE_ENTRIES:
            self._chain.popitem(last=False)


VLLMEvent = BlockStored | BlockRemoved | AllBlocksCleared
