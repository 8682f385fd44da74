"""The cluster recipe (``python -m deploy.cluster``) as an operator runs it.

Two radixmux instances (tiny random-weight models, real processes) behind
sglang-router 0.3.2 with its cache-aware policy, all started by the recipe's
command line. While clients send requests through the router: an instance
killed outright (SIGKILL to its launcher's process group) fails only requests
that were in flight when it died, every later one is answered by the other
instance, and the recipe starts it again on its port, where it gets traffic
again (seen in its own ``/metrics``); a rolling restart (SIGHUP) loses no
request at all. The recipe also fronts instances it did not start.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cluster_harness import TINY_ARGS, recipe, served
from prometheus_client.parser import text_string_to_metric_families

from bench.server_process import ServerProcess, free_port
from bench.tiny_models import make_tiny_model_dir
from deploy.router_admin import RouterAdmin

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang_router") is None,
        reason="sglang-router is not installed (pip install -e '.[dev]')",
    ),
]

START_S = 180.0
RESTART_S = 90.0
CLIENTS = 4
# A pause between each client's requests: unpaced clients keep both cores busy
# and a restarting instance then takes twice as long to start.
PACE_S = 0.1
TOKENS = 24


def free_port_pair() -> int:
    """A port p with p and p+1 both free on 127.0.0.1 now."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


