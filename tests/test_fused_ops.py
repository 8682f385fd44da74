"""The fused RMSNorm / gated-MLP / rotary kernels against transformers' own eager code.

Each kernel reproduces eager's roundings to the model's dtype, so rotary is
bit-exact and the others differ at most in the last bit where float sums or
exp are ordered differently. ``fuse_model`` swaps only code it recognises;
every tiny architecture's runner (``make_runner``) runs fused against a plain
reference in test_runner_tiny.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_runner, reference_logits, seq, tiny_model
from torch import nn

from radixmux.model_runners import fused_ops, paged_attention, paged_decode
from radixmux.model_runners.fused_ops import FuseReport, fuse_model, is_fused

pytestmark = pytest.mark.skipif(not paged_decode.load(), reason="kernel library not built")

DTYPES = [torch.float32, torch.bfloat16]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units of the last place (bfloat16 / float32 as integers)."""
    if a.dtype == torch.bfloat16:
        return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.bfloat16:
        ulps = _ulps(got, want)
        assert int(ulps.max()) <= 1, f"{int(ulps.max())} ulps"
        assert float((ulps == 0).float().mean()) > 0.98
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 37, 64), (1, 5, 4, 16)])
def test_rms_norm_llama_and_gemma(dtype, shape):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = (torch.randn(shape) * 3).to(dtype)
    for cls in (LlamaRMSNorm, Gemma3RMSNorm):
        norm = cls(shape[-1], eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(shape[-1]))
        norm.to(dtype)
        want = norm(x)
        fused = copy.deepcopy(norm)
        fuse_model(nn.Sequential(fused))
        assert fused.forward is not type(fused).forward
        _close(fused(x), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, gemma):
    x = (torch.randn(1, 29, 576) * 3).to(dtype)
    delta = torch.randn(1, 29, 576).to(dtype)
    weight = torch.randn(576).to(dtype)
    h, y = torch.ops.radixmux.add_rms_norm(x, delta, weight, 1e-5, gemma)
    assert torch.equal(h, x + delta)
    assert torch.equal(y, torch.ops.radixmux.rms_norm(x + delta, weight, 1e-5, gemma))
    with pytest.raises(RuntimeError, match="add_rms_norm"):
        torch.ops.radixmux.add_rms_norm(x, delta[:, :3], weight, 1e-5, gemma)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("inter", [1536, 37])  # whole vectors; a scalar tail
def test_tabled_act_and_mul_is_eager_to_the_bit(act, inter):
    from transformers.activations import ACT2FN

    act_fn = ACT2FN[act]
    code = {"silu": fused_ops.SILU, "gelu_pytorch_tanh": fused_ops.GELU_TANH}[act]
    table = fused_ops.act_table(act_fn)
    # Every bf16 gate value at least once, at scales where act(g) lands near a tie.
    gate = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    gate = gate.view(torch.bfloat16).float().nan_to_num(0.0, 0.0, 0.0).to(torch.bfloat16)
    rows = gate.numel() // inter // 64 * 64
    gate = gate[: rows * inter].view(rows, inter)
    gate_up = torch.cat([gate, (torch.randn_like(gate.float()) * 4).to(torch.bfloat16)], -1)
    # Eager's activation on a whole contiguous tensor (as a model's gate output
    # is): its vector path for every element. (On a 37-wide strided slice torch
    # takes a scalar path for each row's last 5, which can round differently.)
    want = act_fn(gate.reshape(-1)).view(rows, inter) * gate_up[:, inter:]
    got = torch.ops.radixmux.act_and_mul(gate_up, code, table)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # Untabled (libm's exp): act(g) one bf16 step off near a tie, the product
    # then up to two steps off; nearly every element equal.
    normal = torch.randn(7, 2 * inter).to(torch.bfloat16)
    untabled = torch.ops.radixmux.act_and_mul(normal, code)
    ulps = _ulps(untabled, act_fn(normal[:, :inter]) * normal[:, inter:])
    assert int(ulps.max()) <= 2 and float((ulps == 0).float().mean()) > 0.99
    with pytest.raises(RuntimeError, match="table"):
        torch.ops.radixmux.act_and_mul(gate_up, code, table[:-1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_mlp(dtype, act):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, hidden_act=act, mlp_bias=True)
    mlp = LlamaMLP(cfg).to(dtype)
    x = torch.randn(1, 23, 64).to(dtype)
    want = mlp(x)
    fused = copy.deepcopy(mlp)
    report = fuse_model(nn.Sequential(fused))
    assert report.mlps == 1 and not hasattr(fused, "gate_proj")
    assert fused.gate_up_proj.weight.shape == (192, 64)
    got = fused(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # one matmul of twice the width may round its bf16 outputs differently
        assert (got.float() - want.float()).abs().max() <= 0.05 * want.float().abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 19])
