"""The scheduler's tree cost against mini-sglang's radix cache, on one trace.

Replays one seeded, one-model trace of requests (shared system prompts,
single questions and multi-turn chats, built by ``bench_radix.TraceBuilder``)
through two prefix caches over the same KV capacity in tokens, so both evict
under the same pressure:

``radixmux``
    ``RadixCache`` with one model over a ``KVAllocator``: ``match``, ``lock``,
    ``alloc`` (``evict_for`` when it fails), ``insert``, ``unlock``.
``mini-sglang``
    mini-sglang's own ``RadixPrefixCache`` (``minisgl.kvcache.radix_cache``)
    under its own ``CacheManager`` free list (``minisgl.scheduler.cache``), run
    from the peer install (``python -m bench.peers install mini-sglang
    --source PATH``), unmodified: ``match_prefix`` (+ ``get_matched_indices``
    when something matched, as its prefill does), ``lock_handle``,
    ``CacheManager._allocate`` (which calls ``evict``), ``insert_prefix``,
    ``lock_handle(unlock=True)``, ``CacheManager._free`` of the duplicate
    slots (what its ``cache_req`` does for a finished request).

Per request both arms query the same prompt tokens and then cache the prompt
plus its reply (the next chat turn re-sends it). Every call is timed on its
own (``perf_counter_ns``). The arms alternate, fresh caches each time, for
several rounds in one process; the figures are medians over rounds.

What differs by design, not by the bench: radixmux's ``insert`` frees the
duplicate slots and its ``evict_for`` frees into the allocator inside the
call, while mini-sglang's caller does both (``_free``, ``_allocate``): the
"tree" total counts the tree calls as each project draws them
(match, lock, evict, insert, unlock), the "tree+alloc" total adds each
side's allocator work (radixmux ``alloc``; mini-sglang ``alloc`` and ``free``).
mini-sglang's LRU clock is ``time.monotonic_ns`` and a match that ends inside
an edge leaves the split node's time as it was; radixmux's clock is a tick
per call and a match refreshes its whole path, so hit rates may differ a little.

Usage::

    .venv/bin/python -m bench.bench_radix --peer mini-sglang [--quick] [--rounds N]
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from bench import peers
from bench.bench_radix import (
    BLOCK_BYTES,
    MODELS,
    Request,
    Timings,
    TraceBuilder,
    TraceConfig,
    log,
    make_cache,
    slots_per_block,
)
from radixmux.memory.radix_cache import RadixCache
from radixmux.memory.radix_diagnostics import check_invariants

MODEL = MODELS[2]  # smol-math: one model, one pool (mini-sglang's tree is one model's)
TREE_OPS = ("match", "lock", "evict", "insert", "unlock")
ALLOC_OPS = ("alloc", "free")
perf = time.perf_counter_ns


@dataclass(frozen=True)
class PeerConfig:
    """The trace, the KV capacity both arms get, and how many alternating rounds."""

    trace: TraceConfig
    capacity_blocks: int  # 2 MiB blocks of SmolLM2 KV: 91 tokens each
    rounds: int

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * slots_per_block(MODEL.layout, 1)

    @staticmethod
    def full(seed: int = 0, rounds: int = 5) -> PeerConfig:
        """609 requests (seed 0) over ~36k tokens of KV."""
        trace = TraceConfig(seed=seed, system_prompts=8, questions=348, chats=50)
        return PeerConfig(trace=trace, capacity_blocks=400, rounds=rounds)

    @staticmethod
    def quick(seed: int = 0, rounds: int = 2) -> PeerConfig:
        """About 110 requests over ~7k tokens of KV (a few seconds)."""
        trace = TraceConfig(seed=seed, system_prompts=4, questions=60, chats=10)
        return PeerConfig(trace=trace, capacity_blocks=80, rounds=rounds)


class _OneModelTrace(TraceBuilder):
    """``TraceBuilder`` with every session on ``MODEL`` (a family of one model)."""

    def family(self) -> str:
        return MODEL.name


def one_model_trace(cfg: TraceConfig) -> list[Request]:
    """The seeded trace, every request for ``MODEL``."""
    return _OneModelTrace(cfg).build()


# ---- one replay --------------------------------------------------------------


@dataclass
class ArmRun:
    """One replay of the trace through one arm."""

    arm: str
    served: int = 0
    rejected: int = 0
    queried: int = 0  # prompt tokens matched against
    matched: int = 0
    evicted_tokens: int = 0
    adopted_tokens: int = 0  # tokens inserts added to the tree (not cached before)
    cached_at_end: int = 0  # tokens the tree holds after the last request
    matched_per_request: list[int] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.matched / self.queried if self.queried else 0.0

    def calls(self, ops: Sequence[str]) -> int:
        return sum(len(self.timings.ns.get(op, ())) for op in ops)

    def total_ns(self, ops: Sequence[str]) -> int:
        return sum(sum(self.timings.ns.get(op, ())) for op in ops)

    def p50_us(self, op: str) -> float:
        ns = self.timings.ns.get(op)
        return float(np.median(ns)) / 1e3 if ns else 0.0


class RadixmuxArm:
    """radixmux's ``RadixCache`` over a one-model arena of ``capacity_blocks`` blocks."""

    name = "radixmux"

    def __init__(self, capacity_blocks: int) -> None:
        self.cache: RadixCache = make_cache([MODEL], capacity_blocks, 1, "lru")
        self.pool = self.cache.pool_of(MODEL.name)

    def serve(self, req: Request, run: ArmRun) -> None:
        """Match, lock, allocate (evicting for room), insert, unlock."""
        cache, t = self.cache, run.timings
        t0 = perf()
        m = cache.match(MODEL.name, req.tokens[: req.prompt_len])
        t.add("match", perf() - t0, req.prompt_len)
        run.matched_per_request.append(m.length)
        run.queried += req.prompt_len
        run.matched += m.length
        t0 = perf()
        cache.lock(m.handle)
        t.add("lock", perf() - t0, m.length)
        need = len(req.tokens) - m.length
        t0 = perf()
        new = cache.allocator.alloc(self.pool, need)
        t.add("alloc", perf() - t0, need)
        if new is None:
            before = cache.stats().evicted_tokens["capacity"]
            t0 = perf()
            ok = cache.evict_for(MODEL.name, need)
            t.add("evict", perf() - t0, cache.stats().evicted_tokens["capacity"] - before)
            if ok:
                t0 = perf()
                new = cache.allocator.alloc(self.pool, need)
                t.add("alloc", perf() - t0, need)
        if new is None:
            cache.unlock(m.handle)
            run.rejected += 1
            return
        slots = np.concatenate([m.slots, new])
        t0 = perf()
        cached = cache.insert(MODEL.name, req.tokens, slots, prefix=m.handle)
        t.add("insert", perf() - t0, len(req.tokens))
        run.adopted_tokens += len(req.tokens) - cached
        t0 = perf()
        cache.unlock(m.handle)
        t.add("unlock", perf() - t0, m.length)
        run.served += 1

    def finish(self, run: ArmRun) -> None:
        """Check the tree's invariants (untimed) and take its eviction count."""
        check_invariants(self.cache, held={})
        run.evicted_tokens = self.cache.stats().evicted_tokens["capacity"]
        run.cached_at_end = self.cache.cached_tokens(MODEL.name)


