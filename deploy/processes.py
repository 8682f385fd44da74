"""A cluster's processes: local instances, remote ones waited for, the router in front."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.server_process import ServerProcess
from deploy.probes import served_model, wait_drained, wait_remote_healthy
from deploy.router_admin import RouterAdmin
from deploy.specs import InstanceSpec, RouterSpec

START_TIMEOUT_S = 900.0  # a first start may fetch and convert the default models


class Cluster:
    """Local instances (started here), remote ones (only waited for) and the router."""

    def __init__(
        self,
        instances: Sequence[InstanceSpec],
        router: RouterSpec,
        log_dir: Path,
        remote_urls: Sequence[str] = (),
    ) -> None:
        self.specs = list(instances)
        self.router_spec = router
        self.remote_urls = list(remote_urls)
        self.log_dir = log_dir
        self.instances: list[ServerProcess | None] = [None] * len(self.specs)
        self.router: ServerProcess | None = None
        self.restarts = [0] * len(self.specs)
        self.model_ids: dict[str, str | None] = {}  # worker URL -> the model it is routed for

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_spec.port}"

    def _spawn(self, i: int) -> ServerProcess:
        spec = self.specs[i]
        log = self.log_dir / f"instance-{i}.{self.restarts[i]}.log"
        self.instances[i] = ServerProcess(spec.command(), spec.port, log, host=spec.reach_host)
        return self.instances[i]

    def start(self, timeout: float = START_TIMEOUT_S) -> str:
        """Every instance healthy, then the router; returns the router's URL."""
        try:
            procs = [self._spawn(i) for i in range(len(self.specs))]
            with ThreadPoolExecutor(max(1, len(procs) + len(self.remote_urls))) as pool:
                waits = [pool.submit(p.wait_healthy, timeout) for p in procs]
                waits += [pool.submit(wait_remote_healthy, u, timeout) for u in self.remote_urls]
                for w in waits:
                    w.result()
            spec = self.router_spec
            self.router = ServerProcess(spec.command(), spec.port, self.log_dir / "router.log")
            self.router.wait_healthy(timeout)
            for url in spec.worker_urls:
                self.model_ids[url] = served_model(url, spec.api_key) if spec.by_model else None
                if spec.by_model:
                    self.rejoin_url(url)
        except BaseException:
            self.stop()
            raise
        return self.url

    def kill_instance(self, i: int) -> None:
        """SIGKILL instance ``i``'s whole process group: a crash, nothing stops in order."""
        proc = self.instances[i]
        assert proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.proc.wait()
        proc.stop()  # closes its log

    def restart_instance(self, i: int, timeout: float = START_TIMEOUT_S) -> None:
        """Start instance ``i`` again on its port and wait until it is healthy."""
        old = self.instances[i]
        if old is not None:
            old.stop()
        self.restarts[i] += 1
        self._spawn(i).wait_healthy(timeout)

    def rejoin_url(self, url: str) -> None:
        """The worker at ``url`` in the router's list, healthy (a no-op if it is)."""
        admin = RouterAdmin(self.url)
        try:
            admin.add(url, self.model_ids.get(url))
        finally:
            admin.close()

    def rejoin(self, i: int) -> None:
        """Local instance ``i`` back in the router's list."""
        self.rejoin_url(self.specs[i].url)

    def rolling_restart(self, timeout: float = START_TIMEOUT_S) -> None:
        """Restart every local instance in turn, none losing a request: each leaves
        the router, finishes what it runs, restarts and rejoins before the next."""
        admin = RouterAdmin(self.url)
        try:
            for i, spec in enumerate(self.specs):
                admin.remove(spec.url)
                wait_drained(spec.url)
                self.restart_instance(i, timeout)
                admin.add(spec.url, self.model_ids.get(spec.url))
        finally:
            admin.close()

    def dead_instances(self) -> list[int]:
        """Local instances whose launcher has exited."""
        return [i for i, p in enumerate(self.instances) if p and p.proc.poll() is not None]

    def stop(self) -> None:
        """The router first (no new requests), then every instance at once. Idempotent."""
        if self.router is not None:
            self.router.stop()
        live = [p for p in self.instances if p is not None]
        with ThreadPoolExecutor(max(1, len(live))) as pool:
            list(pool.map(ServerProcess.stop, live))

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
