"""oneDNN's packed linear against the small-batch kernel (AMX tiles or AVX512-BF16 dot products).

Times one bfloat16 linear call per (shape, row count) both ways, on a model's
own layer shapes (SmolLM2's by default), and prints the time ratio; the row
counts where the kernel stops winning are what ``packed_linear.py``'s limits
come from. Saves ``bench/results/linear.json``.

``--widen``: float32 instead, torch's product on float32 weights against the
widening kernel (``kernels/widen_linear.cpp``) on values held as bfloat16, as an
8-bit grid and as a 4-bit grid (what de-quantised GGUF weights hold), per step:
every linear call of SmolLM2's 30 decoder layers, weights cycled as a step
reads them (cold in cache, as in serving). Saves ``linear-widen.json``.

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
    p.add_argument(
        "--gate-up-act",
        action="store_true",
        help="bfloat16: a gated MLP's projection then act_and_mul vs amx_gate_up_act's one pass",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    name = "linear-widen.json" if args.widen else "linear.json"
    name = "linear-gate-up-act.json" if args.gate_up_act else name
    args.out = args.out or ROOT / "bench" / "results" / name
    if args.widen:
        widen_main(args)
        return
    if args.gate_up_act:
        gate_up_act_main(args)
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


def time_step(
    calls: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]],
    rows: int,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Median of 7 timed passes over ``calls`` (each after 2 untimed), ms per pass."""
    inputs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in calls}}
    times = []
    for i in range(9):
        t0 = time.perf_counter()
        for fn, k in calls:
            fn(inputs[k])
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def gate_up_act_main(args: argparse.Namespace) -> None:
    """SmolLM2's 30 merged gate/up weights cycled (cold in cache, as a step
    reads them): the projection, then ``act_and_mul``, against the one pass."""
    from radixmux.model_runners.fused_ops import act_table

    if small_kernel_limits() is None:
        sys.exit("no small-batch kernel on this CPU (needs AMX or AVX512-BF16) or no compiler")
    ops = torch.ops.radixmux
    k, inter = 576, 1536
    table = act_table(nn.SiLU())
    torch.manual_seed(0)
    weights = [
        ops.amx_pack((torch.randn(2 * inter, k) * 0.05).to(torch.bfloat16)) for _ in range(LAYERS)
    ]
    unfused = [
        (lambda x, w=w: ops.act_and_mul(ops.amx_linear(x, w, None, 2 * inter), 0, table), k)
        for w in weights
    ]
    fused = [(lambda x, w=w: ops.amx_gate_up_act(x, w, None, 2 * inter, table), k) for w in weights]
    print(f"gate/up + SiLU, {LAYERS} layers, {torch.get_num_threads()} threads, ms per step")
    print(f"{'rows':>5} {'unfused':>9} {'one pass':>9} {'ratio':>6}")
    results = []
    for rows in args.rows:
        t_un = time_step(unfused, rows, torch.bfloat16)
        t_fu = time_step(fused, rows, torch.bfloat16)
        print(f"{rows:>5} {t_un:>9.2f} {t_fu:>9.2f} {t_fu / t_un:>6.2f}")
        results.append({"rows": rows, "unfused_ms": t_un, "one_pass_ms": t_fu})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}))
    print(f"wrote {args.out}")


def grid_valued(n: int, k: int, bits: int) -> torch.Tensor:
    """A float32 ``[n, k]`` weight on a ``bits`` grid per 32 k, as a GGUF file
    de-quantised gives (Q4_1 and alike): ``q * d + m`` with fp16 ``d`` and ``m``."""
    q = torch.randint(0, 2**bits, (n, k // 32, 32)).float()
    q[..., 0], q[..., 1] = 0, 2**bits - 1  # (the quantizer maps each run's ends to both)
    d = (torch.rand(n, k // 32, 1) * 0.02 / 2**bits + 1e-4).half().float()
    m = (-d * 2 ** (bits - 1)).half().float()
    return (q * d + m).reshape(n, k)


def widen_main(args: argparse.Namespace) -> None:
    """``--widen``: torch's float32 product against the widening kernel over the
    same values held as bfloat16, as an 8-bit grid and as a 4-bit grid, per step."""
    from radixmux.model_runners import paged_decode

    if not (paged_decode.load() and torch.ops.radixmux.has_widen_linear()):
        sys.exit("the kernel library has no AVX2 + FMA build here (or no compiler)")
    ops = torch.ops.radixmux
    torch.manual_seed(0)
    Calls = list[tuple[Callable[[torch.Tensor], torch.Tensor], int]]
    arms: dict[str, Calls] = {"torch": [], "bfloat16": [], "grid8": [], "grid4": []}
    for _ in range(LAYERS):
        for k, n in LAYER_CALLS:
            w = torch.randn(n, k).to(torch.bfloat16).float()  # bfloat16 values, as published
            arms["torch"].append((functools.partial(torch.nn.functional.linear, weight=w), k))
            for arm, packed in (
                ("bfloat16", ops.widen_pack(w)),
                ("grid8", ops.grid_pack(grid_valued(n, k, 8), 8)),
                ("grid4", ops.grid_pack(grid_valued(n, k, 4), 4)),
            ):
                assert packed.numel(), arm
                arms[arm].append((lambda x, p=packed, n=n: ops.widen_linear(x, p, None, n), k))
    params = sum(k * n for k, n in LAYER_CALLS) * LAYERS
    bits = {"bfloat16": 16, "grid8": 10, "grid4": 6}  # bits read per weight, scales included
    print(
        f"float32 linear calls of a SmolLM2 decode step ({LAYERS} layers, weights cycled), "
        f"{torch.get_num_threads()} threads, ms per step (GB/s read)"
    )
    print(f"{'rows':>5} " + " ".join(f"{a:>16}" for a in arms))
    results = []
    with torch.inference_mode():
        for rows in args.rows:
            # Arms alternate, each timed twice, so a noisy spell hits both.
            ms = {a: time_step(calls, rows) for a, calls in arms.items()}
            ms = {a: min(t, time_step(arms[a], rows)) for a, t in ms.items()}
            cells = [f"{ms['torch']:>16.1f}"] + [
                f"{ms[a]:>7.1f} ({params * bits[a] / 8 / ms[a] / 1e6:>5.1f})" + " " * 2
                for a in bits
            ]
            print(f"{rows:>5} " + " ".join(cells))
            results.append({"rows": rows, **{f"{a}_ms": t for a, t in ms.items()}})
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
