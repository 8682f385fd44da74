"""Runner micro-benchmark: SmolLM2 through radixmux's runner vs plain transformers.

For each dtype: prefill tokens/s of a 512-token prompt, the time of a cache-hit
prefill (448 tokens cached, 64 new), and decode tokens/s at batch 1, 8 and 32
(each sequence with a 128-token prompt); the same through transformers
(``generate`` with its own cache, SDPA). Prints a table, writes JSON under
``bench/results/``.

    .venv/bin/python bench/bench_runner.py [--dtypes float32 bfloat16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from radixmux.memory.arena import KVArena
from radixmux.memory.layout import BlockGeometry
from radixmux.model_runners.loader import load_model
from radixmux.model_runners.model_runner import ModelRunner
from radixmux.model_runners.protocol import ForwardBatch, SeqInput, pack_ids

PREFILL = 512
CACHED = 448
PROMPT = 128


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


class Slots:
    """Sequential slot ids (the benchmark never frees)."""

    def __init__(self, total: int) -> None:
        self.next, self.total = 0, total

    def take(self, n: int) -> list[int]:
        if self.next + n > self.total:
            self.next = 0  # wrap: old K/V are garbage we never read again
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def bench_ours(runner: ModelRunner, vocab: int, batches: list[int], steps: int, repeat: int):
    rng = np.random.default_rng(0)
    slots = Slots(runner.num_slots)
    prompt = rng.integers(100, vocab, PREFILL).tolist()

    def prefill(tokens, ctx_slots, start):
        seqs = [SeqInput("p", pack_ids(tokens), pack_ids(ctx_slots), start)]
        res = runner.forward(ForwardBatch(0, seqs))
        assert res.error is None, res.error

    runner.forward(
        ForwardBatch(0, [SeqInput("w", pack_ids(prompt[:16]), pack_ids(slots.take(16)), 0)])
    )
    t_prefill = _best(lambda: prefill(prompt, slots.take(PREFILL), 0), repeat)
    cached = slots.take(CACHED)
    prefill(prompt[:CACHED], cached, 0)
    t_hit = _best(
        lambda: prefill(prompt[CACHED:], cached + slots.take(PREFILL - CACHED), CACHED), repeat
    )
    out = {"prefill_tok_s": PREFILL / t_prefill, "prefill_s": t_prefill, "hit_prefill_s": t_hit}
    for b in batches:
        ctx = []
        seqs = []
        for i in range(b):
            toks = rng.integers(100, vocab, PROMPT).tolist()
            s = slots.take(PROMPT + steps + 1)
            ctx.append((toks, s))
            seqs.append(SeqInput(f"r{i}", pack_ids(toks), pack_ids(s[:PROMPT]), 0))
        res = runner.forward(ForwardBatch(1, seqs))
        nxt = [o.token_id for o in res.outputs]
        step_s = []
        for step in range(steps):
            t0 = time.perf_counter()
            pos = PROMPT + step
            seqs = [
                SeqInput(f"r{i}", pack_ids([nxt[i]]), pack_ids(ctx[i][1][: pos + 1]), pos)
                for i in range(b)
            ]
            res = runner.forward(ForwardBatch(2 + step, seqs))
            nxt = [o.token_id for o in res.outputs]
            step_s.append(time.perf_counter() - t0)
        # Median step: robust to the other processes sharing these cores.
        out[f"decode_b{b}_tok_s"] = b / float(np.median(step_s))
    return out


class _StepClock:
    """A logits processor that only records when each generate step ends."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


@torch.inference_mode()
def bench_hf(model, vocab: int, batches: list[int], steps: int, repeat: int):
    rng = np.random.default_rng(0)
    ids = torch.tensor([rng.integers(100, vocab, PREFILL).tolist()])
    model(input_ids=ids[:, :16], logits_to_keep=1)
    t_prefill = _best(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), repeat)
    t_hit = _best(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), 1)
    out = {"prefill_tok_s": PREFILL / t_prefill, "prefill_s": t_prefill, "hit_prefill_s": t_hit}
    for b in batches:
        prompts = torch.tensor(rng.integers(100, vocab, (b, PROMPT)).tolist())
        mask = torch.ones_like(prompts)

        from transformers import LogitsProcessorList

        clock = _StepClock()
        model.generate(
            prompts,
            attention_mask=mask,
            max_new_tokens=steps + 1,
            min_new_tokens=steps + 1,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
        )
        # Step i's time is between consecutive processor calls (the first is prefill).
        step_s = np.diff(clock.stamps)
        out[f"decode_b{b}_tok_s"] = b / float(np.median(step_s))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per batch")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is stable on a shared 2-core box)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in args.dtypes:
        loaded = load_model(args.model, dtype=dtype)
        layout = loaded.info.layout
        # 3 MiB: a multiple of every K/V row size of SmolLM2 (768 B fp32, 384 B bf16),
        # so the runner gathers whole rows (see kv_store.py).
        block = 3 << 20
        need = (
            PREFILL * 3 + sum(args.batches) * (PROMPT + args.steps + 1)
        ) * layout.bytes_per_token
        arena = KVArena.create(need // block + 8, block)
        try:
            geometry = BlockGeometry(layout, block, 1)
            runner = ModelRunner(loaded, arena.view(geometry))
            ours = bench_ours(runner, loaded.info.vocab_size, args.batches, args.steps, args.repeat)
        finally:
            arena.destroy()
        loaded.model.config._attn_implementation = "sdpa"
        hf = bench_hf(loaded.model, loaded.info.vocab_size, args.batches, args.steps, args.repeat)
        rows.append({"dtype": dtype, "radixmux": ours, "transformers": hf})

    keys = ["prefill_tok_s", "hit_prefill_s"] + [f"decode_b{b}_tok_s" for b in args.batches]
    head = f"{'dtype':9} {'engine':13}" + "".join(f"{k:>18}" for k in keys)
    print(
        f"\n{args.model}, {args.threads} threads, prefill {PREFILL} tok, hit = {CACHED} cached "
        f"+ {PREFILL - CACHED} new, decode {args.steps} steps after a {PROMPT}-token prompt"
    )
    print(head)
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
