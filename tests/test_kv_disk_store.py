"""The disk tier's chunk store and I/O thread against a plain reference.

A hypothesis state machine drives ``DiskKVStore`` (the index) and
``KVTransfer`` (the I/O thread) the way ``scheduler/disk_tier.py`` does: saves
of whole chunks out of a small shared arena, loads into fresh slots, corrupted
files, restarts on the same directory, with a capacity of a few chunks so LRU
eviction runs all the time. The reference is an ordered dict ``{key: chunk}``
kept in LRU order, with the payload bytes each chunk must load back as, and
its own model of the capacity bound. After every step the index must equal
the reference (keys, order, sizes), the files on disk must match it, and a
load must either return exactly the reference bytes or report the chunk bad:
never other bytes, never a key the store does not hold.

Unit tests cover the directory lock, key separation between namespaces, the
hash chain, the start-up scan and the read's size checks, and that the store
owns only what it made: it takes only an empty or marked directory (or an
unmarked one of the earlier layout), follows no link, makes temporaries under
fresh names with O_EXCL, and its scan and flush delete only its chunk files.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import tracemalloc
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixmux.memory import kv_disk_dir
from radixmux.memory.arena import KVArena
from radixmux.memory.kv_disk_dir import (
    FORMAT_VERSION,
    LOCK_NAME,
    MARK_NAME,
    NotAStore,
    StoreLocked,
    StoreRefused,
)
from radixmux.memory.kv_disk_store import (
    MAGIC,
    SUFFIX,
    DiskKVStore,
    checksum,
    chunk_keys,
    namespace,
    namespace_dir,
)
from radixmux.memory.kv_transfer import (
    ChunkRef,
    ClearJob,
    DeleteJob,
    KVTransfer,
    LoadJob,
    SaveJob,
    byte_view,
)
from radixmux.memory.layout import BlockGeometry, KVLayout

CHUNK = 4  # tokens per chunk
PAGE = 4
BLOCK = 4096
NUM_BLOCKS = 3
HEADER = struct.calcsize("<8sIIQQI32s")  # the packed size of the file header
# Two layouts: rows of 32 bytes (the I/O thread copies int64 words) and of 6
# bytes (it copies single bytes).
LAYOUTS = (
    KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32"),
    KVLayout(num_layers=2, num_kv_heads=1, head_dim=3, dtype="float16"),
)
POOLS = ("w0", "weights-1")  # two namespaces over one layout: files of two sizes
WAIT = 10.0
# The test sets every file's mtime to a synthetic time (its logical stamp) in
# 2001, so the order a restart finds is exact and runs replay identically; a
# file the code wrote or touched since has a real mtime, far later.
SYNTH_BASE = 10**18  # ns
SYNTH_END = SYNTH_BASE + 10**15


def pack(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int32).tobytes()


@dataclass
class Chunk:
    ns: int  # index into the machine's namespaces
    payload: bytes  # what a load must return
    size: int  # the size the index holds for it
    stamp: int  # logical time of the last write or successful read (the file's mtime)
    corrupt: str | None = None  # how the file was damaged (a load must report it bad)


@dataclass(frozen=True)
class Space:
    pool: str
    ns: bytes
    ns_dir: str


class DiskStoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir: str | None = None
        self.arena: KVArena | None = None
        self.store: DiskKVStore | None = None
        self.transfer: KVTransfer | None = None

    # ---- set-up -----------------------------------------------------------------------
    @initialize(layout=st.sampled_from(LAYOUTS), cap_chunks=st.floats(0.5, 10.0))
    def setup(self, layout: KVLayout, cap_chunks: float) -> None:
        self.layout = layout
        self.geometry = BlockGeometry(layout, BLOCK, PAGE)
        self.spb = self.geometry.slots_per_block
        self.nslots = NUM_BLOCKS * self.spb
        self.row = layout.num_kv_heads * layout.head_dim * layout.itemsize
        self.used = self.spb * layout.bytes_per_token
        self.arena = KVArena.create(NUM_BLOCKS, BLOCK)
        self.view = byte_view(self.arena.bytes, self.geometry)
        self.dir = tempfile.mkdtemp(prefix="radixmux-kvstore-")
        self.spaces = []
        for pool in POOLS:
            ns = namespace(pool, layout, CHUNK)
            self.spaces.append(Space(pool, ns, namespace_dir(ns)))
        sizes = [HEADER + len(s.ns) + CHUNK * layout.bytes_per_token for s in self.spaces]
        self.chunk_sizes = sizes
        self.base_capacity = self.capacity = int(cap_chunks * max(sizes))
        self.store = DiskKVStore(self.dir, self.capacity)
        assert len(self.store) == 0 and self.store.dropped_at_start == 0
        self.transfer = KVTransfer(self.store.files)
        self.ref: OrderedDict[bytes, Chunk] = OrderedDict()  # LRU order, oldest first
        self.gone: dict[bytes, int] = {}  # evicted or dropped keys: no file, no index
        self.seqs: list[tuple[int, list[int]]] = []  # token sequences put so far
        self.where: dict[bytes, tuple[int, list[int], int]] = {}  # key: (ns, tokens, index)
        self.clock = 0
        self.steps = 0

    def teardown(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
        if self.store is not None:
            self.store.close()
        if self.arena is not None:
            self.arena.destroy()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        STEPS[0] += getattr(self, "steps", 0)

    # ---- helpers ----------------------------------------------------------------------
    def _np(self) -> np.ndarray:
        """The arena as ``[blocks, layers, 2, slots, kv_heads, head]`` bytes, by
        plain numpy from its head-major blocks (``layout.py``)."""
        lay = self.layout
        a = self.arena.bytes.numpy()[:, : self.used]
        heads = lay.num_kv_heads
        a = a.reshape(NUM_BLOCKS, lay.num_layers, 2, heads, self.spb, self.row // heads)
        return a.transpose(0, 1, 2, 4, 3, 5)

    def _write_slots(self, slots: np.ndarray, payload: np.ndarray) -> None:
        self._np()[slots // self.spb, :, :, slots % self.spb] = payload

    def _read_slots(self, slots: np.ndarray) -> np.ndarray:
        return self._np()[slots // self.spb, :, :, slots % self.spb].copy()

    def _random_payload(self, n_tokens: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        lay = self.layout
        shape = (n_tokens, lay.num_layers, 2, lay.num_kv_heads, self.row // lay.num_kv_heads)
        return rng.integers(0, 256, shape, dtype=np.uint8)

    def _path(self, key: bytes, ns: int) -> str:
        return self.store.path(self.spaces[ns].ns_dir, key)

    def _ref(self, key: bytes, ns: int) -> ChunkRef:
        return ChunkRef(key, self.spaces[ns].ns_dir)

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _used(self, key: bytes, chunk: Chunk) -> None:
        """The code just wrote or read ``key``'s file: its mtime must be real now
        (recency survives a restart); then pin it to a fresh synthetic stamp."""
        path = self._path(key, chunk.ns)
        assert os.stat(path).st_mtime_ns > SYNTH_END, "a used chunk's mtime was not updated"
        chunk.stamp = self._tick()
        t = SYNTH_BASE + chunk.stamp * 1000
        os.utime(path, ns=(t, t))

    def _run(self, *jobs: object) -> list:
        """Submit jobs back to back (FIFO) and return their results in order."""
        for job in jobs:
            self.transfer.submit(job)
        results = self.transfer.wait_idle(WAIT)
        assert [r.job for r in results] == list(jobs), "jobs lost or run out of order"
        for r in results:
            assert r.fatal is None, r.fatal
        return results

    def _model_add(self, key: bytes, chunk: Chunk) -> list[ChunkRef]:
        """The reference's ``added``: insert last, then evict least recently used."""
        self.ref.pop(key, None)
        self.gone.pop(key, None)
        self.ref[key] = chunk
        victims = []
        while sum(c.size for c in self.ref.values()) > self.capacity and len(self.ref) > 1:
            victim, old = self.ref.popitem(last=False)
            self.gone[victim] = old.ns
            victims.append(self._ref(victim, old.ns))
        return victims

    def _delete(self, victims: list[ChunkRef]) -> None:
        if victims:
            self._run(DeleteJob(victims))
            for ref in victims:
                assert not os.path.exists(self.store.path(ref.ns_dir, ref.key)), ref

    def _drop_bad(self, bad: list[tuple[bytes, str]]) -> None:
        """What the scheduler does with bad chunks: forget them in the index."""
        for key, why in bad:
            assert isinstance(why, str) and why
            chunk = self.ref.pop(key, None)
            path = self.store.discard(key)
            if chunk is None:
                assert path is None
                continue
            assert path == self._path(key, chunk.ns)
            assert not os.path.exists(path), "a bad chunk's file must be deleted by the load"
            self.gone[key] = chunk.ns

    def _check_file(self, key: bytes, chunk: Chunk) -> None:
        """A sound file on disk: header, namespace, then exactly the payload."""
        with open(self._path(key, chunk.ns), "rb") as f:
            data = f.read()
        ns = self.spaces[chunk.ns].ns
        assert len(data) == chunk.size == HEADER + len(ns) + len(chunk.payload)
        magic, version, tokens, size, crc, ns_len, file_key = struct.unpack(
            "<8sIIQQI32s", data[:HEADER]
        )
        assert (magic, version, tokens, file_key) == (MAGIC, FORMAT_VERSION, CHUNK, key)
        assert (size, ns_len) == (len(chunk.payload), len(ns))
        assert data[HEADER : HEADER + ns_len] == ns
        assert data[HEADER + ns_len :] == chunk.payload
        assert crc == checksum(chunk.payload)

    def _slots(self, data: st.DataObject, n: int) -> np.ndarray:
        picked = data.draw(
            st.lists(st.integers(0, self.nslots - 1), min_size=n, max_size=n, unique=True)
        )
        return np.asarray(picked, dtype=np.int64)

    def _load(self, ns: int, keys: list[bytes], slots: np.ndarray, skip: int) -> list:
        """Load ``keys`` into ``slots`` as the scheduler does, checking every byte."""
        space = self.spaces[ns]
        refs = [self._ref(k, ns) for k in keys]
        self._write_slots(slots, self._random_payload(len(slots), len(self.seqs) + 7))
        before = self._np().copy()
        for k in keys:  # start_load touches the run before the I/O thread reads it
            self.store.touch(k)
            if k in self.ref:
                self.ref.move_to_end(k)
        (result,) = self._run(LoadJob(self.view, slots, refs, space.ns, CHUNK, skip=skip))
        good = 0
        for k in keys:
            chunk = self.ref.get(k)
            if chunk is None or chunk.corrupt is not None:
                break
            good += 1
        tokens = max(0, good * CHUNK - skip)
        assert result.tokens == tokens, (result.tokens, tokens, result.bad)
        if good < len(keys):
            assert [k for k, _ in result.bad] == [keys[good]], result.bad
        else:
            assert result.bad == []
        expected = before.copy()
        if tokens:
            want = b"".join(self.ref[k].payload for k in keys[:good])
            want_rows = np.frombuffer(want, dtype=np.uint8).reshape(
                good * CHUNK, *before.shape[1:3], *before.shape[4:]
            )
            want_rows = want_rows[skip:]
            assert np.array_equal(self._read_slots(slots[:tokens]), want_rows)
            a = expected.reshape(NUM_BLOCKS, *before.shape[1:])
            a[slots[:tokens] // self.spb, :, :, slots[:tokens] % self.spb] = want_rows
        # Nothing outside the loaded slots changed (the rest of ``slots`` included).
        assert np.array_equal(self._np(), expected), "a load wrote outside its good slots"
        for k in keys[:good]:
            self._used(k, self.ref[k])
        self._drop_bad(result.bad)
        return result.bad

    # ---- rules ------------------------------------------------------------------------
    @rule(
        data=st.data(),
        ns=st.integers(0, len(POOLS) - 1),
        new=st.lists(
            st.lists(st.integers(0, 999), min_size=CHUNK, max_size=CHUNK), min_size=1, max_size=3
        ),
        resave=st.booleans(),
        overwrite=st.booleans(),
        load_back=st.booleans(),
        seed=st.integers(0, 2**32 - 1),
    )
    def put(
        self,
        data: st.DataObject,
        ns: int,
        new: list[list[int]],
        resave: bool,
        overwrite: bool,
        load_back: bool,
        seed: int,
    ) -> None:
        """Save whole chunks of a sequence (extending an earlier one, sometimes),
        then (sometimes) load back what the index holds of it."""
        self.steps += 1
        base: list[int] = []
        mine = [t for n, t in self.seqs if n == ns]
        if mine and data.draw(st.booleans(), label="extend"):
            base = data.draw(st.sampled_from(mine), label="base")
        tokens = base + [t for chunk in new for t in chunk]
        space = self.spaces[ns]
        keys = chunk_keys(space.ns, pack(tokens), CHUNK)
        assert len(keys) == len(tokens) // CHUNK
        self.seqs.append((ns, tokens))
        for i, k in enumerate(keys):
            self.where[k] = (ns, tokens, i)
        # The scheduler saves only the chunks the store lacks; a resave rewrites all.
        todo = [k for k in keys if resave or k not in self.store]
        if not todo:
            return
        slots = self._slots(data, len(todo) * CHUNK)
        payload = self._random_payload(len(slots), seed)
        self._write_slots(slots, payload)
        rows = payload.reshape(len(todo), CHUNK * int(np.prod(payload.shape[1:])))
        refs = [self._ref(k, ns) for k in todo]
        jobs: list[object] = [SaveJob(self.view, slots, refs, space.ns, CHUNK)]
        # A load into the very slots the save reads, submitted right behind it: the
        # FIFO must let the save read them first.
        victim_of_overwrite = None
        if overwrite:
            sound = [k for k, c in self.ref.items() if c.corrupt is None and k not in todo]
            if sound:
                victim_of_overwrite = data.draw(st.sampled_from(sound), label="overwrite")
                other = self.ref[victim_of_overwrite]
                self.store.touch(victim_of_overwrite)
                self.ref.move_to_end(victim_of_overwrite)
                jobs.append(
                    LoadJob(
                        self.view,
                        slots[:CHUNK],
                        [self._ref(victim_of_overwrite, other.ns)],
                        self.spaces[other.ns].ns,
                        CHUNK,
                    )
                )
        results = self._run(*jobs)
        save = results[0]
        assert save.bad == []
        size = self.chunk_sizes[ns]
        assert save.written == [(k, size) for k in todo]
        assert save.nbytes == size * len(todo)
        chunks = [Chunk(ns, rows[i].tobytes(), sz, 0) for i, (_, sz) in enumerate(save.written)]
        for (key, _), chunk in zip(save.written, chunks, strict=True):
            self._check_file(key, chunk)  # the file holds the bytes read before the load
            self._used(key, chunk)  # written before the load below read its chunk
        if victim_of_overwrite is not None:
            (load,) = results[1:]
            assert load.bad == [] and load.tokens == CHUNK
            loaded = self._read_slots(slots[:CHUNK]).tobytes()
            assert loaded == self.ref[victim_of_overwrite].payload
            self._used(victim_of_overwrite, self.ref[victim_of_overwrite])
        # The scheduler's _finished: record each written chunk, delete the victims.
        victims: list[ChunkRef] = []
        expected: list[ChunkRef] = []
        for (key, sz), chunk in zip(save.written, chunks, strict=True):
            expected += self._model_add(key, chunk)
            victims += self.store.added(key, space.ns_dir, sz)
        assert victims == expected, "LRU eviction differs from the reference"
        # A resave can evict a chunk and then write it back within the same loop:
        # its file (written by this job) stays. The scheduler never resaves a
        # stored key, so its keys are evicted at most once and never come back.
        indexed = {self._ref(k, c.ns) for k, c in self.ref.items()}
        self._delete(list(dict.fromkeys(p for p in victims if p not in indexed)))
        if load_back:
            first = keys.index(todo[0])
            skip = data.draw(st.integers(0, CHUNK - 1), label="skip")
            self._load_run(data, ns, tokens, first, skip)

    @rule(
        data=st.data(),
        skip=st.integers(0, CHUNK - 1),
        source=st.sampled_from(["indexed", "indexed", "indexed", "put", "gone", "unknown"]),
    )
    def get(self, data: st.DataObject, skip: int, source: str) -> None:
        """Load, as plan_load does, the run of a sequence's chunks the index holds,
        starting at a chunk it holds (``indexed``) or any chunk once put. A key
        never saved, or evicted or dropped, is not in the index and has no file:
        a load of it anyway reports the file missing and loads nothing."""
        self.steps += 1
        if source == "gone" and self.gone:
            key = data.draw(st.sampled_from(sorted(self.gone)), label="gone")
            self._load_absent(data, key, self.gone[key])
            return
        if source == "indexed" and self.ref:
            key = data.draw(st.sampled_from(sorted(self.ref)), label="key")
            ns, tokens, first = self.where[key]
        elif source != "unknown" and self.seqs:
            ns, tokens = data.draw(st.sampled_from(self.seqs), label="seq")
            first = data.draw(st.integers(0, len(tokens) // CHUNK - 1), label="first")
        else:
            ns = data.draw(st.integers(0, len(POOLS) - 1), label="ns")
            tokens = data.draw(st.lists(st.integers(-9, -1), min_size=CHUNK, max_size=CHUNK))
            first = 0  # no put has negative tokens: a key never saved
        self._load_run(data, ns, tokens, first, skip)

    def _load_run(
        self, data: st.DataObject, ns: int, tokens: list[int], first: int, skip: int
    ) -> None:
        keys = chunk_keys(self.spaces[ns].ns, pack(tokens), CHUNK)
        run = []
        for k in keys[first:]:
            if k not in self.store:
                assert k not in self.ref
                break
            assert k in self.ref
            run.append(k)
        if not run:
            self._load_absent(data, keys[first], ns)
            return
        self._load(ns, run, self._slots(data, len(run) * CHUNK - skip), skip)

    def _load_absent(self, data: st.DataObject, key: bytes, ns: int) -> None:
        assert key not in self.ref
        assert not os.path.exists(self._path(key, ns))
        slots = self._slots(data, CHUNK)
        bad = self._load(ns, [key], slots, 0)
        assert [k for k, _ in bad] == [key] and bad[0][1] == "file missing", bad
        assert len(self.store) == len(self.ref)

    @precondition(lambda self: any(c.corrupt is None for c in self.ref.values()))
    @rule(
        data=st.data(),
        mode=st.sampled_from(["flip", "truncate", "append", "other_key", "delete"]),
        get_now=st.booleans(),
    )
    def corrupt(self, data: st.DataObject, mode: str, get_now: bool) -> None:
        """Damage one file behind the store's back; a load must then reject it."""
        self.steps += 1
        sound = [k for k, c in self.ref.items() if c.corrupt is None]
        key = data.draw(st.sampled_from(sound), label="key")
        chunk = self.ref[key]
        path = self._path(key, chunk.ns)
        st_before = os.stat(path)
        with open(path, "rb") as f:
            raw = f.read()
        if mode == "flip":
            pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
            bit = data.draw(st.integers(1, 255), label="xor")
            raw = raw[:pos] + bytes([raw[pos] ^ bit]) + raw[pos + 1 :]
        elif mode == "truncate":
            raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="length")]
        elif mode == "append":
            raw += data.draw(st.binary(min_size=1, max_size=8), label="tail")
        elif mode == "other_key":
            others = [k for k, c in self.ref.items() if c.corrupt is None and k != key]
            if not others:
                mode = "delete"
            else:
                other = data.draw(st.sampled_from(others), label="other")
                with open(self._path(other, self.ref[other].ns), "rb") as f:
                    raw = f.read()
        if mode == "delete":
            os.unlink(path)
        else:
            with open(path, "wb") as f:
                f.write(raw)
            # Keep the file's recency: damage is not use.
            os.utime(path, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))
        chunk.corrupt = mode
        if get_now:
            bad = self._load(chunk.ns, [key], self._slots(data, CHUNK), 0)
            assert [k for k, _ in bad] == [key]
            assert key not in self.store and key not in self.ref

    @precondition(lambda self: self.ref or self.gone)
    @rule(resize=st.sampled_from([1.0, 1.0, 0.5, 2.0]))
    def restart(self, resize: float) -> None:
        """A new store on the same directory (same capacity, or a new one) indexes
        exactly the files left."""
        self.steps += 1
        self.transfer.close()
        self.store.close()
        self.capacity = int(self.base_capacity * resize)
        # What the files say: sound chunks as recorded, damaged ones as they are now.
        expected: dict[bytes, tuple[str, int]] = {}
        for key, chunk in list(self.ref.items()):
            path = self._path(key, chunk.ns)
            if chunk.corrupt == "delete":
                del self.ref[key]
                self.gone[key] = chunk.ns
                continue
            if chunk.corrupt is not None:
                chunk.size = os.path.getsize(path)
            expected[key] = (self.spaces[chunk.ns].ns_dir, chunk.size)
        # Least recently written or read first, by mtime (all distinct here); the
        # oldest go until the (new) capacity holds the rest.
        by_stamp = sorted(expected, key=lambda k: self.ref[k].stamp)
        total = sum(size for _, size in expected.values())
        trimmed = []
        while total > self.capacity and len(by_stamp) > 1:
            key = by_stamp.pop(0)
            total -= expected.pop(key)[1]
            trimmed.append(key)
        self.store = DiskKVStore(self.dir, self.capacity)
        self.transfer = KVTransfer(self.store.files)
        assert self.store.dropped_at_start == len(trimmed)
        index = self.store._index
        assert {k: (m.ns_dir, m.size) for k, m in index.items()} == expected
        assert self.store.size_bytes == total
        assert list(index) == by_stamp, "the scan did not order the index by mtime"
        for key in trimmed:
            assert not os.path.exists(self._path(key, self.ref[key].ns))
            self.gone[key] = self.ref.pop(key).ns
        self.ref = OrderedDict((k, self.ref[k]) for k in by_stamp)

    # ---- invariants -------------------------------------------------------------------
    @invariant()
    def index_matches_reference(self) -> None:
        if self.store is None:
            return
        store = self.store
        assert len(store) == len(self.ref)
        assert list(store._index) == list(self.ref), "LRU order differs from the reference"
        for key, chunk in self.ref.items():
            assert key in store
            meta = store._index[key]
            assert (meta.ns_dir, meta.size) == (self.spaces[chunk.ns].ns_dir, chunk.size)
            if chunk.corrupt is None:
                assert os.path.getsize(self._path(key, chunk.ns)) == chunk.size
        assert store.size_bytes == sum(c.size for c in self.ref.values())
        assert store.size_bytes <= self.capacity or len(store) == 1
        for key in self.gone:
            assert key not in store


