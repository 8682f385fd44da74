"""vLLM CPU's own attention kernel on causal prefills, for ``bench_decode_attention.py``.

Runs in the vLLM peer's venv (``bench/.peers/vllm``), not radixmux's: it
calls vLLM 0.32's ``cpu_attention_with_kv_cache`` (the kernel its CPU
backend runs, with the ISA it picks: ``amx`` on an AMX host for bfloat16)
over a KV cache written by its own ``cpu_attn_reshape_and_cache``, one
causal prefill per call, 30 layers per step, and prints one JSON line per
case ("new@cached", or "new@cachedxB" for B sequences alike, a decode batch
with new = 1): the 20th-percentile ms per layer, and how far the last
layer's output is from plain causal attention over the same K/V
(``error``). ``bench_decode_attention.py --parts vllm`` starts it and puts
its figures beside radixmux's kernel.

    bench/.peers/vllm/bin/python bench/peer_attention_vllm.py THREADS 512@0 100@1000 1@1099x16
"""

from __future__ import annotations

import json
import sys
import time

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30  # SmolLM2-135M
BLOCK = 128  # tokens per vLLM KV block (a multiple of 32: the AMX kernel's)


def measure(new: int, cached: int, seqs: int, steps: int) -> tuple[float, str, float]:
    """ms per layer (20th percentile of ``steps`` 30-layer steps) for ``seqs``
    sequences of ``new`` tokens after ``cached`` ones each (a decode batch:
    new = 1), the ISA vLLM picked, and the largest difference of its output
    from plain causal attention (the first sequence of the last layer)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    isa = _get_attn_isa(dtype, BLOCK, HEAD_DIM, "auto")
    total = cached + new
    blocks = (total + BLOCK - 1) // BLOCK
    pool = max(2 * blocks * seqs, 64)
    table = torch.randperm(pool)[: blocks * seqs].to(torch.int32).view(seqs, blocks)
    slots = torch.cat(
        [(row.long()[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:total] for row in table]
    )
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    last_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    for _ in range(LAYERS):
        cache = torch.zeros(pool, KV_HEADS, 2 * BLOCK, HEAD_DIM, dtype=dtype)
        key_cache, value_cache = cache.chunk(2, dim=2)
        k = torch.randn(seqs * total, KV_HEADS, HEAD_DIM, dtype=dtype)
        v = torch.randn(seqs * total, KV_HEADS, HEAD_DIM, dtype=dtype)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
        layers.append((key_cache, value_cache))
        last_kv = (k[:total], v[:total])
    q = torch.randn(seqs * new, HEADS, HEAD_DIM, dtype=dtype)
    out = torch.empty_like(q)
    qsl = torch.arange(seqs + 1, dtype=torch.int32) * new
    seq_lens = torch.full((seqs,), total, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seqs,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )

    def step() -> None:
        for key_cache, value_cache in layers:
            ops.cpu_attention_with_kv_cache(
                query=q,
                key_cache=key_cache,
                value_cache=value_cache,
                output=out,
                query_start_loc=qsl,
                seq_lens=seq_lens,
                scale=HEAD_DIM**-0.5,
                causal=True,
                alibi_slopes=None,
                sliding_window=-1,
                block_table=table,
                softcap=0.0,
                scheduler_metadata=meta,
                s_aux=None,
            )

    step()
    # The last layer's output against plain causal attention over its K/V:
    # the kernel computes the attention the comparison assumes.
    k, v = (x.float().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1) for x in last_kv)
    mask = torch.arange(total)[None, :] <= cached + torch.arange(new)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:new].float().transpose(0, 1), k, v, attn_mask=mask, scale=HEAD_DIM**-0.5
    ).transpose(0, 1)
    error = (out[:new].float() - ref).abs().max().item()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 5] * 1e3 / LAYERS, isa, error


def parse_case(case: str) -> tuple[int, int, int]:
    """ "new@cached" (one sequence) or "new@cachedxB" (B sequences alike)."""
    head, _, seqs = case.partition("x")
    new, cached = (int(x) for x in head.split("@"))
    return new, cached, int(seqs or 1)


def main(argv: list[str]) -> None:
    torch.set_num_threads(int(argv[0]))
    # Linux hands out AMX state only to a process that asks (vLLM's engine
    # has torch ask at start-up); without it the AMX kernel dies on SIGILL.
    torch._C._cpu._init_amx()
    for case in argv[1:]:
        new, cached, seqs = parse_case(case)
        ms, isa, error = measure(new, cached, seqs, steps=20 if new * seqs < 1024 else 6)
        row = {"case": case, "ms_per_layer": ms, "isa": isa, "error": error}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
