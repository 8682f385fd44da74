"""The router's worker list, read and changed at run time over its HTTP API.

sglang-router 0.3.2 lists its workers at ``GET /workers``, takes one more at
``POST /workers {"url": ...}`` and drops one at ``DELETE /workers/{id}``; both
answer 202 and apply the change in the background, so each change here waits
until the list shows it. vllm-router 0.1.17 has the same endpoints; in its
``--enable-igw`` mode a worker also carries the one model it is routed for
(``model_id``: a URL added again takes the later id in place of the first).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

CHANGE_TIMEOUT_S = 30.0
POLL_S = 0.2


@dataclass(frozen=True)
class RouterWorker:
    """One worker as the router lists it."""

    id: str
    url: str
    is_healthy: bool


class RouterAdmin:
    """Add, drop and list the workers of the router at ``base_url``."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.client = httpx.Client(base_url=base_url, timeout=10, trust_env=False)

    def workers(self) -> list[RouterWorker]:
        r = self.client.get("/workers")
        r.raise_for_status()
        return [
            RouterWorker(id=w["id"], url=w["url"], is_healthy=w["is_healthy"])
            for w in r.json()["workers"]
        ]

    def find(self, url: str) -> RouterWorker | None:
        return next((w for w in self.workers() if w.url == url), None)

    def _wait(self, url: str, present: bool, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            worker = self.find(url)
            if (worker is not None and worker.is_healthy) == present:
                return
            time.sleep(POLL_S)
        state = "healthy in" if present else "gone from"
        raise TimeoutError(f"{url} not {state} {self.base_url}/workers after {timeout:.0f} s")

    def remove(self, url: str, timeout: float = CHANGE_TIMEOUT_S) -> None:
        """Stop routing to ``url``; returns once the router no longer lists it."""
        worker = self.find(url)
        if worker is not None:
            self.client.delete(f"/workers/{worker.id}").raise_for_status()
        self._wait(url, present=False, timeout=timeout)

    def add(self, url: str, model_id: str | None = None, timeout: float = CHANGE_TIMEOUT_S) -> None:
        """Route to ``url`` (for ``model_id`` only, if given); returns once the
        router lists it healthy."""
        if self.find(url) is None:
            body = {"url": url} if model_id is None else {"url": url, "model_id": model_id}
            self.client.post("/workers", json=body).raise_for_status()
        self._wait(url, present=True, timeout=timeout)

    def close(self) -> None:
        self.client.close()
