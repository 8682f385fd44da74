"""Float32 linear layers over 4/8-bit grids (kernels/widen_linear.cpp, ``grid_pack``):
weights de-quantised from GGUF by gguf's own code are found on their grid and
held exactly, the layout is the documented one, products are the float32
products of the same values and independent of the row count, off-grid
weights are refused, and a de-quantised model takes the grid form end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import pack_every_linear, tiny_model
from gguf import GGMLQuantizationType, quants

from bench.roofline import weight_bytes
from radixmux.model_runners.packed_linear import (
    compact_copy,
    widens_float32,
)

pytestmark = pytest.mark.usefixtures("widen_kernel")
ops = torch.ops.radixmux
# GGUF's block formats of 32 weights, and the grid each fits.
FORMATS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 8, "Q5_1": 8, "Q8_0": 8}


def gguf_valued(n: int, k: int, fmt: str, scale: float = 0.05, seed: int = 0) -> torch.Tensor:
    """A random ``[n, k]`` weight quantised to ``fmt`` and de-quantised back, by
    the gguf package (what transformers' GGUF loading runs)."""
    x = (np.random.default_rng(seed).standard_normal((n, k)) * scale).astype(np.float32)
    x[0, :32] = scale  # a run of one value (no step to find)
    kind = GGMLQuantizationType[fmt]
    return torch.from_numpy(quants.dequantize(quants.quantize(x, kind), kind).copy())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 1e-4])
def test_gguf_weights_are_held_exactly(fmt: str, scale: float) -> None:
    """Each format's values go to its grid and come back bit for bit."""
    w = gguf_valued(70, 96, fmt, scale)
    kind, packed = compact_copy(w)
    bits = FORMATS[fmt]
    assert kind == f"{bits}-bit grid"
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3, 128 + 64 * bits)
    assert torch.equal(ops.widen_gather_rows(packed, torch.arange(70)), w)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize(("k", "n", "bias"), [(576, 200, False), (64, 48, True), (32, 17, True)])
def test_grid_linear_is_the_float32_product(fmt: str, k: int, n: int, bias: bool) -> None:
    """Every register tile (1-6 rows, 1-2 blocks), N past a whole block, with and
    without a bias, 2-d and 3-d inputs: the float32 product of the same values,
    up to the order of its sums."""
    torch.manual_seed(k + n)
    w = gguf_valued(n, k, fmt)
    b = torch.randn(n) if bias else None
    packed = ops.grid_pack(w, FORMATS[fmt])
    for rows in (0, 1, 2, 3, 4, 5, 6, 7, 9, 13, 33):
        x = torch.randn(rows, k)
        got = ops.widen_linear(x, packed, b, n)
        want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert torch.allclose(got.double(), want, rtol=0, atol=1e-5 * k**0.5)
    x3 = torch.randn(2, 5, k)
    got3 = ops.widen_linear(x3, packed, b, n)
    assert torch.equal(got3.reshape(10, n), ops.widen_linear(x3.reshape(10, k), packed, b, n))


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_a_row_gets_the_same_bits_in_any_batch(fmt: str) -> None:
    """Each row's sums run over k in one order whatever the call's row count."""
    torch.manual_seed(2)
    k, n = 576, 200
    packed = ops.grid_pack(gguf_valued(n, k, fmt), FORMATS[fmt])
    x = torch.randn(23, k)
    alone = [ops.widen_linear(x[i : i + 1], packed, None, n) for i in range(23)]
    for rows in (2, 3, 5, 6, 7, 8, 12, 23):
        batch = ops.widen_linear(x[:rows], packed, None, n)
        for i in range(rows):
            assert torch.equal(batch[i], alone[i][0]), (rows, i)


