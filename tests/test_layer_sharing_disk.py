"""Partial hits from the disk tier: a sibling's prompt spilled to disk.

A fine-tune asking a prompt its base ran finds the shared lower layers' K/V
(and the hidden states at their top) in the lower group's namespace on disk,
but none of its own layers': the load brings each lower group back as far as
it has chunks and its own (top) group as far as every group then holds the
prompt, and the request takes the in-memory partial-hit path (only its own
layers computed for the rest). From the plan and its consistency when a load
stops short (scheduler over fake runners, real arena and files) to real
processes (greedy output equal to the fine-tune served alone).
"""

from __future__ import annotations

import select
import time
from pathlib import Path

import numpy as np
import pytest
from test_layer_sharing import (
    LONG,
    fine_tune,
    harness,
    lower_group,
    new_tokens,
    serve_and_ask,
)
from test_scheduler_unit import Harness

from bench.tiny_models import make_tiny_model_dir
from radixmux.memory.kv_disk_store import chunk_keys, namespace, namespace_dir
from radixmux.scheduler import control, disk_holds

CHUNK = 8  # disk chunk tokens: two 4-token pages


def disk_harness(tmp_path: Path, restart: bool = True) -> Harness:
    """Models a, b (sharing layers 0-1) and c over a real arena, with a disk tier."""
    return harness(
        restart=restart,
        arena_dir=tmp_path,
        kv_disk_bytes=1 << 30,
        kv_disk_dir=str(tmp_path / "disk"),
        kv_disk_chunk_tokens=CHUNK,
    )


def settle(h: Harness, timeout: float = 10.0) -> None:
    """Let the I/O thread finish every disk job and the scheduler take the
    results, as its loop does (loaded requests queue again, held batches go)."""
    disk = h.sched.disk
    assert disk is not None
    deadline = time.monotonic() + timeout
    while disk.transfer.pending:
        assert time.monotonic() < deadline, "disk jobs did not finish"
        select.select([disk.fileno()], [], [], 0.1)
        disk_holds.disk_results(h.sched)
        h.sched.after_events()


def run(h: Harness, runner_id: str) -> None:
    """Run the runner's batches to the end, the disk settled before each."""
    settle(h)
    while h.inflight(runner_id) is not None:
        h.step(runner_id)
        settle(h)


def sibling_prompt_on_disk(h: Harness) -> None:
    """b ran the first 17 tokens (its own layers hold 16), a the 41 (the
    shared layers hold 40); then everything is spilled: on disk, b's own
    namespace has 2 chunks of the prompt, the shared one 5."""
    h.request("b-short", model="b", prompt=17, max_tokens=2)
    run(h, "b#0")
    h.request("a-long", model="a", prompt=41, max_tokens=2)
    run(h, "a#0")
    h.sched.cache.evict(num_tokens=1 << 20)
    settle(h)
    assert lower_group(h, "b").cached_tokens == 0 and h.sched.cache.cached_tokens("b") == 0


def chunk_file(h: Harness, name: str, index: int) -> Path:
    """The file of chunk ``index`` of the harness's prompt in ``name``'s namespace."""
    cache, disk = h.sched.cache, h.sched.disk
    assert disk is not None
    pool = cache.pool_of(name)
    ns = namespace(pool, cache.allocator.geometry(pool).layout, CHUNK)
    tokens = np.arange(1, 42, dtype=np.int32).tobytes()
    return Path(disk.store.path(namespace_dir(ns), chunk_keys(ns, tokens, CHUNK)[index]))


def ask_and_load(h: Harness) -> None:
    """b asks the 41-token prompt; its load runs to the end."""
    h.request("b-long", model="b", prompt=41, max_tokens=2)
    assert h.inflight("b#0") is None  # loading, not computing
    settle(h)


def test_a_sibling_prompt_on_disk_loads_the_shared_layers_past_the_own(tmp_path: Path) -> None:
    h = disk_harness(tmp_path)
    try:
        sibling_prompt_on_disk(h)
        ask_and_load(h)
        batch = h.inflight("b#0")
        assert batch is not None
        # b's own layers came back as far as they were on disk (16) and
        # compute the rest; the shared layers came back as far as a's prompt
        # (40) and compute only the last token.
        assert new_tokens(batch) == 41 - 16 and batch.seqs[0].lower_starts == [40]
        run(h, "b#0")
        disk = control.stats(h.sched).disk
        assert disk is not None and disk.loads == 1 and disk.tokens_loaded == {"b": 16}
        assert disk.chunks_loaded == 2 + 5
        assert lower_group(h, "b").tokens_reused == 40 - 16
        h.assert_clean()
    finally:
        assert h.sched.disk is not None
        h.sched.disk.close(flush=False)


