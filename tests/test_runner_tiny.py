"""Paged attention on tiny random-weight models against transformers' own forward."""

from __future__ import annotations

import pytest
import torch
from conftest import Sequences, SlotPool, make_runner, reference_logits, seq, tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"]
TOL = 1e-4


@pytest.mark.parametrize("kind", ARCHS)
def test_prefill_matches_plain_forward(kind, arena):
    loaded = tiny_model(kind)
    ids = torch.randint(0, 211, (37,)).tolist()
    ref = reference_logits(loaded.model, ids)
    runner = make_runner(loaded, arena)
    slots = SlotPool(runner.num_slots).take(len(ids))
    got = runner.logits([seq("a", ids, slots, 0)])
    assert torch.allclose(got[0], ref[-1], atol=TOL), (got[0] - ref[-1]).abs().max()


def _check(step_logits, driver, loaded, tol=TOL):
    for rid, got in step_logits.items():
        ref = reference_logits(loaded.model, driver.ids[rid])[-1]
        err = (got - ref).abs().max().item()
        assert err < tol, f"{rid}: max |diff| {err}"


@pytest.mark.parametrize("kind", ARCHS)
def test_ragged_chunked_prefill_and_decode(kind, arena, backend):
    """16 sequences of different lengths: chunked prefills mixed with decodes."""
    loaded = tiny_model(kind)
    driver = Sequences(make_runner(loaded, arena, backend=backend))
    g = torch.Generator().manual_seed(1)
    prompts = {
        f"s{i}": torch.randint(0, 211, (int(n),), generator=g).tolist()
        for i, n in enumerate(torch.randint(1, 40, (16,), generator=g))
    }
    # Round 1: half the sequences prefill their first part (sampled anyway, to
    # check intermediate logits too).
    first = {rid: p[: max(1, len(p) // 2)] for rid, p in list(prompts.items())[:8]}
    _check(driver.step(first), driver, loaded)
    # Round 2: those finish their prompt while the other half prefill whole.
    second = {rid: prompts[rid][len(first[rid]) :] for rid in first if len(prompts[rid]) > 1}
    second.update({rid: p for rid, p in list(prompts.items())[8:]})
    _check(driver.step(second), driver, loaded)
    # Rounds 3-6: every sequence decodes its greedy token, all 16 in one batch.
    for _ in range(4):
        last = {rid: reference_logits(loaded.model, ids)[-1] for rid, ids in driver.ids.items()}
        work = {rid: [int(lg.argmax())] for rid, lg in last.items()}
        _check(driver.step(work), driver, loaded)
    lengths = {len(ids) for ids in driver.ids.values()}
    assert len(lengths) > 5  # the decode batch really was ragged


SLIDING = {
    "gemma2": dict(sliding_window=4),
    "gemma3": dict(sliding_window=4),
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "mistral": dict(sliding_window=5),
}


@pytest.mark.parametrize("kind", sorted(SLIDING))
def test_sliding_window_shorter_than_context(kind, arena, backend):
    loaded = tiny_model(kind, **SLIDING[kind])
    windows = loaded.info.sliding_windows
    assert any(w is not None and w <= 5 for w in windows), windows
    driver = Sequences(make_runner(loaded, arena, backend=backend))
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 211, (23,), generator=g).tolist()
    b = torch.randint(0, 211, (9,), generator=g).tolist()
    _check(driver.step({"a": a[:11], "b": b}), driver, loaded)
    _check(driver.step({"a": a[11:]}), driver, loaded)
    for t in range(6):
        _check(driver.step({"a": [t + 3], "b": [t + 7]}), driver, loaded)
    # The window matters: full attention over the same tokens gives other logits.
    full = tiny_model(kind)
    with torch.no_grad():
        for p_full, p_win in zip(full.model.parameters(), loaded.model.parameters(), strict=True):
            p_full.copy_(p_win)
    diff = reference_logits(full.model, driver.ids["a"])[-1] - driver.step({"a": [1]})["a"]
    assert diff.abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_cached_prefix_served_from_arena(kind, arena, backend):
    """A second sequence reuses the first one's prefix slots (a radix cache hit)."""
    loaded = tiny_model(kind)
    runner = make_runner(loaded, arena, backend=backend)
    assert runner.use_kernel == (backend == "cpp")
    pool = SlotPool(runner.num_slots, seed=3)
    ids = torch.randint(0, 211, (30,)).tolist()
    prefix_slots = pool.take(20)
    runner.logits([seq("first", ids[:20], prefix_slots, 0)])
    tail_slots = pool.take(10)
    got = runner.logits([seq("second", ids[20:], prefix_slots + tail_slots, 20)])[0]
    ref = reference_logits(loaded.model, ids)[-1]
    assert (got - ref).abs().max() < TOL
    # Corrupting the cached K proves the prefix really is read from the arena.
    blk, off = prefix_slots[0] // runner.slots_per_block, prefix_slots[0] % runner.slots_per_block
    runner.kv[blk, :, 0, off] += 5.0
    bad = runner.logits([seq("third", ids[29:], prefix_slots + tail_slots, 29)])[0]
    assert (bad - ref).abs().max() > 1e-3


def test_malformed_slots_refuse_the_batch(arena):
    """A sequence whose slots repeat (two tokens' K/V in one row) or leave the
    arena gets the whole batch refused, naming it, before anything is written;
    the same batch with distinct slots runs."""
    from radixmux.protocol import ForwardBatch

    loaded = tiny_model("llama")
    runner = make_runner(loaded, arena)
    slots = list(range(40, 52))
    ids = list(range(3, 15))
    ok = runner.forward(ForwardBatch(1, [seq("ok", ids, slots, 0)]))
    assert ok.error is None and ok.outputs[0].token_id >= 0
    for rid, bad in (("dup", [*slots[:11], slots[3]]), ("far", [*slots[:11], 10**9])):
        res = runner.forward(ForwardBatch(2, [seq("ok", ids, slots, 0), seq(rid, ids, bad, 0)]))
        assert not res.outputs and res.error is not None and res.error.startswith(rid)
    res = runner.forward(ForwardBatch(3, [seq("dup", ids, [*slots[:11], slots[3]], 0)]))
    assert res.error == "dup: repeated slot ids"


def test_fast_and_fallback_kv_store_agree():
    """Row-grid gathers (block size a multiple of a head's K row) and (block,
    offset) gathers give the same logits; both paths are exercised."""
    from radixmux.memory.arena import KVArena

    # head_dim 24: 96-byte head rows, which 64 KiB blocks do not divide.
    loaded = tiny_model("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=144)
    head_bytes = 24 * 4
    results = {}
    for block in (64 * 1024, 3 * 64 * 1024):
        with KVArena.create(num_blocks=16, block_bytes=block) as a:
            runner = make_runner(loaded, a)
            results[runner.store.fast] = Sequences(runner, seed=4)
            assert runner.store.fast == (block % head_bytes == 0)
    assert set(results) == {True, False}
    g = torch.Generator().manual_seed(5)
    work = {
        f"s{i}": torch.randint(0, 211, (n,), generator=g).tolist() for i, n in enumerate([9, 1, 30])
    }
    got = {fast: d.step(work) for fast, d in results.items()}
    for rid in work:
        assert torch.allclose(got[True][rid], got[False][rid], atol=1e-5)
        ref = reference_logits(loaded.model, results[True].ids[rid])[-1]
        assert (got[True][rid] - ref).abs().max() < TOL


def test_soft_capping_is_applied(arena):
    """Gemma 2 caps attention scores and final logits; both show in the output."""
    loaded = tiny_model("gemma2")
    runner = make_runner(loaded, arena)
    ids = torch.randint(0, 211, (20,)).tolist()
    got = runner.logits([seq("a", ids, SlotPool(runner.num_slots).take(20), 0)])[0]
    assert got.abs().max() <= 3.0 + 1e-5  # final_logit_softcapping = 3
    assert (got - reference_logits(loaded.model, ids)[-1]).abs().max() < TOL


def test_bfloat16_close_to_float32(arena):
    """A bfloat16 runner (bf16 KV in the arena) tracks the float32 model."""
    loaded32 = tiny_model("llama", seed=7)
    loaded16 = tiny_model("llama", seed=7, dtype="bfloat16")
    assert loaded16.info.layout.dtype == "bfloat16"
    assert loaded16.info.kv_share_key != loaded32.info.kv_share_key
    runner = make_runner(loaded16, arena)
    assert runner.kv.dtype == torch.bfloat16
    ids = torch.randint(0, 211, (25,)).tolist()
    driver = Sequences(runner)
    got = driver.step({"a": ids[:20]})["a"]
    got = driver.step({"a": ids[20:21]})["a"]
    ref = reference_logits(loaded32.model, ids[:21])[-1]
    assert (got - ref).abs().max() < 0.05
    assert int(got.argmax()) == int(ref.argmax())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_linear_weights_match_plain(dtype):
    """Packing every linear layer for oneDNN leaves the logits as they were."""
    from radixmux.model_runners.packed_linear import (
        PackedLinear,
        pack_linear_weights,
        packing_works,
        packs_float32,
    )

    plain = tiny_model("qwen2", dtype=dtype)  # q/k/v biases: the bias path too
    packed = tiny_model("qwen2", dtype=dtype)
    ids = torch.randint(0, 211, (19,)).tolist()
    if not packing_works(getattr(torch, dtype)) or (dtype == "float32" and not packs_float32()):
        # e.g. bfloat16 on a CPU without AVX-512, or float32 values (not bfloat16
        # ones, test_widen_linear.py) below AVX-512: nothing is swapped, nothing breaks.
        assert pack_linear_weights(packed.model) == 0
        assert not any(isinstance(m, PackedLinear) for m in packed.model.modules())
        assert torch.equal(reference_logits(packed.model, ids), reference_logits(plain.model, ids))
        return
    assert pack_linear_weights(packed.model) > 0
    assert not any(type(m) is torch.nn.Linear for m in packed.model.modules())
    assert any(m.bias is not None for m in packed.model.modules() if isinstance(m, PackedLinear))
    diff = reference_logits(packed.model, ids) - reference_logits(plain.model, ids)
    assert diff.abs().max() < (1e-4 if dtype == "float32" else 1e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_linear_row_shapes_are_few_and_warmed(dtype):
    """Any row count is padded to a shape that ``row_counts`` lists (so a
    warm-up builds every oneDNN primitive serving will use), with the same
    results and one oneDNN call."""
    from radixmux.model_runners.packed_linear import (
        PackedLinear,
        packing_works,
        row_counts,
        warm_up,
    )

    if not packing_works(getattr(torch, dtype)):
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU")
    lin = torch.nn.Linear(32, 48).to(getattr(torch, dtype))
    packed = PackedLinear(lin)
    seen: list[int] = []
    real = packed._linear
    packed._linear = lambda x: (seen.append(x.shape[0]), real(x))[1]
    for shape in ((1,), (63,), (64,), (65,), (130,), (200,), (576,), (5, 26)):
        x = torch.randn(*shape, 32).to(lin.weight.dtype)
        want = lin(x)
        got = packed(x)
        assert got.shape == want.shape and got.is_contiguous()
        assert (got.float() - want.float()).abs().max() < (1e-4 if dtype == "float32" else 3e-2)
    assert seen == [1, 63, 64, 128, 192, 256, 576, 192]  # one call each, padded up
    assert set(seen) <= set(row_counts(576)) and len(row_counts(576)) == 64 + 8
    assert row_counts(577)[-1] == 640
    model = torch.nn.Sequential(PackedLinear(lin), torch.nn.ReLU(), PackedLinear(lin))
    assert warm_up(model, 576) == len(row_counts(576))  # one shape, warmed once


def test_warm_up_sizes_the_output_projection_by_sequences(monkeypatch: pytest.MonkeyPatch):
    """The output projection sees one row per sampled sequence, never a whole
    prefill's tokens: warming it at every token count wasted minutes of start-up
    on a 262k vocabulary."""
    from radixmux.model_runners import packed_linear
    from radixmux.model_runners.packed_linear import (
        PackedLinear,
        pack_linear_weights,
        row_counts,
        warm_up,
    )

    # oneDNN packs float32 on any CPU; below AVX-512 it is only slower (packs_float32).
    monkeypatch.setattr(packed_linear, "packs_float32", lambda: True)
    model = tiny_model("llama").model
    pack_linear_weights(model)
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear)
    seen: list[int] = []
    real = head._linear
    head._linear = lambda x: (seen.append(x.shape[0]), real(x))[1]
    warm_up(model, 576, max_sequences=8)
    assert sorted(seen) == row_counts(8)
    seen.clear()
    warm_up(model, 576)  # no bound given: every token count, as before
    assert sorted(seen) == row_counts(576)


def test_model_info_counts_the_weights_as_loaded():
    """``weight_bytes``: parameters and buffers before packing, a tied matrix once."""
    tied = tiny_model("llama", dtype="bfloat16", tie_word_embeddings=True)
    untied = tiny_model("llama", dtype="bfloat16")
    params = sum(p.nbytes for p in untied.model.parameters())
    buffers = sum(b.nbytes for b in untied.model.buffers())
    assert untied.info.weight_bytes == params + buffers
    assert tied.info.weight_bytes == untied.info.weight_bytes - 211 * 64 * 2


def test_float32_layers_stay_plain_below_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    # oneDNN's packed float32 layout loses to its plain product on AVX2 (packs_float32).
    from radixmux.model_runners import packed_linear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    model = tiny_model("llama", dtype="float32").model
    x = torch.randint(0, 100, (1, 7))
    want = model(x).logits
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not packed_linear.packs_float32()
    assert packed_linear.pack_linear_weights(model) == 0
    assert not any(isinstance(m, packed_linear.PackedLinear) for m in model.modules())
    assert torch.equal(model(x).logits, want)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert packed_linear.packs_float32()
    bf16 = tiny_model("llama", dtype="bfloat16").model
    if packed_linear.packing_works(torch.bfloat16):  # (oneDNN's bf16 needs AVX-512)
        assert packed_linear.pack_linear_weights(bf16) > 0  # whatever torch's capability
