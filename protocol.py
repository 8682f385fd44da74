"""Every message our processes exchange, in one low-level module all of them import.

Layering (DESIGN.md): ``memory/`` <- this module <- ``model_runners/`` and
``scheduler/`` <- ``runtime/``. It holds the runner's messages (a forward
batch in, sampled tokens out), the runtime's (requests, outputs, control,
model changes) and the types both carry (``SamplingParams``, ``ModelInfo``,
``ModelArg``). It imports nothing of ours but ``memory.layout``.

Data flow::

    front --GenerateRequest--> tokenizer worker --TokenizedRequest--> scheduler
    scheduler --ForwardBatch--> runner --ForwardResult--> scheduler
    scheduler --TokenBatch--> detokenizer --TextBatch--> front
    tokenizer worker / scheduler --RequestError--> front   (rejected requests)
    front --AbortRequest / ControlRequest--> scheduler --ControlReply--> front
    every process --ProcessReady / ProcessFailed--> launcher
    launcher --RunnerDied / ShutdownProcess--> scheduler

Every message is a tagged ``msgspec.Struct``; one socket carries a union of
them, decoded with :func:`decoder`. Token ids of a whole prompt (and a batch's
slots) travel as packed int32 bytes (:func:`pack_ids` / :func:`unpack_ids`);
the few ids a step adds travel as plain lists. K/V never travel: they live in
the arena.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from radixmux.memory.layout import KVLayout


# ---- what both sides carry -------------------------------------------------------
class ModelArg(msgspec.Struct, frozen=True):
    """One ``--model`` flag: ``SOURCE[,name=N][,dtype=D][,priority=P][,replicas=R]``."""

    source: str
    name: str
    dtype: str | None = None
    priority: float = 1.0
    replicas: int = 1


class ModelInfo(msgspec.Struct, frozen=True):
    """Layout, limits and fingerprints of a loaded model (sent in the ready message).

    ``sliding_windows`` has one entry per layer: the window in tokens, or
    ``None`` for full attention. ``kv_share_key`` is the weights fingerprint.
    """

    name: str
    architecture: str
    layout: KVLayout
    context_length: int
    sliding_windows: list[int | None]
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer_fingerprint: str
    kv_share_key: str
    has_chat_template: bool
    dtype: str
    device: str


# ---- scheduler <-> runner ----------------------------------------------------------
# Decode attention: auto = the C++ kernel where it builds, else torch (gather + SDPA).
ATTENTION_BACKENDS = ("auto", "cpp", "torch")


def pack_ids(ids: object) -> bytes:
    """A sequence of ints as packed int32 bytes."""
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(data: bytes) -> np.ndarray:
    """Packed int32 bytes back to an int64 array."""
    return np.frombuffer(data, dtype="<i4").astype(np.int64)


# A logit bias entry on the wire: token id and the value added to its logit.
BIAS_RECORD = np.dtype([("id", "<i4"), ("value", "<f4")])


def pack_bias(pairs: list[tuple[int, float]]) -> bytes:
    """``SamplingParams.logit_bias`` as packed (int32 id, float32 value) records."""
    return np.array([(int(t), float(v)) for t, v in pairs], dtype=BIAS_RECORD).tobytes()


def unpack_bias(data: bytes) -> np.ndarray:
    """Packed logit bias records back to a structured array (fields ``id``, ``value``)."""
    return np.frombuffer(data, dtype=BIAS_RECORD)


class SamplingParams(msgspec.Struct, frozen=True):
    """How to pick a sequence's next token. Defaults mean greedy, no penalties.

    ``temperature <= 0`` or ``top_k == 1`` is greedy. ``top_k = 0``, ``top_p =
    1``, ``min_p = 0`` switch those filters off. Penalties apply over the
    sequence's ``output_ids``. ``seed`` makes sampling reproducible: the same
    seed, step and logits give the same token, whatever else is in the batch.
    ``logprobs`` asks for the chosen token's log-probability and the
    ``top_logprobs`` most likely alternatives. ``logit_bias`` adds to the
    logits of the listed token ids (after penalties, before everything else).
    ``prompt_logprobs_start >= 0`` asks for the log-probability (and the top
    alternatives) of every prompt token from that index on (the first prompt
    token has none): the scheduler then computes those positions instead of
    taking them from the cache.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    max_new_tokens: int = 128
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: list[tuple[int, float]] = msgspec.field(default_factory=list)
    prompt_logprobs_start: int = -1


