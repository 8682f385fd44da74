"""A tied input embedding reads its rows from the output projection's kernel copy
(model_runners/tied_embedding.py): the same values, and no second copy."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from radixmux.model_runners.packed_linear import pack_linear_weights, small_kernel_limits
from radixmux.model_runners.tied_embedding import gather_rows

pytestmark = pytest.mark.skipif(
    small_kernel_limits() is None, reason="neither AMX nor AVX512-BF16 on this CPU"
)


@pytest.mark.parametrize(("rows", "dim"), [(50, 37), (211, 64), (16, 32), (33, 2)])
def test_gather_rows_is_the_row_major_lookup(rows, dim):
    """Odd row counts and widths (the tiles' padding) included, any id shape."""
    torch.manual_seed(rows * dim)
    weight = torch.randn(rows, dim).to(torch.bfloat16)
    tiles = torch.ops.radixmux.amx_pack(weight)
    ids = torch.tensor([[0, rows - 1, rows // 2, 15 % rows, 16 % rows, 0]])
    got = gather_rows(tiles, ids, rows, dim)
    assert got.shape == (1, 6, dim) and got.is_contiguous()
    assert torch.equal(got, weight[ids])
    assert gather_rows(tiles, torch.zeros(0, dtype=torch.long), rows, dim).shape == (0, dim)
    for bad in (rows, -1):
        with pytest.raises(IndexError):
            gather_rows(tiles, torch.tensor([bad]), rows, dim)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_tied_embedding_drops_its_weight_and_looks_up_the_same_values(kind):
    """Llama's plain embedding and Gemma 3's scaled one: after packing, the
    embedding holds no weight of its own, and its output and the model's
    logits are what they were with it."""
    model = tiny_model(kind, dtype="bfloat16", tie_word_embeddings=True).model
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert embed.weight is head.weight
    ids = torch.tensor([[0, 15, 16, 17, 210, 3, 3, 100]])
    with torch.inference_mode():
        want = embed(ids).clone()
    params_before = sum(p.numel() for p in model.parameters())
    pack_linear_weights(model)
    assert "weight" not in embed._parameters and embed.weight.device.type == "meta"
    assert embed.weight.shape == (211, 64) and embed.weight.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) <= params_before - 211 * 64
    with torch.inference_mode():
        assert torch.equal(embed(ids), want)
        logits = model(ids).logits
    assert logits.shape == (1, 8, 211) and torch.isfinite(logits.float()).all()


def test_an_untied_embedding_keeps_its_weight():
    model = tiny_model("llama", dtype="bfloat16").model
    embed = model.get_input_embeddings()
    weight = embed.weight
    pack_linear_weights(model)
    assert embed.weight is weight and "weight" in embed._parameters
