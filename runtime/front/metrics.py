"""Prometheus metrics of the front: its own latency histograms and the scheduler's figures.

The front measures what only it sees (time to first token, inter-token and
end-to-end latency, requests by finish reason). Cache, memory and queue figures
come from a fresh ``ControlRequest(op="stats")`` reply at each scrape, exposed
by a custom collector so they are exactly the scheduler's numbers.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixmux.protocol import DiskTierStats, ModelStatus, SchedulerStats, served_name

# Latency buckets from 5 ms to 2 min: CPU runners are slow, GPUs fast.
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


# Per-model series carry the served name and its version apart: a reload
# (version 2, the instance ``name@v2`` inside the runtime) keeps the series a
# dashboard or an alert keyed on ``model`` follows.
LABELS = ["model", "version"]


def model_labels(instance: str) -> list[str]:
    """The ``LABELS`` values of a model instance (``name`` or ``name@vN``)."""
    name, version = served_name(instance)
    return [name, str(version)]


class FrontMetrics:
    """The front's own registry (never the global one: tests start several fronts)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "radixmux_time_to_first_token_seconds",
            "Arrival to first generated token, per model",
            LABELS,
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "radixmux_inter_token_latency_seconds",
            "Time between generated tokens, per model",
            LABELS,
            buckets=_ITL,
            registry=r,
        )
        self.queue_time = Histogram(
            "radixmux_request_queue_time_seconds",
            "Arrival at the front to first admission into a runner batch, per model",
            LABELS,
            buckets=_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "radixmux_e2e_request_latency_seconds",
            "Arrival to last token (or error), per model",
            LABELS,
            buckets=_LATENCY,
            registry=r,
        )
        self.requests = Counter(
            "radixmux_requests",
            "Finished requests by model and finish reason (stop, length, abort, error)",
            [*LABELS, "finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "radixmux_prompt_tokens", "Prompt tokens of finished requests", LABELS, registry=r
        )
        self.generation_tokens = Counter(
            "radixmux_generation_tokens", "Generated tokens", LABELS, registry=r
        )
        self.cached_prompt_tokens = Counter(
            "radixmux_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache, as requests reported them",
            LABELS,
            registry=r,
        )
        self.changes = LoadMetrics(r)
        self.scheduler = SchedulerCollector()
        r.register(self.scheduler)

    def render(self, stats: SchedulerStats | None) -> bytes:
        """Prometheus text with ``stats`` (None: the scheduler did not answer)."""
        self.scheduler.stats = stats
        return generate_latest(self.registry)


_LOAD_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


class LoadMetrics:
    """Loads and unloads of every model by reason, and how long loads take."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.loads = Counter(
            "radixmux_model_loads",
            "Model loads by reason (on_demand, manual)",
            ["model", "reason"],
            registry=registry,
        )
        self.unloads = Counter(
            "radixmux_model_unloads",
            "Model unloads by reason (lru, weights, idle, memory, manual)",
            ["model", "reason"],
            registry=registry,
        )
        self.load_seconds = Histogram(
            "radixmux_model_load_seconds",
            "Time a model load at run time took, per model",
            ["model"],
            buckets=_LOAD_BUCKETS,
            registry=registry,
        )

    def loaded(self, name: str, reason: str, seconds: float) -> None:
        """Count one load of ``name``."""
        self.loads.labels(name, reason).inc()
        self.load_seconds.labels(name).observe(seconds)

    def unloaded(self, name: str, reason: str) -> None:
        """Count one unload of ``name``."""
        self.unloads.labels(name, reason).inc()


class SchedulerCollector(Collector):
    """Exposes the scheduler's latest ``SchedulerStats``."""

    def __init__(self) -> None:
        self.stats: SchedulerStats | None = None

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("radixmux_scheduler_up", "1 if the scheduler answered this scrape")
        up.add_metric([], 0.0 if self.stats is None else 1.0)
        yield up
        if self.stats is None:
            return
        yield from _model_metrics(self.stats)
        yield from _global_metrics(self.stats)
        if self.stats.disk is not None:
            yield from _disk_metrics(self.stats)
        if self.stats.layer_groups:
            yield from _layer_group_metrics(self.stats)


def _gauge(name: str, doc: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=LABELS)


def _counter(name: str, doc: str) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=LABELS)


