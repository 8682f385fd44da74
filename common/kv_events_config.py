"""``--kv-events-config``: vLLM's ``KVEventsConfig`` JSON, field for field.

The same JSON a vLLM server takes (``vllm serve --kv-events-config``), so an
operator reuses the one they have; unknown keys and wrong types are refused
with the name of the key.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where and how radixmux publishes its KV events (vLLM's fields and defaults)."""

    enable_kv_cache_events: bool = False
    # None: "zmq" when enabled, else "null" (vLLM's rule).
    publisher: Literal["null", "zmq"] | None = None
    # Bound when it has "*", "::", ipc:// or inproc://, else connected to.
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @property
    def enabled(self) -> bool:
        """Whether a publisher runs: events enabled and a publisher other than "null"."""
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The config from its JSON text; ValueError naming what is wrong."""
    try:
        config = msgspec.json.decode(text, type=KVEventsConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"--kv-events-config: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, name) < 0:
            raise ValueError(f"--kv-events-config: {name} must be >= 0")
    if config.enabled and not config.endpoint:
        raise ValueError("--kv-events-config: endpoint is empty")
    return config
