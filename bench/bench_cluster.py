"""Which router in front of radixmux instances keeps a shared prefix where it is cached.

N instances of one model start once (``launch.py`` as ``deploy.cluster``
starts them, each warmed up by one request sent to it directly); then for
each (router, policy) every cache is flushed (``/flush_cache``: cold, as a
fresh start, without the minute a restart of real-model instances takes), a
fresh router starts in front and the same shuffled generated-shared-prefix
workload goes through it. Each instance's own ``/metrics`` then says how many
prompt tokens it served from its prefix cache, how many requests it took and
how many tokens it evicted for room, and the client times the run
(requests/s, mean latency = time to the whole answer of ``--output-len``
tokens, so mostly prefill). A router
that keeps each system prompt on one instance computes it once; round-robin
computes it on every instance. ``vllm kv_aware`` is event-driven (exact):
each instance publishes its radix tree's stores and evictions as vLLM KV
events (``--kv-events-config``) and vllm-router routes from them, not from
its own guess of what it sent where. Pages of 16 tokens everywhere (the
events' block size).

    .venv/bin/python -m bench.bench_cluster [--instances 2] [--groups 6] [--per-group 8]
    .venv/bin/python -m bench.bench_cluster --model smollm2 --threads 1 ...

The default model is a tiny random-weight one (fast, but its prefill is too
cheap for saved tokens to show in throughput); ``--model`` takes an embedded
short name (``smollm2``: SmolLM2-135M, converted once into
``~/.cache/radixmux``) or a model folder. ``--threads`` is each instance's
``--runner-threads``: instances x threads at most the cores, or they fight
for them. Prints a table and saves it under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.bench_serving import write_json
from bench.server_process import ServerProcess, free_port
from bench.tiny_models import make_tiny_model_dir
from bench.workloads import (
    GSPParams,
    Session,
    generated_shared_prefix,
    resolve_tokenizer,
    vocabulary_words,
)
from deploy.specs import EventSource, InstanceSpec, RouterSpec, kv_events_config, router_event_flags

CONFIGS = (
    ("sglang", "cache_aware"),
    ("vllm", "cache_aware"),
    ("vllm", "kv_aware"),
    ("sglang", "round_robin"),
)
PAGE = 16
TINY = "tiny"
# The tiny model's KV is 512 bytes a token: small blocks, or a 4 MiB arena is 2 blocks.
TINY_ARGS = ("--kv-block-bytes", "65536")
COUNTERS = ("radixmux_prompt_tokens_total", "radixmux_cached_prompt_tokens_total")
EVICTED = "radixmux_evicted_tokens_total"  # its reason="capacity" samples only (not flushes)
OTHER_COUNTERS = ("radixmux_requests_total", EVICTED)
EVENTS_SETTLE_S = 1.0
START_S = 600.0
REQUEST_S = 600.0  # a request may queue behind many prefills on a loaded instance


@dataclass(frozen=True)
class BenchModel:
    """The model every instance serves: its served name, its folder (the
    router's tokenizer for kv_aware) and the instance flags it needs."""

    name: str
    folder: Path
    args: tuple[str, ...]


def resolve_model(source: str) -> BenchModel:
    """``tiny`` (random weights, made once under the temp dir), an embedded short
    name (fetched and converted once) or a model folder."""
    if source == TINY:
        folder = Path(tempfile.gettempdir()) / "radixmux-bench-cluster-tiny"
        return BenchModel(TINY, make_tiny_model_dir(folder, seed=3), TINY_ARGS)
    folder = resolve_tokenizer(source)
    return BenchModel(source if not Path(source).is_dir() else folder.name, folder, ())


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
    evicted_tokens: int  # for room, over all instances: the arenas did not hold the working set


def instance_counters(url: str) -> dict[str, float]:
    """Prompt tokens, cached prompt tokens, finished requests and tokens evicted
    for room of one instance."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    out = dict.fromkeys((*COUNTERS, *OTHER_COUNTERS), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out and (
                sample.name != EVICTED or sample.labels.get("reason") == "capacity"
            ):
                out[sample.name] += sample.value
    return out


def counters_since(url: str, before: dict[str, float]) -> dict[str, float]:
    """An instance's counters less what they were at ``before``."""
    return {k: v - before[k] for k, v in instance_counters(url).items()}


def warm_up(url: str, model: str) -> None:
    """One short request straight to an instance: its first forward's set-up is
    then not part of the timed run (nor is the prompt any system prompt's)."""
    body = {"model": model, "prompt": "Warm up.", "max_tokens": 2, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_S, trust_env=False)
    r.raise_for_status()


def send(router: str, session: Session) -> tuple[bool, float]:
    body = {
        "model": session.model,
        "prompt": f"{session.system}\n\n{session.turns[0]}",
        "max_tokens": session.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.monotonic()
    try:
        r = httpx.post(router + "/v1/completions", json=body, timeout=REQUEST_S, trust_env=False)
    except httpx.HTTPError:
        return False, time.monotonic() - t0
    return r.status_code == 200, time.monotonic() - t0


@dataclass(frozen=True)
class InstanceSetup:
    """What every instance runs with: the model, its arena, threads and dtype."""

    model: BenchModel
    kv_bytes: int
    threads: int
    dtype: str

    def args(self) -> tuple[str, ...]:
        return (
            *self.model.args,
            "--kv-cache-bytes", str(self.kv_bytes), "--page-size", str(PAGE),
            "--runner-threads", str(self.threads), "--dtype", self.dtype,
        )  # fmt: skip


class Instances:
    """N instances of the setup's model, started once for every row: each
    publishes KV events (read only by the event-driven rows' router) and is
    warmed up by one request of its own."""

    def __init__(self, setup: InstanceSetup, n: int, state: Path) -> None:
        self.setup = setup
        self.procs: list[ServerProcess] = []
        self.sources: list[EventSource] = []
        name = setup.model.name
        t0 = time.monotonic()
        try:
            for i in range(n):
                pub, replay = free_port(), free_port()
                # tcp://*: vLLM's rule binds a wildcard endpoint; the router connects to it.
                events = kv_events_config(f"tcp://*:{pub}", f"tcp://*:{replay}")
                spec = InstanceSpec(
                    free_port(),
                    (f"{setup.model.folder},name={name}",),
                    state / f"i{i}",
                    extra_args=(*setup.args(), "--kv-events-config", events),
                )
                self.procs.append(
                    ServerProcess(spec.command(), spec.port, state / "logs" / f"instance-{i}.log")
                )
                self.sources.append(
                    EventSource(spec.url, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
                )
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda p: p.wait_healthy(START_S), self.procs))
            for url in self.urls:
                warm_up(url, name)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0

    @property
    def urls(self) -> list[str]:
        return [p.base_url for p in self.procs]

    def flush(self) -> None:
        """Every cache emptied (a cold start for the next row, without a restart)."""
        for url in self.urls:
            r = httpx.post(url + "/flush_cache", timeout=60, trust_env=False)
            r.raise_for_status()

    def stop(self) -> None:
        with ThreadPoolExecutor(max(1, len(self.procs))) as pool:
            list(pool.map(ServerProcess.stop, self.procs))


def measure(
    router: str,
    policy: str,
    instances: Instances,
    sessions: list[Session],
    concurrency: int,
    log: Path,
) -> RouterFigures:
    """One row: caches flushed, a fresh router with ``policy`` in front, the
    workload through it; the instances' counters over the run."""
    instances.flush()
    urls = instances.urls
    name = instances.setup.model.name
    events = policy == "kv_aware"
    extra = router_event_flags(instances.sources, PAGE, name) if events else ()
    spec = RouterSpec(router, free_port(), tuple(urls), policy=policy, extra_args=extra)
    front = ServerProcess(spec.command(), spec.port, log)
    try:
        front.wait_healthy(START_S)
        if events:
            time.sleep(EVENTS_SETTLE_S)  # its subscriptions reach every publisher
        before = [instance_counters(u) for u in urls]
        t0 = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            done = list(pool.map(lambda s: send(front.base_url, s), sessions))
        seconds = time.monotonic() - t0
        counts = [counters_since(u, b) for u, b in zip(urls, before, strict=True)]
    finally:
        front.stop()
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
        evicted_tokens=int(sum(c[EVICTED] for c in counts)),
    )


