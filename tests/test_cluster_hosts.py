"""The multi-host recipe with each instance on a "host" of its own.

Two radixmux instances (tiny random-weight models, real processes) each run
in a Linux network namespace of their own (``tests/netns_hosts.py``), bound
to that namespace's private address and reached over TCP from this one, the
root namespace, where the routers run; both use the same port, as on two
machines. The recipe's remote mode (``python -m deploy.cluster --worker-url
...``) routes completions to both; and each instance's KV events, published
from its namespace, steer vllm-router's ``kv_aware`` policy here: a prompt
computed on one host (sent there directly, not through the router) is routed
back to that host, which only those events can tell the router.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import netns_hosts
import pytest
from cluster_harness import TINY_ARGS, credited_prefix_tokens, kv_aware_router, recipe, served

from bench.server_process import ServerProcess, free_port
from bench.tiny_models import make_tiny_model_dir
from deploy.probes import metric_sum
from deploy.specs import EventSource, InstanceSpec, kv_events_config

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        (reason := netns_hosts.unavailable()) is not None, reason=f"needs distinct hosts: {reason}"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang_router") is None,
        reason="sglang-router is not installed (pip install -e '.[dev]')",
    ),
]

HOSTS = 2
START_S = 180.0
# One port plan on every host: each namespace has its own ports.
HTTP_PORT, PUB_PORT, REPLAY_PORT = 30000, 5557, 5558
PAGE = 16  # the instances' page size: the events' block size
EVENTS_SETTLE_S = 1.0  # a subscription reaching a publisher, an event reaching the router


@dataclass
class Instance:
    """One instance on its host: where to reach it and its KV event sockets."""

    host: netns_hosts.Host
    proc: ServerProcess

    @property
    def url(self) -> str:
        return self.proc.base_url

    @property
    def events(self) -> EventSource:
        return EventSource(
            self.url,
            f"tcp://{self.host.address}:{PUB_PORT}",
            f"tcp://{self.host.address}:{REPLAY_PORT}",
        )


@dataclass
class Hosts:
    model: Path
    instances: list[Instance]

    @property
    def urls(self) -> list[str]:
        return [i.url for i in self.instances]


def start_instance(host: netns_hosts.Host, model: Path, state: Path) -> ServerProcess:
    """``launch.py`` inside ``host``'s namespace, bound to its address, publishing
    KV events there (the stream on ``tcp://*``: vLLM's rule binds only a wildcard,
    which in the namespace is its address and loopback; the replay socket on the
    address itself)."""
    events = kv_events_config(f"tcp://*:{PUB_PORT}", f"tcp://{host.address}:{REPLAY_PORT}")
    spec = InstanceSpec(
        HTTP_PORT,
        (f"{model},name=tiny",),
        state,
        host=host.address,
        extra_args=(*TINY_ARGS, "--page-size", str(PAGE), "--kv-events-config", events),
    )
    cmd = [*host.exec_prefix(), *spec.command()]
    return ServerProcess(cmd, spec.port, state / "instance.log", host=spec.reach_host)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    root = tmp_path_factory.mktemp("hosts")
    model = make_tiny_model_dir(root / "tiny", seed=43)
    with netns_hosts.private_hosts(HOSTS) as private:
        procs: list[ServerProcess] = []
        try:
            for i, host in enumerate(private):
                procs.append(start_instance(host, model, root / f"instance-{i}"))
            with ThreadPoolExecutor(HOSTS) as pool:
                list(pool.map(lambda p: p.wait_healthy(START_S), procs))
            yield Hosts(model, [Instance(h, p) for h, p in zip(private, procs, strict=True)])
        finally:
            with ThreadPoolExecutor(HOSTS) as pool:
                list(pool.map(ServerProcess.stop, procs))


def complete(base_url: str, prompt: str) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text


def cached_tokens(url: str) -> int:
    """Prompt tokens an instance has served from its prefix cache."""
    return int(metric_sum(url, ("radixmux_cached_prompt_tokens_total",)))


def test_each_instance_runs_on_its_own_host(hosts: Hosts) -> None:
    """Each instance's launcher sits in a network namespace of its own (not this
    one's), and answers at that namespace's address on the one port both use."""
    spaces = {os.readlink(f"/proc/{i.proc.pid}/ns/net") for i in hosts.instances}
    assert len(spaces) == HOSTS and os.readlink("/proc/self/ns/net") not in spaces
    for instance in hosts.instances:
        assert instance.url == f"http://{instance.host.address}:{HTTP_PORT}"
        r = httpx.get(instance.url + "/health", timeout=10, trust_env=False)
        assert r.status_code == 200


def test_the_recipe_routes_to_instances_on_other_hosts(hosts: Hosts, tmp_path: Path) -> None:
    requests = 6
    before = [served(u) for u in hosts.urls]
    args = [a for url in hosts.urls for a in ("--worker-url", url)]
    cli = recipe([*args, "--policy", "round_robin"], free_port(), tmp_path, 60)
    try:
        for n in range(requests):
            complete(cli.base_url, f"Request {n} to whichever host the router picks.")
    finally:
        cli.stop()
    spread = [served(u) - b for u, b in zip(hosts.urls, before, strict=True)]
    print(f"\nrequests per host: {spread}")
    assert sum(spread) == requests and all(n > 0 for n in spread), spread


@pytest.mark.skipif(
    importlib.util.find_spec("vllm_router") is None, reason="vllm-router is not installed"
)
def test_kv_events_from_each_host_steer_the_router(hosts: Hosts, tmp_path: Path) -> None:
    """Each prompt is computed on one host first, sent there directly: the router
    never saw it, so only that host's BlockStored events can say where it is.
    Through the router each then lands on the host that holds it, credited."""
    prompts = [f"Host {i} alone holds this system prompt. " * 6 for i in range(HOSTS)]
    log = tmp_path / "router.log"
    sources = [i.events for i in hosts.instances]
    with kv_aware_router(sources, PAGE, "tiny", hosts.model, log) as router:
        time.sleep(EVENTS_SETTLE_S)  # its subscriptions reach both publishers
        for url, prompt in zip(hosts.urls, prompts, strict=True):
            complete(url, prompt)
        time.sleep(EVENTS_SETTLE_S)
        before = [(served(u), cached_tokens(u)) for u in hosts.urls]
        for prompt in prompts:
            complete(router.base_url, prompt)
        after = [(served(u), cached_tokens(u)) for u in hosts.urls]
    credited = credited_prefix_tokens(log)
    gained = [(s1 - s0, c1 - c0) for (s0, c0), (s1, c1) in zip(before, after, strict=True)]
    print(f"\n(requests, cached prompt tokens) per host: {gained}; credited: {credited}")
    assert len(credited) >= HOSTS and all(n >= PAGE for n in credited[-HOSTS:]), credited
    # Each host took its own prompt and served its pages from its cache.
    assert all(requests == 1 and hit >= PAGE for requests, hit in gained), gained
