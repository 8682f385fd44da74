"""The small-batch bfloat16 linear kernel (kernels/amx_linear.cpp): AMX tiles, or
AVX512-BF16 dot products where the CPU has no AMX."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from radixmux.model_runners.fused_ops import act_table
from radixmux.model_runners.packed_linear import (
    AMX_ALL_ROWS,
    AMX_LIMITS,
    AMX_MAX_ROWS,
    AMX_MAX_ROWS_WIDE,
    AMX_MAX_ROWS_WIDE_COPY,
    DOT_LIMITS,
    PackedLinear,
    amx_available,
    pack_linear_weights,
    row_counts,
    small_kernel_limits,
    unpack_tiles,
    warm_up,
)

LIMITS = small_kernel_limits()
pytestmark = pytest.mark.skipif(
    LIMITS is None, reason="neither AMX nor AVX512-BF16 on this CPU (or no compiler)"
)


def _reference(x: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
    """The product in float64, rounded once to bfloat16: what a float accumulation gives,
    up to the order of its sums."""
    out = x.double() @ lin.weight.double().T
    if lin.bias is not None:
        out = out + lin.bias.double()
    return out


@pytest.mark.parametrize(
    ("k", "n", "bias"),
    [(576, 192, False), (64, 48, True), (100, 70, True), (33, 17, False), (1536, 576, False)],
)
def test_amx_linear_equals_onednn_and_float(k, n, bias):
    """Every row count a call can make (around the 16- and 32-row tile edges and the
    256-row block), odd K and N (zero padding), with and without a bias: within
    bfloat16 rounding of the exact product, and equal to oneDNN's packed result
    but for rare last-bit differences (both accumulate in float)."""
    torch.manual_seed(k + n)
    lin = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    packed = torch.ops.radixmux.amx_pack(lin.weight.detach())
    onednn = PackedLinear(lin)  # no AMX copy: oneDNN for every row count
    assert onednn.amx is None
    for rows in (1, 2, 15, 16, 17, 31, 32, 33, 64, 255, 256, 257, 300):
        x = torch.randn(rows, k).to(torch.bfloat16)
        got = torch.ops.radixmux.amx_linear(x, packed, lin.bias, n)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        ref = _reference(x, lin)
        # One bfloat16 rounding of the result (8 bits of mantissa) plus float sums.
        assert ((got.double() - ref).abs() <= ref.abs() * 2**-7 + 1e-3).all(), rows
        same = (got == onednn(x)).float().mean().item()
        assert same > 0.99, (rows, same)


@pytest.mark.parametrize(("k", "n"), [(576, 192), (576, 576), (1536, 576), (576, 3072)])
def test_each_row_equals_that_row_alone_however_the_call_is_split(k, n):
    """A row's result never depends on its batch-mates: large calls split the rows
    between threads, small ones the outputs, one row runs alone, and every way
    gives the same bits (what keeps a sequence's greedy tokens from depending on
    what shares its step)."""
    torch.manual_seed(n)
    lin = torch.nn.Linear(k, n, bias=True).to(torch.bfloat16)
    packed = torch.ops.radixmux.amx_pack(lin.weight.detach())
    x = torch.randn(527, k).to(torch.bfloat16)
    whole = torch.ops.radixmux.amx_linear(x, packed, lin.bias, n)
    for lo, hi in ((0, 1), (17, 18), (526, 527), (0, 64), (100, 300), (263, 527)):
        part = torch.ops.radixmux.amx_linear(x[lo:hi], packed, lin.bias, n)
        assert torch.equal(part, whole[lo:hi]), (lo, hi)


def test_amx_linear_keeps_leading_dims_and_reads_strided_input():
    lin = torch.nn.Linear(64, 40).to(torch.bfloat16)
    packed = torch.ops.radixmux.amx_pack(lin.weight.detach())
    x = torch.randn(1, 5, 128).to(torch.bfloat16)[..., ::2]  # [1, 5, 64], not contiguous
    got = torch.ops.radixmux.amx_linear(x, packed, lin.bias, 40)
    assert got.shape == (1, 5, 40)
    torch.testing.assert_close(got.float(), lin(x).float(), atol=2e-2, rtol=2e-2)


def test_amx_linear_refuses_a_weight_of_another_shape():
    packed = torch.ops.radixmux.amx_pack(torch.randn(48, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.radixmux.amx_linear(torch.randn(2, 128).to(torch.bfloat16), packed, None, 48)


def test_limits_follow_the_cpu():
    assert LIMITS is (AMX_LIMITS if amx_available() else DOT_LIMITS)


def test_packed_linear_takes_the_kernel_up_to_its_row_limit():
    """A packed bfloat16 model keeps a kernel copy of each layer (with AMX, the
    output projection that copy alone, for every row count) and gives the same
    logits either side of the limit as a model packed without one; float32 and
    ``amx=False`` keep none."""
    amx = tiny_model("llama", dtype="bfloat16").model
    plain = tiny_model("llama", dtype="bfloat16").model
    pack_linear_weights(amx, onednn_copy=True)
    pack_linear_weights(plain, amx=False)
    layers = [m for m in amx.modules() if isinstance(m, PackedLinear)]
    head = amx.get_output_embeddings()
    assert all(m.amx is not None for m in layers)
    assert head.amx_max_rows == LIMITS.head_rows
    assert (head.packed is None) == (LIMITS.head_rows == AMX_ALL_ROWS)
    for m in layers:
        if m is not head:
            wide = m.out_features >= 4 * m.in_features
            assert m.amx_max_rows == (LIMITS.rows_wide if wide else LIMITS.rows)
    assert all(m.amx is None for m in plain.modules() if isinstance(m, PackedLinear))
    for tokens in (3, LIMITS.rows_wide + 9, LIMITS.rows + 9):
        ids = torch.randint(0, 211, (1, tokens))
        with torch.inference_mode():
            a = amx(ids).logits.float()
            b = plain(ids).logits.float()
        assert (a - b).abs().max() < 5e-2, tokens
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.95
    f32 = tiny_model("llama", dtype="float32").model
    pack_linear_weights(f32)
    assert all(m.amx is None for m in f32.modules() if isinstance(m, PackedLinear))


@pytest.mark.skipif(not amx_available(), reason="AMX limits only")
def test_a_wide_projection_keeps_the_kernel_longer_without_a_onednn_copy():
    """A gated MLP's merged gate/up projection (4x as many outputs as inputs and
    more) runs on the tiles up to AMX_MAX_ROWS_WIDE rows when oneDNN would have
    to unpack them first, and up to AMX_MAX_ROWS_WIDE_COPY beside a oneDNN copy."""
    for copy, limit in ((False, AMX_MAX_ROWS_WIDE), (True, AMX_MAX_ROWS_WIDE_COPY)):
        model = torch.nn.Sequential(torch.nn.Linear(64, 320), torch.nn.Linear(64, 64))
        pack_linear_weights(model.to(torch.bfloat16), onednn_copy=copy)
        wide, narrow = model
        assert (wide.amx_max_rows, narrow.amx_max_rows) == (limit, AMX_MAX_ROWS)
        assert (wide.packed is not None) == copy
    assert AMX_MAX_ROWS_WIDE_COPY < AMX_MAX_ROWS_WIDE <= AMX_MAX_ROWS


@pytest.mark.skipif(LIMITS is None, reason="AMX tiles or AVX512-BF16 dot products only")
@pytest.mark.parametrize(
    ("k", "inter", "bias"), [(576, 1536, False), (64, 128, True), (100, 96, True)]
)
def test_gate_up_act_has_the_bits_of_the_projection_then_act_and_mul(k, inter, bias):
    """amx_gate_up_act (the merged gate/up projection and the activation in one
    pass, on AMX tiles or AVX512-BF16 dot products, as amx_linear) gives
    act_and_mul(amx_linear(x))'s bits at every row count (whole and partial
    row groups and panels), with a bias, with an input width the tiles pad,
    and with no rows."""
    g = torch.Generator().manual_seed(k)
    table = act_table(torch.nn.SiLU())
    w = (torch.randn(2 * inter, k, generator=g) * 0.05).to(torch.bfloat16)
    b = (torch.randn(2 * inter, generator=g) * 0.1).to(torch.bfloat16) if bias else None
    tiles = torch.ops.radixmux.amx_pack(w)
    for rows in (0, 1, 2, 3, 16, 17, 33, 100, 300):
        x = torch.randn(1, rows, k, generator=g).to(torch.bfloat16)
        merged = torch.ops.radixmux.amx_linear(x, tiles, b, 2 * inter)
        expected = torch.ops.radixmux.act_and_mul(merged, 0, table)
        got = torch.ops.radixmux.amx_gate_up_act(x, tiles, b, 2 * inter, table)
        assert got.shape == (1, rows, inter)
        assert torch.equal(got, expected), rows
    with pytest.raises(RuntimeError, match="whole tile pairs"):
        torch.ops.radixmux.amx_gate_up_act(x, tiles[:-1], b, 2 * inter - 16, table)
    with pytest.raises(RuntimeError, match="65,537"):
        torch.ops.radixmux.amx_gate_up_act(x, tiles, b, 2 * inter, table[:-1])


def test_a_batch_without_rows_to_project_needs_no_tile_copy():
    """A forward that samples nothing projects zero rows: a float32 layer (no tile
    copy) must take oneDNN then too, and a bf16 one returns an empty result."""
    for dtype in (torch.float32, torch.bfloat16):
        lin = torch.nn.Linear(64, 48).to(dtype)
        for rows in (0, AMX_ALL_ROWS):
            packed = PackedLinear(lin, rows)
            assert packed(torch.randn(1, 0, 64).to(dtype)).shape == (1, 0, 48)


@pytest.mark.parametrize(("k", "n"), [(50, 37), (64, 48), (576, 192), (33, 17)])
def test_unpack_tiles_gives_the_weight_back(k, n):
    """The tiles' padding (odd K and N) included."""
    weight = torch.randn(n, k).to(torch.bfloat16)
    got = unpack_tiles(torch.ops.radixmux.amx_pack(weight), n, k)
    assert got.is_contiguous() and torch.equal(got, weight)


