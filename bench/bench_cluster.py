"""Which router in front of radixmux instances keeps a shared prefix where it is cached.

For each (router, policy) a fresh cluster (``deploy.cluster``: N tiny-model
instances, cold caches, the router in front) gets the same shuffled
generated-shared-prefix workload through the router; each instance's own
``/metrics`` then says how many prompt tokens it served from its prefix cache
and how many requests it took, and the client times the run (requests/s,
mean TTFT = time to the whole answer of 8 tokens, so mostly prefill). A router
that keeps each system prompt on one instance computes it once; round-robin
computes it on every instance. ``vllm kv_aware`` is event-driven (exact):
each instance publishes its radix tree's stores and evictions as vLLM KV
events (``--kv-events-config``) and vllm-router routes from them, not from
its own guess of what it sent where. Pages of 16 tokens everywhere (the
events' block size).

    .venv/bin/python -m bench.bench_cluster [--instances 2] [--groups 6] [--per-group 8]

Prints a table and saves it under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.bench_serving import write_json
from bench.server_process import free_port
from bench.tiny_models import make_tiny_model_dir
from bench.workloads import GSPParams, Session, generated_shared_prefix, vocabulary_words
from deploy.processes import Cluster
from deploy.specs import InstanceSpec, RouterSpec

CONFIGS = (
    ("sglang", "cache_aware"),
    ("vllm", "cache_aware"),
    ("vllm", "kv_aware"),
    ("sglang", "round_robin"),
)
PAGE = 16
TINY_ARGS = (
    "--kv-block-bytes", "65536", "--page-size", str(PAGE),
    "--runner-threads", "1", "--dtype", "float32",
)  # fmt: skip
COUNTERS = ("radixmux_prompt_tokens_total", "radixmux_cached_prompt_tokens_total")


@dataclass(frozen=True)
class RouterFigures:
    """One (router, policy): the token hit rate over all instances and the spread."""

    router: str
    policy: str
    hit_rate: float
    requests_per_instance: list[int]
    failed: int
    seconds: float
    requests_per_s: float
    mean_latency_ms: float


def instance_counters(url: str) -> dict[str, float]:
    """Prompt tokens, cached prompt tokens and finished requests of one instance."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    out = dict.fromkeys((*COUNTERS, "radixmux_requests_total"), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def send(router: str, session: Session) -> tuple[bool, float]:
    body = {
        "model": session.model,
        "prompt": f"{session.system}\n\n{session.turns[0]}",
        "max_tokens": session.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.monotonic()
    r = httpx.post(router + "/v1/completions", json=body, timeout=120, trust_env=False)
    return r.status_code == 200, time.monotonic() - t0


def event_flags(ports: list[tuple[int, int]]) -> list[tuple[str, ...]]:
    """Each instance's ``--kv-events-config`` (ZMQ publisher and replay socket)."""
    return [
        (
            "--kv-events-config",
            json.dumps(
                {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{pub}",
                    "replay_endpoint": f"tcp://*:{replay}",
                    "buffer_steps": 10000,
                }
            ),
        )
        for pub, replay in ports
    ]


def router_event_flags(urls: list[str], ports: list[tuple[int, int]]) -> tuple[str, ...]:
    """vllm-router's sources: each worker's event stream and replay socket."""
    flags: list[str] = []
    for url, (pub, replay) in zip(urls, ports, strict=True):
        flags += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{pub}"]
        flags += ["--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{replay}"]
    return (*flags, "--kv-event-block-size", str(PAGE), "--kv-event-model", "tiny")


def measure(
    router: str,
    policy: str,
    model: Path,
    sessions: list[Session],
    n: int,
    concurrency: int,
    kv_bytes: int,
) -> RouterFigures:
    events = policy == "kv_aware"
    ports = [(free_port(), free_port()) for _ in range(n)]
    extra = event_flags(ports) if events else [()] * n
    base = (*TINY_ARGS, "--kv-cache-bytes", str(kv_bytes))
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as state:
        specs = [
            InstanceSpec(
                free_port(),
                (f"{model},name=tiny",),
                Path(state) / f"i{i}",
                extra_args=(*base, *extra[i]),
            )
            for i in range(n)
        ]
        urls = [s.url for s in specs]
        router_extra = router_event_flags(urls, ports) if events else ()
        spec = RouterSpec(router, free_port(), tuple(urls), policy=policy, extra_args=router_extra)
        with Cluster(specs, spec, Path(state) / "logs") as cluster:
            url = cluster.start(300)
            t0 = time.monotonic()
            with ThreadPoolExecutor(concurrency) as pool:
                done = list(pool.map(lambda s: send(url, s), sessions))
            seconds = time.monotonic() - t0
            counts = [instance_counters(s.url) for s in specs]
    answered = [ok for ok, _ in done]
    prompt = sum(c[COUNTERS[0]] for c in counts)
    cached = sum(c[COUNTERS[1]] for c in counts)
    return RouterFigures(
        router=router,
        policy=policy,
        hit_rate=cached / prompt if prompt else 0.0,
        requests_per_instance=[int(c["radixmux_requests_total"]) for c in counts],
        failed=answered.count(False),
        seconds=seconds,
        requests_per_s=len(sessions) / seconds,
        mean_latency_ms=statistics.fmean(t for _, t in done) * 1e3,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--groups", type=int, default=6, help="distinct system prompts")
    p.add_argument("--per-group", type=int, default=8, help="requests per system prompt")
    p.add_argument("--system-len", type=int, default=256, help="words per system prompt")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--kv-bytes",
        type=int,
        default=64 << 20,
        help="each instance's --kv-cache-bytes (small: the prompts outgrow one arena)",
    )
    p.add_argument("--rounds", type=int, default=1, help="every config again, interleaved")
    p.add_argument("--out", type=Path, help="JSON file (default: timestamped in bench/results/)")
    args = p.parse_args()
    model = make_tiny_model_dir(Path(tempfile.gettempdir()) / "radixmux-bench-cluster-tiny", seed=3)
    params = GSPParams(
        num_groups=args.groups,
        prompts_per_group=args.per_group,
        system_prompt_len=args.system_len,
        question_len=16,
        output_len=8,
        shuffle=True,
    )
    sessions = generated_shared_prefix(vocabulary_words(str(model)), "tiny", params)
    # The router tokenizes prompts itself for kv_aware (offline: the model's folder).
    os.environ.setdefault("VLLM_ROUTER_TOKENIZER", str(model))
    results = []
    print(
        f"{'router':8} {'policy':12} {'hit rate':>8}  requests per instance  failed  seconds"
        "  req/s  mean latency"
    )
    for _ in range(args.rounds):
        for router, policy in CONFIGS:
            fig = measure(
                router, policy, model, sessions, args.instances, args.concurrency, args.kv_bytes
            )
            results.append(fig)
            spread = "/".join(map(str, fig.requests_per_instance))
            print(
                f"{router:8} {policy:12} {fig.hit_rate:8.3f}  {spread:21}  {fig.failed:6}  "
                f"{fig.seconds:7.1f}  {fig.requests_per_s:5.2f}  {fig.mean_latency_ms:8.0f} ms",
                flush=True,
            )
    path = write_json(
        {"params": asdict(params), "results": [asdict(r) for r in results]},
        args.out,
        "cluster",
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