@dataclass
class RunningCluster:
    """The recipe's process, its log and the URLs it serves."""

    cli: ServerProcess
    instance_urls: list[str]

    @property
    def router(self) -> str:
        return self.cli.base_url

    def log_count(self, line: str) -> int:
        return self.cli.log_path.read_text(errors="replace").count(line)

    def wait_log_count(self, line: str, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.log_count(line) < count:
            assert time.monotonic() < deadline, f"no {line!r} in: {self.cli.log_tail()}"
            time.sleep(0.2)

    def launcher_pid(self, i: int) -> int:
        """Instance ``i``'s launcher: the recipe's child serving its port."""
        port = self.instance_urls[i].rsplit(":", 1)[1]
        children = Path(f"/proc/{self.cli.pid}/task/{self.cli.pid}/children").read_text()
        for pid in children.split():
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"launch.py" in cmd[1] and port.encode() in cmd:
                return int(pid)
        raise AssertionError(f"no launcher for port {port} among {children}")

    def wait_all_routed(self) -> None:
        admin = RouterAdmin(self.router)
        try:
            for url in self.instance_urls:
                admin.add(url, timeout=RESTART_S)  # listed and healthy: a no-op
        finally:
            admin.close()


def wait_served(url: str, more_than: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while served(url) <= more_than:
        assert time.monotonic() < deadline, f"{url} got no requests in {timeout:.0f} s"
        time.sleep(0.3)


@dataclass
class Outcome:
    start: float
    end: float
    ok: bool
    detail: str


class Load:
    """CLIENTS threads sending distinct completions through the router until stopped,
    half of them streamed (a router can retry a whole request elsewhere, not a
    stream that has begun)."""

    def __init__(self, router: str) -> None:
        self.router = router
        self.outcomes: list[Outcome] = []
        self.started: dict[int, float] = {}  # request number -> start, while in flight
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.numbers = itertools.count()
        self.threads = [
            threading.Thread(target=self._client, args=(i % 2 == 1,)) for i in range(CLIENTS)
        ]

    @staticmethod
    def _send(client: httpx.Client, url: str, body: dict[str, object]) -> tuple[bool, str]:
        """One request, whole or streamed: answered in full, and what came back."""
        if not body["stream"]:
            r = client.post(url, json=body)
            return r.status_code == 200, f"{r.status_code} {r.text[:200]}"
        with client.stream("POST", url, json=body) as r:
            lines = list(r.iter_lines())
        # A stream cut by the instance's death ends without its [DONE].
        return r.status_code == 200 and "data: [DONE]" in lines, f"{r.status_code} {lines[-2:]}"

    def _client(self, stream: bool) -> None:
        with httpx.Client(timeout=60, trust_env=False) as client:
            while not self.stop.is_set():
                n = next(self.numbers)
                body = {
                    "model": "tiny",
                    "prompt": f"Request {n}: tell a story about the number {n * 7919}.",
                    "max_tokens": TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": stream,
                }
                start = time.monotonic()
                with self.lock:
                    self.started[n] = start
                try:
                    ok, detail = self._send(client, self.router + "/v1/completions", body)
                except httpx.HTTPError as exc:
                    ok, detail = False, repr(exc)
                with self.lock:
                    del self.started[n]
                    self.outcomes.append(Outcome(start, time.monotonic(), ok, detail))
                self.stop.wait(PACE_S)

    def in_flight(self) -> int:
        with self.lock:
            return len(self.started)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("cluster") / "tiny", seed=37)


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    base = free_port_pair()
    args = ["--instances", "2", "--base-port", str(base), "--model", f"{model},name=tiny"]
    cli = recipe([*args, "--", *TINY_ARGS], free_port(), tmp_path_factory.mktemp("state"), START_S)
    try:
        yield RunningCluster(cli, [f"http://127.0.0.1:{base + i}" for i in range(2)])
    finally:
        cli.stop()


def test_a_killed_instance_fails_only_its_requests_and_rejoins(cluster: RunningCluster) -> None:
    cluster.wait_all_routed()
    url0, url1 = cluster.instance_urls
    restarted = cluster.log_count("instance 0 restarted")
    with Load(cluster.router) as load:
        wait_served(url0, served(url0), 30)  # the router sends to both
        wait_served(url1, served(url1), 30)
        pid = cluster.launcher_pid(0)
        in_flight = load.in_flight()
        t_kill = time.monotonic()
        os.killpg(pid, signal.SIGKILL)
        cluster.wait_log_count("instance 0 restarted", restarted + 1, RESTART_S)
        t_back = time.monotonic()
        wait_served(url0, 0, 30)  # a fresh process: any request is one since its return
        t_traffic = time.monotonic()
    failed = [o for o in load.outcomes if not o.ok]
    later = [o for o in load.outcomes if o.start > t_kill]
    print(
        f"\nkill: {in_flight} in flight, {len(failed)} failed, {len(later)} later requests "
        f"all answered; back after {t_back - t_kill:.1f} s, traffic "
        f"{t_traffic - t_back:.1f} s later; {len(load.outcomes)} requests in all"
    )
    assert all(o.start < t_kill for o in failed), [o.detail for o in failed]
    assert len(failed) <= in_flight, [o.detail for o in failed]
    assert later and all(o.ok for o in later)


def test_a_rolling_restart_loses_no_request(cluster: RunningCluster) -> None:
    cluster.wait_all_routed()
    pids = [cluster.launcher_pid(i) for i in range(2)]
    done = cluster.log_count("rolling restart done")
    with Load(cluster.router) as load:
        for url in cluster.instance_urls:
            wait_served(url, served(url), 30)
        os.kill(cluster.cli.pid, signal.SIGHUP)
        cluster.wait_log_count("rolling restart done", done + 1, 2 * RESTART_S)
        for url in cluster.instance_urls:  # each back in the rotation
            wait_served(url, 0, 30)
    failed = [o.detail for o in load.outcomes if not o.ok]
    print(f"\nrolling restart: {len(load.outcomes)} requests, {len(failed)} failed")
    assert not failed
    assert all(cluster.launcher_pid(i) != pids[i] for i in range(2))


def test_fronts_instances_started_elsewhere_and_stops_on_sigterm(
    cluster: RunningCluster, tmp_path: Path
) -> None:
    cluster.wait_all_routed()
    args = [a for url in cluster.instance_urls for a in ("--worker-url", url)]
    cli = recipe(args, free_port(), tmp_path, 60)
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
        r = httpx.post(cli.base_url + "/v1/completions", json=body, timeout=60, trust_env=False)
        assert r.status_code == 200, r.text
        cli.proc.send_signal(signal.SIGTERM)
        assert cli.proc.wait(60) == 130
        with pytest.raises(httpx.ConnectError):
            httpx.get(cli.base_url + "/health", timeout=5, trust_env=False)
        # The instances are not the recipe's to stop.
        for url in cluster.instance_urls:
            assert httpx.get(url + "/health", timeout=10, trust_env=False).status_code == 200
    finally:
        cli.stop()


def served_by_model(url: str) -> dict[str, int]:
    """Finished requests of an instance per model."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "radixmux_requests_total":
                out[s.labels["model"]] = out.get(s.labels["model"], 0) + int(s.value)
    return out


@pytest.mark.skipif(
    importlib.util.find_spec("vllm_router") is None, reason="vllm-router is not installed"
)
def test_instances_serving_different_models_are_routed_by_model(
    model: Path, tmp_path: Path
) -> None:
    base = free_port_pair()
    args = ["--router", "vllm", "--base-port", str(base)]
    args += ["--instance-models", f"{model},name=a", "--instance-models", f"{model},name=b"]
    cli = recipe([*args, "--", *TINY_ARGS], free_port(), tmp_path, START_S)
    try:
        body = {"prompt": "Route me", "max_tokens": 2, "ignore_eos": True}
        with httpx.Client(timeout=60, trust_env=False) as client:
            for name in ["a", "b"] * 3:
                r = client.post(cli.base_url + "/v1/completions", json={**body, "model": name})
                assert r.status_code == 200, r.text
                assert r.json()["model"] == name
        urls = [f"http://127.0.0.1:{base + i}" for i in range(2)]
        assert [served_by_model(u) for u in urls] == [{"a": 3}, {"b": 3}]
    finally:
        cli.stop()
