"""``--kv-cache-dtype bfloat16``: a float32 model's K/V stored in bfloat16.

Half a token's bytes; the runner writes and reads the rounded rows (its logits
move by the rounding, no more); a server with such an arena answers, and the
flag turns layer sharing off as fp8 does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import SlotPool, make_runner, seq, tiny_model

from bench.tiny_models import make_tiny_model_dir
from radixmux.common.server_args import ServerArgs
from radixmux.memory.arena import KVArena
from radixmux.memory.layout import KVLayout
from radixmux.model_runners.loader import LoadedModel, describe
from radixmux.scheduler.bootstrap import layer_sharing


def test_the_flag_halves_a_float32_tokens_bytes() -> None:
    assert 2 * KVLayout(30, 3, 64, "bfloat16").bytes_per_token == (
        KVLayout(30, 3, 64, "float32").bytes_per_token
    )
    assert ServerArgs(kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    assert not layer_sharing(ServerArgs(kv_cache_dtype="bfloat16"))


def _logits(kv_dtype: str | None) -> torch.Tensor:
    tiny = tiny_model("llama", seed=4)
    info = describe(tiny.model, None, "llama", "float32", "cpu", kv_dtype)
    loaded = LoadedModel(tiny.model, None, info, "llama", 0.0)
    arena = KVArena.create(num_blocks=8, block_bytes=1 << 18)
    try:
        runner = make_runner(loaded, arena)
        assert runner.kv.dtype == getattr(torch, kv_dtype or "float32")
        pool = SlotPool(runner.num_slots, seed=1)
        prompt, cut = list(range(3, 40)), 30
        # The first part's K/V go to the arena; the rest attends over them from there.
        first = pool.take(cut)
        runner.logits([seq("a", prompt[:cut], first, 0)])
        rest = seq("b", prompt[cut:], first + pool.take(len(prompt) - cut), cut)
        return runner.logits([rest]).clone()
    finally:
        arena.destroy()


def test_a_float32_model_over_bfloat16_rows_moves_by_the_rounding() -> None:
    exact, rounded = _logits(None), _logits("bfloat16")
    diff = (exact - rounded).abs().max().item()
    assert 0 < diff < 2e-2  # the rows were rounded (not float32), and only that
    assert torch.equal(exact.argmax(-1), rounded.argmax(-1))
    assert torch.equal(_logits(None), exact)  # (the same run twice: the same bits)


def test_a_server_with_a_bfloat16_arena_for_a_float32_model(tmp_path: Path) -> None:
    from radixmux.runtime.client.engine import Engine

    folder = make_tiny_model_dir(tmp_path / "tiny", seed=3)
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    prompts = ["Name a colour. " * 8 + "Now.", "Name a colour. " * 8 + "Again."]
    with Engine(
        model=[f"{folder},name=tiny"],
        kv_cache_bytes=16 << 20,
        kv_block_bytes=64 << 10,
        runner_threads=1,
        dtype="float32",
        kv_cache_dtype="bfloat16",
    ) as engine:
        first = engine.generate(prompts[0], greedy)[0]
        both = engine.generate(prompts, greedy)
    assert len(first.token_ids) == 8 and all(len(b.token_ids) == 8 for b in both)
    assert all(b.cached_tokens > 0 for b in both)  # the shared start came from the arena
