"""The logical side of the KV arena: blocks, pages and slots, owned by the scheduler.

The arena is ``num_blocks`` blocks of ``block_bytes`` each. A block is free
(on the global free list) or owned by exactly one *pool*; a pool is the KV of
one set of identical weights (the KV-share key), so replicas of a model share
a pool. An owned block is carved into whole pages of that pool's token slots
(see ``BlockGeometry``). The allocator hands out and takes back whole pages;
when the last page of a block is freed the block goes back to the global
free list, so memory moves to whichever model is hot.

Everything here is metadata: no tensor is touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from radixmux.memory.layout import BlockGeometry, KVLayout
from radixmux.memory.page_bitmap import DUPLICATE, NOT_IN_USE, PageRows, ReleaseError, make_rows

SlotArray = np.ndarray  # 1-D int64 slot ids of one pool


@dataclass
class _Pool:
    key: str
    geometry: BlockGeometry
    floor_blocks: int
    cap_blocks: int
    rows: PageRows  # the page bitmap and its bulk operations
    blocks: set[int] = field(default_factory=set)
    # Free pages of the owned blocks that have any, by block, so an alloc
    # never walks past full blocks: how many, in dict order of when the block
    # last got one (alloc takes blocks in this order). Which pages are free
    # is ``page_used`` itself: a bitmap row per block (``page_bitmap``).
    free_pages: dict[int, int] = field(default_factory=dict)
    free_page_count: int = 0
    pages_per_block: int = 0  # geometry.pages_per_block, kept (a property chain)

    @property
    def page_used(self) -> np.ndarray:
        return self.rows.used


@dataclass(frozen=True)
class PoolUsage:
    """Memory one pool holds right now."""

    key: str
    blocks: int
    used_slots: int
    free_slots_in_blocks: int  # stranded in partly used blocks: fragmentation
    bytes_per_token: int
    slots_per_block: int

    @property
    def used_bytes(self) -> int:
        return self.used_slots * self.bytes_per_token


@dataclass(frozen=True)
class ArenaUsage:
    """Memory of the whole arena right now."""

    num_blocks: int
    block_bytes: int
    free_blocks: int
    pools: dict[str, PoolUsage]

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def fragmented_slots(self) -> int:
        return sum(p.free_slots_in_blocks for p in self.pools.values())

    @property
    def fragmented_bytes(self) -> int:
        return sum(p.free_slots_in_blocks * p.bytes_per_token for p in self.pools.values())


class KVAllocator:
    """Allocates token slots for pools out of one arena's blocks.

    ``alloc`` returns ``None`` when there is no room, so the caller can evict
    and retry. Requests are rounded up to whole pages (``page_size`` slots).
    Per pool, an optional floor (bytes other pools may not take from it) and
    cap (bytes it may not exceed) keep a cold model warm and a hot one bounded.
    """

    def __init__(
        self, num_blocks: int, block_bytes: int, page_size: int = 1, native: bool | None = None
    ) -> None:
        if num_blocks <= 0 or block_bytes <= 0 or page_size <= 0:
            raise ValueError("num_blocks, block_bytes and page_size must be positive")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.page_size = page_size
        self._native = native  # page_bitmap.make_rows: None picks the C version where it loads
        self._free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self._block_owner: list[str | None] = [None] * num_blocks
        self._block_used = np.zeros(num_blocks, dtype=np.int64)  # pages used by owner
        self._pools: dict[str, _Pool] = {}
        self._floors = False  # any pool with a floor (else no block is reserved for one)

    # ---- pools -------------------------------------------------------------
    def register(
        self,
        key: str,
        layout: KVLayout,
        floor_bytes: int = 0,
        cap_bytes: int | None = None,
    ) -> BlockGeometry:
        """Add a pool (idempotent for the same layout); returns its geometry."""
        geometry = BlockGeometry(layout, self.block_bytes, self.page_size)
        geometry.check()
        if key in self._pools:
            if self._pools[key].geometry != geometry:
                raise ValueError(f"pool {key!r} already registered with another layout")
            return geometry
        floor_blocks = math.ceil(floor_bytes / self.block_bytes)
        cap_blocks = self.num_blocks if cap_bytes is None else cap_bytes // self.block_bytes
        if cap_blocks < floor_blocks:
            raise ValueError(f"pool {key!r}: cap is below floor")
        reserved = sum(p.floor_blocks for p in self._pools.values()) + floor_blocks
        if reserved > self.num_blocks:
            raise ValueError(f"pool floors need {reserved} blocks; the arena has {self.num_blocks}")
        ppb = geometry.pages_per_block
        self._pools[key] = _Pool(
            key,
            geometry,
            floor_blocks,
            cap_blocks,
            make_rows(self.num_blocks, ppb, self._block_used, self._native),
            pages_per_block=ppb,
        )
        self._floors = self._floors or floor_blocks > 0
        return geometry

    def geometry(self, key: str) -> BlockGeometry:
        return self._pool(key).geometry

    def _pool(self, key: str) -> _Pool:
        try:
            return self._pools[key]
        except KeyError:
            raise KeyError(f"unknown KV pool {key!r}") from None

    # ---- allocation --------------------------------------------------------
    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def _blocks_available(self, pool: _Pool, donor: _Pool | None = None) -> int:
        """Free blocks this pool may take: respects its cap and others' floors.

        With ``donor``: as if one of the donor's blocks were free too.
        """
        owned = len(pool.blocks)
        reserved_for_others = 0
        if self._floors:  # with no floor anywhere every term below is 0
            reserved_for_others = sum(
                max(0, p.floor_blocks - len(p.blocks) + (p is donor))
                for p in self._pools.values()
                if p is not pool
            )
        by_global = len(self._free_blocks) + (donor is not None) - reserved_for_others
        return max(0, min(by_global, pool.cap_blocks - owned))

    def may_grow(self, key: str) -> bool:
        """Whether the pool is below its cap (a block freed elsewhere could become its)."""
        pool = self._pool(key)
        return len(pool.blocks) < pool.cap_blocks

    def gains_block(self, key: str, donor: str) -> bool:
        """Whether emptying one of ``donor``'s blocks would let pool ``key`` take
        one more block (not if its cap or ``donor``'s floor keeps it)."""
        pool = self._pool(key)
        return self._blocks_available(pool, self._pool(donor)) > self._blocks_available(pool)

    def block_of(self, key: str, slots: SlotArray) -> np.ndarray:
        """The arena block each slot of pool ``key`` lives in."""
        return np.asarray(slots, dtype=np.int64) // self._pool(key).geometry.slots_per_block

    def block_pool(self, block: int) -> str | None:
        """The pool that owns ``block`` (None when free)."""
        return self._block_owner[block]

    def used_slots_in_block(self, block: int) -> int:
        return int(self._block_used[block]) * self.page_size

    def used_slots_per_block(self) -> np.ndarray:
        """Used slots of every block (0: free), as a copy: one array op, for
        eviction's scan of which blocks could be emptied."""
        return self._block_used * self.page_size

    def block_table(self) -> tuple[list[str | None], np.ndarray]:
        """Every block's owner pool (None: free) and used slots, as copies (a
        snapshot for the live view: one pass, no per-block calls)."""
        return list(self._block_owner), self._block_used * self.page_size

    def free_slots_for(self, key: str) -> int:
        """Slots an ``alloc`` for this pool could get right now."""
        pool = self._pool(key)
        pages = pool.free_page_count + self._blocks_available(pool) * pool.pages_per_block
        return pages * self.page_size

    def capacity_slots(self, key: str) -> int:
        """The most slots this pool could ever hold (its cap, or the whole arena)."""
        pool = self._pool(key)
        return min(self.num_blocks, pool.cap_blocks) * pool.geometry.slots_per_block

    def can_alloc(self, key: str, n_tokens: int) -> bool:
        """Whether ``alloc`` would succeed now (eviction asks after every entry it frees)."""
        pool = self._pool(key)
        short = -(-n_tokens // self.page_size) - pool.free_page_count
        return short <= 0 or short <= self._blocks_available(pool) * pool.pages_per_block

    def alloc(self, key: str, n_tokens: int) -> SlotArray | None:
        """``n_tokens`` rounded up to whole pages of slots, or None if no room.

        Pages come from the pool's blocks with free pages (oldest first),
        lowest free page first within a block, so a fresh block hands out
        one ascending run."""
        pool = self._pool(key)
        need = self.pages_for(n_tokens)
        if need == 0:
            return np.zeros(0, dtype=np.int64)
        ppb = pool.pages_per_block
        short = need - pool.free_page_count
        new_blocks = max(0, -(-short // ppb))
        if new_blocks and new_blocks > self._blocks_available(pool):
            return None
        free_pages = pool.free_pages
        for _ in range(new_blocks):
            block = self._free_blocks.pop()
            self._block_owner[block] = key
            pool.blocks.add(block)
            free_pages[block] = ppb
        pool.free_page_count += new_blocks * ppb
        plan = []  # block, pages taken there, ...
        left = need
        for block, free in free_pages.items():
            take = left if left < free else free
            plan += (block, take)
            left -= take
            if left == 0:
                break
        for i in range(0, len(plan), 2):
            block, take = plan[i], plan[i + 1]
            if free_pages[block] == take:
                del free_pages[block]
            else:
                free_pages[block] -= take  # a value change: the order stays
        page_ids = pool.rows.take(plan, need)
        pool.free_page_count -= need
        return self._page_slots(page_ids)

    def _page_slots(self, page_ids: np.ndarray) -> SlotArray:
        p = self.page_size
        if p == 1:
            return page_ids
        return (page_ids[:, None] * p + np.arange(p, dtype=np.int64)).ravel()

    def free(self, key: str, slots: SlotArray) -> None:
        """Return whole pages of slots; empty blocks go back to the arena."""
        slots = np.asarray(slots, dtype=np.int64)
        n = slots.size
        if n == 0:
            return
        pool = self._pool(key)
        p = self.page_size
        if p == 1:
            page_ids = slots  # slots are pages: release checks they are distinct
        else:
            page_ids = distinct_sorted(slots // p)
            if page_ids.size * p != n:
                raise ValueError(f"free of {n} slots is not whole distinct pages of {p}")
        try:
            touched = pool.rows.release(page_ids)
        except ReleaseError as exc:
            if exc.code == DUPLICATE:
                raise ValueError(f"free of {n} slots is not whole distinct pages of {p}") from None
            if exc.code == NOT_IN_USE:
                raise ValueError(f"double free or foreign slots for pool {key!r}") from None
            raise ValueError("slot id out of the arena's range") from None
        free_pages = pool.free_pages
        count = pool.free_page_count
        triples = iter(touched)
        for block, freed_here, left_here in zip(triples, triples, triples, strict=True):
            if left_here == 0:
                count -= free_pages.pop(block, 0)
                pool.blocks.remove(block)
                self._block_owner[block] = None
                self._free_blocks.append(block)
            else:
                # A block that was full joins the end of the dict's order.
                free_pages[block] = free_pages.get(block, 0) + freed_here
                count += freed_here
        pool.free_page_count = count

    # ---- accounting ----------------------------------------------------------
    def allocated_slots(self, key: str) -> SlotArray:
        """Every slot currently allocated to this pool (for invariant checks)."""
        pool = self._pool(key)
        return self._page_slots(np.flatnonzero(pool.page_used).astype(np.int64))

    def pool_usage(self, key: str) -> PoolUsage:
        pool = self._pool(key)
        geo = pool.geometry
        blocks = len(pool.blocks)
        free_slots = pool.free_page_count * self.page_size
        return PoolUsage(
            key=key,
            blocks=blocks,
            used_slots=blocks * geo.slots_per_block - free_slots,
            free_slots_in_blocks=free_slots,
            bytes_per_token=geo.layout.bytes_per_token,
            slots_per_block=geo.slots_per_block,
        )

    def usage(self) -> ArenaUsage:
        return ArenaUsage(
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            free_blocks=len(self._free_blocks),
            pools={k: self.pool_usage(k) for k in self._pools},
        )

    def check(self) -> None:
        """Raise AssertionError if block and page bookkeeping disagree."""
        assert len(set(self._free_blocks)) == len(self._free_blocks), "block freed twice"
        for block in self._free_blocks:
            assert self._block_owner[block] is None, f"free block {block} has an owner"
            assert self._block_used[block] == 0, f"free block {block} has used pages"
        owned = sum(len(p.blocks) for p in self._pools.values())
        assert owned + len(self._free_blocks) == self.num_blocks, "blocks lost or duplicated"
        for pool in self._pools.values():
            ppb = pool.geometry.pages_per_block
            assert len(pool.blocks) <= pool.cap_blocks, f"pool {pool.key} over its cap"
            assert set(pool.free_pages) <= pool.blocks, "free pages listed for a foreign block"
            assert all(pool.free_pages.values()), "a full block kept on the free-page index"
            free_count = 0
            for block in pool.blocks:
                assert self._block_owner[block] == pool.key, f"block {block} owner mismatch"
                used = int(pool.page_used[block * ppb : (block + 1) * ppb].sum())
                assert used == self._block_used[block], f"block {block}: used pages drifted"
                assert used > 0, f"empty block {block} not returned"
                assert pool.free_pages.get(block, 0) == ppb - used, (
                    f"block {block}: free-page count drifted"
                )
                free_count += ppb - used
            assert free_count == pool.free_page_count, f"pool {pool.key} free count drifted"
            mask = np.ones(self.num_blocks, dtype=bool)
            mask[list(pool.blocks)] = False
            assert not pool.page_used.reshape(self.num_blocks, ppb)[mask].any(), (
                f"pool {pool.key} marks pages used in blocks it does not own"
            )


def distinct_sorted(values: np.ndarray) -> np.ndarray:
    """``np.unique`` for the small int arrays a free or a batch's slot check
    sees: a sort and a neighbour compare (no hashing, no index bookkeeping;
    numpy 2's hashing ``unique`` took 65 us on 1,100 slots, this 6)."""
    # Slots come back as the runs ``alloc`` handed out (ascending within a
    # block): the stable sort (a merge of runs) is several times faster on
    # them than the default quicksort.
    values = np.sort(values, kind="stable")
    if values.size > 1:
        values = values[_run_starts(values)]
    return values


def _run_starts(values: np.ndarray) -> np.ndarray:
    """Where each run of equal neighbours starts, as a mask (``np.r_`` cost
    more than the compare itself on these small arrays)."""
    starts = np.empty(values.size, dtype=bool)
    starts[:1] = True
    np.not_equal(values[1:], values[:-1], out=starts[1:])
    return starts