@pytest.mark.parametrize(
    ("group", "bad", "own", "starts"),
    [
        ("b", 1, 8, [40]),  # b's own chunk 1: its layers hold 8, the shared ones 40
        ("b#layers0-2", 3, 16, [24]),  # the shared layers stop at 24, past b's 16
        ("b#layers0-2", 1, 8, []),  # ... at 8, short of b's 16: b keeps 8 of its own
    ],
)
def test_a_load_cut_short_by_a_bad_chunk_leaves_every_group_consistent(
    tmp_path: Path, group: str, bad: int, own: int, starts: list[int]
) -> None:
    h = disk_harness(tmp_path)
    try:
        sibling_prompt_on_disk(h)
        path = chunk_file(h, group, bad)
        path.write_bytes(path.read_bytes()[:100])  # truncated
        ask_and_load(h)
        batch = h.inflight("b#0")
        assert batch is not None
        assert new_tokens(batch) == 41 - own and batch.seqs[0].lower_starts == starts
        run(h, "b#0")
        disk = control.stats(h.sched).disk
        assert disk is not None and disk.chunks_dropped == 1
        assert disk.tokens_loaded == {"b": own}  # what its own layers use, no more
        assert lower_group(h, "b").tokens_reused == max(starts, default=own) - own
        h.assert_clean()  # no slot of the cut load leaked, every lock released
    finally:
        assert h.sched.disk is not None
        h.sched.disk.close(flush=False)


def test_without_restart_a_load_stops_where_every_group_has_chunks(tmp_path: Path) -> None:
    # A runner that cannot restart its upper layers would recompute the
    # shared layers past its own anyway: loading them would be for nothing.
    h = disk_harness(tmp_path, restart=False)
    try:
        sibling_prompt_on_disk(h)
        ask_and_load(h)
        batch = h.inflight("b#0")
        assert batch is not None
        assert new_tokens(batch) == 41 - 16 and batch.seqs[0].lower_starts == []
        run(h, "b#0")
        disk = control.stats(h.sched).disk
        assert disk is not None and disk.chunks_loaded == 2 + 2
        h.assert_clean()
    finally:
        assert h.sched.disk is not None
        h.sched.disk.close(flush=False)


# ---- real processes ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny base and a fine-tune of its upper two layers (of 4)."""
    root = tmp_path_factory.mktemp("layer-sharing-disk")
    base = make_tiny_model_dir(root / "base", seed=3, layers=4)
    return {"base": base, "ft": fine_tune(base, root / "ft", {2, 3})}


@pytest.mark.timeout(300)
def test_a_fine_tune_answers_a_spilled_sibling_prompt_as_alone(
    pair: dict[str, Path], tmp_path: Path
) -> None:
    prompt, fillers = LONG[0], LONG[1:3]
    alone, _ = serve_and_ask({"ft": pair["ft"]}, share=False, asks=[("ft", prompt)])
    # The base runs the prompt, then others that push it out of the small
    # arena onto disk; then the fine-tune asks it.
    asks = [("base", p) for p in (prompt, *fillers)] + [("ft", prompt)]
    shared, info = serve_and_ask(
        pair,
        share=True,
        asks=asks,
        kv_cache_bytes=2 << 20,  # about two of the ~700-token prompts, both groups
        kv_disk_bytes=1 << 30,
        kv_disk_dir=str(tmp_path / "disk"),
        # Chunks that end before the shared layers' start (~640): they
        # compute none of those layers' rows.
        chunked_prefill_size=256,
    )
    assert shared["ft"] == alone["ft"]
    disk = info["disk"]
    # The only load is the fine-tune's: the shared layers' chunks the base spilled.
    assert disk["loads"] == 1 and disk["chunks_loaded"] > 0
    assert "ft" not in disk["tokens_loaded"]  # none of its own layers were on disk
    [ft_lower] = [g for g in info["layer_groups"] if g["model"] == "ft" and g["start"] == 0]
    assert ft_lower["tokens_reused"] > 64  # a partial hit: only its own layers computed
    assert info["invariants"] in (None, "ok")
