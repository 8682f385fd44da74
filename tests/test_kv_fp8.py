"""``--kv-cache-dtype fp8``: K/V stored in float8 e4m3.

The kernels read float8 rows exactly as torch converts them (every finite
value checked), attend over them as over the same values in float32, and a
server with a float8 arena keeps the cache contract: in deterministic mode a
prompt's greedy tokens are the same alone, batched and from the cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.tiny_models import make_tiny_model_dir
from radixmux.common.server_args import ServerArgs
from radixmux.memory.layout import BlockGeometry, KVLayout
from radixmux.model_runners import paged_decode as pd
from radixmux.scheduler.bootstrap import layer_sharing

needs_kernel = pytest.mark.skipif(not pd.load(), reason="C++ kernels not built here")
# --deterministic needs the kernel's vector tiles (an AVX2 or AVX-512 build).
needs_tiles = pytest.mark.skipif(
    not (pd.load() and pd.has_tiled_path(16)), reason="deterministic mode needs vector tiles"
)
FP8 = torch.float8_e4m3fn


def finite_fp8_values() -> torch.Tensor:
    """Every finite float8 e4m3 value (254 of 256 bit patterns), as float8."""
    every = torch.arange(256, dtype=torch.uint8).view(FP8)
    return every[~torch.isnan(every.float())]


@needs_kernel
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_every_float8_value_exactly(query_dtype: torch.dtype) -> None:
    # One key per sequence: its softmax weight is exactly 1, so the output is
    # the V row as the kernel converted it.
    dim = 64
    values = finite_fp8_values()
    rows = torch.zeros(4 * dim, dtype=FP8)
    rows[: values.numel()] = values
    v_rows = rows.view(4, dim)
    k_rows = torch.ones(4, dim).to(FP8)
    q = torch.randn(4, 1, dim).to(query_dtype)
    addr = torch.arange(4, dtype=torch.int64)
    offsets = torch.arange(5, dtype=torch.int64)
    out = pd.paged_decode(q, k_rows, v_rows, addr, offsets, dim**-0.5, None, None)
    expected = v_rows.float().to(query_dtype)  # every e4m3 value is a bfloat16 value
    assert torch.equal(out[:, 0], expected)


def float8_rows(n: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V-like rows in float8 (with subnormals and zeros among them)
    and the same values in float32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g) * 2
    x[: n // 10] *= 0.003  # subnormal range
    x[n // 10 : n // 5] = 0
    rows = x.to(FP8)
    return rows, rows.float()


@needs_kernel
def test_decode_and_extend_over_float8_match_the_same_values_in_float32() -> None:
    heads, kv_heads, dim = 6, 2, 64
    n = 900
    k8, kf = float8_rows(n, kv_heads * dim, 1)
    v8, vf = float8_rows(n, kv_heads * dim, 2)
    lens = [300, 17, 583]
    addr = torch.randperm(n, generator=torch.Generator().manual_seed(3))[: sum(lens)]
    offsets = torch.tensor([0, 300, 317, 900], dtype=torch.int64)
    # The kernel rounds float8 queries' partners to bfloat16: compare from
    # bfloat16 queries, which both sides then see exactly.
    q = torch.randn(3, heads, dim).to(torch.bfloat16)
    out8 = pd.paged_decode(q, k8, v8, addr, offsets, dim**-0.5, None, None)
    ref = pd.paged_decode(q.float(), kf, vf, addr, offsets, dim**-0.5, None, None)
    assert (out8.float() - ref).abs().max().item() < 0.02 * ref.abs().max().item()
    # Extends: the last 40 and 17 tokens of two contexts as new tokens.
    new = [40, 17]
    qe = torch.randn(sum(new), heads, dim).to(torch.bfloat16)
    ext_addr = torch.cat([addr[:300], addr[300:317]])
    ext_offsets = torch.tensor([0, 300, 317], dtype=torch.int64)
    q_offsets = torch.tensor([0, 40, 57], dtype=torch.int64)
    args = (ext_addr, ext_offsets, q_offsets, dim**-0.5, None, None)
    oe8 = pd.paged_extend(qe, k8, v8, *args)
    oef = pd.paged_extend(qe.float(), kf, vf, *args)
    assert (oe8.float() - oef).abs().max().item() < 0.02 * oef.abs().max().item()
    # Not the values read as bfloat16 bytes or as zeros: a wrong decode of the
    # bytes lands far from the reference.
    wrong = pd.paged_decode(q.float(), kf * 0.5, vf * 0.5, addr, offsets, dim**-0.5, None, None)
    assert (wrong - ref).abs().max().item() > 0.1 * ref.abs().max().item()


def test_the_flag_halves_a_tokens_bytes_and_turns_layer_sharing_off() -> None:
    bf16 = KVLayout(30, 3, 64, "bfloat16")
    fp8 = KVLayout(30, 3, 64, "float8_e4m3fn")
    assert 2 * fp8.bytes_per_token == bf16.bytes_per_token
    block = 64 * bf16.bytes_per_token
    assert BlockGeometry(fp8, block, 16).slots_per_block == 128
    assert BlockGeometry(bf16, block, 16).slots_per_block == 64
    assert layer_sharing(ServerArgs())
    assert not layer_sharing(ServerArgs(kv_cache_dtype="fp8"))
    with pytest.raises(ValueError, match="kv-cache-dtype 'int8'"):
        ServerArgs(kv_cache_dtype="int8")


@needs_tiles
def test_a_float8_arena_keeps_greedy_tokens_alone_batched_and_cached(tmp_path: Path) -> None:
    from radixmux.runtime.client.engine import Engine

    folder = make_tiny_model_dir(tmp_path / "tiny", seed=3)
    system = "You answer in one short sentence and never more than that. " * 6
    prompts = [system + q for q in ("Name a colour.", "Count to three.", "Say hello.")]
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with Engine(
        model=[f"{folder},name=tiny"],
        kv_cache_bytes=16 << 20,
        kv_block_bytes=64 << 10,
        runner_threads=1,
        dtype="bfloat16",
        kv_cache_dtype="fp8",
        deterministic=True,
    ) as engine:
        # The first computes the whole prompt; the others and the batch find
        # the system prompt cached.
        alone = [engine.generate(p, greedy)[0] for p in prompts]
        batched = engine.generate(prompts, greedy)
    assert alone[0].cached_tokens == 0
    assert all(b.cached_tokens > 0 for b in batched)
    assert [a.token_ids for a in alone] == [b.token_ids for b in batched]
    assert all(len(a.token_ids) == 12 for a in alone)