STEPS = [0]
DiskStoreMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class TestDiskStoreMachine(DiskStoreMachine.TestCase):
    def test_ran_many_steps(self) -> None:
        STEPS[0] = 0
        self.runTest()
        assert STEPS[0] >= 2000, STEPS[0]


# ---- unit tests -------------------------------------------------------------------------
LAYOUT = LAYOUTS[0]
NS = namespace("w0", LAYOUT, CHUNK)


def test_second_store_on_a_locked_directory_names_the_holder(tmp_path) -> None:
    store = DiskKVStore(str(tmp_path), 1 << 20)
    with pytest.raises(StoreLocked, match=rf"\(pid {os.getpid()}\)"):
        DiskKVStore(str(tmp_path), 1 << 20)
    store.close()
    DiskKVStore(str(tmp_path), 1 << 20).close()  # released: a new server may open it

    # Held by another process: its pid is named.
    code = (
        "import sys\n"
        "from radixmux.memory.kv_disk_store import DiskKVStore\n"
        "s = DiskKVStore(sys.argv[1], 1 << 20)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(StoreLocked, match=rf"\(pid {proc.pid}\)"):
            DiskKVStore(str(tmp_path), 1 << 20)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    DiskKVStore(str(tmp_path), 1 << 20).close()  # the lock died with its holder


def test_namespaces_share_no_key() -> None:
    tokens = pack(list(range(4 * CHUNK * 2)))
    variants = [
        namespace("w0", LAYOUT, CHUNK),
        namespace("w1", LAYOUT, CHUNK),  # other weights
        namespace("w0", KVLayout(3, 1, 8, "float32"), CHUNK),
        namespace("w0", KVLayout(2, 2, 8, "float32"), CHUNK),
        namespace("w0", KVLayout(2, 1, 16, "float32"), CHUNK),
        namespace("w0", KVLayout(2, 1, 8, "float16"), CHUNK),
        namespace("w0", KVLayout(2, 1, 8, "bfloat16"), CHUNK),
        namespace("w0", LAYOUT, 2 * CHUNK),
    ]
    chunk_sizes = [CHUNK] * 7 + [2 * CHUNK]
    assert len(set(variants)) == len(variants)
    assert len({namespace_dir(ns) for ns in variants}) == len(variants)
    seen: set[bytes] = set()
    for ns, c in zip(variants, chunk_sizes, strict=True):
        keys = chunk_keys(ns, tokens, c)
        assert len(keys) == len(tokens) // 4 // c
        assert all(len(k) == 32 for k in keys)
        assert seen.isdisjoint(keys)
        seen.update(keys)


def test_key_depends_on_every_earlier_token() -> None:
    tokens = list(range(100, 100 + 3 * CHUNK + 2))  # a partial chunk at the end
    keys = chunk_keys(NS, pack(tokens), CHUNK)
    assert len(keys) == 3  # the partial chunk has no key
    assert chunk_keys(NS, pack(tokens), CHUNK) == keys  # deterministic
    assert chunk_keys(NS, pack(tokens[: 2 * CHUNK]), CHUNK) == keys[:2]  # a prefix's keys
    for i in range(3 * CHUNK):
        changed = list(tokens)
        changed[i] += 1
        other = chunk_keys(NS, pack(changed), CHUNK)
        first = i // CHUNK
        assert other[:first] == keys[:first]  # chunks before the change keep their keys
        for j in range(first, 3):
            assert other[j] != keys[j], (i, j)
    changed = [tokens[0] + 1, *tokens[1:]]
    assert set(chunk_keys(NS, pack(changed), CHUNK)).isdisjoint(keys)
    # A token past the last whole chunk changes nothing.
    assert chunk_keys(NS, pack([*tokens[:-1], 7]), CHUNK) == keys


def _payload(n_tokens: int, seed: int = 0) -> memoryview:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, n_tokens * LAYOUT.bytes_per_token, dtype=np.uint8)
    return memoryview(data).cast("B")