class MinisglArm:
    """mini-sglang's ``RadixPrefixCache`` under its ``CacheManager``'s free list."""

    name = "mini-sglang"

    def __init__(self, mods: MinisglModules, capacity_tokens: int, inputs: TorchInputs) -> None:
        torch = mods.torch
        self.torch = torch
        self.inputs = inputs
        self.capacity = capacity_tokens
        # page_table is only read for its device (allocate_paged, which writes
        # it, is not used: the bench hands out slots itself through _allocate).
        table = torch.zeros((1, 1), dtype=torch.int32)
        self.manager = mods.CacheManager(capacity_tokens, 1, table, "radix")
        self.cache = self.manager.prefix_cache
        self.empty = torch.zeros(0, dtype=torch.int32)
        self._run: ArmRun | None = None
        evict = self.cache.evict

        def timed_evict(size: int) -> Any:
            # The only instrumentation: _allocate calls evict itself, so the
            # instance's bound method is wrapped to time that call alone.
            t0 = perf()
            out = evict(size)
            elapsed = perf() - t0
            assert self._run is not None
            self._run.timings.add("evict", elapsed, len(out))
            self._run.evicted_tokens += len(out)
            self._evict_ns += elapsed
            return out

        self.cache.evict = timed_evict
        self._evict_ns = 0

    def serve(self, req: Request, run: ArmRun) -> None:
        """One request as mini-sglang's scheduler admits and finishes it."""
        self._run = run
        cache, manager, t = self.cache, self.manager, run.timings
        prompt, tokens = self.inputs[id(req)]
        t0 = perf()
        handle = cache.match_prefix(prompt).cuda_handle
        # Its prefill reads the matched slots only when something matched.
        matched = handle.get_matched_indices() if handle.cached_len else self.empty
        t.add("match", perf() - t0, req.prompt_len)
        run.matched_per_request.append(handle.cached_len)
        run.queried += req.prompt_len
        run.matched += handle.cached_len
        need = len(tokens) - handle.cached_len
        if need > manager.available_size:  # its prefill adder's admission check
            run.rejected += 1
            return
        t0 = perf()
        cache.lock_handle(handle)
        t.add("lock", perf() - t0, handle.cached_len)
        self._evict_ns = 0
        t0 = perf()
        new = manager._allocate(need)
        t.add("alloc", perf() - t0 - self._evict_ns, need)
        indices = self.torch.cat([matched, new])
        t0 = perf()
        cached_len, new_handle = cache.insert_prefix(tokens, indices)
        t.add("insert", perf() - t0, len(tokens))
        run.adopted_tokens += new_handle.cached_len - cached_len
        t0 = perf()
        cache.lock_handle(handle, unlock=True)
        t.add("unlock", perf() - t0, handle.cached_len)
        t0 = perf()
        # cache_req(finished=True): the slots the tree had already, then the
        # tail past the last whole page (none at page size 1).
        manager._free(indices[handle.cached_len : cached_len])
        manager._free(indices[new_handle.cached_len :])
        t.add("free", perf() - t0, cached_len - handle.cached_len)
        run.served += 1

    def finish(self, run: ArmRun) -> None:
        """Its own integrity check: free slots + cached tokens == capacity, nothing locked."""
        self.manager.check_integrity()
        info = self.cache.size_info
        assert info.protected_size == 0, f"{info.protected_size} tokens still locked"
        assert len(self.manager.free_slots) + info.total_size == self.capacity
        run.cached_at_end = info.total_size
        self._run = None


