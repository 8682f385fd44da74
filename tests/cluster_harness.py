"""What the cluster tests share: the recipe as a process, an instance's request
counter, and vllm-router's ``kv_aware`` policy fed by instances' KV events.

Used by ``test_cluster.py`` (loopback), ``test_cluster_hosts.py`` (instances in
network namespaces of their own) and ``test_kv_events.py``.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from bench.server_process import ServerProcess, free_port
from deploy.probes import metric_sum
from deploy.specs import EventSource, RouterSpec, router_event_flags

READY = "radixmux cluster: router"  # the recipe's line once everything serves
# A tiny random-weight instance: a small arena, one thread, float32.
TINY_ARGS = [
    "--kv-cache-bytes", "16777216", "--kv-block-bytes", "65536",
    "--runner-threads", "1", "--dtype", "float32",
]  # fmt: skip
ROUTER_START_S = 60.0


def recipe(args: list[str], port: int, state: Path, timeout: float) -> ServerProcess:
    """``python -m deploy.cluster`` with the router on ``port``, once it says it
    is ready (the router answers ``/health`` before the recipe has added every
    worker to it)."""
    cmd = [sys.executable, "-m", "deploy.cluster", "--port", str(port)]
    cmd += ["--state-dir", str(state), *args]
    proc = ServerProcess(cmd, port, state / "recipe.log")
    try:
        proc.wait_healthy(timeout)
        deadline = time.monotonic() + timeout
        while READY not in proc.log_path.read_text(errors="replace"):
            if proc.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the recipe never got ready: {proc.log_tail()}")
            time.sleep(0.2)
    except BaseException:
        proc.stop()
        raise
    return proc


def served(url: str) -> int:
    """Requests an instance has finished since it started (its ``/metrics``)."""
    return int(metric_sum(url, ("radixmux_requests_total",)))


def credited_prefix_tokens(log: Path) -> list[int]:
    """vllm-router's ``kv_aware`` decisions, in order, from its debug log: the
    prompt tokens it credited to the chosen worker's cache (what it learnt from
    that worker's KV events)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))  # its colours
    return [int(n) for n in re.findall(r"credited_prefix_tokens=(\d+)", text)]


@contextlib.contextmanager
def kv_aware_router(
    sources: Sequence[EventSource], block_size: int, model: str, tokenizer: Path, log: Path
) -> Iterator[ServerProcess]:
    """vllm-router in front of the sources' workers, routing by their KV events
    (``--policy kv_aware``, debug log for its decisions); healthy, stopped after.

    It tokenizes each prompt itself, offline from ``tokenizer`` (a model folder).
    """
    spec = RouterSpec(
        "vllm",
        free_port(),
        tuple(s.worker_url for s in sources),
        policy="kv_aware",
        extra_args=(*router_event_flags(sources, block_size, model), "--log-level", "debug"),
    )
    env = {"VLLM_ROUTER_TOKENIZER": str(tokenizer), "NO_COLOR": "1"}
    proc = ServerProcess(spec.command(), spec.port, log, env=env)
    try:
        proc.wait_healthy(ROUTER_START_S)
        yield proc
    finally:
        proc.stop()
