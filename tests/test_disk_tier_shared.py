"""A disk tier shared by instances on one host (``--kv-disk-shared``).

Two real server processes on one directory: what one saved, the other loads
(found on disk after it started) and answers with the same greedy tokens as
an uncached server; a chunk file that went bad under it is recomputed, never
used. In-process, over real files: one writer per chunk under a race, a
joining store adopts nothing and deletes only stale temporaries, a chunk
deleted between lookup and load stops the load cleanly, and what a lookup
miss costs.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from bench.tiny_models import make_tiny_model_dir
from radixmux.memory.kv_disk_dir import StoreLocked
from radixmux.memory.kv_disk_store import (
    STALE_TEMPORARY_SECONDS,
    ChunkRef,
    DiskKVStore,
    namespace_dir,
)
from radixmux.runtime.launcher import LaunchError
from tests.test_disk_tier import PROMPTS, ask, scheduler, serve, tier_setup

pytestmark = pytest.mark.timeout(300)

SHARED = {"kv_disk_shared": True, "kv_disk_write_policy": "write_through", "page_size": 16}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("shared_model") / "a", seed=11)


def chunk_files(root: Path) -> set[Path]:
    return set((root / "v1").rglob("*.kv"))


def test_a_prompt_one_server_saved_is_loaded_by_another(model, tmp_path) -> None:
    with serve(model, None) as url:
        uncached = [ask(url, PROMPTS[0]), ask(url, PROMPTS[1])]
    # Both start before anything is saved: B can only find A's chunks on disk later.
    with serve(model, tmp_path, **SHARED) as a, serve(model, tmp_path, **SHARED) as b:
        with (
            pytest.raises(LaunchError, match="in use by another radixmux server"),
            serve(model, tmp_path),  # a server not sharing is kept out
        ):
            pass
        assert ask(a, PROMPTS[0]) == uncached[0]
        saved = scheduler(a)["disk"]
        assert saved["shared"] and saved["chunks_written"] >= 4
        files = chunk_files(tmp_path)
        assert len(files) == saved["chunks_written"]

        before = scheduler(b)
        assert ask(b, PROMPTS[0]) == uncached[0]
        after = scheduler(b)
        disk = after["disk"]
        assert disk["chunks_shared"] == disk["chunks_loaded"] == saved["chunks_written"]
        assert disk["tokens_loaded"]["a"] == 64 * saved["chunks_written"]
        # Only the tail past the last whole chunk was computed.
        assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] < 64
        # B found every chunk written: it saved none again and owns none.
        assert disk["chunks_written"] == disk["store_chunks"] == 0
        metrics = httpx.get(f"{b}/metrics", timeout=30).text
        assert f"radixmux_disk_chunks_shared_total {float(saved['chunks_written'])}" in metrics
        assert chunk_files(tmp_path) == files

        # A's next prompt's files go bad under B: B drops them and recomputes.
        assert ask(a, PROMPTS[1]) == uncached[1]
        bad = chunk_files(tmp_path) - files
        assert len(bad) >= 4
        for path in bad:
            data = bytearray(path.read_bytes())
            data[-7] ^= 0xFF
            path.write_bytes(bytes(data))
        before = scheduler(b)
        assert ask(b, PROMPTS[1]) == uncached[1]
        after = scheduler(b)
        assert after["disk"]["chunks_dropped"] == 1  # the first chunk stopped the load
        assert after["disk"]["tokens_loaded"]["a"] == disk["tokens_loaded"]["a"]
        computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
        assert computed >= 64 * len(bad)
        assert scheduler(a)["disk"]["enabled"] and after["disk"]["enabled"]


def payload(seed: int) -> memoryview:
    return memoryview(np.random.default_rng(seed).bytes(4096))


NS = b"radixmux-kv/test"


def test_one_writer_per_chunk_and_only_a_lone_start_adopts(tmp_path) -> None:
    kv = str(tmp_path / "kv")
    first = DiskKVStore(kv, 1 << 30, shared=True)
    joined = DiskKVStore(kv, 1 << 30, shared=True)
    try:
        assert first.alone and not joined.alone
        with pytest.raises(StoreLocked, match="--kv-disk-shared to every one"):
            DiskKVStore(kv, 1 << 30)
        refs = [ChunkRef(bytes([i]) * 32, namespace_dir(NS)) for i in range(200)]
        wins: list[list[ChunkRef]] = [[], []]

        def write_all(store: DiskKVStore, won: list[ChunkRef]) -> None:
            assert store.files is not None
            for i, ref in enumerate(refs):
                if store.files.write(ref, NS, 8, payload(i)) is not None:
                    won.append(ref)

        threads = [
            threading.Thread(target=write_all, args=(s, w))
            for s, w in zip((first, joined), wins, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Exactly one of the two published each chunk; no temporary is left.
        assert sorted(wins[0] + wins[1], key=lambda r: r.key) == refs
        names = os.listdir(tmp_path / "kv" / "v1" / namespace_dir(NS))
        assert len(names) == len(refs) and all(n.endswith(".kv") for n in names)
        out = memoryview(bytearray(4096))
        assert joined.files is not None and joined.files.read(refs[7], NS, 8, out) is None
        assert bytes(out) == bytes(payload(7))
        assert all(joined.has(r) for r in refs) and len(joined) == 0

        # A joining store leaves young temporaries (live writes) and deletes stale ones.
        ns_path = tmp_path / "kv" / "v1" / namespace_dir(NS)
        young, stale = ns_path / ("ab" * 32 + ".kv.01.tmp"), ns_path / ("cd" * 32 + ".kv.02.tmp")
        young.write_bytes(b"x")
        stale.write_bytes(b"x")
        old = time.time() - STALE_TEMPORARY_SECONDS - 60
        os.utime(stale, (old, old))
        third = DiskKVStore(kv, 1 << 30, shared=True)
        assert not third.alone and len(third) == 0
        assert young.exists() and not stale.exists()
        third.close()
    finally:
        first.close()
        joined.close()
    # Alone at its start, a shared store adopts what stopped instances left.
    size = (ns_path / refs[0].name).stat().st_size
    lone = DiskKVStore(kv, 10 * size, shared=True)
    try:
        assert lone.alone and len(lone) == 10  # trimmed to its capacity, oldest first
        assert not young.exists()
        assert len(os.listdir(ns_path)) == 10
    finally:
        lone.close()


def test_a_chunk_deleted_between_lookup_and_load_stops_the_load_cleanly(tmp_path) -> None:
    from radixmux.protocol import SamplingParams
    from radixmux.scheduler.request import Req

    kv = tmp_path / "kv"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cache_a, tier_a, arena_a, kv_of_a = tier_setup(tmp_path / "a", kv=kv, shared=True)
    cache_b, tier_b, arena_b, kv_of_b = tier_setup(tmp_path / "b", kv=kv, shared=True)
    try:
        tokens = np.arange(16, dtype=np.int32)
        slots = cache_a.allocator.alloc("w", 16)
        saved = kv_of_a(slots)
        cache_a.insert("m", tokens, slots)
        assert cache_a.evict(num_tokens=16) == 16  # A spills its 4 chunks
        tier_a.poll(wait=10)
        assert len(tier_a.store) == 4 and len(tier_b.store) == 0

        ids = np.concatenate([tokens, np.array([99], dtype=np.int32)])
        req = Req("r", "m", ids, SamplingParams(max_new_tokens=4), [], True, 0.0)
        m = cache_b.match("m", ids[:-1], record=False)
        cache_b.lock(m.handle)
        req.handle, req.slots, req.kv_len = m.handle, m.slots, m.length
        plan = tier_b.plan_load(req)
        assert plan is not None and not isinstance(plan, str) and plan.end == 16
        # A evicts its third chunk after B found it.
        victim = plan.chunks[2]
        assert tier_a.store.files is not None and tier_a.store.files.remove(victim)
        req.slots = cache_b.allocator.alloc("w", 16)
        tier_b.start_load(req, plan)
        assert tier_b.poll(wait=10) == [req] and req.kv_len == 8  # two chunks, then recompute
        assert (kv_of_b(req.slots[:8]) == saved[:8]).all()
        stats = tier_b.stats()
        assert stats.chunks_dropped == 1 and stats.chunks_shared == 4
        assert tier_b.plan_load(req) is None  # the lookup stops at the missing chunk now
    finally:
        tier_a.close(flush=False)
        tier_b.close(flush=False)
        arena_a.destroy()
        arena_b.destroy()


def test_a_lookup_miss_costs_microseconds(tmp_path) -> None:
    """The loop looks past its own index with one stat per admitted request's
    first missing chunk: it must stay far below 0.1 ms."""
    store = DiskKVStore(str(tmp_path / "kv"), 1 << 30, shared=True)
    try:
        refs = [ChunkRef(os.urandom(32), namespace_dir(NS)) for _ in range(2000)]
        times = []
        for ref in refs:
            t0 = time.perf_counter()
            assert not store.has(ref)
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        print(f"lookup miss: median {median * 1e6:.1f} us")
        assert median < 50e-6
    finally:
        store.close()


def test_a_stopping_instance_hands_its_chunks_to_the_next_one(tmp_path) -> None:
    kv = str(tmp_path / "kv")
    ns_path = tmp_path / "kv" / "v1" / namespace_dir(NS)
    live = DiskKVStore(kv, 1 << 30, shared=True)
    try:
        own = [ChunkRef(bytes([i]) * 32, namespace_dir(NS)) for i in range(3)]
        assert live.files is not None
        for i, ref in enumerate(own):
            live.added(ref.key, ref.ns_dir, live.files.write(ref, NS, 8, payload(i)) or 0)
        stopping = DiskKVStore(kv, 1 << 30, shared=True)
        assert stopping.files is not None
        theirs = [ChunkRef(bytes([100 + i]) * 32, namespace_dir(NS)) for i in range(5)]
        for i, ref in enumerate(theirs):
            stopping.added(ref.key, ref.ns_dir, stopping.files.write(ref, NS, 8, payload(i)) or 0)
            os.utime(ns_path / ref.name, (1e9 + i, 1e9 + i))  # recency: oldest first
        size = (ns_path / theirs[0].name).stat().st_size
        (ns_path / theirs[0].name).unlink()  # a reader dropped it as bad meanwhile
        stopping.close()
        assert len(list((tmp_path / "kv" / "v1").glob("handover.*.list"))) == 1

        # The next instance joins the live one: it takes the stopped one's chunks
        # that are still there (trimmed to its capacity), never the live one's.
        following = DiskKVStore(kv, 3 * size, shared=True)
        try:
            assert not following.alone
            assert [ref for ref in theirs if ref.key in following] == theirs[2:]
            assert not any(ref.key in following for ref in own)
            assert following.size_bytes == 3 * size
            assert not (ns_path / theirs[1].name).exists()  # the oldest, trimmed
            assert not list((tmp_path / "kv" / "v1").glob("handover.*"))
            other = DiskKVStore(kv, 1 << 30, shared=True)
            assert len(other) == 0  # the list was taken once
            other.close()
        finally:
            following.close()
    finally:
        live.close()
    assert len(list((tmp_path / "kv" / "v1").glob("handover.*.list"))) == 2  # other had none
    lone = DiskKVStore(kv, 1 << 30, shared=True)
    try:  # alone, it adopts every file: the lists are spent
        assert lone.alone and len(lone) == 6
        assert not list((tmp_path / "kv" / "v1").glob("handover.*"))
    finally:
        lone.close()


def test_the_cluster_recipe_gives_sharing_instances_one_folder(tmp_path) -> None:
    from deploy.specs import InstanceSpec

    def kv_dir(i: int, *flags: str) -> str:
        cmd = InstanceSpec(
            31000 + i, ("m",), tmp_path / f"instance-{i}", extra_args=flags
        ).command()
        return cmd[cmd.index("--kv-disk-dir") + 1]

    assert kv_dir(0, "--kv-disk-bytes", "1") != kv_dir(1, "--kv-disk-bytes", "1")
    shared = ("--kv-disk-bytes", "1", "--kv-disk-shared")
    assert kv_dir(0, *shared) == kv_dir(1, *shared) == str(tmp_path / "kv-shared")


def test_a_sharing_store_is_refused_beside_one_that_does_not_share(tmp_path, monkeypatch) -> None:
    from radixmux.common.server_args import ServerArgs
    from radixmux.memory import kv_disk_dir

    with pytest.raises(ValueError, match=r"--kv-disk-shared\) needs --kv-disk-bytes"):
        ServerArgs(kv_disk_shared=True)
    monkeypatch.setattr(kv_disk_dir, "SHARED_LOCK_WAIT_SECONDS", 0.2)
    alone = DiskKVStore(str(tmp_path), 1 << 20)
    try:
        with pytest.raises(StoreLocked, match="runs without --kv-disk-shared"):
            DiskKVStore(str(tmp_path), 1 << 20, shared=True)
    finally:
        alone.close()
    DiskKVStore(str(tmp_path), 1 << 20, shared=True).close()  # free again