def _model_metrics(stats: SchedulerStats) -> Iterator[Metric]:
    fams = {
        "up": _gauge("radixmux_model_up", "1 if the model has a live runner"),
        "replicas_up": _gauge("radixmux_model_replicas_up", "Live runner replicas"),
        "waiting": _gauge("radixmux_queue_length", "Requests waiting to be scheduled"),
        "running": _gauge("radixmux_running_requests", "Requests in a running batch"),
        "cached_tokens": _gauge("radixmux_cached_tokens", "Tokens the radix tree holds KV for"),
        "arena_bytes": _gauge("radixmux_arena_bytes", "KV arena bytes held by the model"),
        "hit_rate": _gauge(
            "radixmux_cache_hit_rate",
            "Prompt tokens matched in the cache / prompt tokens looked up",
        ),
        "cache_hits": _counter("radixmux_cache_hits", "Lookups that matched a cached prefix"),
        "cache_misses": _counter("radixmux_cache_misses", "Lookups that matched nothing"),
        "tokens_queried": _counter("radixmux_cache_tokens_queried", "Prompt tokens looked up"),
        "tokens_matched": _counter(
            "radixmux_cache_tokens_saved", "Prompt tokens matched in the cache (prefill saved)"
        ),
        "steps": _counter("radixmux_model_steps", "Batches the model's runners ran"),
        "runner_busy_seconds": _counter(
            "radixmux_runner_busy_seconds", "Seconds the model's runners spent computing"
        ),
        "restarts": _counter("radixmux_runner_restarts", "Runner restarts after a death or hang"),
        "evicted_for_tokens": _counter(
            "radixmux_evicted_for_tokens",
            "Cached tokens (of any model) evicted to give this model room",
        ),
        "kv_allocated_tokens": _counter(
            "radixmux_kv_allocated_tokens", "KV slots allocated to this model's requests"
        ),
        "pinned_tokens": _gauge(
            "radixmux_pinned_tokens", "Tokens of pinned prefixes (warm-up pin), held from eviction"
        ),
        "evicted_per_admitted": _gauge(
            "radixmux_evicted_tokens_per_admitted_token",
            "Tokens evicted for this model / KV tokens it was given",
        ),
    }
    state = GaugeMetricFamily(
        "radixmux_model_state",
        "1 for the model's state: serving, restarting or down",
        labels=[*LABELS, "state"],
    )
    evicted = CounterMetricFamily(
        "radixmux_model_evicted_tokens",
        "Tokens evicted from the model's cache, by reason (capacity, invalidation, flush, "
        "unload); a cache shared by several models (replicas, aliases) counts for each",
        labels=[*LABELS, "reason"],
    )
    for m in stats.models:
        labels = model_labels(m.name)
        for key, fam in fams.items():
            fam.add_metric(labels, _model_value(m, key))
        for name in ("serving", "restarting", "down"):
            state.add_metric([*labels, name], float(m.state == name))
        for reason, count in sorted(m.evicted_tokens.items()):
            evicted.add_metric([*labels, reason], float(count))
    yield from fams.values()
    yield state
    yield evicted


def _model_value(m: ModelStatus, key: str) -> float:
    if key == "hit_rate":
        return m.tokens_matched / m.tokens_queried if m.tokens_queried else 0.0
    if key == "evicted_per_admitted":
        return m.evicted_for_tokens / m.kv_allocated_tokens if m.kv_allocated_tokens else 0.0
    return float(getattr(m, key))


