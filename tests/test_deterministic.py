"""Deterministic mode (``--deterministic``): bit-identical results whatever the
batch, the chunking or the cache state, in bfloat16.

Three levels, each on real parts: the attention kernel (a token's attention
computed as a decode, inside prefill chunks of several sizes, alone or beside
other sequences), a runner over tiny random-weight models (logits of every
step, through the fused kernels and the small-batch linear kernel), and a
whole server (greedy tokens and their logprobs with the cache on, warm and
batched, against a server with the cache off and another chunk size).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

from bench.bench_deterministic import Answer, ask
from bench.tiny_models import make_tiny_model_dir
from radixmux import protocol
from radixmux.memory.arena import KVArena
from radixmux.memory.layout import BlockGeometry
from radixmux.model_runners import batch_invariance, paged_decode
from radixmux.model_runners.batch_invariance import (
    AttentionShape,
    DeterminismUnsupported,
    attention_varies,
    check_deterministic,
    varying_rows,
)
from radixmux.model_runners.model_runner import ModelRunner
from radixmux.model_runners.packed_linear import pack_linear_weights
from radixmux.model_runners.paged_attention import DecodeGroups
from radixmux.runtime.client.engine import Engine
from tests.conftest import (
    Sequences,
    SlotPool,
    force_decode_groups,
    fused_copy,
    seq,
    tiny_model,
)

pytestmark = pytest.mark.timeout(300)


def _tiled(head_dim: int) -> bool:
    return paged_decode.load() and paged_decode.has_tiled_path(head_dim)


needs_tiles = pytest.mark.skipif(
    not _tiled(16), reason="deterministic mode needs the kernel's vector tiles"
)


# ---- the attention kernel ------------------------------------------------------------------
SHAPES = [
    AttentionShape(9, 3, 64, None, torch.bfloat16),  # SmolLM2
    AttentionShape(9, 3, 64, 100, torch.bfloat16),  # a window, tiles not at the run's start
    AttentionShape(4, 1, 256, 150, torch.bfloat16),  # Gemma 3's local layers
    AttentionShape(4, 2, 16, None, torch.float32),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_rows_do_not_depend_on_chunk_or_batch(shape):
    """A token's attention is the same bits in one prefill, in chunks of 7 or
    100, and as a decode alone or beside others (the load-time probe)."""
    if not _tiled(shape.head_dim):
        pytest.skip("no vector tiles for this head size here")
    assert attention_varies(shape) is None


def test_default_arithmetic_does_depend_on_them():
    """The probe has teeth: the default mode's fastest path per shape does vary."""
    if not _tiled(64):
        pytest.skip("no vector tiles here")
    assert any(attention_varies(s, deterministic=False) for s in SHAPES[:3])


# ---- a runner over tiny models ---------------------------------------------------------------
def _runner(kind: str, arena: KVArena, deterministic: bool = True, **overrides) -> ModelRunner:
    loaded = tiny_model(kind, seed=3, dtype="bfloat16", **overrides)
    served = fused_copy(loaded)
    pack_linear_weights(served.model, deterministic=deterministic)
    geometry = BlockGeometry(served.info.layout, arena.spec.block_bytes, 1)
    return ModelRunner(served, arena.view(geometry), deterministic=deterministic)


