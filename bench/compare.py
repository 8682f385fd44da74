"""Side-by-side serving comparison on one machine, in one run, against the issue's targets.

Each configuration starts its own server (radixmux through ``launch.py``, or a
peer through ``bench/peers.py``), waits for ``/health``, warms up with a few
unrelated requests, measures one workload with ``bench_serving.run_benchmark``
and stops the server (SIGINT, then wait) before the next starts, so no two
configurations share the cores.

Modes:
  1. radixmux default vs ``--disable-radix-cache`` on generated-shared-prefix
     (target: cached >= 5x no-cache throughput);
  2. ``--kv-partition unified`` vs ``static`` at the same ``--kv-cache-bytes`` on the
     multi-model shift, the arena small enough that memory is contended
     (target: unified >= 1.3x static throughput and a higher hit rate);
  3. ``--schedule-policy lpm`` vs ``fcfs`` on shuffled shared-prefix load (lpm >= fcfs);
  4. peers (vLLM CPU, llama.cpp, plain transformers) on mode 1's workload
     (radixmux >= every peer in output tokens/s and TTFT p50); a peer that cannot
     be started is reported with the reason;
  5. two models: one radixmux server vs two vLLM servers, one per model, each
     with half of mode 2's KV bytes and one core, on mode 2's workload
     (target: radixmux's throughput higher at the same total KV memory);
  6. multi-turn chat: radixmux with and without the cache, and vLLM (no target
     in the issue; shown for the record; not in --all);
  7. many tenants: ``--tenants N`` models (e.g. fine-tunes from
     ``bench/make_finetunes.py``) on the multi-tenant workload (per-model and
     shared system prompts, the hot model moving phase by phase), ``--kv-partition
     unified`` vs ``static`` on one fixed arena well below the working set
     (issue 34's target: unified >= 1.3x static throughput; not in --all).

Writes one JSON with every configuration and a PNG (throughput and latency per
configuration) under ``bench/results/``, and prints the tables.

    .venv/bin/python -m bench.compare --modes 1 2 3 [--quick] [--models A B]
    .venv/bin/python -m bench.compare --modes 2 5 --peers vllm --models smollm2 gemma3-270m
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.bench_serving import (
    RESULTS_DIR,
    BenchConfig,
    BenchResult,
    format_table,
    run_benchmark,
    write_json,
)
from bench.server_process import ServerFailed, ServerProcess, free_port
from bench.verdicts import verdict_line, verdict_of
from bench.workloads import GSPParams, MultiTurnParams, ShiftParams, TenantParams

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_PEERS = ("vllm", "llamacpp", "transformers")
START_TIMEOUT_S = 900.0  # a first start may convert GGUF weights


# ---- sizes ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """Every workload size of a comparison; ``QUICK`` is the smoke test's."""

    gsp: GSPParams
    shift: ShiftParams
    shift_concurrency: int
    multi_turn: MultiTurnParams
    # Arena of mode 2, in tokens of the first model: the hot model's prefixes
    # plus its running requests fit in it, but not in half of it.
    shift_kv_tokens: int
    warmup: int
    # Mode 7: its arena in tokens of the first model per tenant; each tenant's
    # working set (3 private + 1 shared prompt of 384 tokens, plus its running
    # requests) is about twice that, so the budget is well below the working set.
    tenant: TenantParams = field(default_factory=TenantParams)
    tenant_concurrency: int = 8
    tenant_kv_tokens: int = 896


FULL = Sizes(
    gsp=GSPParams(8, 8, 512, 32, 16),
    shift=ShiftParams(48, (0.8, 0.2), 6, 384, 32, 16),
    shift_concurrency=8,
    multi_turn=MultiTurnParams(16, 4, 4, 256, 32, 16),
    shift_kv_tokens=3584,
    warmup=2,
)
QUICK = Sizes(
    gsp=GSPParams(2, 4, 96, 8, 4),
    shift=ShiftParams(12, (0.8, 0.2), 2, 64, 8, 4),
    shift_concurrency=4,
    multi_turn=MultiTurnParams(2, 2, 1, 32, 8, 4),
    shift_kv_tokens=2048,
    warmup=1,
    tenant=TenantParams(24, 2, 1.5, 2, 1, 0.3, 96, 8, 4),
    tenant_concurrency=4,
    tenant_kv_tokens=256,
)


