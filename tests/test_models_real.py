"""The embedded pretrained models through the runner vs transformers' own generate.

For SmolLM2 (Llama) and Gemma 3 270M, in float32: five prompts, greedy 32
tokens, KV in the shared arena, token for token equal to ``generate``; the same
when each prompt's first part comes from previously written slots (a cache
hit) and when prompts are prefilled in several chunks. Final-position logits
agree with a plain forward within 1e-3. The runner's models are loaded as
served (linear weights packed for oneDNN); every reference is a second copy
loaded as plain transformers.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SlotPool, make_runner, seq

from radixmux.memory.arena import KVArena
from radixmux.protocol import ForwardBatch, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Here is a list of three fruits: apple,",
    "Water boils at a temperature of",
]
NEW_TOKENS = 32
MODELS = ["smollm2", "gemma3-270m"]
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def real_arena():
    a = KVArena.create(num_blocks=64, block_bytes=1 << 20)
    try:
        yield a
    finally:
        a.destroy()


_reference: dict[str, list[list[int]]] = {}


@pytest.fixture(scope="module")
def plain_models():
    """Both models as plain transformers (no packed weights, no fused ops): the references."""
    from radixmux.model_runners.loader import load_model

    return {
        name: load_model(name, dtype="float32", pack_weights=False, fuse_ops=False)
        for name in MODELS
    }


def hf_generate(loaded, name: str) -> list[list[int]]:
    """transformers' own greedy generate (its own cache, SDPA), new tokens only."""
    if name not in _reference:
        from conftest import plain_attention

        outs = []
        with plain_attention(loaded.model), torch.inference_mode():
            for prompt in PROMPTS:
                ids = loaded.tokenizer(prompt, return_tensors="pt").input_ids
                mask = torch.ones_like(ids)
                gen = loaded.model.generate(
                    ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
                )
                outs.append(gen[0, ids.shape[1] :].tolist())
        _reference[name] = outs
    return _reference[name]


def runner_generate(runner, tokenizer, mode: str) -> list[list[int]]:
    """Greedy 32 tokens for every prompt at once, prefilled as ``mode`` says."""
    pool = SlotPool(runner.num_slots, seed=len(mode))
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    slots = [[] for _ in prompts]
    if mode == "cached":
        # An earlier request wrote each prompt's first half; the new requests
        # reuse those slots and prefill only the rest.
        cut = [len(p) // 2 for p in prompts]
        warm = []
        for i, p in enumerate(prompts):
            slots[i] = pool.take(cut[i])
            warm.append(seq(f"warm{i}", p[: cut[i]], slots[i], 0, sample=False))
        runner.forward(ForwardBatch(0, warm))
        chunks = [[(cut[i], len(p))] for i, p in enumerate(prompts)]
    elif mode == "chunked":
        chunks = []
        for p in prompts:
            a, b = len(p) // 3, 2 * len(p) // 3
            chunks.append([(0, a), (a, b), (b, len(p))] if a > 0 else [(0, len(p))])
    else:
        chunks = [[(0, len(p))] for p in prompts]

    outputs: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(chunks):
        batch = []
        for i, p in enumerate(prompts):
            if not chunks[i]:
                continue
            lo, hi = chunks[i].pop(0)
            slots[i] += pool.take(hi - lo)
            batch.append(seq(f"r{i}", p[lo:hi], list(slots[i]), lo, not chunks[i], params=GREEDY))
        step += 1
        res = runner.forward(ForwardBatch(step, batch))
        assert res.error is None, res.error
        for s, out in zip(batch, res.outputs, strict=True):
            if out.token_id >= 0:
                outputs[int(s.rid[1:])].append(out.token_id)
    while len(outputs[0]) < NEW_TOKENS:
        batch = []
        for i, p in enumerate(prompts):
            slots[i] += pool.take(1)
            ctx = p + outputs[i]
            batch.append(seq(f"r{i}", ctx[-1:], list(slots[i]), len(ctx) - 1, params=GREEDY))
        step += 1
        res = runner.forward(ForwardBatch(step, batch))
        assert res.error is None, res.error
        for i, out in enumerate(res.outputs):
            outputs[i].append(out.token_id)
    return outputs


@pytest.mark.parametrize("mode", ["whole", "cached", "chunked"])
@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_generate(name, mode, real_models, plain_models, real_arena):
    from radixmux.model_runners.packed_linear import PackedLinear, packs_float32, widens_float32

    loaded = real_models[name]
    # Packed where float32 packs (AVX-512); below it (AVX2) these de-quantised
    # weights are held as 4/8-bit grids and widened per call (but Gemma's Q6_K
    # layers, on no grid of 32, which stay plain).
    layers = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    if packs_float32():
        assert layers and all(m.widen is None for m in layers)
    elif widens_float32():
        kinds = {m.widen_kind for m in layers}
        assert kinds == {"4-bit grid", "8-bit grid"}  # (SmolLM2: Q4_1 layers, a Q8_0 head)
        plain = [m for m in loaded.model.modules() if type(m) is torch.nn.Linear]
        assert name != "smollm2" or not plain  # every layer and the head
    else:
        assert not layers
    ref = hf_generate(plain_models[name], name)
    runner = make_runner(loaded, real_arena)
    got = runner_generate(runner, loaded.tokenizer, mode)
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        assert len(r) >= 8, f"prompt {i}: generate stopped after {len(r)} tokens"
        assert g[: len(r)] == r, f"{name}/{mode} prompt {i}:\n{r}\n{g}"


@pytest.mark.parametrize("name", MODELS)
def test_final_logits_match_plain_forward(name, real_models, plain_models, real_arena):
    from conftest import reference_logits

    loaded = real_models[name]
    runner = make_runner(loaded, real_arena)
    pool = SlotPool(runner.num_slots, seed=9)
    prompts = [loaded.tokenizer(p).input_ids for p in PROMPTS]
    batch = [seq(f"r{i}", p, pool.take(len(p)), 0) for i, p in enumerate(prompts)]
    got = runner.logits(batch)
    for i, p in enumerate(prompts):
        ref = reference_logits(plain_models[name].model, p)[-1]
        err = (got[i] - ref).abs().max().item()
        assert err < 1e-3, f"{name} prompt {i}: max |diff| {err}"


def test_gemma_past_its_sliding_window(real_models, plain_models, real_arena):
    """A 700-token context exceeds Gemma 3's 512-token window: sliding layers
    must forget what full-attention layers still see."""
    from conftest import Sequences, reference_logits

    loaded = real_models["gemma3-270m"]
    text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(120))
    ids = loaded.tokenizer(text).input_ids[:700]
    assert len(ids) == 700
    driver = Sequences(make_runner(loaded, real_arena), seed=11)
    driver.step({"a": ids[:400]})
    driver.step({"a": ids[400:698]})
    got = driver.step({"a": ids[698:699]})["a"]
    got2 = driver.step({"a": ids[699:700]})["a"]
    ref = reference_logits(plain_models["gemma3-270m"].model, ids)
    assert (got - ref[698]).abs().max() < 1e-3
    assert (got2 - ref[699]).abs().max() < 1e-3
