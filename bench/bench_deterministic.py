"""Does a greedy answer depend on the cache, the batch or the chunking? Default vs deterministic.

For each mode (the default, then ``--deterministic``) radixmux serves a real
model (SmolLM2, bfloat16 unless ``--dtype`` says otherwise) twice, one server
at a time: with the prefix cache and its default chunk size, then with
``--disable-radix-cache`` and ``--chunked-prefill-size 64``. Prompts share a
system prompt; each is asked greedily with logprobs in three ways:

``alone``
    one at a time on the cached server (the first cold, the rest over the
    cached system prompt, each prefilled beside nothing);
``batched``
    all at once on the cached server (everything cached, decodes batched);
``uncached``
    all at once, in reverse order, on the uncached server (prefilled in
    chunks of 64 beside each other's decodes).

Per mode it prints how many prompts got different tokens (and different
logprobs) in any two of the three, and writes a JSON and a PNG under
``bench/results/``. The throughput the mode costs is measured by vLLM's own
client::

    .venv/bin/python -m bench.bench_deterministic [--prompts 16] [--max-tokens 64] [--dtype auto]
    .venv/bin/python -m bench.vs_vllm --engines radixmux --server-args "" \\
        --server-args=--deterministic --interleave 2
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.bench_serving import RESULTS_DIR
from bench.server_process import ServerProcess, launch_radixmux

MODES = {"default": (), "deterministic": ("--deterministic",)}
UNCACHED = ("--disable-radix-cache", "--chunked-prefill-size", "64")
SYSTEM = (
    "You are a patient teacher. Answer in plain words, with one short example, and never "
    "more than four sentences. If a question is unclear, say what you would need to know. "
)
TOPICS = (
    "why the sky is blue",
    "how a bicycle stays upright",
    "what a prime number is",
    "why bread rises",
    "how a rainbow forms",
    "what photosynthesis does",
    "why ice floats on water",
    "how a compass works",
    "what causes tides",
    "why leaves change colour",
    "how vaccines train the body",
    "what a black hole is",
    "why the sea is salty",
    "how a refrigerator keeps food cold",
    "what inflation means",
    "why we dream",
)


@dataclasses.dataclass(frozen=True)
class Answer:
    """One greedy completion: its tokens and their logprobs."""

    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]


@dataclasses.dataclass
class ModeResult:
    """What one mode gave: every prompt's answer in each of the three ways."""

    mode: str
    alone: list[Answer]
    batched: list[Answer]
    uncached: list[Answer]

    def changed(self, field: str) -> int:
        """Prompts whose ``field`` (tokens or logprobs) differ between any two ways."""
        ways = zip(self.alone, self.batched, self.uncached, strict=True)
        return sum(len({getattr(a, field) for a in triple}) > 1 for triple in ways)


def prompts(n: int) -> list[str]:
    """``n`` questions after one shared system prompt."""
    return [f"{SYSTEM}Question: explain {TOPICS[i % len(TOPICS)]}.\nAnswer:" for i in range(n)]


async def ask(
    url: str, texts: Sequence[str], max_tokens: int, model: str = "default"
) -> list[Answer]:
    """Every text at once to ``model``, greedy, with the chosen tokens' logprobs."""
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:

        async def one(text: str) -> Answer:
            body = {
                "model": model,
                "prompt": text,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 1,
            }
            r = await client.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            lp = r.json()["choices"][0]["logprobs"]
            return Answer(tuple(lp["tokens"]), tuple(lp["token_logprobs"]))

        return list(await asyncio.gather(*(one(t) for t in texts)))


def serve(model: str, dtype: str, flags: Sequence[str], log: Path) -> ServerProcess:
    """radixmux serving ``model`` in ``dtype`` as ``default``, healthy."""
    return launch_radixmux(["--model", f"{model},name=default", "--dtype", dtype, *flags], log)


def run_mode(mode: str, args: argparse.Namespace, logs: Path) -> ModeResult:
    texts = prompts(args.prompts)
    flags = MODES[mode]
    print(f"[deterministic] {mode}: cached server", file=sys.stderr, flush=True)
    server = serve(args.model, args.dtype, flags, logs / f"{mode}-cached.log")
    try:
        alone = [asyncio.run(ask(server.base_url, [t], args.max_tokens))[0] for t in texts]
        batched = asyncio.run(ask(server.base_url, texts, args.max_tokens))
    finally:
        server.stop()
    print(f"[deterministic] {mode}: uncached server", file=sys.stderr, flush=True)
    server = serve(args.model, args.dtype, (*flags, *UNCACHED), logs / f"{mode}-uncached.log")
    try:
        uncached = asyncio.run(ask(server.base_url, texts[::-1], args.max_tokens))[::-1]
    finally:
        server.stop()
    return ModeResult(mode, alone, batched, uncached)


def plot(results: Sequence[ModeResult], n: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r.changed("tokens") for r in results], 0.4, label="tokens")
    ax.bar([i + 0.2 for i in x], [r.changed("logprobs") for r in results], 0.4, label="logprobs")
    ax.set_xticks(list(x), [r.mode for r in results])
    ax.set_ylim(0, n)
    ax.set_ylabel(f"prompts that changed (of {n})")
    ax.set_title("Same greedy request: alone, batched, uncached")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="short name or HF folder")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--dtype", default="bfloat16", help="the model's --dtype (auto: float32 below AVX512-BF16)"
    )
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--out", type=Path, default=None, help="JSON path; the PNG goes beside it")
    args = p.parse_args(argv)
    out = args.out or RESULTS_DIR / f"deterministic-{time.strftime('%Y%m%dT%H%M%S')}.json"
    logs = out.with_suffix("").with_name(out.stem + "-logs")
    results = [run_mode(mode, args, logs) for mode in args.modes]
    print(f"{'mode':<14} {'tokens changed':>15} {'logprobs changed':>17}  (of {args.prompts})")
    for r in results:
        print(f"{r.mode:<14} {r.changed('tokens'):>15} {r.changed('logprobs'):>17}")
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "model": args.model,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "modes": [
            {
                "mode": r.mode,
                "tokens_changed": r.changed("tokens"),
                "logprobs_changed": r.changed("logprobs"),
                "answers": dataclasses.asdict(r),
            }
            for r in results
        ],
    }
    out.write_text(json.dumps(data, indent=1))
    plot(results, args.prompts, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