# ---- results --------------------------------------------------------------------------
@dataclass
class ConfigResult:
    """One configuration: its figures, or why it could not run."""

    label: str
    system: str  # "radixmux" or a peer's name
    server_args: list[str]
    result: BenchResult | None = None
    unavailable: str | None = None


@dataclass
class Target:
    """One of the issue's targets; ``passed`` None when it could not be measured."""

    mode: int
    name: str
    measured: str
    passed: bool | None

    @property
    def verdict(self) -> str:
        return verdict_of(self.passed)


@dataclass
class ModeReport:
    mode: int
    title: str
    configs: list[ConfigResult] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)


# ---- radixmux server ------------------------------------------------------------------
class RadixmuxServer(ServerProcess):
    """``launch.py`` on a free port with ``args``; logs to ``log_path``."""

    def __init__(self, args: Sequence[str], log_path: Path) -> None:
        port = free_port()
        cmd = [sys.executable, str(ROOT / "launch.py"), "--port", str(port), *args]
        super().__init__(cmd, port, log_path)


@contextlib.contextmanager
def radixmux(args: Sequence[str], log_path: Path) -> Iterator[RadixmuxServer]:
    server = RadixmuxServer(args, log_path)
    try:
        server.wait_healthy(START_TIMEOUT_S)
        yield server
    finally:
        server.stop()


# ---- running configurations -----------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """What every configuration of a comparison shares."""

    sources: tuple[str, ...]  # model sources (short names or folders); mode 2 uses two
    dtype: str
    sizes: Sizes
    seed: int
    logs: Path
    extra_args: tuple[str, ...] = ()
    progress: bool = True

    def served_name(self, i: int) -> str:
        return Path(self.sources[i].rstrip("/")).name

    def model_flags(self, n: int) -> list[str]:
        out: list[str] = []
        for i in range(n):
            out += ["--model", f"{self.sources[i]},name={self.served_name(i)}"]
        return out


def run_radixmux(
    setup: Setup, label: str, n_models: int, flags: Sequence[str], config: BenchConfig
) -> ConfigResult:
    """Start radixmux with ``flags``, run ``config`` against it, stop it."""
    args = [*setup.model_flags(n_models), "--dtype", setup.dtype, *setup.extra_args, *flags]
    out = ConfigResult(label, "radixmux", args)
    log = setup.logs / f"{label.replace(' ', '_').replace('/', '_')}.log"
    print(f"[compare] {label}: starting radixmux {' '.join(args)}", file=sys.stderr)
    try:
        with radixmux(args, log) as server:
            cfg = dataclasses.replace(config, base_url=server.base_url, label=label)
            out.result = asyncio.run(run_benchmark(cfg))
    except ServerFailed as exc:
        out.unavailable = f"radixmux failed to start: {exc}"
    return out


def gsp_config(setup: Setup, shuffle: bool = False) -> BenchConfig:
    return BenchConfig(
        base_url="",
        models=[setup.served_name(0)],
        workload="generated-shared-prefix",
        tokenizer=setup.sources[0],
        seed=setup.seed,
        gsp=dataclasses.replace(setup.sizes.gsp, shuffle=shuffle),
        warmup_requests=setup.sizes.warmup,
        progress=setup.progress,
    )


def _ratio(a: BenchResult | None, b: BenchResult | None, key: str = "output_throughput") -> float:
    if a is None or b is None or getattr(b, key) <= 0:
        return math.nan
    return getattr(a, key) / getattr(b, key)


def _ratio_target(
    mode: int, name: str, a: ConfigResult, b: ConfigResult, need: float, detail: str = ""
) -> Target:
    """``a``'s output throughput over ``b``'s, PASS at ``need`` or more."""
    ratio = _ratio(a.result, b.result)
    detail = detail or f"hit {_hit(a.result)} vs {_hit(b.result)}"
    return Target(
        mode,
        name,
        f"{ratio:.2f}x ({_tps(a.result)} vs {_tps(b.result)} out tok/s; {detail})",
        _verdict(ratio >= need, a.result, b.result),
    )