class SeqInput(msgspec.Struct, frozen=True):
    """One sequence's part of a forward pass.

    ``slots`` lists the arena slot of every context token, oldest first
    (cached prefix then the new tokens); the last ``len(new_tokens)`` are where
    the new tokens' K/V are written, so the first new token's position is
    ``len(slots) - len(new_tokens)``. ``sample`` is False for a prefill chunk
    that is not the prompt's last. ``next_token`` is the prompt token after
    a chunk that does not end the prompt (-1 otherwise): with prompt logprobs,
    the chunk's last position scores it.
    """

    rid: str
    new_tokens: bytes
    slots: bytes
    sample: bool = True
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    output_ids: bytes = b""
    next_token: int = -1
    # The scheduler packs the request's stop token ids and logit bias here and
    # leaves them out of ``params``: as lists they would be decoded item by
    # item on every step. The lists in ``params``, if any, count too.
    stop_ids: bytes = b""
    logit_bias: bytes = b""
    # Tokens generated so far. ``output_ids`` holds them only when penalties
    # count them (-1: as many as ``output_ids`` holds).
    num_output: int = -1


class PrefixGroup(msgspec.Struct, frozen=True):
    """Single-token sequences of a batch whose first ``prefix_len`` context
    slots are the same slot ids (a cached prefix they share): decode attention
    reads that prefix's K/V once for all of them. ``members`` index
    ``ForwardBatch.seqs``."""

    prefix_len: int
    members: list[int]


class ForwardBatch(msgspec.Struct, tag="forward", frozen=True):
    """A ragged batch: any mix of prefill chunks and single-token decodes."""

    batch_id: int
    seqs: list[SeqInput]
    # torch threads to run it with (0: keep the runner's current count); the
    # scheduler gives a runner more cores while the others have no work.
    threads: int = 0
    prefix_groups: list[PrefixGroup] = msgspec.field(default_factory=list)


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    """Asks the runner to exit cleanly."""


class SeqOutput(msgspec.Struct, frozen=True):
    """The sampled token of one sequence (``token_id == -1`` when not sampled).

    ``finish_reason`` is ``"stop"`` (a stop / EOS token), ``"length"``
    (``max_new_tokens`` reached with this token) or ``None``. ``error`` is set
    (and ``token_id`` is -1) when this sequence failed on its own.
    ``prompt_logprobs`` (with prompt logprobs asked for, on prompt chunks):
    the logprob of each prompt token this chunk scores, i.e. the tokens at
    positions ``first_pos + 1 ..`` of the chunk (and ``next_token``), with
    their top alternatives in ``prompt_top_logprobs``.
    """

    rid: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None  # this sequence alone failed (its batch-mates did not)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


class ForwardResult(msgspec.Struct, tag="result", frozen=True):
    """The runner's answer to one ``ForwardBatch`` (outputs in batch order)."""

    batch_id: int
    outputs: list[SeqOutput] = msgspec.field(default_factory=list)
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    error: str | None = None
    threads: int = 0  # torch threads it ran with


class Ready(msgspec.Struct, tag="ready", frozen=True):
    """First message a runner sends once its model is loaded and the arena mapped."""

    info: ModelInfo
    pid: int
    load_seconds: float
    threads: int


class Failed(msgspec.Struct, tag="failed", frozen=True):
    """Sent instead of ``Ready`` when start-up fails (then the runner exits)."""

    error: str
    pid: int


RunnerRequest = ForwardBatch | Shutdown
RunnerReply = Ready | Failed | ForwardResult


# ---- the runtime's processes -------------------------------------------------------
__all__ = ["SamplingParams", "pack_ids", "unpack_ids"]


