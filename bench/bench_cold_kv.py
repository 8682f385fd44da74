"""A cold on-demand model's first request, with and without its KV kept on the disk tier.

Two models of distinct weights: ``--loaded`` (loaded at start) and
``--on-demand`` (registered with ``load=on_demand``, served as ``cold``).
Distinct weights matter: an alias of a loaded model keeps its KV in memory
when unloaded, so only a model whose KV nobody else shares goes to disk. Per
configuration:

1. ask ``cold`` a long prompt (it loads, computes and caches it);
2. unload it (``DELETE /models/cold``): with the disk tier on, its cache is
   saved to disk as it goes;
3. ask it the same prompt again: a cold load, then either a prefix loaded from
   disk or the whole prompt recomputed.

Configurations, one server each: ``disk`` (``--kv-disk-bytes``) and
``no_disk``. Reported: step 3's latency and ``cached_tokens``, step 1's
latency (cold, nothing cached), and a warm repeat for reference.

    .venv/bin/python -m bench.bench_cold_kv [--prompt-words 1200]

Prints a table and writes ``bench/results/cold_kv-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.bench_serving import RESULTS_DIR
from bench.server_process import launch_radixmux

MAX_TOKENS = 16


@dataclass
class ColdRow:
    """One configuration's first requests to the on-demand model."""

    config: str
    first_ms: float  # cold load, nothing cached
    after_unload_ms: float  # cold load again, after an unload
    after_unload_cached: int  # prompt tokens served from a cache on that request
    warm_ms: float  # the same request with the model loaded and the prompt cached
    prompt_tokens: int
    same_text: bool  # step 3 answered what step 1 did


def ask(client: httpx.Client, url: str, model: str, prompt: str) -> tuple[float, dict]:
    """One greedy completion: (latency ms, response JSON)."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/completions", json=body)
    ms = (time.perf_counter() - t0) * 1e3
    r.raise_for_status()
    return ms, r.json()


def run_config(config: str, args: argparse.Namespace, prompt: str, logs: Path) -> ColdRow:
    flags = [
        "--dtype",
        "bfloat16",
        "--model",
        f"{args.loaded},name=resident",
        "--model",
        f"{args.on_demand},name=cold,load=on_demand",
    ]
    disk_dir = None
    if config == "disk":
        disk_dir = tempfile.mkdtemp(prefix="radixmux-cold-kv-")
        flags += ["--kv-disk-bytes", str(args.disk_bytes), "--kv-disk-dir", f"{disk_dir}/kv"]
    print(f"[cold_kv] {config}: starting", file=sys.stderr, flush=True)
    server = launch_radixmux(flags, logs / f"{config}.log", timeout=900)
    try:
        with httpx.Client(timeout=args.request_timeout, trust_env=False) as client:
            url = server.base_url
            first_ms, first = ask(client, url, "cold", prompt)
            client.delete(f"{url}/models/cold").raise_for_status()
            wait_registered(client, url, args.request_timeout)
            again_ms, again = ask(client, url, "cold", prompt)
            warm_ms, _ = ask(client, url, "cold", prompt)
    finally:
        server.stop()
    usage = again["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return ColdRow(
        config,
        first_ms,
        again_ms,
        int(details.get("cached_tokens") or 0),
        warm_ms,
        int(usage["prompt_tokens"]),
        first["choices"][0]["text"] == again["choices"][0]["text"],
    )


def wait_registered(client: httpx.Client, url: str, timeout: float) -> None:
    """Until ``/v1/models`` lists the unloaded model as registered again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        models = client.get(f"{url}/v1/models").json()["data"]
        if any(m["id"] == "cold" and m.get("state") == "registered" for m in models):
            return
        time.sleep(0.2)
    raise TimeoutError("the unloaded model never showed as registered")


def make_prompt(words: int) -> str:
    """A long prompt of ordinary words (deterministic)."""
    vocab = [
        "river",
        "stone",
        "lamp",
        "orchard",
        "winter",
        "signal",
        "harbor",
        "copper",
        "meadow",
        "lantern",
    ]
    return " ".join(vocab[(i * 7 + i // 10) % len(vocab)] for i in range(words))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--loaded", default="smollm2", help="the model loaded at start")
    p.add_argument("--on-demand", default="gemma3-270m", help="the model loaded on demand")
    p.add_argument("--prompt-words", type=int, default=1200)
    p.add_argument("--disk-bytes", type=int, default=2 << 30)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or RESULTS_DIR / f"cold_kv-{stamp}.json"
    logs = out.with_name(out.stem + "-logs")
    prompt = make_prompt(args.prompt_words)
    rows = [run_config(c, args, prompt, logs) for c in ("no_disk", "disk")]
    print(
        f"{'config':8} {'prompt':>6} {'first ms':>9} {'reload ms':>10} {'cached':>7} "
        f"{'warm ms':>8} same"
    )
    for r in rows:
        print(
            f"{r.config:8} {r.prompt_tokens:6d} {r.first_ms:9.0f} {r.after_unload_ms:10.0f} "
            f"{r.after_unload_cached:7d} {r.warm_ms:8.0f} {r.same_text}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"args": vars(args) | {"out": str(out)}, "rows": [asdict(r) for r in rows]},
            indent=1,
            default=str,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