def _refs(n: int, ns: bytes = NS, first_token: int = 0) -> list[ChunkRef]:
    keys = chunk_keys(ns, pack(list(range(first_token, first_token + n * CHUNK))), CHUNK)
    return [ChunkRef(k, namespace_dir(ns)) for k in keys]


def test_scan_removes_leftover_temporaries(tmp_path) -> None:
    store = DiskKVStore(str(tmp_path), 1 << 20)
    a, b = _refs(2)
    size = store.files.write(a, NS, CHUNK, _payload(CHUNK))
    path_b = store.path(b.ns_dir, b.key)
    # Writes a crash interrupted: a random temporary name, and the per-pid one
    # of the layout before the random names.
    leftovers = [f"{path_b}.0123456789abcdef.tmp", f"{path_b}.12345.tmp"]
    for leftover in leftovers:
        with open(leftover, "wb") as f:
            f.write(b"half a chunk")
    store.close()

    store = DiskKVStore(str(tmp_path), 1 << 20)
    try:
        assert not any(os.path.exists(p) for p in leftovers)
        assert store.dropped_at_start == 2
        assert a.key in store and b.key not in store and len(store) == 1
        assert store.size_bytes == size == os.path.getsize(store.path(a.ns_dir, a.key))
        assert sorted(os.listdir(os.path.join(store.root, a.ns_dir))) == [a.name]
    finally:
        store.close()


