"""Layer sharing on vs off: fine-tunes that froze their lower layers, one arena.

    python -m bench.bench_layer_sharing --models DIR [DIR ...] [--kv-cache-bytes N]

Serves the given model folders (for example the ``upper`` family of
``python -m bench.make_finetunes``) twice, with layer sharing (the default)
and with ``--disable-layer-sharing``, on the same arena, and sends both the
same trace: every model answers every one of a set of long system prompts
(plus a short question each), round after round, so the working set of
(model, prompt) K/V is well above what the arena holds when nothing is
shared. For each setting it prints and saves:

* hit rate: prompt tokens served from the cache / prompt tokens;
* arena bytes per cached model-token: arena bytes in use / the sum over models
  of the tokens cached for each (a token cached for 4 models counts 4), the
  memory the sharing saves;
* output tokens per second and mean latency;
* per lower layer group: tokens cached once for every sharer, tokens reused
  (a partial hit: only the model's own layers computed) and recomputed.

Writes ``bench/results/layer_sharing-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.server_process import launch_radixmux

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TOPICS = [
    "a bakery that ships bread across the country",
    "a city library's opening hours and rules",
    "a bicycle repair shop and its services",
    "an airline's baggage and refund policy",
    "a museum of early computing machines",
    "a hiking club that plans weekend trips",
    "a language school teaching Portuguese",
    "an insurance company's claims process",
]
QUESTIONS = ["What are your hours?", "How do I get a refund?", "Who should I contact?"]


def system_prompt(topic: str, words: int) -> str:
    """A long, distinct system prompt about ``topic`` (deterministic)."""
    line = (
        f"You are the assistant of {topic}. Answer politely, briefly and only with facts "
        f"about {topic}; refuse anything unrelated and never invent prices. "
    )
    return (line * (words // len(line.split()) + 1)).strip()


@dataclass
class Result:
    """One setting's figures."""

    share_layers: bool
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    arena_used_bytes: int = 0
    cached_model_tokens: int = 0
    layer_groups: list[dict] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def bytes_per_cached_token(self) -> float:
        return self.arena_used_bytes / self.cached_model_tokens if self.cached_model_tokens else 0.0


def run(args: argparse.Namespace, share: bool, names: list[str]) -> Result:
    flags = [
        *(f"--model={path},name={name}" for name, path in zip(names, args.models, strict=True)),
        f"--kv-cache-bytes={args.kv_cache_bytes}",
        f"--dtype={args.dtype}",
        *([] if share else ["--disable-layer-sharing"]),
    ]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log = RESULTS_DIR / f"layer_sharing-{stamp}-logs" / f"share-{share}.log"
    print(f"starting radixmux ({len(names)} models, share_layers={share}) ...", flush=True)
    server = launch_radixmux(flags, log)
    result = Result(share)
    try:
        url = server.base_url
        with httpx.Client(timeout=600, trust_env=False) as client:
            prompts = [system_prompt(t, args.prompt_words) for t in TOPICS[: args.prompts]]
            t0 = time.perf_counter()
            for r in range(args.rounds):
                for i, sys_prompt in enumerate(prompts):
                    for name in names:
                        question = QUESTIONS[(r + i) % len(QUESTIONS)]
                        body = {
                            "model": name,
                            "messages": [
                                {"role": "system", "content": sys_prompt},
                                {"role": "user", "content": question},
                            ],
                            "max_tokens": args.max_tokens,
                            "temperature": 0,
                        }
                        t1 = time.perf_counter()
                        resp = client.post(f"{url}/v1/chat/completions", json=body)
                        resp.raise_for_status()
                        result.latencies_s.append(time.perf_counter() - t1)
                        usage = resp.json()["usage"]
                        result.requests += 1
                        result.prompt_tokens += usage["prompt_tokens"]
                        result.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
                        result.output_tokens += usage["completion_tokens"]
                print(f"  round {r + 1}/{args.rounds}: hit rate {result.hit_rate:.3f}", flush=True)
            result.seconds = time.perf_counter() - t0
            info = client.get(f"{url}/get_server_info").json()["scheduler"]
        result.arena_used_bytes = info["arena_total_bytes"] - info["arena_free_bytes"]
        result.cached_model_tokens = sum(m["cached_tokens"] for m in info["models"])
        result.layer_groups = info["layer_groups"]
    finally:
        server.stop()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", required=True, help="HF folders (fine-tunes of one base)")
    p.add_argument("--kv-cache-bytes", type=int, default=24 << 20)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=6, help="distinct system prompts")
    p.add_argument("--prompt-words", type=int, default=220)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    names = [f"ft{i}" for i in range(len(args.models))]
    results = [run(args, share, names) for share in (False, True)]
    print(
        f"\n{len(names)} models, arena {args.kv_cache_bytes / 2**20:.0f} MiB, "
        f"{args.prompts} system prompts x {args.rounds} rounds"
    )
    print("| share layers | hit rate | arena B / cached model-token | out tok/s | mean latency s |")
    print("|---|---|---|---|---|")
    for r in results:
        mean = sum(r.latencies_s) / max(len(r.latencies_s), 1)
        print(
            f"| {'on' if r.share_layers else 'off'} | {r.hit_rate:.3f} | "
            f"{r.bytes_per_cached_token:,.0f} | {r.output_tokens / r.seconds:.1f} | {mean:.2f} |"
        )
    for g in results[1].layer_groups:
        print(
            f"  {g['model']} layers {g['start']}-{g['end']}: {g['cached_tokens']} tokens cached "
            f"(shared with {', '.join(g['shared_with']) or 'nobody'}), "
            f"{g['tokens_reused']} reused in partial hits, {g['tokens_recomputed']} recomputed"
        )
    RESULTS_DIR.mkdir(exist_ok=True)
    out = args.out or RESULTS_DIR / f"layer_sharing-{time.strftime('%Y%m%d-%H%M%S')}.json"
    payload = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": [
            {**asdict(r), "hit_rate": r.hit_rate, "bytes_per_token": r.bytes_per_cached_token}
            for r in results
        ],
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