# ---- models ---------------------------------------------------------------------
class ServedModel(msgspec.Struct, frozen=True):
    """A model as every process sees it once its runners are up.

    ``version`` counts reloads of one served name; each version is its own
    *instance* inside the runtime (runners, tree entries, tokenizer), so a
    request bound to one version at the front never runs on another.
    """

    name: str  # the served name clients use
    folder: str  # local HF folder (tokenizer, config, chat template)
    info: ModelInfo
    replicas: int = 1
    priority: float = 1.0
    version: int = 1

    @property
    def instance(self) -> str:
        """The name this version has inside the runtime (scheduler, tree, tokenizers)."""
        return instance_name(self.name, self.version)


def instance_name(name: str, version: int) -> str:
    """A served name's internal name at ``version``: the name itself for the
    first version, so a server whose models never change keeps its names."""
    return name if version == 1 else f"{name}@v{version}"


# ---- requests -------------------------------------------------------------------
class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


class GenerateRequest(msgspec.Struct, tag="generate", frozen=True):
    """A request as the front accepted it (text, ids or chat messages)."""

    rid: str
    model: str
    params: SamplingParams
    prompt: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stream: bool = False
    skip_special_tokens: bool = True
    arrival: float = 0.0  # time.time() when the front received it


class TokenizedRequest(msgspec.Struct, tag="tokenized", frozen=True):
    """A request ready to schedule: prompt ids (packed int32) and sampling."""

    rid: str
    model: str
    input_ids: bytes
    params: SamplingParams
    stop: list[str] = msgspec.field(default_factory=list)
    skip_special_tokens: bool = True
    arrival: float = 0.0


class AbortRequest(msgspec.Struct, tag="abort", frozen=True):
    """Stop a request now and free its KV (client gone, stop string, timeout).

    ``early``: the front had no reply for it yet, so the request may still be
    in a tokenizer worker; the scheduler remembers the abort for a while and
    drops the request if it arrives later.
    """

    rid: str
    reason: str = "abort"
    early: bool = False


class RequestError(msgspec.Struct, tag="error", frozen=True):
    """A request that ends in an error before or during generation.

    ``status`` is the HTTP status the front answers with; ``param`` names the
    offending field where there is one.
    """

    rid: str
    status: int
    message: str
    param: str | None = None


# ---- outputs --------------------------------------------------------------------
class TokenLogprob(msgspec.Struct, frozen=True):
    """A sampled token's log-probability and the top alternatives'. ``text`` and
    ``top_text`` (the tokens as text) are filled in by the detokenizer."""

    token_id: int
    logprob: float | None  # None only for a prompt's first token (nothing scores it)
    top: list[tuple[int, float]] | None = None
    text: str | None = None
    top_text: list[str] | None = None


class RequestOutput(msgspec.Struct, frozen=True):
    """What one scheduler step produced for one request.

    ``finish_reason``: ``"stop"`` (EOS / stop token), ``"length"``, ``"abort"``
    or ``"error"`` (then ``error`` and ``status`` say why), None while running.
    ``stop`` and ``skip_special_tokens`` are set on a request's first output so
    the detokenizer learns them.
    """

    rid: str
    model: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    status: int = 200
    stop: list[str] | None = None
    skip_special_tokens: bool = True
    # Seconds from arrival at the front to first admission into a batch; on
    # the request's first output only (None before admission or unknown).
    queue_time: float | None = None
    # With prompt logprobs asked for: on the first output, one per prompt
    # token from the asked start (the prompt's first token has logprob None).
    prompt_logprobs: list[TokenLogprob] | None = None


class TokenBatch(msgspec.Struct, tag="tokens", frozen=True):
    outputs: list[RequestOutput]


class TextOutput(msgspec.Struct, frozen=True):
    """A text delta for one request (what the front streams)."""

    rid: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None = None
    matched_stop: str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    status: int = 200
    queue_time: float | None = None  # as in RequestOutput: first output only
    prompt_logprobs: list[TokenLogprob] | None = None  # as in RequestOutput


class TextBatch(msgspec.Struct, tag="text", frozen=True):
    outputs: list[TextOutput]


# ---- tokenizer service (/tokenize, /detokenize) ---------------------------------
class TokenizeRequest(msgspec.Struct, tag="tokenize", frozen=True):
    """Front to a tokenizer worker: a prompt's ids as generation would see them
    (``messages`` through the chat template), without generating."""

    req_id: str
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: as generation does for that form
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, tag="detokenize", frozen=True):
    """Front to a tokenizer worker: token ids back to text."""

    req_id: str
    model: str
    tokens: list[int]


