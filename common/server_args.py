"""One flag set for the whole runtime: command line, Python API and docs.

Flag names follow SGLang where one exists. ``ServerArgs`` is a msgspec Struct
so every process receives the same parsed flags as JSON.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import msgspec

from radixmux.common.allowed_names import check_flags as check_allowed_names
from radixmux.common.kv_events_config import parse_kv_events_config
from radixmux.common.model_entry import DTYPES, parse_model_arg, read_models_file
from radixmux.memory.eviction import EVICTION_POLICIES
from radixmux.memory.kv_disk_store import WRITE_POLICIES, check_settings
from radixmux.protocol import ModelArg

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs", "lof", "random")  # scheduler/policy.py
# Decode attention: auto = the C++ kernel where it builds, else torch (gather + SDPA).
ATTENTION_BACKENDS = ("auto", "cpp", "torch")
RUNNER_STARTS = ("zygote", "spawn")
KV_PARTITIONS = ("unified", "static")
# --kv-cache-dtype (vLLM's and SGLang's names): the arena's K/V dtype, None for
# the model's own.
KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None,
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
}
DEVICES = ("cpu", "cuda")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_MODEL = "smollm2"
DEFAULT_KV_DISK_DIR = "~/.cache/radixmux/kv"


class ServerArgs(msgspec.Struct, kw_only=True):
    """Every runtime setting; see ``python launch.py --help``."""

    models: list[ModelArg] = msgspec.field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    allowed_hosts: list[str] = msgspec.field(default_factory=list)
    allowed_origins: list[str] = msgspec.field(default_factory=list)
    schedule_policy: str = "lpm"
    eviction_policy: str = "lru"
    kv_cache_bytes: int = 2 << 30
    kv_block_bytes: int = 3 << 20  # a multiple of every embedded model's K row: fast gathers
    page_size: int = 1
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048
    prefill_tokens_during_decode: int = 1024
    prefill_wait_ratio: float = 0.5
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    disable_layer_sharing: bool = False
    disable_fused_ops: bool = False
    linear_onednn_copy: bool = False
    enable_jump_forward: bool = False
    deterministic: bool = False
    kv_partition: str = "unified"
    max_queued_requests: int = 1024
    tokenizer_workers: int = 1
    device: str = "cpu"
    attention_backend: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    log_level: str = "info"
    chat_template: str | None = None
    max_request_bytes: int = 1 << 20
    runner_threads: int = 0
    runner_start: str = "spawn"
    zmq_endpoint: str | None = None
    runtime_dir: str | None = None
    check_invariants: bool = False
    incremental_streaming_output: bool = False
    seed: int = 0
    runner_timeout: float = 300.0
    kv_disk_bytes: int = 0
    kv_disk_dir: str | None = None
    kv_disk_write_policy: str = "write_back"
    kv_disk_chunk_tokens: int = 64
    kv_disk_min_load_tokens: int = 0
    kv_disk_timeout: float = 300.0
    kv_disk_shared: bool = False
    warmup: str | None = None
    max_pinned_fraction: float = 0.5
    memory_reserve_bytes: int = 1 << 30
    drain_timeout: float = 30.0
    model_load_timeout: float = 900.0
    max_loaded_models: int = 0
    max_weights_bytes: int = 0
    idle_unload_seconds: float = 0.0
    # Not a flag: the --model entries marked load=on_demand, split from
    # ``models`` (which every process loads at start) here.
    on_demand_models: list[ModelArg] = msgspec.field(default_factory=list)
    kv_events_config: str | None = None
    grammar_compile_timeout: float = 10.0

    def __post_init__(self) -> None:
        _one_of("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        _one_of("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        _one_of("kv_partition", self.kv_partition, KV_PARTITIONS)
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _one_of("runner_start", self.runner_start, RUNNER_STARTS)
        _one_of("device", self.device, DEVICES)
        if self.device != "cpu":
            # The arena is host shared memory and no CUDA path has been tested:
            # a GPU model would fail at its first forward, so refuse it now.
            raise ValueError(
                f"--device {self.device}: radixmux has no tested CUDA path yet (the KV arena "
                "lives in host shared memory); use --device cpu"
            )
        for name in (
            "page_size",
            "max_running_requests",
            "chunked_prefill_size",
            "max_queued_requests",
            "tokenizer_workers",
            "kv_cache_bytes",
            "kv_block_bytes",
            "max_request_bytes",
            "runner_timeout",
            "kv_disk_timeout",
            "model_load_timeout",
            "grammar_compile_timeout",
        ):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.kv_cache_bytes < self.kv_block_bytes:
            raise ValueError(
                f"--kv-cache-bytes {self.kv_cache_bytes} is smaller than one block "
                f"(--kv-block-bytes {self.kv_block_bytes})"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port}: must be in [0, 65535]")
        check_allowed_names(self.host, self.allowed_hosts, self.allowed_origins)
        if self.prefill_tokens_during_decode < 0:
            raise ValueError("--prefill-tokens-during-decode must be >= 0 (0: no extra bound)")
        if not self.prefill_wait_ratio >= 0:
            raise ValueError("--prefill-wait-ratio must be >= 0 (0: new prompts never wait)")
        if self.runner_threads < 0:
            raise ValueError("--runner-threads must be >= 0 (0: divide the cores)")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"--log-level {self.log_level!r}: choose one of {list(LOG_LEVELS)}")
        if not self.schedule_conservativeness >= 0:
            raise ValueError("--schedule-conservativeness must be >= 0")
        self._check_disk_tier()
        if self.kv_events_config is not None:
            parse_kv_events_config(self.kv_events_config)
        if not 0 <= self.max_pinned_fraction <= 1:  # also refuses NaN
            raise ValueError("--max-pinned-fraction must be in [0, 1]")
        if self.memory_reserve_bytes < 0 or not self.drain_timeout >= 0:  # NaN too
            raise ValueError("--memory-reserve-bytes and --drain-timeout must be >= 0")
        self._split_on_demand()

    def _split_on_demand(self) -> None:
        """Move the ``load=on_demand`` models out of ``models`` (loaded at start)."""
        if self.max_loaded_models < 0 or self.max_weights_bytes < 0:
            raise ValueError("--max-loaded-models and --max-weights-bytes must be >= 0")
        if not self.idle_unload_seconds >= 0:  # NaN too
            raise ValueError("--idle-unload-seconds must be >= 0")
        self.on_demand_models += [m for m in self.models if m.on_demand]
        self.models = [m for m in self.models if not m.on_demand]
        if not self.models and not self.on_demand_models:
            self.models = [ModelArg(DEFAULT_MODEL, DEFAULT_MODEL)]
        # Every model on demand is fine: the server starts with none loaded.
        if self.on_demand_models and self.kv_partition == "static":
            raise ValueError(
                "load=on_demand needs --kv-partition unified (static shares are fixed at start)"
            )
        names = [m.name for m in self.models + self.on_demand_models]
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must be unique: {names}")

    def _check_disk_tier(self) -> None:
        check_settings(self.kv_disk_chunk_tokens, self.page_size, self.kv_disk_write_policy)
        if self.kv_disk_bytes < 0 or self.kv_disk_min_load_tokens < 0:
            raise ValueError("--kv-disk-bytes and --kv-disk-min-load-tokens must be >= 0")
        if not self.kv_disk_bytes:
            if self.kv_disk_dir is not None or self.kv_disk_shared:
                raise ValueError(
                    "--kv-disk-dir (or --kv-disk-shared) needs --kv-disk-bytes (the store's size)"
                )
            return
        if self.disable_radix_cache:
            raise ValueError("--kv-disk-bytes needs the radix cache (not --disable-radix-cache)")
        if self.kv_disk_dir is None:
            self.kv_disk_dir = DEFAULT_KV_DISK_DIR

    @property
    def disk_tier(self) -> bool:
        return self.kv_disk_bytes > 0


def _one_of(flag: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"--{flag.replace('_', '-')} {value!r}: choose one of {list(choices)}")


# (flag, type, help) in the order `--help` shows them; defaults come from ServerArgs.
_FLAGS: list[tuple[str, type, str]] = [
    ("host", str, "address to bind the HTTP server (127.0.0.1: this machine only)"),
    ("port", int, "HTTP port"),
    ("api-key", str, "require 'Authorization: Bearer KEY' on every request"),
    ("schedule-policy", str, f"order of waiting requests within a model {SCHEDULE_POLICIES}"),
    ("eviction-policy", str, f"which cached KV goes first under pressure {EVICTION_POLICIES}"),
    ("kv-cache-bytes", int, "size of the one KV arena shared by every model"),
    ("kv-block-bytes", int, "arena block size (a block belongs to one model at a time)"),
    ("page-size", int, "tokens per KV page: matching and allocation granularity"),
    ("max-running-requests", int, "most requests decoding at once, per model instance"),
    (
        "chunked-prefill-size",
        int,
        "most tokens (prompt chunks and decodes) one forward pass computes",
    ),
    (
        "prefill-tokens-during-decode",
        int,
        "most tokens (decodes counted) a forward pass that also decodes computes, "
        "bounding the inter-token latency of running requests (0: --chunked-prefill-size)",
    ),
    (
        "prefill-wait-ratio",
        float,
        "new prompts wait for the running requests to finish when that wait is at most "
        "this many times the delay their prefill would add to each running request's "
        "next token (measured step times; prompts then prefill together; 0: never wait)",
    ),
    ("schedule-conservativeness", float, "reserve KV for future decode tokens (x max_tokens)"),
    ("kv-partition", str, f"{KV_PARTITIONS}: static gives each model a fixed share"),
    ("max-queued-requests", int, "waiting requests per model before 429"),
    ("tokenizer-workers", int, "tokenizer processes"),
    ("device", str, "cpu (cuda is refused until a CUDA path is built and tested)"),
    (
        "attention-backend",
        str,
        f"{ATTENTION_BACKENDS}: decode attention in the C++ paged kernel or torch gather + SDPA",
    ),
    (
        "dtype",
        str,
        f"model and KV dtype {DTYPES}; auto: bfloat16 where the CPU has native bfloat16, "
        "else float32 (per model: --model ...,dtype=)",
    ),
    (
        "kv-cache-dtype",
        str,
        f"{tuple(KV_CACHE_DTYPES)}: auto stores K/V in the model's dtype; bfloat16 (= bf16) "
        "halves a float32 model's K/V bytes (docs/kernels.md#bfloat16-kv-for-float32-models); fp8 "
        "(= fp8_e4m3) in float8 e4m3, half of bfloat16's bytes, so the arena holds twice the "
        "tokens, at a measured accuracy and decode cost (docs/kernels.md#float8-kv-cache); "
        "either turns layer sharing off",
    ),
    ("log-level", str, "debug, info, warning, error"),
    ("chat-template", str, "Jinja chat template file for models that have none"),
    ("max-request-bytes", int, "largest HTTP body accepted (413 above)"),
    ("runner-threads", int, "torch threads per runner (0: cores divided among runners with work)"),
    (
        "runner-start",
        str,
        f"{RUNNER_STARTS}: fork runners from one process that imported torch and transformers "
        "once (an on-demand load's first answer ~2x sooner; a forked runner's unload was "
        "measured returning less memory: opt-in), or start each as a new process",
    ),
    ("zmq-endpoint", str, "ZeroMQ endpoint for the Python client (default: in the runtime dir)"),
    (
        "runtime-dir",
        str,
        "where a new private (0700) subdirectory for the sockets is made; the directory"
        " itself is left as it is (default: the temp dir)",
    ),
    ("seed", int, "base random seed"),
    (
        "runner-timeout",
        float,
        "seconds a runner may take to answer one batch before it is treated as hung "
        "(killed and restarted)",
    ),
    (
        "kv-disk-bytes",
        int,
        "size of the disk tier under the arena: evicted KV is saved to files and loaded "
        "back instead of recomputed, across restarts too (0: off)",
    ),
    ("kv-disk-dir", str, f"directory of the disk tier (default {DEFAULT_KV_DISK_DIR})"),
    (
        "kv-disk-write-policy",
        str,
        f"{WRITE_POLICIES}: save KV when it is evicted, or as soon as it is cached",
    ),
    ("kv-disk-chunk-tokens", int, "tokens per disk chunk (a multiple of --page-size)"),
    (
        "kv-disk-min-load-tokens",
        int,
        "load from disk only when at least this many prompt tokens come back "
        "(shorter ones are recomputed; 0: one chunk)",
    ),
    (
        "kv-disk-timeout",
        float,
        "seconds the disk tier may go without finishing a save or load something waits on "
        "before it is treated as hung (turned off; what waited on it fails with a 503)",
    ),
    (
        "warmup",
        str,
        "JSON-lines file of POST /cache/warmup bodies, run at start before /health turns 200 "
        "(a bad line fails the start)",
    ),
    (
        "max-pinned-fraction",
        float,
        "most of the arena pinned prefixes may hold (a pin past it is refused)",
    ),
    (
        "memory-reserve-bytes",
        int,
        "memory kept free for the rest of the machine: a model load (POST /models, reload) "
        "whose estimated need does not fit what is available less this is refused (507)",
    ),
    (
        "drain-timeout",
        float,
        "seconds an unload or reload waits for the old instance's running requests, and "
        "their clients, before failing the rest with a 503 (?timeout= overrides)",
    ),
    (
        "model-load-timeout",
        float,
        "seconds a model load at run time (POST /models, reload) may take; then it is "
        "cancelled and undone (504); a request waiting on an on-demand load gets a 503",
    ),
    (
        "max-loaded-models",
        int,
        "most models loaded at once (0: no limit); an on-demand load past it first unloads "
        "the least recently used idle on-demand model",
    ),
    (
        "max-weights-bytes",
        int,
        "most weight bytes the loaded models may hold, as their runners report them (0: no "
        "limit); a load past it first unloads the least recently used idle on-demand models "
        "(503 no_room when none can go)",
    ),
    (
        "idle-unload-seconds",
        float,
        "unload an on-demand model nobody asked for this long (0: never; per model: "
        "--model ...,keep_alive=S)",
    ),
    (
        "kv-events-config",
        str,
        "vLLM's KV events JSON (enable_kv_cache_events, publisher, endpoint, replay_endpoint, "
        "buffer_steps, hwm, max_queue_size, topic): publish what the radix cache stores and "
        "evicts, per model, as vLLM's ZMQ KV events; {model} in the topic: one topic per "
        "served model (docs/kv-events.md)",
    ),
    (
        "grammar-compile-timeout",
        float,
        "seconds a structured-output constraint (JSON schema, regex, EBNF, tools) may take "
        "to compile for a model's tokenizer; a slower or invalid one is a 400 naming its field",
    ),
]
# (flag, help) of list flags: repeat them or give a comma list; default: empty.
_LIST_FLAGS: list[tuple[str, str]] = [
    (
        "allowed-hosts",
        "Host header names served besides localhost, loopback addresses and --host "
        "(.example.com: it and its subdomains; '*': any); bound to 0.0.0.0 or :: with none "
        "given, any Host is served",
    ),
    (
        "allowed-origins",
        "browser origins (scheme://host[:port]) allowed to call the API cross-origin, with "
        "CORS headers ('*': any); others are refused (403)",
    ),
]
_SWITCHES: list[tuple[str, str]] = [
    ("disable-radix-cache", "no prefix cache: every prompt is prefilled in full"),
    (
        "disable-fused-ops",
        "run transformers' own RMSNorm, gated MLP and rotary code instead of the fused kernels",
    ),
    (
        "linear-onednn-copy",
        "keep a second, oneDNN-packed copy of each bfloat16 linear weight for calls above "
        "the small-batch kernel's row limit (a few percent faster prefill on 2+ threads per "
        "runner, for the weights' size again plus 40-100 MB of oneDNN code per layer shape)",
    ),
    (
        "enable-jump-forward",
        "structured output: append the tokens a grammar forces at once and compute them in "
        "the next step (SGLang's jump-forward) instead of sampling each; fewer steps at low "
        "concurrency, slower at high (docs/structured-output.md)",
    ),
    (
        "deterministic",
        "batch-invariant inference: a request's output (greedy tokens, logprobs) is "
        "bit-identical whatever its batch-mates, chunking or cache state, in bfloat16 "
        "(SGLang's --enable-deterministic-inference, also accepted); slower "
        "(docs/kernels.md#deterministic-mode)",
    ),
    (
        "disable-layer-sharing",
        "store every model's K/V whole; by default models whose lower layers are identical "
        "(fine-tunes of one base that froze them) store those layers' K/V once, each cut "
        "where its weights part from another's, and a model that finds the shared layers "
        "cached computes only its own (never with --kv-partition static)",
    ),
    ("check-invariants", "check the cache's invariants after every step (slow; debugging)"),
    (
        "kv-disk-shared",
        "share --kv-disk-dir with other servers on this host that are given it with this flag: "
        "each loads the chunks any of them saved, and evicts only its own",
    ),
    (
        "incremental-streaming-output",
        "streamed /generate chunks carry only the new text and output_ids (SGLang's flag; "
        "default: cumulative, as SGLang's clients expect); logprobs are always only the new ones",
    ),
]


def build_parser() -> argparse.ArgumentParser:
    """The ``launch.py`` argument parser."""
    defaults = ServerArgs(models=[ModelArg("x", "x")])
    parser = argparse.ArgumentParser(
        prog="launch.py",
        description="Serve several LLMs side by side over one unified radix cache.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="SOURCE[,name=N][,dtype=D][,priority=P][,replicas=R][,load=L][,keep_alive=S]",
        help="a short name (smollm2, gemma3-270m), HF folder or GGUF file; repeat to serve "
        f"several (default: {DEFAULT_MODEL}); load=on_demand registers it, its first request "
        "loads it",
    )
    parser.add_argument(
        "--models-file",
        metavar="PATH",
        help="a JSON file of model entries, each with the fields of a --model flag: "
        '{"models": [{"source": S, "name": N, "load": "on_demand", "keep_alive": 600, ...}]}; '
        "served beside the --model flags (docs/http-api.md#models-on-demand)",
    )
    for flag, typ, help_text in _FLAGS:
        default = getattr(defaults, flag.replace("-", "_"))
        parser.add_argument(f"--{flag}", type=typ, default=default, help=help_text)
    for flag, help_text in _LIST_FLAGS:
        parser.add_argument(
            f"--{flag}",
            action="extend",
            type=_comma_list,
            default=[],
            metavar="A,B",
            help=help_text,
        )
    for flag, help_text in _SWITCHES:
        parser.add_argument(f"--{flag}", action="store_true", help=help_text)
    # SGLang's spelling of --deterministic, for users coming from there.
    parser.add_argument(
        "--enable-deterministic-inference",
        dest="deterministic",
        action="store_true",
        help=argparse.SUPPRESS,
    )
    return parser


def _comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """Parse a command line into ``ServerArgs``; bad values exit with a clear message."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    values = vars(ns)
    try:
        values["models"] = [parse_model_arg(m) for m in values.pop("model")]
        if (path := values.pop("models_file")) is not None:
            values["models"] += read_models_file(path)
        return ServerArgs(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