def test_read_checks_sizes(tmp_path) -> None:
    store = DiskKVStore(str(tmp_path), 1 << 20)
    files = store.files
    (ref,) = _refs(1)
    key = ref.key
    path = store.path(ref.ns_dir, key)
    payload = _payload(CHUNK, seed=3)
    size = files.write(ref, NS, CHUNK, payload)
    assert size == os.path.getsize(path) == HEADER + len(NS) + payload.nbytes
    assert os.listdir(os.path.dirname(path)) == [ref.name]  # no temporary left

    out = np.zeros(payload.nbytes, dtype=np.uint8)
    assert files.read(ref, NS, CHUNK, memoryview(out)) is None
    assert out.tobytes() == payload.tobytes()

    # The caller expects another payload size (a bigger or smaller buffer).
    for n in (payload.nbytes - 1, payload.nbytes + 1, payload.nbytes * 2):
        assert files.read(ref, NS, CHUNK, memoryview(np.zeros(n, np.uint8))) is not None
    # Another token count, namespace or key.
    assert files.read(ref, NS, CHUNK + 1, memoryview(out)) is not None
    assert files.read(ref, NS[:-1] + b"X", CHUNK, memoryview(out)) is not None
    os.link(path, store.path(ref.ns_dir, bytes(32)))
    assert files.read(ChunkRef(bytes(32), ref.ns_dir), NS, CHUNK, memoryview(out)) is not None

    # A file whose payload is shorter or longer than its header says.
    with open(path, "rb") as f:
        raw = f.read()
    for bad in (raw[:-1], raw + b"\0", raw[: HEADER + len(NS)], raw[: HEADER - 1]):
        with open(path, "wb") as f:
            f.write(bad)
        assert files.read(ref, NS, CHUNK, memoryview(out)) is not None, len(bad)
    # A header claiming a payload of a size other than the one written.
    fields = list(struct.unpack("<8sIIQQI32s", raw[:HEADER]))
    fields[3] += 4
    with open(path, "wb") as f:
        f.write(struct.pack("<8sIIQQI32s", *fields) + raw[HEADER:] + b"\0" * 4)
    assert files.read(ref, NS, CHUNK, memoryview(out)) is not None
    # A header claiming a 4 GiB namespace: refused before anything that size is allocated.
    fields = list(struct.unpack("<8sIIQQI32s", raw[:HEADER]))
    fields[5] = 2**32 - 1
    with open(path, "wb") as f:
        f.write(struct.pack("<8sIIQQI32s", *fields) + raw[HEADER:])
    tracemalloc.start()
    try:
        assert files.read(ref, NS, CHUNK, memoryview(out)) == "namespace differs"
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    os.unlink(path)
    assert files.read(ref, NS, CHUNK, memoryview(out)) == "file missing"
    store.close()


