"""oneDNN's packed linear against the small-batch kernel (AMX tiles or AVX512-BF16 dot products).

Times one bfloat16 linear call per (shape, row count) both ways, on a model's
own layer shapes (SmolLM2's by default), and prints the time ratio; the row
counts where the kernel stops winning are what ``packed_linear.py``'s limits
come from. Saves ``bench/results/linear.json``.

    .venv/bin/python -m bench.bench_linear [--rows 1 4 16 64 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
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
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "linear.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    main()