@needs_tiles
@pytest.mark.parametrize(
    ("kind", "overrides"),
    [("llama", {}), ("gemma3", {"sliding_window": 40})],
)
def test_runner_logits_identical_in_any_batch_chunking_or_cache_state(kind, overrides):
    arena = KVArena.create(num_blocks=96, block_bytes=64 * 1024)
    try:
        runner = _runner(kind, arena, **overrides)
        vocab = runner.info.vocab_size
        prompt = [int(t) for t in torch.randint(0, vocab, (150,), generator=torch.Generator())]
        other = [(7 * i + 3) % vocab for i in range(90)]
        follow = [11, 23, 5, 42, 17, 8]  # fed as decodes, one per step

        # A: the prompt in one prefill, then decodes alone.
        a = Sequences(runner, seed=1)
        want = [a.step({"a": prompt})["a"]]
        want += [a.step({"a": [t]})["a"] for t in follow]

        # B: chunks of 13 beside another sequence's chunks, then decodes beside its decodes.
        b = Sequences(runner)
        b.pool = a.pool  # one pool: no sequence overwrites another's K/V
        got_b = []
        for s in range(0, len(prompt), 13):
            work = {"b": prompt[s : s + 13]}
            if s < len(other):
                work["x"] = other[s : s + 13]
            got_b.append(b.step(work)["b"])
        got = [got_b[-1]] + [b.step({"x": [1], "b": [t]})["b"] for t in follow]
        for step, (w, g) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(w, g), f"{kind}: step {step} differs chunked and batched"

        # C: the first 128 tokens from A's slots (a cache hit), the rest as one extend.
        c = Sequences(runner)
        c.pool = a.pool
        c.ids["c"], c.slots["c"] = list(prompt[:128]), list(a.slots["a"][:128])
        got = [c.step({"c": prompt[128:]})["c"]]
        got += [c.step({"c": [t]})["c"] for t in follow]
        for step, (w, g) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(w, g), f"{kind}: step {step} differs over a cached prefix"
    finally:
        arena.destroy()


@needs_tiles
@pytest.mark.parametrize(
    ("kind", "overrides"),
    [("llama", {}), ("gemma3", {"sliding_window": 40}), ("gemma3", {"sliding_window": 30})],
)
def test_runner_grouped_decodes_identical_to_ungrouped(kind, overrides):
    """Six decodes over one cached 150-token prompt, in two prefix groups and
    in none: the same logits bit for bit at every step. Grouped, each member
    resumes its group's prefix state at key 128 (with a 30-key window the
    members' windows start in different tiles, and the group is dropped)."""
    arena = KVArena.create(num_blocks=96, block_bytes=64 * 1024)
    try:
        runner = _runner(kind, arena, **overrides)
        assert runner.ungrouped_why is None  # the load probe found grouped decodes exact
        vocab = runner.info.vocab_size
        pool = SlotPool(runner.num_slots)
        prompt = [(5 * i + 1) % vocab for i in range(150)]
        shared = pool.take(len(prompt))
        runner.logits([seq("prompt", prompt, shared, 0)])  # the cached prefix
        ids, slots, batch = {}, {}, []
        for i in range(6):
            own = [(13 * i + 7 * j) % vocab for j in range(1 + 2 * i)]
            ids[i], slots[i] = prompt + own, shared + pool.take(len(own))
            batch.append(seq(f"r{i}", own, slots[i], len(prompt)))
        runner.logits(batch)
        groups = DecodeGroups.build(6, [[0, 1, 2, 3], [4, 5]], [150, 150])
        for step in range(3):
            batch = []
            for i in range(6):
                ids[i].append((step * 31 + len(ids[i])) % vocab)
                slots[i] += pool.take(1)
                batch.append(seq(f"r{i}", ids[i][-1:], slots[i], len(ids[i]) - 1))
            force_decode_groups(runner, None)
            plain = runner.logits(batch)  # writing a token's K/V twice stores the same values
            force_decode_groups(runner, groups)
            assert torch.equal(runner.logits(batch), plain), f"step {step}"
    finally:
        arena.destroy()