def test_scan_trims_to_capacity(tmp_path) -> None:
    """A restart with a smaller ``--kv-disk-bytes`` must not keep more than that."""
    store = DiskKVStore(str(tmp_path), 1 << 20)
    size = 0
    for i, ref in enumerate(_refs(5)):
        size = store.files.write(ref, NS, CHUNK, _payload(CHUNK, i))
        assert store.added(ref.key, ref.ns_dir, size) == []
    store.close()
    store = DiskKVStore(str(tmp_path), 2 * size)
    try:
        assert store.size_bytes <= store.capacity_bytes, (len(store), store.size_bytes)
        assert len(os.listdir(os.path.join(store.root, namespace_dir(NS)))) == len(store)
    finally:
        store.close()


# ---- the store owns only what it made ---------------------------------------------------
NS2 = namespace("w1", LAYOUT, CHUNK)
_NS_NAME = re.compile(r"[0-9a-f]{16}")
_CHUNK_NAME = re.compile(r"[0-9a-f]{64}\.kv")


def _tree(root: Path) -> dict[str, object]:
    """Every entry under ``root``, no link followed: a link's target, a file's
    bytes, ``"fifo"`` or ``"dir"``."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode
            rel = os.path.relpath(path, root)
            if stat.S_ISLNK(mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(mode):
                out[rel] = "dir"
            elif stat.S_ISFIFO(mode):
                out[rel] = "fifo"
            else:
                out[rel] = Path(path).read_bytes()
    return out


def _is_ours(rel: str, what: object) -> bool:
    """Whether an entry of ``_tree`` is one a store makes (its lock, its mark,
    ``v1``, namespace directories and the chunk files in them)."""
    parts = rel.split(os.sep)
    if parts[0] != "v1":
        return parts[0] in (LOCK_NAME, MARK_NAME) and len(parts) == 1 and isinstance(what, bytes)
    if len(parts) < 3:
        return what == "dir" and (len(parts) == 1 or bool(_NS_NAME.fullmatch(parts[1])))
    return (
        len(parts) == 3
        and bool(_NS_NAME.fullmatch(parts[1]) and _CHUNK_NAME.fullmatch(parts[2]))
        and isinstance(what, bytes)
    )


def _foreign(top: Path) -> dict[str, object]:
    return {rel: what for rel, what in _tree(top).items() if not _is_ours(rel, what)}


def _chunk_files(top: Path) -> list[str]:
    return sorted(
        rel for rel, what in _tree(top).items() if _is_ours(rel, what) and rel.endswith(SUFFIX)
    )


def _plant(top: Path, outside: Path) -> None:
    """Put things radixmux did not make everywhere in a store: files, directories,
    a FIFO, and links to ``outside`` (a file, and a file named like a chunk)
    under a chunk's, a temporary's and a namespace's name."""
    outside.mkdir()
    (outside / "precious.txt").write_bytes(b"not yours")
    stray = _refs(1, first_token=500)[0]
    (outside / stray.name).write_bytes(b"named like a chunk, not one")
    ns = top / "v1" / namespace_dir(NS)
    chunk_like = "ab" * 32 + SUFFIX
    (top / "notes.txt").write_bytes(b"mine")
    (top / "link-to-outside").symlink_to(outside)
    (top / "v1" / "README").write_bytes(b"mine too")
    (top / "v1" / "photos" / "2024").mkdir(parents=True)
    (top / "v1" / "photos" / "2024" / "a.jpg").write_bytes(b"\xff\xd8")
    (top / "v1" / namespace_dir(namespace("elsewhere", LAYOUT, CHUNK))).symlink_to(outside)
    (top / "v1" / "0123456789abcdef").mkdir()  # a namespace's name, holding no chunk
    (top / "v1" / "0123456789abcdef" / "diary.txt").write_bytes(b"dear diary")
    ns.mkdir(parents=True, exist_ok=True)
    (ns / "keep.txt").write_bytes(b"keep")
    (ns / ("Z" * 64 + SUFFIX)).write_bytes(b"not hex")
    (ns / chunk_like.upper()).write_bytes(b"upper-case hex")
    (ns / (chunk_like + ".bak")).write_bytes(b"a suffix more")
    (ns / chunk_like / "inner").mkdir(parents=True)  # a directory named like a chunk
    (ns / stray.name).symlink_to(outside / stray.name)  # a chunk-named link
    temporary = f"{_refs(1, first_token=900)[0].name}.{os.getpid()}.tmp"
    (ns / temporary).symlink_to(outside / "precious.txt")  # a temporary-named link
    os.mkfifo(ns / _refs(1, first_token=700)[0].name)  # a chunk-named FIFO


