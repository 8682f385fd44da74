"""The hostile mode's settings.

Limits, the two profiles, its server flags and temporary directory.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.soak.config import SoakConfig

EXTRA = "h"  # the model loaded, reloaded and unloaded at run time
RCVBUF = 4096  # a slow reader's receive buffer (the kernel doubles it)
TOP = 20  # alternatives per token in logprob streams (the most the APIs allow)
STALL_LIMIT = 3.0  # the stall probe's median beside the hostile clients, in idle medians
STALL_PROMPT = "Hello there"
STALL_TOKENS = 8
DRAIN_SLACK_S = 60.0  # a change may take this long past its drain timeout (loads included)
DRAIN_COLLECT_S = 60.0  # a held stream must end this soon after its model's change
HEAD_TIMEOUT_S = 120.0  # the first output of a slow reader's stream
TRICKLE_BYTES, TRICKLE_EVERY_S = 256, 0.5
SLOW_BYTES, SLOW_EVERY_S = 16 << 10, 0.1  # "slow to the end": 160 KB/s
SLOW_MODES = ("slow", "never", "trickle")  # to the end, never after the headers, a trickle
STATE_SETTLE_TRIES = 20
FOREIGN_HOST = "rebind.example"
FOREIGN_ORIGIN = "http://evil.example"
HOSTILE_KINDS = (
    "bound_past",
    "bound_at",
    "admission",
    "cross_site",
    "slow_reader",
    "drain_reader",
    "model_change",
    "stall_probe",
)


@dataclass(frozen=True)
class HostileProfile:
    """Pacing and sizes of the hostile clients (tiny random models or the real ones)."""

    bounds_every_s: tuple[float, float]
    cross_site_every_s: tuple[float, float]
    slow_readers: int  # concurrent slow-reader clients
    slow_pause_s: tuple[float, float]
    slow_max_tokens: int  # a slow reader's output: long
    slow_hold_s: float  # how long a reader that stopped reading keeps its socket
    cycle_first_s: float  # the first model change cycle starts this far into the load
    cycle_every_s: float
    drain_timeout_s: float  # the server's --drain-timeout
    drain_readers: int  # streams held on the extra model across each change
    drain_max_tokens: int
    trap_every_s: float
    hostile_window_s: float  # before the load: the hostile clients alone, probed
    stall_every_s: float
    stall_idle_samples: int  # per model, on the idle server before the load
    disk_bytes: int  # the disk tier: small, so its LRU deletes files all the time
    state_prompts: int  # long prompts per model before a state check (evictions: disk files)


# Tiny: the drain timeout is short so a short run holds a whole cycle; a held
# stream's 1,000 tokens are over 6 MB of /generate chunks (cumulative text and
# ids, 20 alternatives a token): past any socket buffer (4 MB here), so its
# writer blocks however fast the model is, and 256 KB of KV (the extra model
# has one layer), a quarter of the arena.
TINY_HOSTILE = HostileProfile(
    bounds_every_s=(0.3, 1.0),
    cross_site_every_s=(0.5, 1.5),
    slow_readers=2,
    slow_pause_s=(1.0, 3.0),
    slow_max_tokens=600,
    slow_hold_s=15.0,
    cycle_first_s=5.0,
    cycle_every_s=30.0,
    drain_timeout_s=5.0,
    drain_readers=2,
    drain_max_tokens=1000,
    trap_every_s=5.0,
    hostile_window_s=12.0,
    stall_every_s=3.0,
    stall_idle_samples=5,
    disk_bytes=4 << 20,
    state_prompts=3,
)
# Real: the drain timeout is the server's default; the extra model is tiny, so
# its held streams outgrow the socket buffers within seconds and their writers block.
REAL_HOSTILE = HostileProfile(
    bounds_every_s=(2.0, 5.0),
    cross_site_every_s=(2.0, 5.0),
    slow_readers=2,
    slow_pause_s=(5.0, 15.0),
    slow_max_tokens=300,
    slow_hold_s=45.0,
    cycle_first_s=60.0,
    cycle_every_s=240.0,
    drain_timeout_s=30.0,
    drain_readers=3,
    drain_max_tokens=2000,
    trap_every_s=30.0,
    hostile_window_s=120.0,
    stall_every_s=10.0,
    stall_idle_samples=5,
    disk_bytes=256 << 20,
    state_prompts=3,
)


def profile(config: SoakConfig) -> HostileProfile:
    return TINY_HOSTILE if config.tiny else REAL_HOSTILE


def prepare(config: SoakConfig) -> SoakConfig:
    """``config`` with a fresh temporary directory for the store and the canaries."""
    path = tempfile.mkdtemp(prefix="radixmux-soak-hostile-")
    return dataclasses.replace(config, hostile_dir=path)


def store_dir(config: SoakConfig) -> Path:
    return Path(config.hostile_dir) / "kv-store"


def server_flags(config: SoakConfig) -> list[str]:
    """The disk tier in the run's directory and the drain timeout the checks use."""
    p = profile(config)
    return [
        "--kv-disk-bytes",
        str(p.disk_bytes),
        "--kv-disk-dir",
        str(store_dir(config)),
        "--drain-timeout",
        f"{p.drain_timeout_s:g}",
    ]