@needs_tiles
def test_grouped_decodes_that_vary_turn_groups_off_not_the_mode(monkeypatch):
    """Where only grouped decodes give other bits (the resume path is built per
    instruction set and cannot run on every CPU the suite does), the runner
    keeps --deterministic and stops grouping; any other difference refuses it."""
    probe = batch_invariance.probe_attention
    where = "as a decode at position 50 in a group sharing a prefix"

    def grouped_vary(shape, deterministic=True):
        found = probe(shape, deterministic)
        return batch_invariance.AttentionDifference(found.ungrouped, where)

    arena = KVArena.create(num_blocks=8, block_bytes=64 * 1024)
    try:
        monkeypatch.setattr(batch_invariance, "probe_attention", grouped_vary)
        runner = _runner("llama", arena)
        assert runner.deterministic and where in (runner.ungrouped_why or "")
        group = protocol.PrefixGroup(4, [0, 1])
        assert runner._decode_groups([0, 1], [group]) is None
        monkeypatch.setattr(batch_invariance, "probe_attention", probe)
        assert _runner("llama", arena)._decode_groups([0, 1], [group]) is not None

        def chunks_vary(shape, deterministic=True):
            return batch_invariance.AttentionDifference("in prefill chunks of 7")

        monkeypatch.setattr(batch_invariance, "probe_attention", chunks_vary)
        with pytest.raises(DeterminismUnsupported, match="prefill chunks of 7"):
            _runner("llama", arena)
    finally:
        arena.destroy()


@needs_tiles
def test_deterministic_refuses_the_torch_attention_backend():
    arena = KVArena.create(num_blocks=8, block_bytes=64 * 1024)
    try:
        loaded = tiny_model("llama", dtype="bfloat16")
        geometry = BlockGeometry(loaded.info.layout, arena.spec.block_bytes, 1)
        with pytest.raises(DeterminismUnsupported, match="C\\+\\+ attention kernel"):
            ModelRunner(loaded, arena.view(geometry), "torch", deterministic=True)
    finally:
        arena.destroy()


class _BatchMeanLinear(nn.Linear):
    """A linear layer whose rows depend on their batch-mates (it subtracts the
    batch mean): what the load-time probe exists to catch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y - y.mean(0, keepdim=True)


def test_probe_finds_a_layer_whose_rows_depend_on_the_batch():
    torch.manual_seed(0)
    plain = nn.Linear(32, 48).bfloat16()
    assert varying_rows(plain) is None or not _tiled(16)
    odd = _BatchMeanLinear(32, 48).bfloat16()
    assert varying_rows(odd) == 1
    model = nn.Sequential(plain, odd)
    if _tiled(16):
        with pytest.raises(DeterminismUnsupported, match="1 rows"):
            check_deterministic(model, use_kernel=True, head_dim=16)


# ---- a whole server --------------------------------------------------------------------------
SYSTEM = "You are a terse assistant who answers in one line. " * 6
PROMPTS = [SYSTEM + f"Question {i}: name {i + 2} colours of the sea." for i in range(5)]


async def _answers(url: str, prompts: list[str]) -> list[Answer]:
    return await ask(url, prompts, 12, model="m")


def _serve(folder: Path, **flags: object) -> Engine:
    return Engine(
        model=[f"{folder},name=m"],
        dtype="bfloat16",
        deterministic=True,
        kv_cache_bytes=16 << 20,
        kv_block_bytes=64 << 10,
        runner_threads=1,
        **flags,
    )


@needs_tiles
def test_server_answers_identical_cached_batched_and_uncached(tmp_path: Path):
    folder = make_tiny_model_dir(tmp_path / "m", seed=5, layers=3, hidden=128)
    engine = _serve(folder, chunked_prefill_size=32)
    try:
        url = f"http://127.0.0.1:{engine.args.port}"
        alone = [asyncio.run(_answers(url, [p]))[0] for p in PROMPTS]  # one at a time, cold-ish
        batched = asyncio.run(_answers(url, PROMPTS))  # all at once, the system prompt cached
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        engine.shutdown()
    assert "radixmux_cache_hit" in metrics
    assert alone == batched
    engine = _serve(folder, chunked_prefill_size=48, disable_radix_cache=True)
    try:
        url = f"http://127.0.0.1:{engine.args.port}"
        uncached = asyncio.run(_answers(url, list(reversed(PROMPTS))))[::-1]
    finally:
        engine.shutdown()
    assert uncached == alone