def replay(arm: RadixmuxArm | MinisglArm, trace: Sequence[Request]) -> ArmRun:
    """Every request of ``trace`` through ``arm``; checks the cache afterwards (untimed)."""
    run = ArmRun(arm.name)
    gc.collect()
    start = time.perf_counter()
    for req in trace:
        arm.serve(req, run)
    run.wall_s = time.perf_counter() - start
    arm.finish(run)
    return run


# ---- mini-sglang -------------------------------------------------------------


@dataclass
class MinisglModules:
    """mini-sglang's modules the arm uses, and how they were made importable."""

    torch: ModuleType
    CacheManager: type
    commit: str
    source: str
    compare_key: str  # what its fast_compare_key runs


def load_minisgl() -> MinisglModules:
    """Import mini-sglang from the peer install; PeerUnavailable if it is not there.

    Puts its package and its extra dependencies on ``sys.path``, points
    tvm-ffi's kernel cache at the build the install made, and sets its global
    context (page size 1) the way its engine does at start-up. Nothing of
    mini-sglang is replaced.
    """
    peer = peers.minisgl_paths()
    for path in reversed(peer.sys_path):
        if path not in sys.path:
            sys.path.insert(0, path) if path == str(peer.src) else sys.path.append(path)
    os.environ.setdefault("TVM_FFI_CACHE_DIR", str(peer.build))
    import torch
    from minisgl import core
    from minisgl.kernel import fast_compare_key
    from minisgl.scheduler.cache import CacheManager

    if core._GLOBAL_CTX is None:
        core.set_global_ctx(core.Context(page_size=1))
    elif core.get_global_ctx().page_size != 1:
        raise peers.PeerUnavailable("mini-sglang's global context has another page size")
    probe = torch.arange(8, dtype=torch.int32)
    assert fast_compare_key(probe, torch.arange(8, dtype=torch.int32)) == 8
    return MinisglModules(
        torch,
        CacheManager,
        peer.commit,
        peer.source,
        "its C++ fast_compare_key (std::mismatch), built by tvm-ffi with the system c++ -O3",
    )