class TokenizerReply(msgspec.Struct, tag="tokenizer_reply", frozen=True):
    """A tokenizer worker's answer; ``status`` >= 400 carries an error naming ``param``."""

    req_id: str
    status: int = 200
    tokens: list[int] = msgspec.field(default_factory=list)
    token_strs: list[str] | None = None
    text: str | None = None
    error: str | None = None
    param: str | None = None


# ---- control --------------------------------------------------------------------
class ControlRequest(msgspec.Struct, tag="control", frozen=True):
    """Operations the front asks of the scheduler: ``stats``, ``check`` (stats
    with the invariant check run now, unless nothing changed since the last
    one or it ran under a second ago: rate-limited, the reply says its age),
    ``flush_cache``, ``invalidate`` (``model`` required), ``dashboard`` (stats
    plus a ``DashboardSnapshot``)."""

    req_id: str
    op: str
    model: str | None = None


class ModelStatus(msgspec.Struct, frozen=True):
    """One served model's health, load and cache figures."""

    name: str
    up: bool
    error: str | None
    waiting: int
    running: int
    replicas_up: int
    cache_hits: int
    cache_misses: int
    tokens_queried: int
    tokens_matched: int
    cached_tokens: int
    arena_bytes: int
    steps: int = 0  # batches its runners ran
    # Seconds its runners spent computing (forward + sampling); over wall time
    # this is how busy the scheduler keeps them.
    runner_busy_seconds: float = 0.0
    threads: int = 0  # most torch threads one of its runners last ran with
    state: str = "serving"  # serving (a runner is up), restarting, or down (gave up)
    runner_pids: list[int] = msgspec.field(default_factory=list)
    restarts: int = 0  # runner restarts after a death or a hang
    # Capacity evictions made to give this model room, and KV tokens it was
    # given: their ratio is what its admissions cost other cached prefixes.
    evicted_for_tokens: int = 0
    kv_allocated_tokens: int = 0
    # Tokens evicted from this model's cache, by reason (capacity,
    # invalidation, flush, unload); a cache shared by several models
    # (replicas, aliases) counts for each of them.
    evicted_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    pinned_tokens: int = 0  # tokens of its pinned prefixes (warm-up ``pin``), each counted once


class DiskTierStats(msgspec.Struct, frozen=True):
    """The disk tier's counters (``--kv-disk-bytes``)."""

    enabled: bool
    write_policy: str
    disabled_reason: str | None
    store_bytes: int
    store_chunks: int
    capacity_bytes: int
    bytes_written: int
    bytes_read: int
    chunks_written: int
    chunks_dropped: int  # corrupt, truncated or mismatched files found and deleted
    write_errors: int  # chunks a save could not write (the tier stays on)
    loads: int
    load_seconds: float
    load_p50_s: float  # over the last 1,024 loads
    load_p99_s: float
    tokens_loaded: dict[str, int] = msgspec.field(default_factory=dict)  # per model


class SchedulerStats(msgspec.Struct, frozen=True):
    """Everything ``/metrics`` and ``/get_server_info`` report from the scheduler."""

    models: list[ModelStatus]
    evicted_tokens: dict[str, int]
    arena_total_bytes: int
    arena_free_bytes: int
    arena_fragmented_bytes: int
    tree_nodes: int
    steps: int
    retractions: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens prefilled (not served from the cache)
    # "ok", or what the last invariant check found (run after every step with
    # --check-invariants, and on op "check" at most once a second); None: never run.
    invariants: str | None = None
    invariants_age_s: float | None = None  # seconds since that check ran
    invariants_current: bool = False  # nothing changed since it ran: it holds now
    invariant_checks: int = 0  # checks run so far
    locks_held: int = 0  # lock references on the tree (0 on an idle server)
    request_owned_slots: int = 0  # KV slots requests hold outside the tree
    aborted_before_arrival: int = 0  # requests dropped: their abort came first
    contained_failures: int = 0  # messages/results whose handling raised
    shared_prefix_rows: int = 0  # decode context rows read once for a group, not per member
    disk: DiskTierStats | None = None  # None: no disk tier
    tree_tokens: int = 0  # KV tokens the tree holds, summed over caches
    tree_index_bytes: int = 0  # Python memory of the tree's index (estimate, O(1))
    pins: int = 0  # pinned prefixes (each holds one lock on the tree)
    pinned_bytes: int = 0  # KV bytes of pinned tokens, all models
    max_pinned_bytes: int = 0  # --max-pinned-fraction of the arena


