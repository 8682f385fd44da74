"""What an instance says over HTTP: health, the model it serves, how busy it is."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

HEALTH_POLL_S = 0.5
DRAIN_TIMEOUT_S = 600.0  # the longest request an instance being drained may finish
DRAIN_SETTLE_POLLS = 3  # idle this many polls in a row: nothing was still on its way in


def served_model(url: str, api_key: str | None) -> str:
    """The one model an instance serves (its ``/v1/models``); ValueError if several."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url + "/v1/models", headers=headers, timeout=10, trust_env=False)
    r.raise_for_status()
    names = [m["id"] for m in r.json()["data"]]
    if len(names) != 1:
        raise ValueError(f"{url} serves {names}: routed by model, an instance serves one")
    return names[0]


def wait_remote_healthy(url: str, timeout: float) -> None:
    """Poll an instance started elsewhere until its ``/health`` says 200."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5, trust_env=False) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url + "/health").status_code == 200:
                    return
            time.sleep(HEALTH_POLL_S)
    raise TimeoutError(f"{url}/health did not answer 200 in {timeout:.0f} s")


def metric_sum(url: str, names: Sequence[str]) -> float:
    """The sum of an instance's ``/metrics`` samples named in ``names`` (every label)."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in names
    )


def busy_requests(url: str) -> int:
    """Requests an instance is running or has queued."""
    return int(metric_sum(url, ("radixmux_running_requests", "radixmux_queue_length")))


def wait_drained(url: str, timeout: float = DRAIN_TIMEOUT_S) -> None:
    """Wait until an instance the router no longer sends to has finished its requests."""
    deadline = time.monotonic() + timeout
    idle = 0
    while idle < DRAIN_SETTLE_POLLS:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} still busy after {timeout:.0f} s")
        idle = idle + 1 if busy_requests(url) == 0 else 0
        time.sleep(HEALTH_POLL_S)
