"""The lean Llama stack (lean_stack.py) against transformers' own forward of the same model."""

from __future__ import annotations

import pytest
import torch
from conftest import Sequences, fused_copy, tiny_model

from radixmux.memory.arena import KVArena
from radixmux.memory.layout import BlockGeometry
from radixmux.model_runners.lean_stack import LeanStack
from radixmux.model_runners.model_runner import ModelRunner
from radixmux.model_runners.packed_linear import pack_linear_weights, small_kernel_limits


def _served(kind: str, dtype: str):
    """A tiny model fused and packed, as the server loads it."""
    loaded = fused_copy(tiny_model(kind, dtype=dtype))
    pack_linear_weights(loaded.model)
    return loaded


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lean_stack_gives_the_model_forwards_logits_bit_for_bit(dtype):
    """Prefill chunks, a cached prefix and decodes in one batch: the lean loop and
    transformers' forward (same fused, packed model, each on its own arena with
    the same slots) give identical logits at every step."""
    loaded = _served("llama", dtype)
    runners = []
    arenas = [KVArena.create(num_blocks=32, block_bytes=1 << 20) for _ in range(2)]
    try:
        for arena, lean in zip(arenas, (True, False), strict=True):
            geometry = BlockGeometry(loaded.info.layout, arena.spec.block_bytes, 1)
            runners.append(ModelRunner(loaded, arena.view(geometry), lean=lean))
        assert runners[0].lean is not None and runners[1].lean is None
        # bf16 on AMX tiles or AVX512-BF16 dot products: the MLP takes the
        # one-pass gate/up + activation kernel (whose bits this test holds to
        # transformers' forward).
        fused = dtype == "bfloat16" and small_kernel_limits() is not None
        assert all(
            (lay.gate_up_act.__name__ == "gate_up_act") == fused for lay in runners[0].lean.layers
        )
        drivers = [Sequences(r, seed=3) for r in runners]
        ids = torch.randint(0, 211, (80,)).tolist()
        plan = [
            {"a": ids[:30], "b": ids[30:41]},
            {"a": ids[30:31], "b": ids[41:60], "c": ids[:7]},
            {"a": ids[31:32], "b": ids[60:61], "c": ids[7:8]},
            {"a": ids[32:33], "b": ids[61:62], "c": ids[8:40]},
        ]
        for work in plan:
            lean_out, plain_out = (d.step(work) for d in drivers)
            for rid in work:
                assert torch.equal(lean_out[rid], plain_out[rid]), rid
    finally:
        for arena in arenas:
            arena.destroy()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
def test_other_architectures_keep_transformers_forward(kind):
    """Only code that is Llama's, fused, runs lean; the rest keeps its own forward."""
    assert LeanStack.build(_served(kind, "bfloat16").model) is None


def test_unfused_or_hooked_llama_keeps_transformers_forward():
    plain = tiny_model("llama", dtype="bfloat16")
    pack_linear_weights(plain.model)
    assert LeanStack.build(plain.model) is None  # norms and MLPs not fused
    hooked = _served("llama", "bfloat16")
    assert LeanStack.build(hooked.model) is not None
    hooked.model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: None)
    assert LeanStack.build(hooked.model) is None  # a hook must still run
    for reach in (
        lambda m: m.model.layers[0].post_attention_layernorm,
        lambda m: m.model.norm,
        lambda m: m.model,
    ):
        other = _served("llama", "bfloat16")
        reach(other.model).register_forward_pre_hook(lambda *a: None)
        assert LeanStack.build(other.model) is None  # norms and the stack's own forwards too