class ArenaPool(msgspec.Struct, frozen=True):
    """One KV pool (a set of identical weights) in the arena map."""

    key: str  # KV-share key
    models: list[str]  # the served models whose KV it holds
    blocks: int
    used_slots: int
    slots_per_block: int
    bytes_per_token: int


class ArenaMap(msgspec.Struct, frozen=True):
    """The arena, block by block: which pool owns each and how full it is.

    Past ``MAX_ARENA_CELLS`` blocks, consecutive blocks are merged into
    cells of ``blocks_per_cell`` (owner: the pool with most of them)."""

    num_blocks: int
    block_bytes: int
    blocks_per_cell: int
    pools: list[ArenaPool]
    owners: list[int]  # per cell: index into ``pools``, -1 when free
    fill: list[int]  # per cell: percent of the owner's slots in use


class PrefixHolderView(msgspec.Struct, frozen=True):
    """One cache's KV under a shared prefix: its models, use and size."""

    models: list[str]
    hits: int  # lookups that matched through the prefix
    locks: int  # running requests holding it
    subtree_tokens: int  # KV tokens for the prefix and everything cached below it
    subtree_bytes: int


class SharedPrefixView(msgspec.Struct, frozen=True):
    """A cached prefix many lookups shared (head and tail of its token ids)."""

    length: int  # tokens
    hits: int
    children: int  # cached continuations branching here
    head_ids: list[int]  # the first tokens
    tail_ids: list[int]  # the last tokens, when the prefix is longer than the head
    holders: list[PrefixHolderView]


class DashboardSnapshot(msgspec.Struct, frozen=True):
    """What only the scheduler knows for ``/dashboard``: arena map, tree top."""

    arena: ArenaMap
    prefixes: list[SharedPrefixView]
    prefixes_complete: bool  # False: the bounded walk stopped early


class ControlReply(msgspec.Struct, tag="control_reply", frozen=True):
    req_id: str
    ok: bool
    message: str = ""
    stats: SchedulerStats | None = None
    dashboard: DashboardSnapshot | None = None


# ---- warm-up (POST /cache/warmup, --warmup FILE) ------------------------------------
class WarmupRequest(msgspec.Struct, tag="warmup", frozen=True):
    """Front to scheduler: prefill each prefix (packed int32 ids) at low
    priority and cache it; ``pin`` True keeps it from eviction, False releases
    a pin an earlier warm-up of the same prefix took. Answered by ``WarmupReply``."""

    req_id: str
    model: str  # instance name
    prefixes: list[bytes]
    pin: bool = False


class WarmedPrefix(msgspec.Struct, frozen=True):
    """One prefix after its warm-up: ``cached_tokens`` of its ``prompt_tokens``
    are in the tree now (whole pages), ``computed_tokens`` were prefilled for
    it, ``pinned_tokens`` are held by its pin (0 when not pinned)."""

    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    pinned_tokens: int


class WarmupReply(msgspec.Struct, tag="warmup_reply", frozen=True):
    """Scheduler to front: every prefix of a ``WarmupRequest`` is done
    (``status`` 200, one item each, in order) or it failed (``status`` >= 400,
    ``message`` says why, ``param`` names the field)."""

    req_id: str
    status: int = 200
    message: str = ""
    param: str | None = None
    items: list[WarmedPrefix] = msgspec.field(default_factory=list)


# ---- lifecycle ------------------------------------------------------------------
class ProcessReady(msgspec.Struct, tag="process_ready", frozen=True):
    """A process is up; the scheduler's carries the served models."""

    name: str
    pid: int
    models: list[ServedModel] = msgspec.field(default_factory=list)


