"""The C++ paged decode kernel against a plain per-sequence softmax reference."""

from __future__ import annotations

import pytest
import torch

from radixmux.model_runners import paged_decode as kernel

pytestmark = pytest.mark.skipif(not kernel.load(), reason=f"kernel not built: {kernel.error()}")


def reference(q, k_rows, v_rows, addr, offsets, scale, softcap, window):
    """Each sequence's attention computed alone in float64."""
    batch, heads, dim = q.shape
    kv_heads = k_rows.shape[1] // dim
    out = []
    for b in range(batch):
        rows = addr[offsets[b] : offsets[b + 1]]
        if window and len(rows) > window:
            rows = rows[-window:]
        k = (
            k_rows[rows]
            .double()
            .view(len(rows), kv_heads, dim)
            .repeat_interleave(heads // kv_heads, dim=1)
        )
        v = (
            v_rows[rows]
            .double()
            .view(len(rows), kv_heads, dim)
            .repeat_interleave(heads // kv_heads, dim=1)
        )
        s = torch.einsum("hd,lhd->hl", q[b].double(), k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "softcap", "window"),
    [
        (9, 3, 64, None, None),  # SmolLM2's shape: GQA, vector path
        (4, 1, 256, 50.0, None),  # Gemma's: one KV head, soft-capping
        (8, 8, 16, None, 7),  # MHA with a window shorter than most contexts
        (6, 2, 24, None, None),  # head size with no vector path: scalar loop
        (4, 2, 128, None, 1000),  # window longer than every context
    ],
)
def test_kernel_matches_reference(dtype, heads, kv_heads, dim, softcap, window):
    g = torch.Generator().manual_seed(dim + heads)
    num_rows, row = 3000, kv_heads * dim
    # Row tables with a stride wider than the row, as the arena's are.
    k_rows = torch.randn(num_rows, row + 32, generator=g).to(dtype)[:, :row]
    v_rows = torch.randn(num_rows, row + 32, generator=g).to(dtype)[:, :row]
    lens = [1, 2, 17, 300, 1111, 5]
    addr = torch.cat([torch.randperm(num_rows, generator=g)[:n] for n in lens])
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    got = kernel.paged_decode(q, k_rows, v_rows, addr, offsets, dim**-0.5, softcap, window)
    want = reference(q, k_rows, v_rows, addr, offsets, dim**-0.5, softcap, window)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = (got.double() - want).abs().max().item()
    assert err < tol, err


def test_kernel_rejects_mismatched_inputs():
    q = torch.randn(2, 4, 16)
    rows = torch.randn(10, 32)
    addr = torch.arange(4)
    with pytest.raises(RuntimeError, match="offsets"):
        kernel.paged_decode(q, rows, rows, addr, torch.tensor([0, 4]), 0.25, None, None)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernel.paged_decode(
            torch.randn(2, 3, 16), rows, rows, addr, torch.tensor([0, 2, 4]), 1, None, None
        )
