"""oneDNN's packed linear against the small-batch kernel (AMX tiles or AVX512-BF16 dot products).

Times one bfloat16 linear call per (shape, row count) both ways, on a model's
own layer shapes (SmolLM2's by default), and prints the time ratio; the row
counts where the kernel stops winning are what ``packed_linear.py``'s limits
come from. Saves ``bench/results/linear.json``.

``--widen``: float32 instead, torch's product on float32 weights against the
widening kernel on the same values held as bfloat16 (``kernels/widen_linear.cpp``),
per step: every linear call of SmolLM2's 30 decoder layers, weights cycled as a
step reads them (cold in cache, as in serving). Saves ``linear-widen.json``.

    .venv/bin/python -m bench.bench_linear [--rows 1 4 16 64 256] [--threads 2] [--widen]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from radixmux.model_runners.packed_linear import PackedLinear, small_kernel_limits

ROOT = Path(__file__).resolve().parents[1]
# (name, in_features, out_features): SmolLM2-135M's layers (gate and up merged).
SHAPES = [
    ("q/o 576x576", 576, 576),
    ("k/v 576x192", 576, 192),
    ("gate_up 576x3072", 576, 3072),
    ("down 1536x576", 1536, 576),
    ("lm_head 576x49152", 576, 49152),
]


def time_call(fn, x: torch.Tensor, calls: int) -> float:
    """20th-percentile wall time of one call, in microseconds."""
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 5] * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", type=Path, default=None, help="default: bench/results/linear*.json")
    p.add_argument("--widen", action="store_true", help="float32: torch vs the widening kernel")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    name = "linear-widen.json" if args.widen else "linear.json"
    args.out = args.out or ROOT / "bench" / "results" / name
    if args.widen:
        widen_main(args)
        return
    limits = small_kernel_limits()
    if limits is None:
        sys.exit("no small-batch kernel on this CPU (needs AMX or AVX512-BF16) or no compiler")
    print(
        f"bfloat16 linear, {torch.get_num_threads()} threads, oneDNN vs {limits.kind}, us per call"
    )
    print(f"{'shape':>18} {'rows':>5} {'oneDNN':>9} {'kernel':>9} {'ratio':>6}")
    results = []
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, k, n in SHAPES:
            lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
            onednn = PackedLinear(lin)
            packed = torch.ops.radixmux.amx_pack(lin.weight.detach())
            for rows in args.rows:
                x = torch.randn(rows, k).to(torch.bfloat16)
                t_dnn = time_call(onednn, x, args.calls)
                t_ker = time_call(
                    lambda v, w=packed, n=n: torch.ops.radixmux.amx_linear(v, w, None, n),
                    x,
                    args.calls,
                )
                ratio = t_ker / t_dnn
                print(f"{name:>18} {rows:>5} {t_dnn:>9.1f} {t_ker:>9.1f} {ratio:>6.2f}")
                results.append(
                    {
                        "shape": name,
                        "k": k,
                        "n": n,
                        "rows": rows,
                        "onednn_us": t_dnn,
                        "kernel_us": t_ker,
                    }
                )
    wins = [r["kernel_us"] / r["onednn_us"] for r in results]
    print(f"kernel/oneDNN time, median over all rows: {statistics.median(wins):.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"kernel": limits.kind, "threads": torch.get_num_threads(), "results": results})
    )
    print(f"wrote {args.out}")


# SmolLM2's decoder layer as a step calls it: q, k, v, o, gate_up, down.
LAYER_CALLS = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 3072), (1536, 576)]
LAYERS = 30


def time_step(calls: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]], rows: int) -> float:
    """Median of 7 timed passes over ``calls`` (each after 2 untimed), ms per pass."""
    inputs = {k: torch.randn(rows, k) for k in {k for _, k in calls}}
    times = []
    for i in range(9):
        t0 = time.perf_counter()
        for fn, k in calls:
            fn(inputs[k])
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def widen_main(args: argparse.Namespace) -> None:
    """``--widen``: torch's float32 product against the widening kernel, per step."""
    from radixmux.model_runners import paged_decode

    if not (paged_decode.load() and torch.ops.radixmux.has_widen_linear()):
        sys.exit("the kernel library has no AVX2 + FMA build here (or no compiler)")
    torch.manual_seed(0)
    plain: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]] = []
    widened: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]] = []
    for _ in range(LAYERS):
        for k, n in LAYER_CALLS:
            w = torch.randn(n, k).to(torch.bfloat16).float()  # bfloat16 values, as published
            packed = torch.ops.radixmux.widen_pack(w)
            plain.append((functools.partial(torch.nn.functional.linear, weight=w), k))
            widened.append(
                (lambda x, p=packed, n=n: torch.ops.radixmux.widen_linear(x, p, None, n), k)
            )
    params = sum(k * n for k, n in LAYER_CALLS) * LAYERS
    print(
        f"float32 linear calls of a SmolLM2 decode step ({LAYERS} layers, weights cycled), "
        f"{torch.get_num_threads()} threads, ms per step"
    )
    print(f"{'rows':>5} {'torch':>9} {'widen':>9} {'speedup':>8} {'widen GB/s':>11} {'GFLOPS':>7}")
    results = []
    with torch.inference_mode():
        for rows in args.rows:
            # Arms alternate, each timed twice, so a noisy spell hits both.
            t_plain = min(time_step(plain, rows), time_step(plain, rows))
            t_widen = min(time_step(widened, rows), time_step(widened, rows))
            gbs = params * 2 / t_widen / 1e6
            gflops = rows * params * 2 / t_widen / 1e6
            print(
                f"{rows:>5} {t_plain:>9.1f} {t_widen:>9.1f} {t_plain / t_widen:>7.2f}x "
                f"{gbs:>11.1f} {gflops:>7.1f}"
            )
            results.append({"rows": rows, "torch_ms": t_plain, "widen_ms": t_widen})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "threads": torch.get_num_threads(),
                "results": results,
            }
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
