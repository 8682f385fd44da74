"""The disk tier end to end: real server processes, real files, real HTTP.

A tiny random-weight model with SmolLM2's tokenizer and an arena far smaller
than the prompts' working set, so KV is evicted, saved, loaded back and
carried across restarts. The scheduler runs with ``check_invariants``: a
leaked or doubly owned slot (a load's, a save's lock) fails the test. Greedy
outputs must be the same whether a prefix was computed, hit in memory or
loaded from disk.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from bench.tiny_models import make_tiny_model_dir
from radixmux.runtime.client.engine import Engine
from radixmux.runtime.launcher import LaunchError

pytestmark = pytest.mark.timeout(300)

PROMPTS = [
    f"Story {i}: " + " ".join(f"word{j}" for j in range(i * 7, i * 7 + 300)) for i in range(10)
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("disk_model") / "a", seed=11)


@contextlib.contextmanager
def serve(model: Path, disk: Path | None, **flags: object) -> Iterator[str]:
    if disk is not None:
        flags = {"kv_disk_bytes": 1 << 30, "kv_disk_dir": str(disk), **flags}
    engine = Engine(
        model=[f"{model},name=a"],
        kv_cache_bytes=4 << 20,  # ~3 prompts of the 10
        kv_block_bytes=64 << 10,
        runner_threads=1,
        check_invariants=True,
        dtype="float32",
        **flags,
    )
    try:
        yield f"http://127.0.0.1:{engine.args.port}"
    finally:
        engine.shutdown()


def ask(url: str, prompt: str) -> str:
    body = {"model": "a", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def scheduler(url: str) -> dict:
    sched = httpx.get(f"{url}/get_server_info", timeout=30).json()["scheduler"]
    assert sched["invariants"] == "ok", sched["invariants"]
    return sched


def two_rounds(url: str) -> list[str]:
    return [ask(url, p) for _ in range(2) for p in PROMPTS]


@pytest.fixture(scope="module")
def recomputed(model: Path) -> list[str]:
    """Every answer with no disk tier: the second round recomputes what was evicted."""
    with serve(model, None) as url:
        return two_rounds(url)


def test_loaded_equals_recomputed_and_survives_restart(model, recomputed, tmp_path) -> None:
    with serve(model, tmp_path) as url:
        assert two_rounds(url) == recomputed
        first = scheduler(url)
        assert ask(url, PROMPTS[-1]) == recomputed[-1]  # a memory hit, same answer
    disk = first["disk"]
    assert disk["enabled"] and disk["chunks_written"] > 0 and disk["chunks_dropped"] == 0
    assert disk["tokens_loaded"]["a"] > 5 * 300  # the second round came back from disk
    with serve(model, tmp_path) as url:
        assert ask(url, PROMPTS[0]) == recomputed[0]
        restarted = scheduler(url)
        assert two_rounds(url) == recomputed
        after = scheduler(url)
    assert restarted["disk"]["store_chunks"] >= disk["store_chunks"]
    # The first request after the restart computed only its tail.
    assert restarted["prompt_tokens_computed"] < 100
    assert restarted["disk"]["tokens_loaded"]["a"] > 250
    assert after["prompt_tokens_computed"] < first["prompt_tokens_computed"] / 4


def test_write_through_saves_on_insert_and_flush_clears_the_store(model, recomputed, tmp_path):
    # Pages of 16 tokens under 64-token chunks: loads and inserts stay page-aligned.
    with serve(model, tmp_path, kv_disk_write_policy="write_through", page_size=16) as url:
        assert ask(url, PROMPTS[0]) == recomputed[0]
        saved = scheduler(url)["disk"]
        assert saved["store_chunks"] == saved["chunks_written"]
        assert saved["chunks_written"] >= 4  # ~300 tokens in 64-token chunks, no eviction yet
        assert scheduler(url)["evicted_tokens"]["capacity"] == 0
        assert two_rounds(url) == recomputed
        r = httpx.post(f"{url}/flush_cache", timeout=30)
        assert r.status_code == 200, r.text
        assert scheduler(url)["disk"]["store_chunks"] == 0
    assert not list((tmp_path / "v1").rglob("*.kv"))


def test_corrupt_truncated_and_foreign_files_are_dropped_never_used(model, recomputed, tmp_path):
    with serve(model, tmp_path) as url:
        assert two_rounds(url) == recomputed
    files = sorted((tmp_path / "v1").rglob("*.kv"))
    assert len(files) > 12
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if i % 3 == 0:
            data[-7] ^= 0xFF  # a flipped bit in the payload
        elif i % 3 == 1:
            data = data[: len(data) // 2]  # truncated
        else:
            data = bytearray(files[(i + 1) % len(files)].read_bytes())  # another chunk's file
        path.write_bytes(bytes(data))
    with serve(model, tmp_path) as url:
        assert two_rounds(url) == recomputed
        disk = scheduler(url)["disk"]
    assert disk["chunks_dropped"] > 0
    assert disk["enabled"]


def test_a_second_server_on_the_same_directory_is_refused(model, tmp_path) -> None:
    with serve(model, tmp_path) as url:
        with (
            pytest.raises(LaunchError, match="in use by another radixmux server"),
            serve(model, tmp_path),
        ):
            pass
        assert ask(url, "still serving")  # the first one is untouched


def test_a_directory_that_cannot_be_created_leaves_the_tier_off(model, recomputed, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with serve(model, blocker / "kv") as url:
        assert [ask(url, p) for p in PROMPTS[:3]] == recomputed[:3]
        assert scheduler(url)["disk"] is None


@pytest.fixture
def tiny_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: a few chunks fit, then every write fails with ENOSPC."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_turns_the_tier_off_and_serving_goes_on(model, recomputed, tiny_filesystem):
    with serve(model, tiny_filesystem) as url:
        assert two_rounds(url) == recomputed
        disk = scheduler(url)["disk"]
    assert not disk["enabled"]
    assert "No space left" in disk["disabled_reason"]
    assert os.path.isdir(tiny_filesystem / "v1")


REAL = ["smollm2,dtype=float32", "gemma3-270m,name=gemma,dtype=float32"]
# Two ~270-token prompts per model: four together are twice what the arena holds.
REAL_PROMPTS = [
    f"Chapter {i}. " + "The river ran past the mill and the old town, " * 24 + f"and on day {i}"
    for i in range(2)
]


def real_rounds(url: str, rounds: int = 2) -> list[str]:
    out = []
    for _ in range(rounds):
        for model in ("smollm2", "gemma"):
            for p in REAL_PROMPTS:
                body = {"model": model, "prompt": p, "max_tokens": 8, "temperature": 0}
                r = httpx.post(
                    f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=300
                )
                assert r.status_code == 200, r.text
                out.append(r.json()["choices"][0]["text"])
    return out


@contextlib.contextmanager
def serve_real(disk: Path) -> Iterator[str]:
    flags = {"kv_disk_bytes": 1 << 30, "kv_disk_dir": str(disk)}
    engine = Engine(model=REAL, kv_cache_bytes=24 << 20, check_invariants=True, **flags)
    try:
        yield f"http://127.0.0.1:{engine.args.port}"
    finally:
        engine.shutdown()


def test_real_models_same_greedy_from_memory_disk_recompute_and_restart(tmp_path) -> None:
    """SmolLM2 and Gemma 3 in float32 in one arena too small for the prompts:
    the round is computed (nothing is on disk yet; evictions write their KV,
    the close what only the arena holds), and after a restart every prompt's
    prefix comes from disk; every answer is the same. (That the first round
    equals a server without the tier, and a load back in the server that
    wrote, are the tiny-model tests' job: real layouts are what this adds.)"""
    with serve_real(tmp_path) as url:
        computed = real_rounds(url, rounds=1)
        first = scheduler(url)
    assert first["evicted_tokens"]["capacity"] > 0 and first["disk"]["chunks_written"] > 0
    with serve_real(tmp_path) as url:  # every prompt's prefix is on disk now
        assert real_rounds(url, rounds=1) == computed
        sched = scheduler(url)
    loaded = sched["disk"]["tokens_loaded"]
    n = len(REAL_PROMPTS)
    assert loaded["smollm2"] > n * 200 and loaded["gemma"] > n * 200  # every prompt's prefix
    assert sched["disk"]["chunks_dropped"] == 0
    assert sched["prompt_tokens_computed"] < 2 * n * 100  # only the prompts' tails


# ---- the tier's rules, in-process over a real arena and real files ----------------------
def tier_setup(
    tmp_path: Path,
    chunk: int = 4,
    kv: Path | None = None,
    shared: bool = False,
    capacity: int = 1 << 20,
):
    import numpy as np

    from radixmux.memory.allocator import KVAllocator
    from radixmux.memory.arena import KVArena
    from radixmux.memory.kv_disk_store import DiskKVStore
    from radixmux.memory.layout import KVLayout
    from radixmux.memory.radix_cache import ModelSpec, RadixCache
    from radixmux.scheduler.disk_tier import DiskTier

    layout = KVLayout(2, 1, 8, "float32")  # 128 bytes per token: 32 slots per 4 KiB block
    arena = KVArena.create(4, 4096, directory=str(tmp_path))
    cache = RadixCache(KVAllocator(4, 4096))
    cache.register_model(ModelSpec("m", "g", "w", layout))
    store = DiskKVStore(str(kv or tmp_path / "kv"), capacity, shared=shared)
    tier = DiskTier(cache, arena, store, chunk)
    geometry = cache.allocator.geometry("w")
    view = arena.view(geometry)
    view.copy_(__import__("torch").randn(view.shape))

    def kv_of(slots: np.ndarray):
        spb = geometry.slots_per_block
        return view[slots // spb, :, :, slots % spb].clone()

    return cache, tier, arena, kv_of


def looked_up(cache, rid: str, tokens):
    """A request for ``tokens`` and one more token, its memory match locked (as
    admission's ``KVManager.lookup`` leaves it)."""
    import numpy as np

    from radixmux.protocol import SamplingParams
    from radixmux.scheduler.request import Req

    ids = np.concatenate([tokens, np.array([99], dtype=np.int32)])
    r = Req(rid, "m", ids, SamplingParams(max_new_tokens=4), [], True, 0.0)
    m = cache.match("m", ids[:-1], record=False)
    cache.lock(m.handle)
    r.handle, r.slots, r.kv_len = m.handle, m.slots, m.length
    return r


def test_a_batch_is_held_back_while_a_save_reads_its_block_and_loads_wait_for_each_other(
    tmp_path,
) -> None:
    import numpy as np

    cache, tier, arena, kv_of = tier_setup(tmp_path)
    try:
        tokens = np.arange(16, dtype=np.int32)
        slots = cache.allocator.alloc("w", 16)
        saved = kv_of(slots)
        cache.insert("m", tokens, slots)
        assert cache.evict(num_tokens=16) == 16  # spills 4 chunks, frees the slots now
        assert tier.holds_back("w", slots[:1])  # its block is still being read
        assert tier.poll(wait=10) == []
        assert not tier.holds_back("w", slots[:1])
        assert len(tier.store) == 4 and cache.cached_tokens("m") == 0

        a, b = looked_up(cache, "a", tokens), looked_up(cache, "b", tokens)
        plan = tier.plan_load(a)
        assert plan is not None and not isinstance(plan, str)
        assert (plan.start, plan.end) == (0, 16)
        a.slots = cache.allocator.alloc("w", 16)
        tier.start_load(a, plan)
        assert tier.plan_load(b) == "wait"  # those chunks are on their way already
        assert tier.poll(wait=10) == [a] and a.kv_len == 16
        assert (kv_of(a.slots) == saved).all()  # the bytes that were evicted, exactly
        assert tier.stats().tokens_loaded == {"m": 16}
    finally:
        tier.close(flush=False)
        arena.destroy()


def test_an_unloaded_models_kv_is_saved_and_loads_back_after_its_reload(tmp_path) -> None:
    import numpy as np

    cache, tier, arena, kv_of = tier_setup(tmp_path)
    try:
        spec = cache.model("m")
        long, short = np.arange(12, dtype=np.int32), np.arange(100, 110, dtype=np.int32)
        slots = {}
        for tokens in (long, short):
            slots[len(tokens)] = cache.allocator.alloc("w", len(tokens))
            cache.insert("m", tokens, slots[len(tokens)])
        saved = kv_of(slots[12])
        assert tier.save_unloaded("m") == 3 + 2  # whole 4-token chunks the store lacks
        assert cache.unregister_model("m") == 22  # freed in the tree at once ...
        assert tier.holds_back("w", slots[12][:1])  # ... but no batch writes them yet
        assert tier.poll(wait=10) == []
        assert not tier.holds_back("w", slots[12][:1])
        assert tier.stats().chunks_saved == {
            "capacity": 0,
            "unload": 5,
            "write_through": 0,
            "shutdown": 0,
        }

        cache.register_model(spec)  # the same weights again: the same pool and chunk keys
        req = looked_up(cache, "r", long)
        assert req.kv_len == 0
        plan = tier.plan_load(req)
        assert plan is not None and not isinstance(plan, str)
        assert (plan.start, plan.end) == (0, 12)
        req.slots = cache.allocator.alloc("w", 12)
        tier.start_load(req, plan)
        assert tier.poll(wait=10) == [req] and req.kv_len == 12
        assert (kv_of(req.slots) == saved).all()
    finally:
        tier.close(flush=False)
        arena.destroy()


def test_an_unloads_chunks_are_reported_stored_on_disk_for_the_unloaded_model(tmp_path) -> None:
    import numpy as np

    from radixmux.memory.tree_events import TreeEventLog
    from radixmux.scheduler.disk_events import DiskEvents

    cache, tier, arena, _ = tier_setup(tmp_path)
    try:
        cache.events = TreeEventLog()
        tier.events = DiskEvents(cache, cache.events, tier.chunk)
        cache.insert("m", np.arange(8, dtype=np.int32), cache.allocator.alloc("w", 8))
        tier.save_unloaded("m")
        cache.unregister_model("m")
        tier.poll(wait=10)  # written once m is gone: still m's KV (a router may route there)
        disk = [(e.kind, e.models, e.start) for e in cache.events.drain() if e.tier == "disk"]
        assert disk == [("stored", ("m",), 0), ("stored", ("m",), 4)]
    finally:
        tier.close(flush=False)
        arena.destroy()


def test_an_unload_saves_what_the_capacity_holds_and_nothing_an_alias_keeps(tmp_path) -> None:
    import numpy as np

    from radixmux.memory.kv_disk_store import file_bytes, namespace
    from radixmux.memory.layout import KVLayout

    layout = KVLayout(2, 1, 8, "float32")  # tier_setup's
    three_chunks = 3 * file_bytes(namespace("w", layout, 4), 4 * layout.bytes_per_token)
    cache, tier, arena, _ = tier_setup(tmp_path, capacity=three_chunks)
    try:
        spec = cache.model("m")
        old, new = np.arange(12, dtype=np.int32), np.arange(100, 112, dtype=np.int32)
        for tokens in (old, new):  # ``new`` is the most recently used
            cache.insert("m", tokens, cache.allocator.alloc("w", 12))
        alias = replace(spec, name="m2")
        cache.register_model(alias)
        assert tier.save_unloaded("m") == 0  # m2 still uses the same KV: nothing is dropped
        assert cache.unregister_model("m") == 0
        assert tier.save_unloaded("m2") == 3  # what the store holds: the newest path
        cache.unregister_model("m2")
        tier.poll(wait=10)
        assert len(tier.store) == 3 and tier.stats().chunks_saved["unload"] == 3
        cache.register_model(spec)
        for tokens, on_disk in ((new, 12), (old, 0)):
            plan = tier.plan_load(looked_up(cache, "r", tokens))
            assert (plan.end if plan is not None and not isinstance(plan, str) else 0) == on_disk
    finally:
        tier.close(flush=False)
        arena.destroy()


def test_a_graceful_close_saves_what_only_the_arena_holds(tmp_path) -> None:
    import numpy as np

    cache, tier, arena, _ = tier_setup(tmp_path)
    try:
        tokens = np.arange(10, dtype=np.int32)
        cache.insert("m", tokens, cache.allocator.alloc("w", 10))
        assert len(tier.store) == 0
        tier.close(flush=True)
        files = list((tmp_path / "kv").rglob("*.kv"))
        assert len(files) == 2  # the two whole 4-token chunks; the 2-token tail is not one
    finally:
        arena.destroy()


@pytest.mark.parametrize("kind", ["runs", "scattered", "one slot"])
def test_gather_and_scatter_copy_exactly_the_rows_of_their_slots(tmp_path, kind) -> None:
    import numpy as np
    import torch

    from radixmux.memory.arena import KVArena
    from radixmux.memory.kv_transfer import byte_view, gather, scatter
    from radixmux.memory.layout import BlockGeometry, KVLayout

    geometry = BlockGeometry(KVLayout(3, 2, 8, "bfloat16"), 8192, 1)  # 84 slots per block
    arena = KVArena.create(6, 8192, directory=str(tmp_path))
    try:
        view = byte_view(arena.bytes, geometry)
        spb = geometry.slots_per_block
        view.copy_(torch.randint(-(2**62), 2**62, view.shape, dtype=view.dtype))
        rng = np.random.default_rng(3)
        if kind == "runs":  # page runs crossing block edges, as the allocator hands them out
            slots = np.concatenate([np.arange(spb - 5, spb + 40), np.arange(4 * spb, 4 * spb + 30)])
        elif kind == "scattered":
            slots = rng.permutation(6 * spb)[:100]
        else:
            slots = np.array([2 * spb + 7])
        expect = torch.stack([view[s // spb, :, :, s % spb] for s in slots.tolist()])
        assert torch.equal(gather(view, slots), expect)
        dest = np.setdiff1d(np.arange(6 * spb), slots)[: len(slots)]
        if kind == "runs":
            dest = np.arange(2 * spb + 3, 2 * spb + 3 + len(slots))
        before = view.clone()
        scatter(view, dest, expect)
        assert torch.equal(gather(view, dest), expect)
        untouched = np.setdiff1d(np.arange(6 * spb), dest)
        flat = lambda v: v.permute(0, 3, 1, 2, 4, 5).reshape(6 * spb, -1)  # noqa: E731
        assert torch.equal(flat(view)[untouched], flat(before)[untouched])
    finally:
        arena.destroy()


def test_disk_flags_are_checked_and_default_off() -> None:
    from radixmux.common.server_args import DEFAULT_KV_DISK_DIR, ServerArgs, parse_args

    assert not ServerArgs().disk_tier and ServerArgs().kv_disk_dir is None
    on = parse_args(["--kv-disk-bytes", "1000000"])
    assert on.disk_tier and on.kv_disk_dir == DEFAULT_KV_DISK_DIR
    for bad, why in [
        ({"kv_disk_dir": "/tmp/x"}, "needs --kv-disk-bytes"),
        ({"kv_disk_bytes": 1 << 20, "disable_radix_cache": True}, "needs the radix cache"),
        ({"kv_disk_bytes": 1 << 20, "page_size": 16, "kv_disk_chunk_tokens": 40}, "multiple"),
        ({"kv_disk_bytes": 1 << 20, "kv_disk_write_policy": "lazy"}, "write-policy"),
        ({"kv_disk_bytes": -1}, ">= 0"),
    ]:
        with pytest.raises(ValueError, match=why):
            ServerArgs(**bad)