# id(request) -> (prompt, prompt + reply) as int32 CPU tensors.
TorchInputs = dict[int, tuple[Any, Any]]


def torch_inputs(trace: Sequence[Request], torch: ModuleType) -> TorchInputs:
    """Each request's tokens as the int32 CPU tensors mini-sglang's cache takes
    (sharing the arrays' memory), made once before any timing."""
    out = {}
    for req in trace:
        tokens = torch.from_numpy(req.tokens)
        out[id(req)] = (tokens[: req.prompt_len], tokens)
    return out


# ---- rounds and summary --------------------------------------------------------


@dataclass
class ArmSummary:
    """One arm's figures: medians over rounds."""

    arm: str
    requests: int
    served: int
    rejected: int
    hit_rate: float
    evicted_tokens: int
    adopted_tokens: int  # inserted tokens the tree did not hold yet
    cached_at_end: int  # so adopted - cached_at_end must equal evicted_tokens
    evict_calls: int
    p50_us: dict[str, float]  # per op: median over rounds of the round's median
    total_ms: dict[str, float]  # per op: median over rounds of the round's summed time
    tree_calls: int
    tree_ms: float  # summed time of every tree call (median over rounds)
    tree_ops_per_s: float
    tree_requests_per_s: float
    alloc_ms: float  # the allocator work beside it (see the module doc)
    tree_alloc_requests_per_s: float
    wall_s: float

    @staticmethod
    def of(runs: Sequence[ArmRun], requests: int) -> ArmSummary:
        first = runs[0]
        ops = [op for op in (*TREE_OPS, *ALLOC_OPS) if op in first.timings.ns]
        tree_ns = [r.total_ns(TREE_OPS) for r in runs]
        alloc_ns = [r.total_ns(ALLOC_OPS) for r in runs]
        both_ns = [a + b for a, b in zip(tree_ns, alloc_ns, strict=True)]
        calls = first.calls(TREE_OPS)
        return ArmSummary(
            arm=first.arm,
            requests=requests,
            served=first.served,
            rejected=first.rejected,
            hit_rate=first.hit_rate,
            evicted_tokens=first.evicted_tokens,
            adopted_tokens=first.adopted_tokens,
            cached_at_end=first.cached_at_end,
            evict_calls=len(first.timings.ns.get("evict", ())),
            p50_us={op: statistics.median(r.p50_us(op) for r in runs) for op in ops},
            total_ms={op: statistics.median(r.total_ns([op]) for r in runs) / 1e6 for op in ops},
            tree_calls=calls,
            tree_ms=statistics.median(tree_ns) / 1e6,
            tree_ops_per_s=statistics.median(calls / (ns / 1e9) for ns in tree_ns),
            tree_requests_per_s=statistics.median(requests / (ns / 1e9) for ns in tree_ns),
            alloc_ms=statistics.median(alloc_ns) / 1e6,
            tree_alloc_requests_per_s=statistics.median(requests / (ns / 1e9) for ns in both_ns),
            wall_s=statistics.median(r.wall_s for r in runs),
        )


@dataclass
class PeerResult:
    """Everything the comparison writes to its JSON file."""

    config: dict
    environment: dict
    minisgl: dict
    trace: dict
    arms: list[ArmSummary]
    # Per round, radixmux's figure over mini-sglang's (tree ops/s, tree+alloc requests/s).
    round_ratios: list[dict[str, float]]
    same_match_lengths: float  # fraction of requests both arms matched equally (round 1)

    def arm(self, name: str) -> ArmSummary:
        return next(a for a in self.arms if a.arm == name)

    @property
    def ratio_ops(self) -> float:
        """radixmux's whole-trace tree ops/s over mini-sglang's (median over rounds)."""
        return statistics.median(r["tree_ops_per_s"] for r in self.round_ratios)