def test_scan_and_flush_leave_everything_the_store_did_not_make(tmp_path, caplog) -> None:
    top, outside = tmp_path / "kv", tmp_path / "outside"
    store = DiskKVStore(str(top), 1 << 20)
    refs = _refs(3) + _refs(2, ns=NS2)
    for i, ref in enumerate(refs):
        store.files.write(ref, NS if i < 3 else NS2, CHUNK, _payload(CHUNK, i))
    store.close()
    _plant(top, outside)
    planted, beyond = _foreign(top), _tree(outside)
    assert len(planted) == 17, sorted(planted)
    assert len(_chunk_files(top)) == len(refs)

    with caplog.at_level(logging.WARNING, logger="radixmux.scheduler"):
        store = DiskKVStore(str(top), 1 << 20)
    try:
        assert sorted(store._index) == sorted(r.key for r in refs)
        assert store.dropped_at_start == 0
        # Every entry not ours in v1 or a namespace directory (3 + 8 + 1); the
        # insides of foreign directories are not looked into.
        assert store.left_alone == 12
        warned = [r for r in caplog.records if "left alone" in r.getMessage()]
        assert len(warned) == 1, "one line for all of them"
        assert _foreign(top) == planted and _tree(outside) == beyond

        transfer = KVTransfer(store.files)
        try:
            store.clear()
            transfer.submit(ClearJob())
            (result,) = transfer.wait_idle(WAIT)
            assert result.fatal is None, result.fatal
        finally:
            transfer.close()
        assert len(store) == 0 and _chunk_files(top) == []
        assert _foreign(top) == planted and _tree(outside) == beyond
        # A namespace directory left empty goes; one holding anything else stays.
        assert not (top / "v1" / namespace_dir(NS2)).exists()
        assert (top / "v1" / namespace_dir(NS)).is_dir()
    finally:
        store.close()
    store = DiskKVStore(str(top), 1 << 20)  # and starts again on it
    store.close()
    assert _foreign(top) == planted and _tree(outside) == beyond