def main() -> None:
    # A SIGTERM unwinds like Ctrl-C, through the code that stops the instances
    # and the router; by default it would leave them running.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default=TINY,
        help="tiny (random weights, default), an embedded short name (smollm2) or a model folder",
    )
    p.add_argument("--instances", type=int, default=2)
    p.add_argument(
        "--threads", type=int, default=1, help="each instance's --runner-threads (default 1)"
    )
    p.add_argument(
        "--dtype",
        help="each instance's --dtype (default float32 for tiny, else auto: bfloat16 where native)",
    )
    p.add_argument("--groups", type=int, default=6, help="distinct system prompts")
    p.add_argument("--per-group", type=int, default=8, help="requests per system prompt")
    p.add_argument(
        "--system-len", type=int, default=256, help="words per system prompt (~tokens, SmolLM2)"
    )
    p.add_argument("--question-len", type=int, default=16, help="words per question")
    p.add_argument("--output-len", type=int, default=8, help="tokens per answer")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--kv-bytes",
        type=int,
        default=64 << 20,
        help="each instance's --kv-cache-bytes (small: the prompts outgrow one arena)",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        metavar="ROUTER:POLICY",
        default=[f"{r}:{q}" for r, q in CONFIGS],
        help="which (router, policy) rows, in order (default: all four)",
    )
    p.add_argument("--rounds", type=int, default=1, help="every config again, interleaved")
    p.add_argument("--out", type=Path, help="JSON file (default: timestamped in bench/results/)")
    args = p.parse_args()
    model = resolve_model(args.model)
    dtype = args.dtype or ("float32" if model.name == TINY else "auto")
    setup = InstanceSetup(model, args.kv_bytes, args.threads, dtype)
    configs = [tuple(c.split(":", 1)) for c in args.policies]
    params = GSPParams(
        num_groups=args.groups,
        prompts_per_group=args.per_group,
        system_prompt_len=args.system_len,
        question_len=args.question_len,
        output_len=args.output_len,
        shuffle=True,
    )
    sessions = generated_shared_prefix(vocabulary_words(str(model.folder)), model.name, params)
    # The router tokenizes prompts itself for kv_aware (offline: the model's folder).
    os.environ["VLLM_ROUTER_TOKENIZER"] = str(model.folder)
    print(
        f"{model.name}: {args.instances} instances x {args.threads} threads, {dtype}, "
        f"{args.kv_bytes / 2**20:.0f} MiB arenas; {args.groups} system prompts of "
        f"~{args.system_len} tokens x {args.per_group}, concurrency {args.concurrency}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        state = Path(tmp)
        instances = Instances(setup, args.instances, state)
        try:
            print(f"instances up and warm in {instances.start_s:.0f} s", flush=True)
            print(
                f"{'router':8} {'policy':12} {'hit rate':>8}  requests per instance  failed"
                "  seconds  req/s  mean latency  evicted"
            )
            for r in range(args.rounds):
                for router, policy in configs:
                    log = state / "logs" / f"router-{router}-{policy}-{r}.log"
                    fig = measure(router, policy, instances, sessions, args.concurrency, log)
                    results.append(fig)
                    spread = "/".join(map(str, fig.requests_per_instance))
                    print(
                        f"{router:8} {policy:12} {fig.hit_rate:8.3f}  {spread:21}  "
                        f"{fig.failed:6}  {fig.seconds:7.1f}  {fig.requests_per_s:5.2f}  "
                        f"{fig.mean_latency_ms:8.0f} ms  {fig.evicted_tokens:7}",
                        flush=True,
                    )
        finally:
            instances.stop()
    setup_json = {
        "model": model.name,
        "instances": args.instances,
        "threads": args.threads,
        "dtype": dtype,
        "kv_bytes": args.kv_bytes,
        "page_size": PAGE,
        "concurrency": args.concurrency,
        "start_s": instances.start_s,
    }
    path = write_json(
        {"setup": setup_json, "params": asdict(params), "results": [asdict(r) for r in results]},
        args.out,
        "cluster",
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