def check_runs(runs: dict[str, list[ArmRun]]) -> None:
    """Every round of an arm made the same decisions (the trace is deterministic),
    and raise AssertionError otherwise: a cache whose decisions drift between
    fresh replays is measuring something else."""
    for name, arm_runs in runs.items():
        first = arm_runs[0]
        for r in arm_runs[1:]:
            same = (r.served, r.matched, r.evicted_tokens) == (
                first.served,
                first.matched,
                first.evicted_tokens,
            )
            assert same, f"{name}: round decisions differ ({r.matched} vs {first.matched})"


def run_peer(cfg: PeerConfig, mode: str) -> PeerResult:
    """Alternate the arms over ``cfg.rounds`` rounds on one trace; summarise."""
    mods = load_minisgl()
    trace = one_model_trace(cfg.trace)
    inputs = torch_inputs(trace, mods.torch)
    log(
        f"[peer] {len(trace)} requests, capacity {cfg.capacity_tokens:,} tokens "
        f"({cfg.capacity_blocks} blocks), {cfg.rounds} rounds; mini-sglang {mods.commit[:12]}"
    )
    makers: dict[str, Callable[[], RadixmuxArm | MinisglArm]] = {
        "radixmux": lambda: RadixmuxArm(cfg.capacity_blocks),
        "mini-sglang": lambda: MinisglArm(mods, cfg.capacity_tokens, inputs),
    }
    runs: dict[str, list[ArmRun]] = {name: [] for name in makers}
    order = list(makers)
    for i in range(cfg.rounds):
        for name in order if i % 2 == 0 else order[::-1]:
            runs[name].append(replay(makers[name](), trace))
        log(
            f"  round {i + 1}/{cfg.rounds}: "
            + ", ".join(f"{n} tree {runs[n][-1].total_ns(TREE_OPS) / 1e6:.1f} ms" for n in order)
        )
    check_runs(runs)
    ratios = []
    for rx, ms in zip(runs["radixmux"], runs["mini-sglang"], strict=True):
        ratios.append(
            {
                "tree_ops_per_s": (rx.calls(TREE_OPS) / rx.total_ns(TREE_OPS))
                / (ms.calls(TREE_OPS) / ms.total_ns(TREE_OPS)),
                "tree_requests_per_s": ms.total_ns(TREE_OPS) / rx.total_ns(TREE_OPS),
                "tree_alloc_requests_per_s": (ms.total_ns(TREE_OPS) + ms.total_ns(ALLOC_OPS))
                / (rx.total_ns(TREE_OPS) + rx.total_ns(ALLOC_OPS)),
            }
        )
    a, b = runs["radixmux"][0].matched_per_request, runs["mini-sglang"][0].matched_per_request
    same = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
    env = {
        "mode": mode,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": mods.torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        # The cores may be shared: the load says how much (medians absorb some).
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    minisgl = {
        "commit": mods.commit,
        "source": mods.source,
        "compare_key": mods.compare_key,
        "substituted": "nothing: its radix cache, CacheManager and kernel run as published",
        "set_by_the_bench": "its global Context(page_size=1), as its engine sets at start-up",
    }
    summary = {
        "requests": len(trace),
        "prompt_tokens": sum(r.prompt_len for r in trace),
        "total_tokens": sum(len(r.tokens) for r in trace),
        "max_request_tokens": max(len(r.tokens) for r in trace),
        "capacity_tokens": cfg.capacity_tokens,
        "block_bytes": BLOCK_BYTES,
    }
    arms = [ArmSummary.of(runs[name], len(trace)) for name in order]
    return PeerResult(asdict(cfg), env, minisgl, summary, arms, ratios, same)


# ---- reporting -----------------------------------------------------------------


def format_peer(result: PeerResult) -> str:
    """The human-readable comparison."""
    tr, cfg, ms = result.trace, result.config, result.minisgl
    rx, peer = result.arm("radixmux"), result.arm("mini-sglang")
    lines = [
        f"radix tree cost, radixmux vs mini-sglang ({result.environment['mode']}, seed "
        f"{cfg['trace']['seed']}, {cfg['rounds']} alternating rounds, medians; "
        f"torch {result.environment['torch']}, numpy {result.environment['numpy']}; "
        f"load average {result.environment['load_average'][0]} on "
        f"{result.environment['cpus']} cores)",
        f"trace: {tr['requests']} requests of one model, {tr['prompt_tokens']:,} prompt tokens, "
        f"{tr['total_tokens']:,} with replies, longest {tr['max_request_tokens']:,}; "
        f"KV capacity {tr['capacity_tokens']:,} tokens in both",
        f"mini-sglang {ms['commit'][:12]} from {ms['source']}: key compare = {ms['compare_key']}; "
        f"substituted: {ms['substituted']}; set by the bench: {ms['set_by_the_bench']}",
        "",
    ]
    ops = [*TREE_OPS, *ALLOC_OPS]
    head = f"{'per op':<22}" + "".join(f"{op:>10}" for op in ops)
    lines += [head, "-" * len(head)]
    for label, attr in (("p50 us", "p50_us"), ("summed ms", "total_ms")):
        for arm in result.arms:
            figures = getattr(arm, attr)
            cells = [f"{figures[op]:>10.1f}" if op in figures else f"{'-':>10}" for op in ops]
            lines.append(f"{arm.arm + ' ' + label:<22}" + "".join(cells))
    lines.append("")
    head = (
        f"{'arm':<13}{'served':>7}{'rej':>5}{'hit rate':>10}{'evicted':>10}{'evicts':>8}"
        f"{'tree calls':>11}{'tree ms':>9}{'tree ops/s':>12}{'req/s tree':>12}"
        f"{'alloc ms':>10}{'req/s t+a':>11}"
    )
    lines += [head, "-" * len(head)]
    for a in result.arms:
        lines.append(
            f"{a.arm:<13}{a.served:>7}{a.rejected:>5}{a.hit_rate:>10.4f}{a.evicted_tokens:>10,}"
            f"{a.evict_calls:>8}{a.tree_calls:>11,}{a.tree_ms:>9.1f}{a.tree_ops_per_s:>12,.0f}"
            f"{a.tree_requests_per_s:>12,.0f}{a.alloc_ms:>10.1f}"
            f"{a.tree_alloc_requests_per_s:>11,.0f}"
        )
    med = {k: statistics.median(r[k] for r in result.round_ratios) for k in result.round_ratios[0]}
    spread = ", ".join(f"{r['tree_ops_per_s']:.2f}" for r in result.round_ratios)
    lines += [
        "",
        f"radixmux / mini-sglang: tree ops/s {med['tree_ops_per_s']:.2f}x (rounds: {spread}), "
        f"requests per second of tree time {med['tree_requests_per_s']:.2f}x, "
        f"with allocator work {med['tree_alloc_requests_per_s']:.2f}x; "
        f"evict p50 {rx.p50_us.get('evict', 0):.0f} vs {peer.p50_us.get('evict', 0):.0f} us",
        f"same match length on {result.same_match_lengths:.1%} of requests; hit rate "
        f"{rx.hit_rate:.4f} vs {peer.hit_rate:.4f}, evicted {rx.evicted_tokens:,} vs "
        f"{peer.evicted_tokens:,} tokens",
    ]
    return "\n".join(lines)


def write_peer(result: PeerResult, path: Path) -> None:
    """The result as JSON (parents made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out = asdict(result)
    out["ratio_tree_ops_per_s"] = result.ratio_ops
    path.write_text(json.dumps(out, indent=2) + "\n")


def main(
    quick: bool, seed: int, rounds: int | None, out: Path, capacity_blocks: int | None = None
) -> int:
    """``bench_radix --peer mini-sglang``: run, print, write; 2 if the peer is missing."""
    cfg = PeerConfig.quick(seed) if quick else PeerConfig.full(seed)
    if rounds:
        cfg = replace(cfg, rounds=rounds)
    if capacity_blocks:
        cfg = replace(cfg, capacity_blocks=capacity_blocks)
    try:
        result = run_peer(cfg, "quick" if quick else "full")
    except peers.PeerUnavailable as exc:
        print(f"mini-sglang: UNAVAILABLE: {exc}", file=sys.stderr)
        return 2
    print(format_peer(result))
    write_peer(result, out)
    print(f"\nwrote {out}")
    return 0
