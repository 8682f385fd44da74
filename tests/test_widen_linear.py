"""Float32 linear layers over bfloat16-held weights (kernels/widen_linear.cpp): the
layout, the products, row-count independence, and which layers take it."""

from __future__ import annotations

import pytest
import torch
from conftest import pack_every_linear, tiny_model

from bench.roofline import weight_bytes
from radixmux.model_runners.packed_linear import (
    WIDEN_ENV,
    PackedLinear,
    holds_bfloat16,
    pack_linear_weights,
    widens_float32,
)

pytestmark = pytest.mark.usefixtures("widen_kernel")


def _bf16_valued(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16).float()


@pytest.mark.parametrize(("k", "n", "bias"), [(576, 192, False), (64, 48, True), (33, 17, True)])
def test_widen_linear_is_the_float32_product(k: int, n: int, bias: bool) -> None:
    """Every register tile (1-6 rows, 1-4 blocks), odd K, N past a whole block,
    with and without a bias, 2-d and 3-d inputs: the float32 product of the
    same values, up to the order of its sums."""
    torch.manual_seed(k + n)
    w = _bf16_valued(n, k)
    b = torch.randn(n) if bias else None
    packed = torch.ops.radixmux.widen_pack(w)
    assert packed.dtype == torch.bfloat16 and packed.shape == (-(-n // 16), k, 16)
    for rows in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 33):
        x = torch.randn(rows, k)
        got = torch.ops.radixmux.widen_linear(x, packed, b, n)
        want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert torch.allclose(got.double(), want, rtol=0, atol=1e-4 * k**0.5)
    x3 = torch.randn(2, 5, k)
    got3 = torch.ops.radixmux.widen_linear(x3, packed, b, n)
    assert got3.shape == (2, 5, n)
    assert torch.equal(
        got3.reshape(10, n), torch.ops.radixmux.widen_linear(x3.reshape(10, k), packed, b, n)
    )


def test_a_row_gets_the_same_bits_in_any_batch() -> None:
    """Each row's sums run over k in one order whatever the call's row count (the
    deterministic mode's contract for linear layers)."""
    torch.manual_seed(1)
    k, n = 576, 200
    w = _bf16_valued(n, k)
    packed = torch.ops.radixmux.widen_pack(w)
    x = torch.randn(23, k)
    alone = [torch.ops.radixmux.widen_linear(x[i : i + 1], packed, None, n) for i in range(23)]
    for rows in (2, 3, 4, 5, 6, 7, 8, 12, 23):
        batch = torch.ops.radixmux.widen_linear(x[:rows], packed, None, n)
        for i in range(rows):
            assert torch.equal(batch[i], alone[i][0]), (rows, i)


def test_widen_pack_keeps_bfloat16_values_exactly() -> None:
    """The packed weight holds each value once, in the documented word order."""
    n, k = 20, 3
    w = _bf16_valued(n, k)
    packed = torch.ops.radixmux.widen_pack(w).float()
    for row in range(n):
        block, j = divmod(row, 16)
        slot = 2 * j if j < 8 else 2 * (j - 8) + 1
        assert torch.equal(packed[block, :, slot], w[row])
    assert not packed[1, :, 2 * 4 :].any() and not packed[1, :, 9::2].any()  # padding past N


def test_bad_calls_are_refused() -> None:
    packed = torch.ops.radixmux.widen_pack(_bf16_valued(32, 8))
    with pytest.raises(RuntimeError, match="float32 activations"):
        torch.ops.radixmux.widen_linear(torch.randn(2, 8).bfloat16(), packed, None, 32)
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.radixmux.widen_linear(torch.randn(2, 9), packed, None, 32)
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.radixmux.widen_linear(torch.randn(2, 8), packed, None, 12)
    with pytest.raises(RuntimeError, match="bias of 3"):
        torch.ops.radixmux.widen_linear(torch.randn(2, 8), packed, torch.zeros(3), 32)
    with pytest.raises(RuntimeError, match="not packed by widen_pack"):
        torch.ops.radixmux.widen_linear(torch.randn(2, 8), packed.reshape(2, -1), None, 32)


def test_holds_bfloat16() -> None:
    assert holds_bfloat16(_bf16_valued(7, 5))
    w = _bf16_valued(7, 5)
    w[3, 2] += 2**-20  # one value off the bfloat16 grid
    assert not holds_bfloat16(w)
    with pytest.raises(ValueError, match="bfloat16 values"):
        PackedLinear(torch.nn.Linear(5, 7).requires_grad_(False), widen=True)


def _avx2(monkeypatch: pytest.MonkeyPatch) -> None:
    # The rule is for CPUs where torch runs no AVX-512 (packs_float32).
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")


def test_float32_models_of_bfloat16_values_widen(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 model whose weights are bfloat16 values (a model published in
    bfloat16) swaps every linear layer for a widened one, one bfloat16 copy each,
    and its logits stay the float32 model's; with ``RADIXMUX_WIDEN_LINEAR=0`` or
    weights off the grid, layers stay plain."""
    _avx2(monkeypatch)
    assert widens_float32()
    plain = tiny_model("qwen2", dtype="bfloat16").model.float()  # q/k/v biases too
    model = tiny_model("qwen2", dtype="bfloat16").model.float()
    ids = torch.randint(0, 211, (1, 19))
    layers, diff = pack_every_linear(plain, model, ids)
    assert all(m.widen is not None and m.packed is None and m.amx is None for m in layers)
    assert diff < 1e-4
    read = weight_bytes(model, 4)
    assert read.copies == {"bfloat16 widened": len(layers)}
    linear_params = sum(m.in_features * m.out_features for m in layers)
    assert read.held < weight_bytes(plain, 4).held - linear_params  # about half of each layer

    monkeypatch.setenv(WIDEN_ENV, "0")
    assert not widens_float32()
    off = tiny_model("qwen2", dtype="bfloat16").model.float()
    assert pack_linear_weights(off) == 0
    monkeypatch.delenv(WIDEN_ENV)
    random = tiny_model("qwen2", dtype="float32").model  # float32 values: nothing to halve
    assert pack_linear_weights(random) == 0
    assert not any(isinstance(m, PackedLinear) for m in random.modules())


def test_gather_rows_reads_the_packed_values() -> None:
    """A tied embedding's look-up from the packed copy is the row-major look-up."""
    from radixmux.model_runners.tied_embedding import gather_rows

    rows, dim = 37, 24
    w = _bf16_valued(rows, dim)
    packed = torch.ops.radixmux.widen_pack(w)
    ids = torch.tensor([[0, 36, 5], [16, 17, 8]])
    got = gather_rows(packed, ids, rows, dim)
    assert got.dtype == torch.float32 and torch.equal(got, w[ids])
    assert gather_rows(packed, torch.zeros(0, dtype=torch.long), rows, dim).shape == (0, dim)
    for bad in (-1, rows):
        with pytest.raises(IndexError, match="out of range"):
            gather_rows(packed, torch.tensor([bad]), rows, dim)


def test_a_tied_embedding_reads_the_widened_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2-style tied weights: the embedding drops its float32 copy and looks
    its rows up in the head's bfloat16 one; the logits stay the model's."""
    _avx2(monkeypatch)
    plain = tiny_model("llama", dtype="bfloat16", tie_word_embeddings=True).model.float()
    model = tiny_model("llama", dtype="bfloat16", tie_word_embeddings=True).model.float()
    ids = torch.randint(0, 211, (1, 23))
    with torch.no_grad():
        want = plain(ids).logits
        assert pack_linear_weights(model) > 0
        got = model(ids).logits
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert embed.weight.is_meta and head.widen is not None
    assert torch.equal(embed(ids), plain.get_input_embeddings()(ids))
    assert (got - want).abs().max().item() < 1e-4
