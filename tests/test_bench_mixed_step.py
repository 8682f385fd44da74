"""``bench.bench_mixed_step``: its shapes parse, its batches are what they say, and a
tiny model's mixed step is timed and profiled op by op."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from conftest import BLOCK_BYTES, make_runner, tiny_model

from radixmux.bench import bench_mixed_step as bms
from radixmux.memory.arena import KVArena
from radixmux.protocol import unpack_ids


def test_shapes_parse_and_bad_ones_are_refused() -> None:
    assert bms.parse_chunks(["2x100@1000", "512@0"]) == ((100, 1000), (100, 1000), (512, 0))
    assert bms.parse_decodes("44x525") == (44, 525) and bms.parse_decodes("0x0") == (0, 0)
    for bad in (["100"], ["0@10"], ["x5@3"], ["-1@0"]):
        with pytest.raises(ValueError, match="NEW@CACHED"):
            bms.parse_chunks(bad)
    for bad in ("44", "3x0", "x3"):
        with pytest.raises(ValueError, match="DxCONTEXT"):
            bms.parse_decodes(bad)
    assert bms.main(["--chunks", "oops"]) == 2
    assert bms.main(["--chunks", "--decodes", "0x0"]) == 2  # nothing to run


@pytest.mark.parametrize("shared", [False, True])
def test_batches_lay_out_the_shape(shared: bool) -> None:
    shape = bms.StepShape(((5, 20), (3, 20)), decodes=2, context=7, shared_prefix=shared)
    batches = bms.MixedBatches(shape, vocab=50)
    fb = batches.batch()
    slots = [unpack_ids(s.slots) for s in fb.seqs]
    news = [unpack_ids(s.new_tokens) for s in fb.seqs]
    assert [len(s) for s in slots] == [7, 7, 25, 23]
    assert [len(n) for n in news] == [1, 1, 5, 3]
    assert all(0 <= t < 50 for n in news for t in n)
    chunk_a, chunk_b = slots[2], slots[3]
    assert (chunk_a[:20] == chunk_b[:20]).all() == shared  # one cached prefix, or one each
    own = [slots[0], slots[1], chunk_a[20:], chunk_b[20:]]
    assert len(np.unique(np.concatenate(own))) == sum(len(o) for o in own)  # no slot twice
    assert batches.slots_used == 7 * 2 + (20 if shared else 40) + 8
    assert unpack_ids(batches.batch().seqs[2].slots).tolist() == chunk_a.tolist()  # same slots


def test_a_tiny_models_mixed_step_is_timed_and_profiled() -> None:
    loaded = tiny_model("llama")
    shape = bms.StepShape(((6, 10),), decodes=3, context=9)
    batches = bms.MixedBatches(shape, loaded.info.vocab_size)
    arena = KVArena.create(num_blocks=8, block_bytes=BLOCK_BYTES)
    try:
        runner = make_runner(loaded, arena)
        fig = bms.measure(runner, batches, steps=3, profile_steps=2)
    finally:
        arena.destroy()
    assert fig.step_ms > 0 and fig.median_ms >= fig.step_ms
    assert fig.ops and fig.profiled_ms == pytest.approx(sum(o.ms_per_step for o in fig.ops))
    per_step = [o.ms_per_step for o in fig.ops]
    assert per_step == sorted(per_step, reverse=True)
    table = bms.format_table(fig, top=5)
    assert table.splitlines()[0].startswith("6@10 beside 3 decodes over 9 keys: step")
    assert len(table.splitlines()) == 2 + min(5, len(fig.ops))


def test_parse_args_defaults_are_a_random_c16_step() -> None:
    args = bms.parse_args([])
    assert isinstance(args, argparse.Namespace)
    assert bms.parse_chunks(args.chunks) == ((512, 0),)
    assert bms.parse_decodes(args.decodes) == (14, 530)
