"""The soak's settings: paths, pacing and limits, the two run profiles, one run's config."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "bench" / "results"
MODEL_NAMES = ("a", "b")
REAL_SOURCES = ("smollm2", "gemma3-270m")

HEALTH_EVERY_S = 2.0  # model-state timeline resolution (outage windows)
PROGRESS_EVERY_S = 10.0
RSS_EVERY_S = 5.0
RSS_GROWTH_LIMIT = 0.05  # the issue: < 5% between minute 2 and the end
RSS_BASELINE_S = 120.0  # "minute 2"; runs shorter than 4 minutes use their halfway point
RSS_MIN_WINDOW_S = 60.0  # compared over at least this long (half a shorter run), or listed apart
OUTAGE_GRACE_S = 3.0  # a 503 this close to an outage still belongs to it (polling lag)
# A killed runner must be serving again within this: generous, since on a
# shared 2-core machine a restart may also rebuild the decode kernel.
RESTART_TIMEOUT_S = 300.0
DOWN_FOR_GOOD_S = 15.0  # a model "down" this long after a kill is not coming back
KILL_MARGIN_S = 20.0  # no kill this close to the end of the load
IDLE_GRACE_S = 15.0  # load ended: anything still running after this runs for nobody
IDLE_TIMEOUT_S = 300.0  # then wait this long for idle before checking anyway
QUIET_DISCONNECTS = 3  # end-phase disconnects during tokenization on an idle server
QUIET_SETTLE_S = 3.0
QUIET_IDLE_S = 5.0  # an aborted request is gone in ~1 s; an orphan decodes for much longer
# A burst: this many requests at once over both models, each admitted on a
# reservation of 64 decode tokens, together outgrow the arena as they decode.
BURST_SIZE = 12
PROBE_PROMPT = "The history of the radix tree begins with a question about memory, and"
PROBE_TOKENS = 16
# What a client must never see in an error message: tracebacks, source paths,
# exception class names.
INTERNALS = re.compile(r"Traceback|File \"|\.py\b|\b[A-Z]\w*(Error|Exception):")
ERROR_TYPE_STATUS = {
    "invalid_request_error": 400,
    "not_found_error": 404,
    "rate_limit_exceeded": 429,
    "server_error": 500,
    "service_unavailable": 503,
}
CONTROL_KINDS = ("invalidate", "flush")
SERVER_INFO_FIELDS = ("invariants", "locks_held", "request_owned_slots")
MODEL_INFO_FIELDS = ("state", "runner_pids", "restarts")


# Every kind of request the load makes; a run that made none of one proves nothing about it.
REQUEST_KINDS = (
    "shared_prefix",
    "multi_turn",
    "abandon",
    "burst",
    "disconnect",
    "bad_input",
    "invalidate",
    "flush",
    "probe",
)


@dataclass(frozen=True)
class Profile:
    """Sizes and pacing of one kind of run (tiny random models or the real ones)."""

    kv_cache_bytes: int
    kv_block_bytes: int
    kill_every_s: float
    request_timeout_s: float
    start_timeout_s: float
    system_words: int  # shared-prefix and multi-turn system prompts
    num_systems: int  # per model
    question_words: int
    max_tokens: tuple[int, int]  # inclusive range of a normal request's output
    burst_every_s: float  # a burst of BURST_SIZE long requests (retraction pressure)
    burst_max_tokens: int
    max_turns: int
    abandon_max_tokens: int
    disconnect_words: int
    disconnect_max_tokens: int  # large: an orphaned request outlives IDLE_GRACE_S
    probe_every_s: float
    cache_op_every_s: float
    disconnect_every_s: tuple[float, float]
    bad_input_every_s: tuple[float, float]


# Tiny models: float32, 2 layers x 2 KV heads x 16 dims = 512 B per token, so
# 1 MiB is 2,048 tokens for both models together: less than the load keeps
# running at once, so decode runs out of KV and retracts.
TINY = Profile(
    kv_cache_bytes=1 << 20,
    kv_block_bytes=32 << 10,
    kill_every_s=40.0,
    request_timeout_s=240.0,  # a hang, not slowness: other work shares the 2 cores
    start_timeout_s=600.0,
    system_words=300,
    num_systems=3,
    question_words=24,
    max_tokens=(4, 24),
    burst_every_s=20.0,
    burst_max_tokens=400,
    max_turns=6,
    abandon_max_tokens=200,
    disconnect_words=600,
    disconnect_max_tokens=1000,
    probe_every_s=15.0,
    cache_op_every_s=12.0,
    disconnect_every_s=(2.0, 5.0),
    bad_input_every_s=(0.3, 1.0),
)
# Real models in bfloat16: SmolLM2 23 KiB and Gemma 3 270M 18 KiB per token, so
# 32 MiB is about 1,450-1,800 tokens (less than the load keeps running at once);
# float32 doubles the arena to hold as many tokens (``arena_bytes``). 1.5 MiB
# blocks are a multiple of both models' K rows in either dtype.
REAL = Profile(
    kv_cache_bytes=32 << 20,
    kv_block_bytes=1536 << 10,
    kill_every_s=180.0,
    request_timeout_s=300.0,
    start_timeout_s=1200.0,
    system_words=300,
    num_systems=3,
    question_words=24,
    max_tokens=(4, 16),
    burst_every_s=60.0,
    burst_max_tokens=160,
    max_turns=5,
    abandon_max_tokens=64,
    disconnect_words=500,
    disconnect_max_tokens=400,
    probe_every_s=30.0,
    cache_op_every_s=30.0,
    disconnect_every_s=(5.0, 10.0),
    bad_input_every_s=(2.0, 5.0),  # cheap to answer: keep them from dominating the counts
)


@dataclass(frozen=True)
class SoakConfig:
    """One soak run."""

    minutes: float
    tiny: bool
    kill_every_s: float
    seed: int
    port: int
    out: Path
    runner_timeout_s: float  # 0: do not pass --runner-timeout (older servers)
    server_args: tuple[str, ...]
    profile: Profile
    dtype: str = "float32"  # the models' dtype ("": the server's default)
    hostile: bool = False  # hostile clients beside the load (bench/soak/hostile/)
    hostile_dir: str = ""  # their temporary directory: the disk store, canaries

    @property
    def load_s(self) -> float:
        return self.minutes * 60.0

    @property
    def png(self) -> Path:
        return self.out.with_suffix(".png")

    @property
    def log(self) -> Path:
        return self.out.with_name(self.out.stem + "-server.log")