def test_a_link_in_the_store_is_never_read_written_or_deleted_through(tmp_path) -> None:
    """Links at a chunk's name and at a namespace directory's name, to sound
    chunk files outside: a load reports them bad and loads nothing, a save
    does not write through (or over) them, a delete leaves them; the files
    outside are untouched. A FIFO at a chunk's name does not hang a load."""
    outside = tmp_path / "outside"
    outside.mkdir()
    store = DiskKVStore(str(tmp_path / "kv"), 1 << 20)
    geometry = BlockGeometry(LAYOUT, BLOCK, PAGE)
    arena = KVArena.create(1, BLOCK)
    transfer = KVTransfer(store.files)
    try:
        view = byte_view(arena.bytes, geometry)
        (a,) = _refs(1)
        (b,) = _refs(1, ns=NS2)
        (c,) = _refs(1, first_token=40)
        for ref, ns in ((a, NS), (b, NS2)):  # sound files, then moved out and linked to
            store.files.write(ref, ns, CHUNK, _payload(CHUNK, 1))
            os.rename(store.path(ref.ns_dir, ref.key), outside / ref.name)
        os.symlink(outside / a.name, store.path(a.ns_dir, a.key))
        os.rmdir(os.path.join(store.root, b.ns_dir))
        os.symlink(outside, os.path.join(store.root, b.ns_dir))
        os.mkfifo(store.path(c.ns_dir, c.key))
        before, links = _tree(outside), _tree(Path(store.root))
        slots = np.arange(CHUNK)
        arena.bytes.zero_()
        jobs = [
            LoadJob(view, slots, [a], NS, CHUNK),
            LoadJob(view, slots, [b], NS2, CHUNK),
            LoadJob(view, slots, [c], NS, CHUNK),
            SaveJob(view, slots, [a], NS, CHUNK),
            SaveJob(view, slots, [b], NS2, CHUNK),
            DeleteJob([a, b, c]),
        ]
        for job in jobs:
            transfer.submit(job)
        results = transfer.wait_idle(WAIT)
        assert [r.job for r in results] == jobs, "a job hung (a FIFO opened for reading?)"
        for r in results[:3]:
            assert r.tokens == 0 and len(r.bad) == 1, r.bad
        assert "symbolic link" in results[0].bad[0][1]
        assert "symbolic link" in results[1].bad[0][1]
        assert results[2].bad[0][1] == "not a regular file"
        for r in results[3:5]:
            assert r.written == [] and len(r.bad) == 1 and r.fatal is None, (r.bad, r.fatal)
        assert not arena.bytes.any(), "a load wrote bytes read through a link"
        assert _tree(outside) == before, "a file outside the store changed"
        assert _tree(Path(store.root)) == links, "a link (or the FIFO) was replaced or deleted"
    finally:
        transfer.close()
        store.close()
        arena.destroy()