def test_the_packed_layout() -> None:
    """Per 16 outputs and 32 inputs: d[16], m[16] as floats, then per input 8
    bytes, byte j holding output j's q in its low nibble and 8 + j's in its high
    one (4 bits), or 16 bytes in output order (8 bits); zeros past N."""
    torch.manual_seed(3)
    n, k = 20, 64
    for bits in (4, 8):
        q = torch.randint(0, 2**bits, (n, k // 32, 32))
        q[..., 0], q[..., 1] = 0, 2**bits - 1  # (each run spans the grid: d and m are unique)
        d = (torch.rand(n, k // 32, 1) * 0.1 + 0.01).half().float()
        m = -(torch.rand(n, k // 32, 1)).half().float()
        w = (q.double() * d.double() + m.double()).float().reshape(n, k)
        packed = ops.grid_pack(w, bits)
        assert packed.shape == (2, 2, 128 + 64 * bits)
        head = packed[:, :, :128].contiguous().view(torch.float32)  # [block, group, 32]
        data = packed[:, :, 128:].reshape(2, 2, 32, 16 * bits // 8)
        for row in range(n):
            block, j = divmod(row, 16)
            for g in range(k // 32):
                assert head[block, g, j] == d[row, g, 0] and head[block, g, 16 + j] == m[row, g, 0]
                if bits == 8:
                    got = data[block, g, :, j]
                else:
                    got = (data[block, g, :, j % 8] >> (0 if j < 8 else 4)) & 0xF
                assert torch.equal(got.long(), q[row, g])
        assert not packed[1, :, 16:64].any() and not packed[1, :, 80:128].any()  # rows 20-31
        assert torch.equal(ops.widen_gather_rows(packed, torch.arange(n)), w)


def test_off_grid_weights_are_refused() -> None:
    """A weight is held as a grid only if every value comes back exactly."""
    assert compact_copy(torch.randn(48, 64)) is None  # plain float32 values
    w = gguf_valued(48, 64, "Q4_1")
    w[7, 40] = torch.nextafter(w[7, 40], torch.tensor(9.0))  # one value one ulp off
    assert ops.grid_pack(w, 4).numel() == 0
    copy = compact_copy(w)
    assert copy is None or copy[0] != "4-bit grid"
    for bad in (float("inf"), float("nan")):
        w = gguf_valued(48, 64, "Q4_1")
        w[3, 3] = bad
        assert ops.grid_pack(w, 4).numel() == 0 and ops.grid_pack(w, 8).numel() == 0
    assert ops.grid_pack(gguf_valued(48, 64, "Q4_1")[:, :40], 4).numel() == 0  # K % 32
    with pytest.raises(RuntimeError, match="4 or 8 bits"):
        ops.grid_pack(gguf_valued(16, 32, "Q4_1"), 5)
    with pytest.raises(RuntimeError, match="2-d float32"):
        ops.grid_pack(gguf_valued(16, 32, "Q4_1").bfloat16(), 4)
    packed = ops.grid_pack(gguf_valued(32, 64, "Q4_1"), 4)
    with pytest.raises(RuntimeError, match="do not fit"):
        ops.widen_linear(torch.randn(2, 32), packed, None, 32)
    with pytest.raises(RuntimeError, match="not packed"):
        ops.widen_linear(torch.randn(2, 64), packed[:, :, :200].contiguous(), None, 32)
    with pytest.raises(RuntimeError, match="outside the packed"):
        ops.widen_gather_rows(packed, torch.tensor([32]))


def _dequantised(model: torch.nn.Module, fmt: str) -> torch.nn.Module:
    # Every 2-d weight through the format, as a GGUF checkpoint loads.
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if p.dim() == 2:
                p.copy_(gguf_valued(*p.shape, fmt=fmt, seed=i) + p * 0)
    return model


def test_a_dequantised_model_widens_from_grids(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 model de-quantised from Q4_1 (tied embeddings, like the embedded
    SmolLM2) holds every linear layer as a 4-bit grid; the embedding reads the
    head's copy; logits stay the model's; the roofline counts the grids."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert widens_float32()
    kind = {"kind": "llama", "tie_word_embeddings": True}
    plain = _dequantised(tiny_model(**kind).model, "Q4_1")
    model = _dequantised(tiny_model(**kind).model, "Q4_1")
    ids = torch.randint(0, 211, (1, 23))
    layers, diff = pack_every_linear(plain, model, ids)
    assert {m.widen_kind for m in layers} == {"4-bit grid"}
    assert diff < 1e-4
    embed = model.get_input_embeddings()
    assert embed.weight.is_meta
    assert torch.equal(embed(ids), plain.get_input_embeddings()(ids))
    read = weight_bytes(model, 4)
    assert read.copies == {"4-bit grid widened": len(layers)}
    linear_bytes = sum(m.in_features * m.out_features * 4 for m in layers)
    assert read.held < weight_bytes(plain, 4).held - 0.75 * linear_bytes  # 6 of 32 bits kept