class ProcessFailed(msgspec.Struct, tag="process_failed", frozen=True):
    name: str
    pid: int
    error: str


class RunnerDied(msgspec.Struct, tag="runner_died", frozen=True):
    """The launcher saw a runner process exit; its requests fail (or move to a
    live replica). ``restarting``: a new process is on its way (it sends
    ``Ready`` when up); False when the launcher gave up on it."""

    runner_id: str
    exitcode: int
    restarting: bool = False


class ServerReady(msgspec.Struct, tag="server_ready", frozen=True):
    """Launcher to front: every process is up; stop answering "starting"."""


class ShutdownProcess(msgspec.Struct, tag="shutdown_process", frozen=True):
    """Ask a process to exit cleanly."""


# ---- models at run time ------------------------------------------------------------
class ModelCommand(msgspec.Struct, tag="model_command", frozen=True):
    """Front to launcher: ``load`` an instance (``model.name`` is the instance
    name; ``served`` and ``version`` what the front lists it as) or ``unload``
    one (only ``model.name`` is read). The front has drained an instance
    before it asks for its unload."""

    req_id: str
    op: str
    model: ModelArg
    served: str = ""
    version: int = 1


class ModelCommandReply(msgspec.Struct, tag="model_reply", frozen=True):
    """Launcher to front: a ``ModelCommand`` done (``status`` 200, ``model``
    set for a load) or failed (``status`` >= 400, ``message`` says why)."""

    req_id: str
    status: int
    message: str = ""
    model: ServedModel | None = None
    freed_tokens: int = 0


class ModelTable(msgspec.Struct, tag="model_table", frozen=True):
    """Launcher to tokenizer workers and detokenizer: every instance now
    loaded. A tokenizer worker loads and drops tokenizers to match; the
    detokenizer only adds (it drops an instance on the scheduler's
    ``ModelRemoved``, which reaches it after that instance's last outputs)."""

    version: int
    models: list[ServedModel]


class ModelTableApplied(msgspec.Struct, tag="table_applied", frozen=True):
    """A process holds the tokenizers of ``ModelTable`` ``version`` (or says why not)."""

    name: str
    version: int
    error: str | None = None


class AddModel(msgspec.Struct, tag="add_model", frozen=True):
    """Launcher to scheduler: runners for ``model`` (instance name) are
    starting; register it once they are all ready."""

    model: ModelArg
    served: str
    version: int = 1


class ModelAdded(msgspec.Struct, tag="model_added", frozen=True):
    """Scheduler to launcher: an ``AddModel`` is serving (``served``) or failed (``error``)."""

    name: str
    served: ServedModel | None = None
    error: str | None = None


class RemoveModel(msgspec.Struct, tag="remove_model", frozen=True):
    """Launcher to scheduler: stop an instance's runners and drop its cache
    entries (also cancels an ``AddModel`` still waiting for its runners)."""

    name: str


class ModelRemoved(msgspec.Struct, tag="model_removed", frozen=True):
    """Scheduler to launcher and detokenizer: an instance is gone; its
    blocks are back in the arena."""

    name: str
    freed_tokens: int = 0


# Unions, one per receiving socket.
TokenizerInbox = GenerateRequest | TokenizeRequest | DetokenizeRequest | ShutdownProcess
TokenizerBroadcast = ModelTable
SchedulerInbox = (
    TokenizedRequest
    | AbortRequest
    | ControlRequest
    | RunnerDied
    | ShutdownProcess
    | AddModel
    | RemoveModel
    | WarmupRequest
)
DetokenizerInbox = TokenBatch | ModelTable | ModelRemoved | ShutdownProcess
FrontInbox = (
    TextBatch
    | RequestError
    | ControlReply
    | TokenizerReply
    | ServerReady
    | ModelCommandReply
    | WarmupReply
)
LauncherInbox = (
    ProcessReady | ProcessFailed | ModelCommand | ModelAdded | ModelRemoved | ModelTableApplied
)

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """One message as msgpack bytes."""
    return _encoder.encode(msg)


def decoder(union: Any) -> msgspec.msgpack.Decoder:
    """A decoder for one socket's message union."""
    return msgspec.msgpack.Decoder(union)
