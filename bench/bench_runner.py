"""Runner micro-benchmark: SmolLM2 through radixmux's runner vs plain transformers.

For each dtype: prefill tokens/s of a 512-token prompt, the time of a cache-hit
prefill (448 tokens cached, 64 new), and decode tokens/s at batch 1, 8 and 32
(each sequence with a 128-token prompt). The transformers side is what
``generate`` runs per step: the model with its own ``DynamicCache`` (SDPA) and a
greedy pick. The two engines are timed *interleaved*, step by step, so both
see the same load from other processes on these shared cores; each figure is
the 20th-percentile step (a low percentile measures the machine, the median
mostly the neighbours). Prints a table, writes JSON under ``bench/results/``.

    .venv/bin/python -m bench.bench_runner [--dtypes float32 bfloat16] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from radixmux.common.server_args import ATTENTION_BACKENDS
from radixmux.memory.arena import KVArena
from radixmux.memory.layout import BlockGeometry
from radixmux.model_runners.loader import LoadedModel, load_model
from radixmux.model_runners.model_runner import ModelRunner
from radixmux.model_runners.paged_attention import ATTN_NAME
from radixmux.protocol import (
    ForwardBatch,
    SeqInput,
    pack_ids,
)

PREFILL = 512
CACHED = 448
PROMPT = 128


def _typical(times: list[float]) -> float:
    return float(np.percentile(times, 20))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Slots:
    """Sequential slot ids; wraps around (old K/V are never read again)."""

    def __init__(self, total: int) -> None:
        self.next, self.total = 0, total

    def take(self, n: int) -> list[int]:
        if self.next + n > self.total:
            self.next = 0
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


class Ours:
    """radixmux's runner, driven the way the scheduler will drive it."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.slots = Slots(runner.num_slots)
        self.ctx: list[tuple[list[int], list[int]]] = []

    def run(self, seqs: list[SeqInput]) -> list[int]:
        self.runner.model.config._attn_implementation = ATTN_NAME
        res = self.runner.forward(ForwardBatch(0, seqs))
        assert res.error is None, res.error
        return [o.token_id for o in res.outputs]

    def prefill(self, tokens: list[int]) -> None:
        self.run([SeqInput("p", pack_ids(tokens), pack_ids(self.slots.take(len(tokens))))])

    def hit_prefill(self, cached: list[int], tokens: list[int]) -> None:
        s = cached + self.slots.take(len(tokens))
        self.run([SeqInput("h", pack_ids(tokens), pack_ids(s))])

    def start(self, prompts: list[list[int]]) -> list[int]:
        self.ctx = [(list(p), self.slots.take(len(p))) for p in prompts]
        return self.run(
            [SeqInput(f"r{i}", pack_ids(p), pack_ids(s)) for i, (p, s) in enumerate(self.ctx)]
        )

    def step(self, nxt: list[int]) -> list[int]:
        seqs = []
        for i, (ids, slots) in enumerate(self.ctx):
            ids.append(nxt[i])
            slots += self.slots.take(1)
            seqs.append(SeqInput(f"r{i}", pack_ids(nxt[i : i + 1]), pack_ids(slots)))
        return self.run(seqs)


class Plain:
    """transformers' own decode loop: DynamicCache, SDPA, greedy argmax."""

    def __init__(self, model) -> None:
        from transformers import DynamicCache

        self.model = model
        self.new_cache = lambda: DynamicCache(config=model.config)
        self.cache = None

    @torch.inference_mode()
    def _fwd(self, ids: torch.Tensor, cache) -> list[int]:
        self.model.config._attn_implementation = "sdpa"
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].argmax(-1).tolist()

    def prefill(self, tokens: list[int]) -> None:
        self._fwd(torch.tensor([tokens]), self.new_cache())

    def start(self, prompts: list[list[int]]) -> list[int]:
        self.cache = self.new_cache()
        return self._fwd(torch.tensor(prompts), self.cache)

    def step(self, nxt: list[int]) -> list[int]:
        return self._fwd(torch.tensor(nxt)[:, None], self.cache)