@pytest.mark.parametrize(("k", "n", "bias"), [(576, 192, False), (100, 70, True), (64, 300, True)])
def test_one_copy_gives_the_bits_of_two(k, n, bias):
    """Without a oneDNN copy, calls above the kernel's limit multiply the tiles
    unpacked: the same bits as oneDNN's packed copy, on both sides of the limit
    and of the 64-row padding grain."""
    torch.manual_seed(k * n)
    lin = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    limit = 40
    one = PackedLinear(lin, limit, onednn_copy=False)
    two = PackedLinear(lin, limit, onednn_copy=True)
    assert one.packed is None and two.packed is not None
    for rows in (1, limit, limit + 1, 64, 65, 130, 300):
        x = torch.randn(1, rows, k).to(torch.bfloat16)
        assert torch.equal(one(x), two(x)), rows


def test_warm_up_skips_the_rows_the_kernel_takes():
    """No oneDNN primitive is built for a row count that never reaches oneDNN; a
    layer the kernel takes at every row count is not warmed at all."""
    lin = torch.nn.Linear(64, 48).to(torch.bfloat16)
    layer = PackedLinear(lin, 70, onednn_copy=False)
    seen: list[int] = []
    real = layer._linear
    layer._linear = lambda x: (seen.append(x.shape[0]), real(x))[1]
    head = PackedLinear(torch.nn.Linear(64, 211).to(torch.bfloat16), AMX_ALL_ROWS)
    assert head.packed is None and not head.onednn_rows
    warm_up(torch.nn.Sequential(layer, torch.nn.ReLU(), head), 576)
    assert seen == [r for r in row_counts(576) if r > 70]


def test_pack_keeps_one_copy_unless_asked():
    model = tiny_model("llama", dtype="bfloat16").model
    pack_linear_weights(model)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.amx is not None and m.packed is None for m in layers)
    model = tiny_model("llama", dtype="bfloat16").model
    pack_linear_weights(model, onednn_copy=True)
    head = model.get_output_embeddings()
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m is not head]
    assert all(m.amx is not None and m.packed is not None for m in layers)