def _hit(r: BenchResult | None) -> str:
    return "n/a" if r is None or r.cache_hit_rate is None else f"{r.cache_hit_rate:.1%}"


def _verdict(ok: bool, *results: BenchResult | None) -> bool | None:
    """None when a side did not run or had errors (a figure with errors proves nothing)."""
    if any(r is None or r.errors for r in results):
        return None
    return ok


def mode_cache(setup: Setup) -> ModeReport:
    """Mode 1: the radix cache vs none on generated-shared-prefix."""
    rep = ModeReport(1, "radix cache vs --disable-radix-cache (generated-shared-prefix)")
    labels = ("radixmux cache", "radixmux no-cache")
    cache_vs_no_cache(rep, setup, gsp_config(setup), labels, "cache >= 5x no-cache throughput", 5)
    return rep


def cache_vs_no_cache(
    rep: ModeReport,
    setup: Setup,
    cfg: BenchConfig,
    labels: tuple[str, str],
    target: str,
    need: float,
) -> ConfigResult:
    """Run ``cfg`` on radixmux with the cache and without, add both and their
    throughput ratio (PASS at ``need``) to ``rep``; returns the cached run."""
    on = run_radixmux(setup, labels[0], 1, [], cfg)
    off = run_radixmux(setup, labels[1], 1, ["--disable-radix-cache"], cfg)
    rep.configs += [on, off]
    rep.targets.append(_ratio_target(rep.mode, target, on, off, need))
    return on


def shift_kv_bytes(setup: Setup, tokens: int | None = None) -> int:
    """Mode 2's arena: ``shift_kv_tokens`` (or ``tokens``) of the first model, from its config."""
    from radixmux.model_runners.fetch import fetch

    src = Path(setup.sources[0])
    folder = src if src.is_dir() else fetch(setup.sources[0], progress=False)
    import json

    c = json.loads((folder / "config.json").read_text())
    c = c.get("text_config", c)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    per_token = (
        c["num_hidden_layers"] * 2 * kv_heads * head_dim * (2 if setup.dtype == "bfloat16" else 4)
    )
    return (setup.sizes.shift_kv_tokens if tokens is None else tokens) * per_token


def shift_config(setup: Setup) -> BenchConfig:
    """Modes 2 and 5: the multi-model shift over the first two models."""
    return BenchConfig(
        base_url="",
        models=[setup.served_name(0), setup.served_name(1)],
        workload="multi-model-shift",
        tokenizer=setup.sources[0],
        concurrency=setup.sizes.shift_concurrency,
        seed=setup.seed,
        shift=setup.sizes.shift,
        warmup_requests=2 * setup.sizes.warmup,
        progress=setup.progress,
    )