def _global_metrics(stats: SchedulerStats) -> Iterator[Metric]:
    queried = sum(m.tokens_queried for m in stats.models)
    matched = sum(m.tokens_matched for m in stats.models)
    rate = GaugeMetricFamily(
        "radixmux_global_cache_hit_rate", "Cache token hit rate over every model"
    )
    rate.add_metric([], matched / queried if queried else 0.0)
    yield rate
    saved = CounterMetricFamily("radixmux_global_cache_tokens_saved", "Tokens matched, all models")
    saved.add_metric([], float(matched))
    yield saved
    evicted = CounterMetricFamily(
        "radixmux_evicted_tokens", "Tokens evicted from the cache, by reason", labels=["reason"]
    )
    for reason, count in sorted(stats.evicted_tokens.items()):
        evicted.add_metric([reason], float(count))
    yield evicted
    for family, name, doc, value in (
        (
            GaugeMetricFamily,
            "radixmux_arena_total_bytes",
            "Size of the KV arena",
            stats.arena_total_bytes,
        ),
        (
            GaugeMetricFamily,
            "radixmux_arena_free_bytes",
            "Free KV arena bytes",
            stats.arena_free_bytes,
        ),
        (
            GaugeMetricFamily,
            "radixmux_arena_fragmented_bytes",
            "Free slots inside blocks owned by a model",
            stats.arena_fragmented_bytes,
        ),
        (
            GaugeMetricFamily,
            "radixmux_tree_nodes",
            "Nodes in the unified radix tree",
            stats.tree_nodes,
        ),
        (
            GaugeMetricFamily,
            "radixmux_tree_tokens",
            "KV tokens the radix tree holds, summed over caches (a shared cache once)",
            stats.tree_tokens,
        ),
        (
            GaugeMetricFamily,
            "radixmux_tree_index_bytes",
            "Python memory of the radix tree's index: nodes, edges, slot ids (estimate)",
            stats.tree_index_bytes,
        ),
        (CounterMetricFamily, "radixmux_scheduler_steps", "Batches run", stats.steps),
        (
            CounterMetricFamily,
            "radixmux_retractions",
            "Running requests retracted for lack of KV",
            stats.retractions,
        ),
        (
            CounterMetricFamily,
            "radixmux_prefill_waits",
            "Scheduling rounds in which new prompts waited for running requests to finish",
            stats.waits_for_decodes,
        ),
        (
            CounterMetricFamily,
            "radixmux_prompt_tokens_computed",
            "Prompt tokens prefilled (not served from the cache)",
            stats.prompt_tokens_computed,
        ),
        (
            GaugeMetricFamily,
            "radixmux_cache_locks_held",
            "Lock references requests hold on the radix tree",
            stats.locks_held,
        ),
        (
            GaugeMetricFamily,
            "radixmux_request_owned_kv_slots",
            "KV slots requests hold outside the radix tree",
            stats.request_owned_slots,
        ),
        (GaugeMetricFamily, "radixmux_pinned_bytes", "KV bytes pins hold", stats.pinned_bytes),
        (
            GaugeMetricFamily,
            "radixmux_max_pinned_bytes",
            "Most KV bytes pins may hold (--max-pinned-fraction of the arena)",
            stats.max_pinned_bytes,
        ),
        (
            CounterMetricFamily,
            "radixmux_aborted_before_arrival",
            "Requests dropped because their abort reached the scheduler first",
            stats.aborted_before_arrival,
        ),
        (
            CounterMetricFamily,
            "radixmux_decode_shared_prefix_rows",
            "Decode context rows read once for a group sharing a prefix instead of per request",
            stats.shared_prefix_rows,
        ),
        (
            CounterMetricFamily,
            "radixmux_contained_failures",
            "Scheduler events whose handling failed (their requests got a 500)",
            stats.contained_failures,
        ),
    ):
        metric = family(name, doc)
        metric.add_metric([], float(value))
        yield metric


