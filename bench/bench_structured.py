"""What structured output costs: constrained against unconstrained requests.

One radixmux server (SmolLM2 bfloat16 by default) serves the same prompts
twice per concurrency, interleaved: plain, and with a JSON-schema
``response_format`` (an object holding an array of eight short strings, so
every constrained output is 40-90 tokens and ends when the grammar does).
The plain run asks for the same number of tokens (``ignore_eos``), so TPOT
and output throughput compare like for like. ``bench_serving`` drives both
over HTTP (streamed, vLLM-style figures). Also measured in this process: the
compile of the schema for each model's tokenizer, cold and from the cache.

Goal (stated by the issue): constrained TPOT p50 within 10% of unconstrained.

    .venv/bin/python -m bench.bench_structured [--concurrency 1 16] [--prompts 32]

Each configuration (``--server-args``; by default as is, then with
``--enable-jump-forward``) gets its own server and both runs.

``--peer vllm`` adds vLLM CPU (bench/peers.py installs it in its own
environment) on the same weights, dtype and KV bytes, driven by the same
client with the same ``response_format`` (vLLM's ``bench serve`` has no
structured-output workload; its structured-output backend is xgrammar too).
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
from typing import Any

from bench.bench_serving import BenchConfig, BenchResult, run_benchmark, write_json
from bench.compare import radixmux
from bench.workloads import GSPParams
from radixmux.common.grammar import GrammarCompiler
from radixmux.model_runners.fetch import fetch
from radixmux.protocol import Constraint

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 8,
            "maxItems": 8,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "items", "schema": SCHEMA, "strict": True},
}
OUTPUT_TOKENS = 64  # the plain run's length: about a constrained output's


@dataclasses.dataclass
class Pair:
    """One concurrency's two runs."""

    concurrency: int
    plain: BenchResult
    constrained: BenchResult

    @property
    def tpot_ratio(self) -> float | None:
        a, b = self.constrained.tpot_ms.p50, self.plain.tpot_ms.p50
        return None if a is None or not b else a / b


def compile_times(models: Sequence[str]) -> dict[str, dict[str, float]]:
    """Milliseconds to compile ``SCHEMA`` for each model's tokenizer: the
    tokenizer's tables (once per server), the schema cold, then cached."""
    from transformers import AutoTokenizer

    out = {}
    for model in models:
        folder = fetch(model)
        tok = AutoTokenizer.from_pretrained(folder)
        config = json.loads((Path(folder) / "config.json").read_text())
        vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
        compiler = GrammarCompiler(tok, vocab, [tok.eos_token_id])
        t0 = time.perf_counter()
        compiler.token_info  # noqa: B018 (builds the tables)
        t1 = time.perf_counter()
        c = Constraint("json", json.dumps(SCHEMA))
        compiler.compile(c, 600)
        t2 = time.perf_counter()
        compiler.compile(c, 600)
        t3 = time.perf_counter()
        out[model] = {
            "tables_ms": (t1 - t0) * 1e3,
            "cold_ms": (t2 - t1) * 1e3,
            "cached_ms": (t3 - t2) * 1e3,
        }
        print(f"compile {model}: " + ", ".join(f"{k} {v:.3f}" for k, v in out[model].items()))
    return out


def run_pairs(
    base_url: str, served: str, model: str, concurrency: Sequence[int], prompts: int
) -> list[Pair]:
    """For each concurrency, the plain run then the constrained one (fresh
    prompts per concurrency: no run reuses another's cached prefixes);
    ``served``: the name the server knows the model by."""
    pairs = []
    for i, c in enumerate(concurrency):
        gsp = GSPParams(
            num_groups=prompts // 4,
            prompts_per_group=4,
            system_prompt_len=256,
            question_len=32,
            output_len=OUTPUT_TOKENS,
        )
        base = BenchConfig(
            base_url=base_url,
            models=[served],
            tokenizer=model,
            concurrency=c,
            seed=1000 + i,
            gsp=gsp,
            progress=False,
        )
        runs = {}
        # The constrained side ends where its grammar does (a peer that honours
        # ignore_eos past it would generate other text than the answer).
        constrained = {"response_format": RESPONSE_FORMAT, "ignore_eos": False}
        for label, extra in (("plain", {}), ("json_schema", constrained)):
            # Prompts of one shape but each run its own (another seed): the
            # second run must not hit the first's cached prefixes.
            cfg = dataclasses.replace(
                base, label=f"{label} c={c}", extra_body=extra, seed=base.seed + len(runs) * 100
            )
            runs[label] = asyncio.run(run_benchmark(cfg))
            r = runs[label]
            print(
                f"c={c:3} {label:12} {r.completed}/{r.num_requests} ok, "
                f"{r.output_throughput:7.1f} out tok/s, TPOT p50 {r.tpot_ms.p50 or 0:6.1f} ms, "
                f"TTFT p50 {r.ttft_ms.p50 or 0:7.1f} ms, {r.total_output_tokens} tokens",
                flush=True,
            )
        pairs.append(Pair(c, runs["plain"], runs["json_schema"]))
    return pairs


