"""The C++ paged decode kernel against a plain per-sequence softmax reference."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from radixmux.model_runners import paged_decode as kernel
from radixmux.model_runners.packed_linear import amx_available

pytestmark = pytest.mark.skipif(not kernel.load(), reason=f"kernel not built: {kernel.error()}")


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the kernel with ``n`` threads (the tests otherwise use one)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


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
@pytest.mark.parametrize("deterministic", [False, True])
def test_kernel_matches_reference(dtype, heads, kv_heads, dim, softcap, window, deterministic):
    """Decodes against float64; deterministic mode runs every row count through
    the tiled path (16 lanes with AVX-512, 8 with AVX2), windows and caps included."""
    g = torch.Generator().manual_seed(dim + heads)
    num_rows, row = 3000, kv_heads * dim
    # Row tables with a stride wider than the row, as the arena's are.
    k_rows = torch.randn(num_rows, row + 32, generator=g).to(dtype)[:, :row]
    v_rows = torch.randn(num_rows, row + 32, generator=g).to(dtype)[:, :row]
    lens = [1, 2, 17, 300, 1111, 5]
    addr = torch.cat([torch.randperm(num_rows, generator=g)[:n] for n in lens])
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    got = kernel.paged_decode(
        q, k_rows, v_rows, addr, offsets, dim**-0.5, softcap, window, deterministic
    )
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


# ---- shared-prefix (cascade) decode ------------------------------------------------------
def random_groups(g: torch.Generator, num_rows: int, batch: int, max_len: int):
    """A decode batch where random groups of 1..8 sequences share a random prefix.

    Returns (addr, offsets, group_of, group_prefix). Every context is drawn
    from one shuffled slot table, so shared prefixes are not contiguous rows;
    a quarter of the sequences are in no group, groups and loners are
    interleaved, prefixes run from 0 to a member's whole context.
    """
    free = torch.randperm(num_rows, generator=g).tolist()

    def take(n: int) -> list[int]:
        out = free[:n]
        del free[:n]
        return out

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    contexts: list[list[int]] = []
    groups: list[int] = []
    prefixes: list[int] = []
    for _ in range(batch // 4):  # loners
        contexts.append(take(rand(1, max_len)))
        groups.append(-1)
    while len(contexts) < batch:
        members = min(rand(1, 8), batch - len(contexts))
        lens = [rand(1, max_len) for _ in range(members)]
        prefix = rand(0, min(lens))
        shared = take(prefix)
        gid = len(prefixes)
        prefixes.append(prefix)
        for n in lens:
            contexts.append(shared + take(n - prefix))
            groups.append(gid)
    order = torch.randperm(batch, generator=g).tolist()
    contexts = [contexts[i] for i in order]
    group_of = torch.tensor([groups[i] for i in order])
    addr = torch.tensor([r for c in contexts for r in c])
    offsets = torch.tensor([0, *torch.tensor([len(c) for c in contexts]).cumsum(0).tolist()])
    return addr, offsets, group_of, torch.tensor(prefixes, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "softcap", "window"),
    [
        (9, 3, 64, None, None),  # SmolLM2's shape: four-row and tiled vector paths
        (9, 3, 64, 20.0, 300),  # tiled, a window inside the prefix, soft-capping
        (4, 1, 256, 50.0, None),  # Gemma's: one KV head, wide rows, soft-capping
        (8, 8, 16, None, 40),  # MHA, a window shorter than most prefixes
        (6, 2, 24, None, 150),  # no vector path (scalar loops), a window inside some prefixes
        (4, 2, 128, 30.0, 5000),  # a window longer than every context, soft-capping
        (2, 1, 80, None, 1),  # each query sees only its own key
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_cascade_matches_reference(dtype, heads, kv_heads, dim, softcap, window, threads):
    g = torch.Generator().manual_seed(dim * 7 + heads)
    num_rows, row = 20000, kv_heads * dim
    k_rows = torch.randn(num_rows, row + 32, generator=g).to(dtype)[:, :row]
    v_rows = torch.randn(num_rows, row + 32, generator=g).to(dtype)[:, :row]
    addr, offsets, group_of, prefix = random_groups(g, num_rows, batch=24, max_len=700)
    assert (group_of >= 0).any() and (group_of < 0).any()
    q = torch.randn(len(group_of), heads, dim, generator=g).to(dtype)
    scale = dim**-0.5
    with torch_threads(threads):
        got = kernel.paged_decode_cascade(
            q, k_rows, v_rows, addr, offsets, group_of, prefix, scale, softcap, window
        )
        plain = kernel.paged_decode(q, k_rows, v_rows, addr, offsets, scale, softcap, window)
    want = reference(q, k_rows, v_rows, addr, offsets, scale, softcap, window)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, out in (("cascade", got), ("plain", plain)):
        err = (out.double() - want).abs().max().item()
        assert err < tol, f"{name}: {err}"


def test_cascade_one_big_group_and_no_groups():
    """Everyone in one group (the case one core could not carry alone), and no group at all."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim = 9, 3, 64
    k_rows = torch.randn(4000, kv_heads * dim, generator=g).to(torch.bfloat16)
    v_rows = torch.randn(4000, kv_heads * dim, generator=g).to(torch.bfloat16)
    rows = torch.randperm(4000, generator=g)
    shared, own = rows[:1000], rows[1000:].view(-1, 100)[:16]
    addr = torch.cat([torch.cat([shared, own[b]]) for b in range(16)])
    offsets = torch.arange(17) * 1100
    q = torch.randn(16, heads, dim, generator=g).to(torch.bfloat16)
    want = reference(q, k_rows, v_rows, addr, offsets, 0.125, None, None)
    for group_of, prefix in (
        (torch.zeros(16, dtype=torch.int64), torch.tensor([1000])),
        (torch.full((16,), -1), torch.zeros(0, dtype=torch.int64)),
    ):
        got = kernel.paged_decode_cascade(
            q, k_rows, v_rows, addr, offsets, group_of, prefix, 0.125, None, None
        )
        assert (got.double() - want).abs().max().item() < 1e-2