def shift_server_flags(kv: int) -> list[str]:
    """The contended arena of modes 2 and 5."""
    # Blocks small enough that a model's share is many blocks, not a handful.
    return ["--kv-cache-bytes", str(kv), "--kv-block-bytes", str(max(64 << 10, kv // 64))]


def run_unified(setup: Setup, kv: int) -> ConfigResult:
    """radixmux serving both models from one unified arena of ``kv`` bytes (modes 2, 5)."""
    flags = [*shift_server_flags(kv), "--kv-partition", "unified"]
    return run_radixmux(setup, "unified", 2, flags, shift_config(setup))


def mode_partition(setup: Setup) -> ModeReport:
    """Mode 2: one unified arena vs fixed halves, two models, shifting load."""
    rep = ModeReport(2, "--kv-partition unified vs static (multi-model shift, contended arena)")
    if len(setup.sources) < 2:
        rep.targets.append(Target(2, "unified >= 1.3x static", "needs two models", None))
        return rep
    kv = shift_kv_bytes(setup)
    cfg = shift_config(setup)
    base = shift_server_flags(kv)
    uni = run_unified(setup, kv)
    sta = run_radixmux(setup, "static", 2, [*base, "--kv-partition", "static"], cfg)
    rep.configs += [uni, sta]
    name = "unified >= 1.3x static throughput"
    rep.targets.append(_ratio_target(2, name, uni, sta, 1.3, f"arena {kv / 2**20:.0f} MiB"))
    hu = uni.result.cache_hit_rate if uni.result else None
    hs = sta.result.cache_hit_rate if sta.result else None
    rep.targets.append(
        Target(
            2,
            "unified hit rate > static",
            f"{_hit(uni.result)} vs {_hit(sta.result)}",
            None if hu is None or hs is None else _verdict(hu > hs, uni.result, sta.result),
        )
    )
    return rep


def tenant_config(setup: Setup, n: int) -> BenchConfig:
    """Mode 7: the multi-tenant workload over the first ``n`` models."""
    return BenchConfig(
        base_url="",
        models=[setup.served_name(i) for i in range(n)],
        workload="multi-tenant",
        tokenizer=setup.sources[0],
        concurrency=setup.sizes.tenant_concurrency,
        seed=setup.seed,
        tenant=setup.sizes.tenant,
        warmup_requests=n * setup.sizes.warmup,
        progress=setup.progress,
    )


def tenant_max_model_len(setup: Setup) -> int:
    """A vLLM context just long enough for the multi-tenant requests.

    vLLM refuses a KV cache smaller than one sequence of its context length, and
    mode 7's per-model share is small: the context must not ask for more than the
    workload needs (words are about one token each; the margin covers the
    "User:/Assistant:" framing and tokens that split).
    """
    t = setup.sizes.tenant
    return t.system_prompt_len + t.question_len + t.output_len + 64


def _median_config(runs: Sequence[ConfigResult]) -> ConfigResult:
    """The round with the median output throughput (the lower middle one of an even count)."""
    done = sorted((c for c in runs if c.result), key=lambda c: c.result.output_throughput)
    return done[(len(done) - 1) // 2] if done else runs[0]


def mode_tenants(
    setup: Setup,
    n: int,
    peers: ModuleType | None = None,
    why_not: str = "",
    rounds: int = 1,
    peer_kinds: Sequence[str] = (),
    sharing_arm: bool = True,
) -> ModeReport:
    """Mode 7: ``n`` tenants' models, one unified arena vs ``n`` fixed shares of it vs
    one peer server per model with a share each, every arm once per round, interleaved.

    The arena is ``tenant_kv_tokens`` of the first model per tenant, so 4 and 8
    tenants see the same share each and the same ratio of budget to working set.
    The unified arm runs with layer sharing (the default) and without, to separate
    what the shared arena and the shared lower layers each give (``sharing_arm``).
    """
    rep = ModeReport(7, f"{n} tenants: unified vs static arena vs one server per model")
    if len(setup.sources) < n:
        need = f"needs {n} models, got {len(setup.sources)}"
        rep.targets.append(Target(7, "unified >= 1.3x static", need, None))
        return rep
    kv = shift_kv_bytes(setup, setup.sizes.tenant_kv_tokens * n)
    cfg = tenant_config(setup, n)
    base = shift_server_flags(kv)
    arms: dict[str, Callable[[str], ConfigResult]] = {
        f"unified x{n}": lambda lb: run_radixmux(
            setup, lb, n, [*base, "--kv-partition", "unified"], cfg
        ),
        f"static x{n}": lambda lb: run_radixmux(
            setup, lb, n, [*base, "--kv-partition", "static"], cfg
        ),
    }
    if sharing_arm:
        arms[f"unified x{n} no layer sharing"] = lambda lb: run_radixmux(
            setup, lb, n, [*base, "--kv-partition", "unified", "--disable-layer-sharing"], cfg
        )
    for kind in peer_kinds:
        label = f"{kind} x{n} (KV and cores split)"

        def run_peers(lb: str, kind: str = kind) -> ConfigResult:
            out = ConfigResult(lb, kind, [f"--kv-cache-memory-bytes {kv // n}"] * n)
            if peers is None:
                out.unavailable = why_not
                return out
            return run_peer_per_model(
                setup, peers, kind, cfg, kv // n, out, tenant_max_model_len(setup)
            )

        arms[label] = run_peers
    runs: dict[str, list[ConfigResult]] = {label: [] for label in arms}
    for r in range(rounds):
        for label, run in arms.items():
            runs[label].append(run(label if rounds == 1 else f"{label} r{r + 1}"))
    for label in arms:
        rep.configs += runs[label]
    med = {label: _median_config(rs) for label, rs in runs.items()}
    uni = med[f"unified x{n}"]
    detail = f"arena {kv / 2**20:.0f} MiB, median of {rounds} round(s)"
    for label, need in [(f"static x{n}", 1.3), *[(k, 1.5) for k in arms if " (KV" in k]]:
        name = f"unified >= {need}x {label} throughput"
        rep.targets.append(_ratio_target(7, name, uni, med[label], need, detail))
        u99 = uni.result.ttft_ms.p99 if uni.result else None
        o99 = med[label].result.ttft_ms.p99 if med[label].result else None
        rep.targets.append(
            Target(
                7,
                f"unified TTFT p99 < {label}",
                f"{u99 or math.nan:.0f} vs {o99 or math.nan:.0f} ms; hit "
                f"{_hit(uni.result)} vs {_hit(med[label].result)}",
                None
                if u99 is None or o99 is None
                else _verdict(u99 < o99, uni.result, med[label].result),
            )
        )
    if sharing_arm:
        plain = med[f"unified x{n} no layer sharing"]
        name = "layer sharing on vs off (no goal)"
        rep.targets.append(_ratio_target(7, name, uni, plain, 0.0, detail))
    return rep


def mode_policy(setup: Setup) -> ModeReport:
    """Mode 3: longest-prefix-match vs first-come-first-served on shuffled shared prefixes."""
    rep = ModeReport(3, "--schedule-policy lpm vs fcfs (shuffled generated-shared-prefix)")
    cfg = gsp_config(setup, shuffle=True)
    lpm = run_radixmux(setup, "lpm", 1, ["--schedule-policy", "lpm"], cfg)
    fcfs = run_radixmux(setup, "fcfs", 1, ["--schedule-policy", "fcfs"], cfg)
    rep.configs += [lpm, fcfs]
    rep.targets.append(_ratio_target(3, "lpm >= fcfs throughput", lpm, fcfs, 1.0))
    return rep


def load_peers() -> tuple[ModuleType | None, str]:
    """``bench.peers`` or why not (a missing module is reported, never skipped)."""
    if not (ROOT / "bench" / "peers.py").exists():
        return None, "bench/peers.py not present"
    try:
        from bench import peers
    except Exception as exc:  # any import failure is a reason to report
        return None, f"bench/peers.py failed to import: {type(exc).__name__}: {exc}"
    return peers, ""


def mode_peers(
    setup: Setup,
    ours: ConfigResult | None,
    peers: ModuleType | None,
    why_not: str,
    kv_bytes: int = 1 << 30,
    only: Sequence[str] | None = None,
) -> ModeReport:
    """Mode 4: each peer on mode 1's workload; ``ours`` is radixmux's run of it (or None)."""
    rep = ModeReport(4, "peers on generated-shared-prefix (same model, prompts, output lengths)")
    cfg = gsp_config(setup)
    if ours is None:
        ours = run_radixmux(setup, "radixmux cache", 1, [], cfg)
    rep.configs.append(ours)
    kinds = tuple(getattr(peers, "PEERS", DEFAULT_PEERS)) if peers else DEFAULT_PEERS
    kinds = tuple(only) if only else kinds
    add_peers(rep, setup, ours, kinds, cfg, peers, why_not, kv_bytes)
    return rep


def add_peers(
    rep: ModeReport,
    setup: Setup,
    ours: ConfigResult,
    kinds: Sequence[str],
    cfg: BenchConfig,
    peers: ModuleType | None,
    why_not: str,
    kv_bytes: int,
) -> None:
    """Run each peer on ``cfg`` (or record why not) and its target against ``ours``."""
    for kind in kinds:
        out = ConfigResult(kind, kind, [])
        if peers is None:
            out.unavailable = why_not
        else:
            out = run_peer(setup, peers, kind, cfg, kv_bytes)
        rep.configs.append(out)
        rep.targets.append(peer_target(rep.mode, kind, ours, out))


def peer_target(mode: int, kind: str, ours: ConfigResult, peer: ConfigResult) -> Target:
    """radixmux at least as fast as ``peer`` in output tokens/s and TTFT p50."""
    name = f"radixmux >= {kind} out tok/s, TTFT p50"
    r, o = peer.result, ours.result
    if r is None:
        return Target(mode, name, f"unavailable: {peer.unavailable}", None)
    tps_ok = o is not None and o.output_throughput >= r.output_throughput
    ttft_ok = (
        o is not None
        and o.ttft_ms.p50 is not None
        and r.ttft_ms.p50 is not None
        and o.ttft_ms.p50 <= r.ttft_ms.p50
    )
    measured = f"{_tps(o)} vs {_tps(r)} out tok/s; TTFT p50 {_ms(o)} vs {_ms(r)} ms"
    return Target(mode, name, measured, _verdict(tps_ok and ttft_ok, o, r))


def multi_turn_config(setup: Setup) -> BenchConfig:
    """Mode 6: chats whose every turn resends the conversation so far."""
    return BenchConfig(
        base_url="",
        models=[setup.served_name(0)],
        workload="multi-turn",
        api="chat",
        tokenizer=setup.sources[0],
        concurrency=setup.sizes.multi_turn.num_conversations,
        seed=setup.seed,
        multi_turn=setup.sizes.multi_turn,
        warmup_requests=setup.sizes.warmup,
        progress=setup.progress,
    )


def mode_multi_turn(
    setup: Setup,
    peers: ModuleType | None,
    why_not: str,
    kv_bytes: int,
    only: Sequence[str] | None = None,
) -> ModeReport:
    """Mode 6 (no target in the issue; shown for the record): multi-turn chat,
    radixmux with and without the cache, and peers (default: vLLM)."""
    rep = ModeReport(6, "multi-turn chat (each turn resends the conversation)")
    cfg = multi_turn_config(setup)
    labels = ("radixmux chat", "radixmux chat no-cache")
    on = cache_vs_no_cache(rep, setup, cfg, labels, "chat: cache >= no-cache throughput", 1)
    add_peers(rep, setup, on, only or ("vllm",), cfg, peers, why_not, kv_bytes)
    return rep


def run_peer(
    setup: Setup, peers: ModuleType, kind: str, cfg: BenchConfig, kv_bytes: int
) -> ConfigResult:
    """Start one peer, run ``cfg`` against it, stop it; unavailability is recorded."""
    out = ConfigResult(kind, kind, [])
    print(f"[compare] {kind}: starting peer", file=sys.stderr)
    try:
        server = peers.start_peer(kind, setup.sources[0], free_port(), setup.dtype, kv_bytes)
    except peers.PeerUnavailable as exc:
        out.unavailable = str(exc) or type(exc).__name__
        return out
    except Exception as exc:  # a peer crashing on start is a finding, not a crash of ours
        out.unavailable = f"{type(exc).__name__}: {exc}"
        return out
    try:
        # Peers without a metrics API fall back to usage.cached_tokens or n/a.
        c = dataclasses.replace(
            cfg, base_url=server.base_url, models=[server.served_model], label=server.name
        )
        out.result = asyncio.run(run_benchmark(c))
    finally:
        server.stop()
    return out


def mode_two_servers(
    setup: Setup, ours: ConfigResult | None, peers: ModuleType | None, why_not: str
) -> ModeReport:
    """Mode 5: radixmux serving both models vs one vLLM server per model with the KV split.

    Same total KV bytes (mode 2's contended arena) and the same two cores: each
    vLLM server is pinned to one core, as radixmux gives each model's runner one
    thread. ``ours`` is radixmux's unified run of mode 2 (or None: run it here).
    """
    rep = ModeReport(5, "one radixmux for two models vs two vLLM servers with the KV split")
    name = "radixmux > two vLLM servers throughput at the same KV bytes"
    if len(setup.sources) < 2:
        rep.targets.append(Target(5, name, "needs two models", None))
        return rep
    kv = shift_kv_bytes(setup)
    ours = ours or run_unified(setup, kv)
    pair = ConfigResult("vllm x2 (KV split)", "vllm", [f"--kv-cache-memory-bytes {kv // 2}"] * 2)
    if peers is None:
        pair.unavailable = why_not
    else:
        pair = run_peer_per_model(setup, peers, "vllm", shift_config(setup), kv // 2, pair)
    rep.configs += [ours, pair]
    rep.targets.append(_ratio_target(5, name, ours, pair, 1.0, f"KV {kv / 2**20:.0f} MiB in all"))
    return rep


def run_peer_per_model(
    setup: Setup,
    peers: ModuleType,
    kind: str,
    cfg: BenchConfig,
    kv_each: int,
    out: ConfigResult,
    max_model_len: int = 1024,
) -> ConfigResult:
    """One ``kind`` server per model of ``cfg``, each on its own core with ``kv_each``
    bytes of KV, started together; the workload routes each request to its model's."""
    from concurrent.futures import ThreadPoolExecutor

    cores = os.cpu_count() or 1
    # Room for the workload's prompts in a small KV (vLLM refuses a KV smaller
    # than one sequence of its max length).
    extra = ["--max-model-len", str(max_model_len)] if kind == "vllm" else []

    def start(i: int):
        return peers.start_peer(
            kind,
            setup.sources[i],
            free_port(),
            setup.dtype,
            kv_each,
            extra_args=extra,
            progress=setup.progress,
            cpus=[i % cores],
        )

    print(f"[compare] {out.label}: starting one {kind} per model", file=sys.stderr)
    with ThreadPoolExecutor(len(cfg.models)) as pool:
        futures = [pool.submit(start, i) for i in range(len(cfg.models))]
    servers, errors = [], []
    for f in futures:
        try:
            servers.append(f.result())
        except Exception as exc:  # a peer that cannot start is a finding, reported
            errors.append(f"{type(exc).__name__}: {exc}")
    try:
        if errors:
            out.unavailable = "; ".join(errors)
            return out
        urls = {s.served_model: s.base_url for s in servers}
        c = dataclasses.replace(
            cfg,
            base_url=servers[0].base_url,
            models=list(urls),
            model_urls=urls,
            label=out.label,
        )
        out.result = asyncio.run(run_benchmark(c))
    finally:
        for server in servers:
            server.stop()
    return out


def _tps(r: BenchResult | None) -> str:
    return "n/a" if r is None else f"{r.output_throughput:.1f}"


def _ms(r: BenchResult | None) -> str:
    return "n/a" if r is None or r.ttft_ms.p50 is None else f"{r.ttft_ms.p50:.0f}"


# ---- output ---------------------------------------------------------------------------
def format_report(reports: Sequence[ModeReport]) -> str:
    """Every configuration's figures, then every target with PASS/MISS."""
    lines: list[str] = []
    for rep in reports:
        lines.append(f"\n== mode {rep.mode}: {rep.title}")
        ran = [c.result for c in rep.configs if c.result is not None]
        if ran:
            lines.append(format_table(ran))
        for c in rep.configs:
            if c.result is None:
                lines.append(f"{c.label:<28} unavailable: {c.unavailable}")
    lines.append("\n== targets")
    for rep in reports:
        for t in rep.targets:
            lines.append(verdict_line(t.passed, f"mode {t.mode}: {t.name}: {t.measured}"))
    return "\n".join(lines)


def plot(reports: Sequence[ModeReport], path: Path) -> Path | None:
    """Bars of output tokens/s and TTFT / E2E p50 per configuration, grouped by mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{r.mode}: {c.label}", c.result) for r in reports for c in r.configs if c.result]
    if not rows:
        return None
    labels = [n for n, _ in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(rows) + 4), 4.5))
    ax1.bar(labels, [r.output_throughput for _, r in rows], color="tab:blue")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("throughput")
    x = range(len(rows))
    ttft = [r.ttft_ms.p50 or 0 for _, r in rows]
    e2e = [r.e2e_ms.p50 or 0 for _, r in rows]
    ax2.bar([i - 0.2 for i in x], ttft, width=0.4, label="TTFT p50")
    ax2.bar([i + 0.2 for i in x], e2e, width=0.4, label="E2E p50")
    ax2.set_xticks(list(x), labels)
    ax2.set_ylabel("ms (log scale)")
    ax2.set_yscale("log")  # queueing makes configurations differ by orders of magnitude
    ax2.set_title("latency")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=35, labelsize=8)
        for t in ax.get_xticklabels():
            t.set_horizontalalignment("right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_json(reports: Sequence[ModeReport], meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "meta": meta,
        "modes": [dataclasses.asdict(r) for r in reports],
        "targets": [
            {**dataclasses.asdict(t), "verdict": t.verdict} for r in reports for t in r.targets
        ],
    }


def earlier(reports: Sequence[ModeReport], mode: int, label: str) -> ConfigResult | None:
    """A configuration an earlier mode of this run already measured (reused, not rerun)."""
    return next((c for r in reports if r.mode == mode for c in r.configs if c.label == label), None)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modes", "--mode", nargs="+", type=int, choices=range(1, 8), default=None)
    p.add_argument("--all", action="store_true", help="modes 1 2 3 4 5")
    p.add_argument("--quick", action="store_true", help="tiny workloads (the smoke test)")
    p.add_argument(
        "--models",
        "--model-args",
        nargs="+",
        default=["smollm2", "gemma3-270m"],
        help="model sources: the first for modes 1, 3, 4; both for modes 2 and 5 "
        "(short names or HF folders, e.g. tiny test models)",
    )
    p.add_argument("--tenants", type=int, default=4, help="mode 7: serve the first N of --models")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument(
        "--server-args", default="", help="extra flags for every radixmux server, one string"
    )
    p.add_argument("--peer-kv-bytes", type=int, default=1 << 30)
    p.add_argument(
        "--peers",
        nargs="+",
        default=None,
        help=f"peers of modes 4, 6 and 7 (default: {' '.join(DEFAULT_PEERS)}; vllm in mode 6; "
        "none in mode 7: one server per tenant model)",
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="mode 7: every arm this many times, interleaved"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="JSON path; the PNG goes beside it")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    modes = [1, 2, 3, 4, 5] if args.all else (args.modes or [1, 2, 3])
    stamp = time.strftime("%Y%m%dT%H%M%S")
    out = args.out or RESULTS_DIR / f"compare-{stamp}.json"
    setup = Setup(
        sources=tuple(args.models),
        dtype=args.dtype,
        sizes=QUICK if args.quick else FULL,
        seed=args.seed,
        logs=out.parent / f"{out.stem}-logs",
        extra_args=tuple(args.server_args.split()),
        progress=not args.no_progress,
    )
    t0 = time.monotonic()
    reports: list[ModeReport] = []
    runners: dict[int, Callable[[], ModeReport]] = {
        1: lambda: mode_cache(setup),
        2: lambda: mode_partition(setup),
        3: lambda: mode_policy(setup),
        4: lambda: mode_peers(
            setup,
            earlier(reports, 1, "radixmux cache"),
            *load_peers(),
            kv_bytes=args.peer_kv_bytes,
            only=args.peers,
        ),
        5: lambda: mode_two_servers(setup, earlier(reports, 2, "unified"), *load_peers()),
        6: lambda: mode_multi_turn(setup, *load_peers(), args.peer_kv_bytes, args.peers),
        7: lambda: mode_tenants(
            setup, args.tenants, *load_peers(), rounds=args.rounds, peer_kinds=args.peers or ()
        ),
    }
    for m in modes:
        reports.append(runners[m]())
    meta = {
        "modes": modes,
        "quick": args.quick,
        "models": list(args.models),
        "tenants": args.tenants,
        "dtype": args.dtype,
        "server_args": args.server_args,
        "sizes": dataclasses.asdict(setup.sizes),
        "cpus": os.cpu_count(),
        "wall_s": time.monotonic() - t0,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "when": stamp,
    }
    write_json(report_json(reports, meta), out, "compare")
    png = plot(reports, out.with_suffix(".png"))
    print(format_report(reports))
    print(f"\nwrote {out}" + (f" and {png}" if png else ""))
    # Non-zero when a radixmux configuration failed or had errors (peers may be absent).
    ours = [c for r in reports for c in r.configs if c.system == "radixmux"]
    return 0 if all(c.result is not None and c.result.errors == 0 for c in ours) else 1


if __name__ == "__main__":
    raise SystemExit(main())
