"""Shared-prefix (cascade) decode through the runner: same logits with and without groups."""

from __future__ import annotations

import pytest
import torch
from conftest import SlotPool, force_decode_groups, make_runner, reference_logits, seq, tiny_model

from radixmux.model_runners import paged_decode
from radixmux.model_runners.paged_attention import DecodeGroups

pytestmark = pytest.mark.skipif(
    not paged_decode.load(), reason=f"kernel not built: {paged_decode.error()}"
)


CASES = [
    ("llama", "float32", {}),
    ("llama", "bfloat16", {}),  # bfloat16 dot products in the tiled path
    ("gemma2", "float32", {"sliding_window": 6}),  # soft-capping, a window inside the prefix
    ("gemma3", "bfloat16", {"sliding_window": 6}),  # sliding and full layers
]


@pytest.mark.parametrize(("kind", "dtype", "overrides"), CASES)
def test_logits_equal_with_and_without_groups(kind, dtype, overrides, arena):
    """Eight requests over one cached 40-token prompt (plus two loners) decode together.

    Two groups (six members, then two) share the prompt: enough query rows
    for the kernel's tiled path and a group too small for it.
    """
    loaded = tiny_model(kind, dtype=dtype, **overrides)
    runner = make_runner(loaded, arena, backend="cpp")
    pool = SlotPool(runner.num_slots)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 211, (40,), generator=g).tolist()
    shared = pool.take(len(prompt))
    runner.logits([seq("prompt", prompt, shared, 0)])  # the cached prefix
    ids, slots = {}, {}
    batch = []
    for i in range(10):
        own = torch.randint(0, 211, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        loner = i >= 8
        ctx = ([] if loner else prompt) + own.tolist()
        ctx_slots = ([] if loner else shared) + pool.take(len(own))
        rid = f"r{i}"
        ids[rid], slots[rid] = ctx, ctx_slots
        batch.append(seq(rid, own.tolist(), ctx_slots, len(ctx) - len(own)))
    runner.logits(batch)  # each request's own tokens, after the cached prompt
    order = list(ids)
    groups = DecodeGroups.build(len(order), [[0, 1, 2, 3, 4, 5], [6, 7]], [40, 40])
    tol = 1e-4 if dtype == "float32" else 2e-2  # bfloat16: about 4 ulps of the logits
    for step in range(3):
        batch = []
        for rid in order:
            ids[rid].append((step * 31 + len(ids[rid])) % 211)
            slots[rid] += pool.take(1)
            batch.append(seq(rid, [ids[rid][-1]], slots[rid], len(ids[rid]) - 1))
        force_decode_groups(runner, None)
        plain = runner.logits(batch)  # writing a token's K/V twice stores the same values
        force_decode_groups(runner, groups)
        grouped = runner.logits(batch)
        err = (grouped - plain).abs().max().item()
        assert err < tol, f"step {step}: max |diff| {err}"
    if dtype == "float32":  # and both are the model's own answer
        for i, rid in enumerate(order):
            ref = reference_logits(loaded.model, ids[rid])[-1]
            assert (grouped[i] - ref).abs().max().item() < 1e-4, rid


def test_decode_groups_build_and_check():
    slots = torch.tensor([5, 6, 7, 1, 5, 6, 2, 9])
    offsets = torch.tensor([0, 4, 7, 8])  # [5 6 7 1] [5 6 2] [9]
    ok = DecodeGroups.build(3, [[0, 1], [2]], [2, 1])
    assert ok.group_of.tolist() == [0, 0, 1] and ok.prefix_len.tolist() == [2, 1]
    ok.check(slots, offsets)
    DecodeGroups.build(3, [], []).check(slots, offsets)  # no groups at all
    with pytest.raises(ValueError, match="differ in their shared prefix"):
        DecodeGroups.build(3, [[0, 1]], [3]).check(slots, offsets)
    with pytest.raises(ValueError, match="longer than"):
        DecodeGroups.build(3, [[1, 2]], [2]).check(slots, offsets)
    with pytest.raises(ValueError, match="more than one group"):
        DecodeGroups.build(3, [[0, 1], [1]], [1, 1])
    with pytest.raises(ValueError, match="outside"):
        DecodeGroups.build(3, [[0, 3]], [1])