def test_cascade_rejects_bad_groups():
    q = torch.randn(2, 4, 16)
    rows = torch.randn(10, 32)
    addr = torch.arange(6)
    offsets = torch.tensor([0, 2, 6])

    def call(group_of: list[int], prefix: list[int]) -> None:
        kernel.paged_decode_cascade(
            q, rows, rows, addr, offsets, torch.tensor(group_of), torch.tensor(prefix), 1.0, 0, 0
        )

    with pytest.raises(RuntimeError, match="longer than member 0"):
        call([0, 0], [3])
    with pytest.raises(RuntimeError, match="outside"):
        call([0, 1], [1])
    with pytest.raises(RuntimeError, match="group_of must be int64"):
        call([0], [1])


# ---- extends (prefill chunks) ------------------------------------------------------------
def extend_reference(q, k_rows, v_rows, addr, offsets, q_offsets, scale, softcap, window):
    """Each extend's causal attention computed alone in float64."""
    _, heads, dim = q.shape
    kv_heads = k_rows.shape[1] // dim
    out = []
    for e in range(len(offsets) - 1):
        rows = addr[offsets[e] : offsets[e + 1]]
        n, length = int(q_offsets[e + 1] - q_offsets[e]), len(rows)
        k = k_rows[rows].double().view(length, kv_heads, dim)
        v = v_rows[rows].double().view(length, kv_heads, dim)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        qe = q[q_offsets[e] : q_offsets[e + 1]].double()
        s = torch.einsum("nhd,lhd->nhl", qe, k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        pos = torch.arange(length)
        at = pos[length - n :, None]  # each new token's context index
        seen = pos[None, :] <= at
        if window:
            seen &= pos[None, :] > at - window
        s = s.masked_fill(~seen[:, None, :], float("-inf"))
        out.append(torch.einsum("nhl,lhd->nhd", s.softmax(-1), v))
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "softcap", "window"),
    [
        (9, 3, 64, None, None),  # SmolLM2's shape
        (9, 3, 64, 20.0, 70),  # soft-capping, a window shorter than the chunks
        (4, 1, 256, 50.0, None),  # Gemma's: one KV head, wide rows
        (8, 8, 16, None, 5),  # MHA, a tiny window
        (6, 2, 24, None, 33),  # no vector path (scalar loops)
        (4, 2, 128, None, 5000),  # a window longer than every context
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_extend_matches_reference(dtype, heads, kv_heads, dim, softcap, window, threads):
    g = torch.Generator().manual_seed(dim + heads + 1)
    num_rows, row = 6000, kv_heads * dim
    k_rows = torch.randn(num_rows, row + 32, generator=g).to(dtype)[:, :row]
    v_rows = torch.randn(num_rows, row + 32, generator=g).to(dtype)[:, :row]
    # (cached, new) per chunk: fresh prompts, cached prefixes, one-token and
    # odd-sized chunks, and chunks after long prefixes (which take the wider
    # tasks), all in one call; contexts are shuffled slots.
    chunks = [(0, 300), (448, 64), (17, 2), (0, 1), (130, 97), (1000, 5), (600, 150)]
    lens = [c + n for c, n in chunks]
    addr = torch.cat([torch.randperm(num_rows, generator=g)[:n] for n in lens])
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q_offsets = torch.tensor([0, *torch.tensor([n for _, n in chunks]).cumsum(0).tolist()])
    q = torch.randn(int(q_offsets[-1]), heads, dim, generator=g).to(dtype)
    args = (q, k_rows, v_rows, addr, offsets, q_offsets, dim**-0.5, softcap, window)
    with torch_threads(threads):
        got = kernel.paged_extend(*args)
    want = extend_reference(*args)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    err = (got.double() - want).abs().max().item()
    assert err < tol, err


@pytest.mark.skipif(not amx_available(), reason="no AMX on this CPU (or no compiler)")
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 1, 256), (32, 8, 128)])
def test_extend_rows_do_not_depend_on_the_chunk(heads, kv_heads, dim):
    """On AMX a prompt token's attention is the same bits computed with the whole
    prompt or after any cached prefix (chunks of 1 to 699 new tokens)."""
    g = torch.Generator().manual_seed(dim)
    k_rows = torch.randn(4000, kv_heads * dim, generator=g).bfloat16()
    v_rows = torch.randn(4000, kv_heads * dim, generator=g).bfloat16()
    length = 700
    addr = torch.randperm(4000, generator=g)[:length]
    q = torch.randn(length, heads, dim, generator=g).bfloat16()
    span = torch.tensor([0, length])

    def extend(cached: int) -> torch.Tensor:
        new = torch.tensor([0, length - cached])
        return kernel.paged_extend(
            q[cached:].contiguous(), k_rows, v_rows, addr, span, new, dim**-0.5, 0, 0
        )

    whole = extend(0)
    for cached in (1, 31, 400, 650, 699):
        assert torch.equal(extend(cached), whole[cached:]), cached


def test_extend_rejects_bad_offsets():
    q = torch.randn(5, 4, 16)
    rows = torch.randn(10, 32)
    addr = torch.arange(8)
    offsets = torch.tensor([0, 3, 8])
    with pytest.raises(RuntimeError, match="4 new tokens in a context of 3"):
        kernel.paged_extend(q, rows, rows, addr, offsets, torch.tensor([0, 4, 5]), 1.0, 0, 0)
    with pytest.raises(RuntimeError, match="do not cover"):
        kernel.paged_extend(q, rows, rows, addr, offsets, torch.tensor([0, 2, 4]), 1.0, 0, 0)


def test_tiled_path_only_for_vector_head_sizes():
    assert not kernel.has_tiled_path(24)  # scalar loops: extends stay on SDPA
    # The library's build decides (RADIXMUX_KERNEL_ARCH may target less than this CPU).
    vector = kernel.built_isa() in ("avx2", "avx512f", "avx512bf16", "amx")
    assert all(kernel.has_tiled_path(d) == vector for d in (16, 32, 64, 80, 96, 128, 256))