def bench_dtype(loaded: LoadedModel, runner: ModelRunner, plain_model, args) -> dict:
    rng = np.random.default_rng(0)
    vocab = loaded.info.vocab_size
    ours, plain = Ours(runner), Plain(plain_model)
    prompt = rng.integers(100, vocab, PREFILL).tolist()
    ours.prefill(prompt[:16])
    plain.prefill(prompt[:16])
    res = {"radixmux": {}, "transformers": {}}
    pre = {"radixmux": [], "transformers": []}
    hit = []
    cached = ours.slots.take(CACHED)
    ours.run([SeqInput("c", pack_ids(prompt[:CACHED]), pack_ids(cached), sample=False)])
    for _ in range(args.repeat):
        pre["radixmux"].append(_timed(lambda: ours.prefill(prompt)))
        pre["transformers"].append(_timed(lambda: plain.prefill(prompt)))
        hit.append(_timed(lambda: ours.hit_prefill(cached, prompt[CACHED:])))
    for eng in pre:
        res[eng]["prefill_tok_s"] = PREFILL / min(pre[eng])
    res["radixmux"]["hit_prefill_s"] = min(hit)
    # transformers has no prefix cache: a "hit" recomputes the whole prompt.
    res["transformers"]["hit_prefill_s"] = min(pre["transformers"])
    for b in args.batches:
        prompts = rng.integers(100, vocab, (b, args.prompt)).tolist()
        nxt_o, nxt_p = ours.start(prompts), plain.start(prompts)
        steps = {"radixmux": [], "transformers": []}
        for _ in range(args.steps):
            t0 = time.perf_counter()
            nxt_o = ours.step(nxt_o)
            t1 = time.perf_counter()
            nxt_p = plain.step(nxt_p)
            t2 = time.perf_counter()
            steps["radixmux"].append(t1 - t0)
            steps["transformers"].append(t2 - t1)
        for eng in steps:
            res[eng][f"decode_b{b}_tok_s"] = b / _typical(steps[eng])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per batch size")
    ap.add_argument("--repeat", type=int, default=3, help="prefill repetitions (best kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument(
        "--attention-backend", default="auto", choices=ATTENTION_BACKENDS, help="decode attention"
    )
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens before decoding")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in args.dtypes:
        loaded = load_model(args.model, dtype=dtype)
        layout = loaded.info.layout
        # 3 MiB: a multiple of every K/V row size of SmolLM2 (768 B fp32, 384 B
        # bf16), so the runner gathers whole rows (see kv_store.py).
        block = 3 << 20
        tokens = PREFILL * (args.repeat + 3) + sum(args.batches) * (args.prompt + args.steps + 1)
        arena = KVArena.create(tokens * layout.bytes_per_token // block + 4, block)
        try:
            view = arena.view(BlockGeometry(layout, block, 1))
            runner = ModelRunner(loaded, view, args.attention_backend)
            # The baseline is transformers as shipped: its own copy, weights unpacked.
            plain = load_model(args.model, dtype=dtype, pack_weights=False, fuse_ops=False).model
            rows.append({"dtype": dtype, **bench_dtype(loaded, runner, plain, args)})
        finally:
            arena.destroy()

    keys = ["prefill_tok_s", "hit_prefill_s"] + [f"decode_b{b}_tok_s" for b in args.batches]
    print(
        f"\n{args.model}, {args.threads} thread(s); prefill = {PREFILL}-token prompt; "
        f"hit = {CACHED} cached + {PREFILL - CACHED} new (transformers has no prefix cache: "
        f"it recomputes all {PREFILL}); decode = {args.steps} steps after a {args.prompt}-token "
        "prompt, 20th-percentile step, engines interleaved"
    )
    print(f"{'dtype':9} {'engine':13}" + "".join(f"{k:>18}" for k in keys))
    for r in rows:
        for eng in ("radixmux", "transformers"):
            vals = "".join(f"{r[eng][k]:18.2f}" for k in keys)
            print(f"{r['dtype']:9} {eng:13}{vals}")
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"bench_runner-{time.strftime('%Y%m%dT%H%M%S')}.json"
    meta = {"model": args.model, "threads": args.threads, "steps": args.steps}
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
