"""How far a float8 (or bfloat16) KV cache moves greedy answers, against a float32 reference.

``python -m bench.fp8_accuracy --model smollm2`` serves the model six times
(float32; float32 again; bfloat16; bfloat16 with ``--kv-cache-dtype fp8``;
float32 with it; float32 with ``--kv-cache-dtype bfloat16``), every run in
``--deterministic`` mode so that only the dtypes differ, asks the same 16
prompts for 64 greedy tokens, and reports for each run how many answers
equal the float32 one and the mean length of the common start. Where the
mode is not available (it needs the kernel's AVX2 or AVX-512 tiles),
``--no-deterministic``: the second float32 run then shows how far answers
move from run to run alone.
Prints a table and saves JSON (docs/kernels.md#float8-kv-cache).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.bench_serving import write_json
from radixmux.runtime.client.engine import Engine

PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.\n",
    "def fibonacci(n):\n",
    "List three colors:",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "Explain photosynthesis in one sentence.",
    "import numpy as np\n",
    "Q: What is 12 times 7?\nA:",
    "My favourite book is",
    "The three laws of motion are",
    "Dear hiring manager,",
    "SELECT name FROM",
    "In 1969, the first",
    "Roses are red,",
    "The best way to learn a language is",
)
# (label, model dtype, --kv-cache-dtype); the first is the reference.
RUNS = (
    ("float32", "float32", "auto"),
    ("float32 again", "float32", "auto"),
    ("bfloat16", "bfloat16", "auto"),
    ("bfloat16 + fp8 KV", "bfloat16", "fp8"),
    ("float32 + fp8 KV", "float32", "fp8"),
    ("float32 + bf16 KV", "float32", "bfloat16"),
)


@dataclass
class Agreement:
    """One run's greedy answers against the reference's."""

    label: str
    identical: int
    mean_common_prefix: float


def answers(
    model: str, dtype: str, kv_dtype: str, tokens: int, deterministic: bool = True
) -> list[list[int]]:
    """Greedy token ids for every prompt from one (deterministic) server."""
    with Engine(
        model=[model],
        kv_cache_bytes=256 << 20,
        deterministic=deterministic,
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
    ) as engine:
        done = engine.generate(list(PROMPTS), {"max_new_tokens": tokens, "temperature": 0})
    return [d.token_ids for d in done]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def agreement(label: str, ref: list[list[int]], got: list[list[int]]) -> Agreement:
    return Agreement(
        label,
        sum(a == b for a, b in zip(ref, got, strict=True)),
        statistics.fmean(common_prefix(a, b) for a, b in zip(ref, got, strict=True)),
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="an embedded name or a model folder")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per answer")
    p.add_argument("--out", type=Path, help="JSON file (default: timestamped in bench/results/)")
    p.add_argument(
        "--no-deterministic",
        action="store_true",
        help="serve without --deterministic (CPUs without the kernel's vector tiles)",
    )
    args = p.parse_args(argv)
    runs = {}
    for label, dtype, kv_dtype in RUNS:
        print(f"[fp8_accuracy] {args.model}: {label} ...", flush=True)
        runs[label] = answers(args.model, dtype, kv_dtype, args.tokens, not args.no_deterministic)
    ref = runs[RUNS[0][0]]
    rows = [agreement(label, ref, runs[label]) for label, _, _ in RUNS[1:]]
    print(f"\n{args.model}, {len(PROMPTS)} prompts x {args.tokens} greedy tokens, vs float32:")
    for r in rows:
        print(
            f"  {r.label:20} identical {r.identical:2}/{len(PROMPTS)}, "
            f"mean common prefix {r.mean_common_prefix:5.1f}/{args.tokens}"
        )
    path = write_json(
        {
            "model": args.model,
            "tokens": args.tokens,
            "deterministic": not args.no_deterministic,
            "rows": [asdict(r) for r in rows],
        },
        args.out,
        "fp8_accuracy",
    )
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