# (metric, kind, help, DiskTierStats field)
_DISK: list[tuple[str, type[Metric], str, str]] = [
    ("radixmux_disk_tier_enabled", GaugeMetricFamily, "1 while the disk tier works", "enabled"),
    ("radixmux_disk_store_bytes", GaugeMetricFamily, "Bytes of KV chunk files", "store_bytes"),
    ("radixmux_disk_store_chunks", GaugeMetricFamily, "KV chunk files", "store_chunks"),
    ("radixmux_disk_capacity_bytes", GaugeMetricFamily, "--kv-disk-bytes", "capacity_bytes"),
    ("radixmux_disk_written_bytes", CounterMetricFamily, "Bytes saved", "bytes_written"),
    ("radixmux_disk_read_bytes", CounterMetricFamily, "Bytes loaded", "bytes_read"),
    ("radixmux_disk_chunks_written", CounterMetricFamily, "Chunks saved", "chunks_written"),
    (
        "radixmux_disk_chunks_dropped",
        CounterMetricFamily,
        "Corrupt, truncated or mismatched chunk files deleted instead of used",
        "chunks_dropped",
    ),
    (
        "radixmux_disk_write_errors",
        CounterMetricFamily,
        "Chunks a save could not write",
        "write_errors",
    ),
    ("radixmux_disk_loads", CounterMetricFamily, "Requests that loaded KV from disk", "loads"),
    ("radixmux_disk_chunks_loaded", CounterMetricFamily, "Chunks loads asked for", "chunks_loaded"),
    (
        "radixmux_disk_chunks_shared",
        CounterMetricFamily,
        "Chunks loaded that another instance wrote (--kv-disk-shared)",
        "chunks_shared",
    ),
    (
        "radixmux_disk_load_seconds",
        CounterMetricFamily,
        "Seconds from a load's start to its KV in memory, summed",
        "load_seconds",
    ),
    ("radixmux_disk_load_p50_seconds", GaugeMetricFamily, "Median load (last 1,024)", "load_p50_s"),
    ("radixmux_disk_load_p99_seconds", GaugeMetricFamily, "p99 load (last 1,024)", "load_p99_s"),
]


def _layer_group_metrics(stats: SchedulerStats) -> Iterator[Metric]:
    """Lower layer groups of models cut for layer sharing (the default)."""
    labels = [*LABELS, "layers"]
    cached = GaugeMetricFamily(
        "radixmux_layer_group_cached_tokens",
        "Tokens of a lower layer group's K/V the cache holds (once for every model sharing it)",
        labels=labels,
    )
    recomputed = CounterMetricFamily(
        "radixmux_layer_group_recomputed_tokens",
        "Prompt tokens a lower layer group held cached but the model's upper layers did not "
        "(recomputed)",
        labels=labels,
    )
    reused = CounterMetricFamily(
        "radixmux_layer_group_reused_tokens",
        "Prompt tokens a lower layer group held cached past the full hit and served "
        "(a partial hit: only the layers above were computed)",
        labels=labels,
    )
    for g in stats.layer_groups:
        key = [*model_labels(g.model), f"{g.start}-{g.end}"]
        cached.add_metric(key, float(g.cached_tokens))
        recomputed.add_metric(key, float(g.tokens_recomputed))
        reused.add_metric(key, float(g.tokens_reused))
    yield cached
    yield recomputed
    yield reused


def _disk_metrics(stats: SchedulerStats) -> Iterator[Metric]:
    disk: DiskTierStats | None = stats.disk
    assert disk is not None
    for name, family, doc, key in _DISK:
        metric = family(name, doc)
        metric.add_metric([], float(getattr(disk, key)))
        yield metric
    saved = CounterMetricFamily(
        "radixmux_disk_chunks_saved",
        "Chunks saved, by why: capacity (an eviction), unload, write_through, shutdown",
        labels=["reason"],
    )
    for reason, count in sorted(disk.chunks_saved.items()):
        saved.add_metric([reason], float(count))
    yield saved
    loaded = _counter("radixmux_disk_tokens_loaded", "Prompt tokens loaded from disk, not computed")
    rate = _gauge(
        "radixmux_disk_hit_rate", "Prompt tokens loaded from disk / prompt tokens looked up"
    )
    for m in stats.models:
        tokens = disk.tokens_loaded.get(m.name, 0)
        loaded.add_metric([m.name], float(tokens))
        rate.add_metric([m.name], tokens / m.tokens_queried if m.tokens_queried else 0.0)
    yield loaded
    yield rate
