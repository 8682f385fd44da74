"""The command lines of a cluster's members: a radixmux instance and a router."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.server_process import free_port, http_url

ROOT = Path(__file__).resolve().parents[1]

# The router's launch module per name; both take the same core flags.
ROUTERS = {"sglang": "sglang_router.launch_router", "vllm": "vllm_router.launch_router"}

# Both routers' defaults check health once a minute and keep a tripped circuit
# open a minute: a dead instance would draw requests (each retried elsewhere)
# and a restarted one would wait a minute for traffic. These make both a
# matter of seconds.
FAILOVER_FLAGS = (
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "1",
    "--health-success-threshold", "1",
    "--health-check-timeout-secs", "2",
    "--cb-failure-threshold", "3",
    "--cb-timeout-duration-secs", "2",
    "--cb-success-threshold", "1",
)  # fmt: skip


# Bind addresses that mean every interface: the instance is reached on loopback here.
WILDCARDS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class InstanceSpec:
    """One local radixmux server: its models, address and own state folder."""

    port: int
    models: tuple[str, ...]
    state_dir: Path
    host: str = "127.0.0.1"
    extra_args: tuple[str, ...] = ()

    @property
    def reach_host(self) -> str:
        """The address this host reaches the instance at: its --host, or loopback
        when that is a wildcard (every interface)."""
        return "127.0.0.1" if self.host in WILDCARDS else self.host

    @property
    def url(self) -> str:
        return http_url(self.reach_host, self.port)

    def command(self) -> list[str]:
        """``launch.py`` with this instance's port, models and disk-tier folder.

        Its sockets go to a private runtime dir the launcher makes under the temp
        dir (a deep state dir would pass the length limit of a socket path). The
        disk tier (used with ``--kv-disk-bytes``) is the instance's own and outlives
        a restart, so a restarted instance comes back with it warm; with
        ``--kv-disk-shared`` it is one folder beside the instances' that all share.
        """
        cmd = [sys.executable, str(ROOT / "launch.py"), "--host", self.host]
        cmd += ["--port", str(self.port)]
        flags = {a.split("=", 1)[0] for a in self.extra_args}
        if "--kv-disk-bytes" in flags and "--kv-disk-dir" not in flags:
            shared = "--kv-disk-shared" in flags
            kv = self.state_dir.parent / "kv-shared" if shared else self.state_dir / "kv"
            cmd += ["--kv-disk-dir", str(kv)]
        for model in self.models:
            cmd += ["--model", model]
        return cmd + list(self.extra_args)


@dataclass(frozen=True)
class RouterSpec:
    """The router in front: which one, its policy, where it listens, whom it routes to."""

    kind: str
    port: int
    worker_urls: tuple[str, ...]
    policy: str = "cache_aware"
    # Route by the request's model field (vllm-router's --enable-igw): the
    # workers are added after start, each for the one model it serves.
    by_model: bool = False
    host: str = "127.0.0.1"
    api_key: str | None = None
    prometheus_port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()

    def command(self) -> list[str]:
        """The router's command line, failover flags included."""
        cmd = [sys.executable, "-m", ROUTERS[self.kind], "--host", self.host]
        cmd += ["--port", str(self.port), "--policy", self.policy]
        workers = ["--enable-igw"] if self.by_model else ["--worker-urls", *self.worker_urls]
        cmd += [*workers, *FAILOVER_FLAGS]
        # Its own metrics port: the default one is shared by every router on the host.
        cmd += ["--prometheus-port", str(self.prometheus_port)]
        if self.api_key:  # sent to the workers as 'Authorization: Bearer KEY'
            cmd += ["--api-key", self.api_key]
        return cmd + list(self.extra_args)


def kv_events_config(
    endpoint: str, replay_endpoint: str, buffer_steps: int = 10_000, topic: str = ""
) -> str:
    """An instance's ``--kv-events-config`` (vLLM's JSON): a ZMQ publisher at
    ``endpoint`` and its replay socket at ``replay_endpoint``.

    vLLM's rule decides bind or connect: a wildcard (``tcp://*:5557``) or
    ``ipc://`` endpoint is bound and the router connects to it; a named address
    is connected to. The replay socket is always bound. The default topic,
    empty, is vLLM's and what vllm-router reads.
    """
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": replay_endpoint,
        "buffer_steps": buffer_steps,
        "topic": topic,
    }
    return json.dumps(config)


@dataclass(frozen=True)
class EventSource:
    """Where a router reads one worker's KV events: the stream and its replay socket."""

    worker_url: str
    endpoint: str  # e.g. tcp://10.0.0.5:5557, as the router's host reaches it
    replay_endpoint: str


def router_event_flags(
    sources: Sequence[EventSource], block_size: int, model: str
) -> tuple[str, ...]:
    """vllm-router's flags for its ``kv_aware`` policy: each worker's event stream
    and replay socket, the page size the instances hash by, the served model."""
    flags: list[str] = []
    for s in sources:
        flags += ["--kv-event-source", f"{s.worker_url}={s.endpoint}"]
        flags += ["--kv-event-replay-source", f"{s.worker_url}={s.replay_endpoint}"]
    return (*flags, "--kv-event-block-size", str(block_size), "--kv-event-model", model)