def plot(pairs: Sequence[Pair], path: Path) -> None:
    """TPOT p50 and output throughput, plain vs constrained, per concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_tpot, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(pairs))
    for k, (attr, label) in enumerate((("plain", "plain"), ("constrained", "json_schema"))):
        runs = [getattr(p, attr) for p in pairs]
        ax_tpot.bar(x + k * 0.4, [r.tpot_ms.p50 or 0 for r in runs], 0.4, label=label)
        ax_tps.bar(x + k * 0.4, [r.output_throughput for r in runs], 0.4, label=label)
    for ax, title in ((ax_tpot, "TPOT p50 (ms)"), (ax_tps, "output tokens/s")):
        ax.set_xticks(x + 0.2, [f"c={p.concurrency}" for p in pairs])
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompts", type=int, default=32, help="requests per run (a multiple of 4)")
    ap.add_argument("--compile-models", nargs="*", default=["smollm2", "gemma3-270m"])
    ap.add_argument(
        "--server-args",
        action="append",
        default=None,
        help="one radixmux configuration (repeatable; default: as is, then with "
        "--enable-jump-forward)",
    )
    ap.add_argument("--peer", choices=["vllm"], default=None, help="also measure this peer")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results/)")
    a = ap.parse_args(argv)
    configs = a.server_args if a.server_args is not None else ["", "--enable-jump-forward"]
    compiled = compile_times(a.compile_models)
    logs = Path("bench/results/structured-logs")
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[Pair]] = {}
    if a.peer:
        from bench import peers

        kv = 2 << 30  # radixmux's default --kv-cache-bytes: the same KV for both
        print(f"== {a.peer} (peer)", flush=True)
        with peers.start_peer(a.peer, a.model, dtype=a.dtype, kv_bytes=kv) as peer:
            runs[a.peer] = run_pairs(
                peer.base_url, peer.served_model, a.model, a.concurrency, a.prompts
            )
    for k, extra in enumerate(configs):
        args = ["--model", a.model, "--dtype", a.dtype, *extra.split()]
        print(f"== radixmux {' '.join(args)}", flush=True)
        with radixmux(args, logs / f"server-{k}.log") as server:
            runs[extra or "default"] = run_pairs(
                server.base_url, a.model, a.model, a.concurrency, a.prompts
            )
    print(
        f"{'config':24} {'conc':>4} {'TPOT plain':>10} {'TPOT json':>10} {'ratio':>6}  goal <= 1.10"
    )
    for name, pairs in runs.items():
        for p in pairs:
            ratio = p.tpot_ratio
            verdict = "n/a" if ratio is None else ("PASS" if ratio <= 1.10 else "MISS")
            print(
                f"{name:24} {p.concurrency:4} {p.plain.tpot_ms.p50 or 0:10.1f} "
                f"{p.constrained.tpot_ms.p50 or 0:10.1f} {ratio or 0:6.2f}  {verdict}"
            )
    data = {
        "argv": sys.argv[1:],
        "compile_ms": compiled,
        "configs": {
            name: [
                {
                    "concurrency": p.concurrency,
                    "tpot_ratio": p.tpot_ratio,
                    "plain": p.plain.to_json(),
                    "constrained": p.constrained.to_json(),
                }
                for p in pairs
            ]
            for name, pairs in runs.items()
        },
    }
    out = write_json(data, a.out, "structured")
    plot([p for pairs in runs.values() for p in pairs], out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