def test_temporaries_are_fresh_names_made_with_o_excl(tmp_path, monkeypatch) -> None:
    outside = tmp_path / "precious.txt"
    outside.write_bytes(b"not yours")
    store = DiskKVStore(str(tmp_path / "kv"), 1 << 20)
    try:
        (a,) = _refs(1)
        ns = Path(store.root) / a.ns_dir
        ns.mkdir()
        # The name the layout before used (predictable), and a name planted where
        # the next random one will be: both links, neither followed nor replaced.
        predictable = ns / f"{a.name}.{os.getpid()}.tmp"
        planted = ns / f"{a.name}.{'0' * 16}.tmp"
        for link in (predictable, planted):
            link.symlink_to(outside)
        fresh = kv_disk_dir.temporary_name
        names = iter([planted.name, planted.name])
        monkeypatch.setattr(kv_disk_dir, "temporary_name", lambda n: next(names, None) or fresh(n))
        payload = _payload(CHUNK, 5)
        store.files.write(a, NS, CHUNK, payload)
        out = np.zeros(payload.nbytes, dtype=np.uint8)
        assert store.files.read(a, NS, CHUNK, memoryview(out)) is None
        assert out.tobytes() == payload.tobytes()
        assert outside.read_bytes() == b"not yours"
        assert sorted(os.listdir(ns)) == sorted([a.name, predictable.name, planted.name])
        assert all(os.readlink(p) == str(outside) for p in (predictable, planted))

        # Every name taken: the write fails and leaves nothing of its own.
        monkeypatch.setattr(kv_disk_dir, "temporary_name", lambda n: planted.name)
        (b,) = _refs(1, first_token=40)
        with pytest.raises(OSError, match="no free temporary name"):
            store.files.write(b, NS, CHUNK, payload)
        assert sorted(os.listdir(ns)) == sorted([a.name, predictable.name, planted.name])
        assert outside.read_bytes() == b"not yours"
    finally:
        store.close()
    assert fresh("x") != fresh("x")  # no one can plant a link ahead of a write


def test_a_non_empty_directory_without_the_mark_is_refused(tmp_path) -> None:
    for i, make in enumerate(
        [
            lambda d: (d / "photo.jpg").write_bytes(b"\xff\xd8"),
            lambda d: (d / "empty-dir").mkdir(),
            lambda d: (d / "link").symlink_to(tmp_path),
            # The earlier layout, but with one file it never made.
            lambda d: (
                (d / "v1" / namespace_dir(NS)).mkdir(parents=True)
                or (d / "v1" / namespace_dir(NS) / "keep.txt").write_bytes(b"keep")
            ),
            lambda d: (d / "v1").mkdir() or (d / "v1" / "0123456789abcdef").symlink_to(tmp_path),
            lambda d: (d / "v1").symlink_to(tmp_path),
            lambda d: (d / LOCK_NAME).mkdir(),
        ]
    ):
        d = tmp_path / f"dir{i}"
        d.mkdir()
        make(d)
        before = _tree(d)
        with pytest.raises(NotAStore) as caught:
            DiskKVStore(str(d), 1 << 20)
        assert isinstance(caught.value, StoreRefused)
        message = str(caught.value)
        assert str(d) in message and "not a radixmux KV store" in message, message
        assert "point --kv-disk-dir at an empty or new directory" in message
        assert _tree(d) == before, "a refused directory was changed"


def test_an_empty_directory_is_taken_and_marked(tmp_path) -> None:
    store = DiskKVStore(str(tmp_path), 1 << 20)  # exists, empty
    store.close()
    mark = (tmp_path / MARK_NAME).read_bytes()
    assert mark == f"{MARK_NAME} {kv_disk_dir.STORE_VERSION}\n".encode()
    assert sorted(os.listdir(tmp_path)) == sorted([LOCK_NAME, MARK_NAME, "v1"])
    # Marked: anything else put in it later does not make it refused.
    (tmp_path / "notes.txt").write_bytes(b"mine")
    DiskKVStore(str(tmp_path), 1 << 20).close()
    new = tmp_path / "a" / "b"  # made, parents too
    DiskKVStore(str(new), 1 << 20).close()
    assert (new / MARK_NAME).read_bytes() == mark
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o700


def test_an_unmarked_store_of_the_earlier_layout_is_adopted(tmp_path) -> None:
    """A store an earlier radixmux made (no mark; only its lock, ``v1``, and
    namespace directories of chunk files and temporaries) keeps its chunks."""
    store = DiskKVStore(str(tmp_path), 1 << 20)
    refs = _refs(3)
    for i, ref in enumerate(refs):
        store.files.write(ref, NS, CHUNK, _payload(CHUNK, i))
    store.close()
    os.unlink(tmp_path / MARK_NAME)
    leftover = Path(store.path(refs[0].ns_dir, refs[0].key) + ".4242.tmp")
    leftover.write_bytes(b"half")
    (tmp_path / "v1" / namespace_dir(NS2)).mkdir()  # an empty namespace
    store = DiskKVStore(str(tmp_path), 1 << 20)
    try:
        assert sorted(store._index) == sorted(r.key for r in refs)
        assert store.dropped_at_start == 1 and not leftover.exists()
        assert (tmp_path / MARK_NAME).is_file()
    finally:
        store.close()


def test_a_bad_mark_or_a_link_for_the_stores_own_parts_is_refused(tmp_path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_bytes(b"not yours")
    cases = {
        "another layout": lambda d: (d / MARK_NAME).write_bytes(f"{MARK_NAME} 2\n".encode()),
        "not a mark": lambda d: (d / MARK_NAME).write_bytes(b"hello"),
        "mark is a link": lambda d: (
            (d / MARK_NAME).unlink() or (d / MARK_NAME).symlink_to(outside / "precious.txt")
        ),
        "lock is a link": lambda d: (
            (d / LOCK_NAME).unlink() or (d / LOCK_NAME).symlink_to(outside / "precious.txt")
        ),
        "v1 is a link": lambda d: shutil.rmtree(d / "v1") or (d / "v1").symlink_to(outside),
    }
    for i, (case, spoil) in enumerate(cases.items()):
        d = tmp_path / f"store{i}"
        DiskKVStore(str(d), 1 << 20).close()
        spoil(d)
        before, beyond = _tree(d), _tree(outside)
        with pytest.raises(NotAStore, match=re.escape(str(d))) as caught:
            DiskKVStore(str(d), 1 << 20)
        assert "point --kv-disk-dir at an empty or new directory" in str(caught.value), case
        assert _tree(d) == before and _tree(outside) == beyond, case
