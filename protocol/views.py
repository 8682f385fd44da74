"""Read-only views the scheduler reports: per-model status, cache and disk-tier
figures (``/metrics``, ``/get_server_info``) and the dashboard's arena map."""

from __future__ import annotations

import msgspec


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
    chunks_loaded: int = 0  # chunks loads asked for (a load stopped by a bad one included)
    chunks_shared: int = 0  # of them, another instance's (--kv-disk-shared)
    shared: bool = False  # --kv-disk-shared
    # chunks written by why the save was made: capacity, unload, write_through, shutdown
    chunks_saved: dict[str, int] = msgspec.field(default_factory=dict)


class LayerGroupStatus(msgspec.Struct, frozen=True):
    """One lower layer group of a model cut for layer sharing (the default):
    layers ``[start, end)`` of ``model``, stored in ``pool`` with every model
    that shares them (``shared_with``)."""

    model: str
    start: int
    end: int
    pool: str
    shared_with: list[str]
    cached_tokens: int  # tokens of these layers' K/V the tree holds (once for all sharers)
    tokens_matched: int  # prompt tokens this model found cached in these layers and used
    # prompt tokens these layers held cached but the model's upper layers did
    # not: recomputed with them (what a partial-hit path would save)
    tokens_recomputed: int
    # prompt tokens these layers held cached past the full hit and served: only
    # the layers above were computed for them (a partial hit)
    tokens_reused: int
    arena_bytes: int  # arena bytes of the blocks the pool owns


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
    waits_for_decodes: int = 0  # rounds new prompts waited for running requests to finish
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
    tree_tokens: int = 0  # KV tokens the tree holds, summed over generations
    tree_index_bytes: int = 0  # Python memory of the tree's index (estimate, O(1))
    pins: int = 0  # pinned prefixes (each holds one lock on the tree)
    pinned_bytes: int = 0  # KV bytes of pinned tokens, all models
    max_pinned_bytes: int = 0  # --max-pinned-fraction of the arena
    layer_groups: list[LayerGroupStatus] = msgspec.field(default_factory=list)


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
    """One generation's KV under a shared prefix: its models, use and size."""

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