def test_rotary_is_bit_exact(dtype, tokens):
    from transformers.models.llama import modeling_llama

    q = torch.randn(1, tokens, 6, 32).to(dtype).transpose(1, 2)  # [1, H, T, D] view
    k = torch.randn(1, tokens, 2, 32).to(dtype).transpose(1, 2)
    ang = torch.randn(1, tokens, 16).repeat(1, 1, 2)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    eager = getattr(modeling_llama.apply_rotary_pos_emb, "radixmux_eager", None)
    eager = eager or modeling_llama.apply_rotary_pos_emb
    want_q, want_k = eager(q, k, cos, sin)
    fuse_model(nn.Sequential(tiny_model("llama").model))  # swaps modeling_llama's function
    swapped = modeling_llama.apply_rotary_pos_emb
    assert hasattr(swapped, "radixmux_eager")
    batch = paged_attention.PagedBatch(None, *([torch.zeros(0)] * 5), extends=[])  # type: ignore[arg-type]
    with paged_attention.paged_batch(batch):
        got_q, got_k = swapped(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    # [T, H, D] memory: what the paged attention reads without a copy.
    assert got_q[0].transpose(0, 1).is_contiguous()
    # Outside a radixmux forward (a plain transformers model) it is eager's own code.
    out_q, _ = swapped(q, k, cos, sin)
    assert torch.equal(out_q, want_q)


def test_plain_function_sees_through_the_hub_kernel_wrapper():
    """transformers with ``kernels`` wraps module-level functions in an nn.Module;
    code comparison must reach the function inside, and a plain one is itself."""
    from transformers.integrations import use_kernel_forward_from_hub

    def double(x):
        return x * 2

    wrapped = use_kernel_forward_from_hub("radixmux_test_double")(double)
    assert fused_ops.plain_function(double) is double
    identity = nn.Identity()  # a module that wraps no function is itself
    assert fused_ops.plain_function(identity) is identity
    if isinstance(wrapped, nn.Module):  # the wrapper exists in this transformers
        assert fused_ops.plain_function(wrapped) is double
        assert fused_ops.same_code(fused_ops.plain_function(wrapped), double)
        assert not fused_ops.same_code(wrapped, double)


def test_only_known_code_is_swapped():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class ScaledNorm(LlamaRMSNorm):  # same attributes, different arithmetic
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(ScaledNorm(8), LlamaRMSNorm(8))
    report = fuse_model(model)
    assert report.norms == 1 and is_fused(model)
    assert model[0].forward.__func__ is ScaledNorm.forward
    assert fuse_model(model) is report  # a second call changes nothing


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2", "gemma3"])
def test_fused_tiny_model_matches_plain(kind, arena):
    """Each architecture's norms, MLPs and rotary are found, and bfloat16 logits
    stay within rounding of the plain model's."""
    loaded = tiny_model(kind, dtype="bfloat16")
    layers = loaded.model.config.num_hidden_layers
    runner = make_runner(loaded, arena)
    report: FuseReport = runner.model.radixmux_fused
    assert report.mlps == layers and report.rotary_modules == 1
    assert report.norms >= 2 * layers + 1
    ids = torch.randint(0, 211, (29,)).tolist()
    got = runner.logits([seq("a", ids, list(range(len(ids))), 0)])[0]
    want = reference_logits(loaded.model, ids)[-1]
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    plain = make_runner(loaded, arena, fused=False).logits([seq("a", ids, list(range(29)), 0)])
    assert (got - plain[0]).abs().max() < 0.05 * want.abs().max()
