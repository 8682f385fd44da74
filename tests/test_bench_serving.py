"""Smoke and unit tests of the serving benchmark (bench/bench_serving.py, bench/compare.py).

One radixmux server on a tiny random-weight model runs every workload of
``bench_serving`` over real HTTP, so the benchmark cannot rot; the comparison's
report (targets, unavailable peers, JSON, plot) is checked on synthetic results
without starting more servers (each start costs tens of seconds on 2 cores).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import compare
from bench.bench_serving import (
    BenchConfig,
    BenchResult,
    ModelFigures,
    Percentiles,
    completion_prompt,
    run_benchmark,
    scrape_hit_counters,
)
from bench.tiny_models import make_tiny_model_dir
from bench.workloads import (
    GSPParams,
    MultiTurnParams,
    ShiftParams,
    TenantParams,
    generated_shared_prefix,
    multi_model_shift,
    multi_tenant,
    vocabulary_words,
    zipf_weights,
)
from radixmux.runtime.client.engine import Engine

pytestmark = pytest.mark.timeout(180)

GSP = GSPParams(
    num_groups=2, prompts_per_group=4, system_prompt_len=96, question_len=8, output_len=4
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bench_models")
    return {
        "a": make_tiny_model_dir(root / "a", seed=21),
        "b": make_tiny_model_dir(root / "b", seed=22, chat_template=False),
    }


@pytest.fixture(scope="module")
def server(models: dict[str, Path]) -> Iterator[str]:
    engine = Engine(
        model=[f"{models['a']},name=a", f"{models['b']},name=b"],
        kv_cache_bytes=16 << 20,
        kv_block_bytes=64 << 10,
        runner_threads=1,
    )
    try:
        yield f"http://127.0.0.1:{engine.args.port}"
    finally:
        engine.shutdown()


def _config(url: str, folders: dict[str, Path], **kw: object) -> BenchConfig:
    base = dict(
        base_url=url,
        models=["a"],
        tokenizer=str(folders["a"]),
        gsp=GSP,
        warmup_requests=1,
        progress=False,
    )
    return BenchConfig(**{**base, **kw})  # type: ignore[arg-type]


def _shift_config(
    url: str, folders: dict[str, Path], shift: ShiftParams, **kw: object
) -> BenchConfig:
    return _config(url, folders, models=["a", "b"], workload="multi-model-shift", shift=shift, **kw)


def _sane(r: BenchResult, n: int) -> None:
    assert r.errors == 0, r.error_samples
    assert r.num_requests == r.completed == n
    assert r.request_throughput > 0 and r.output_throughput > 0 and r.input_throughput > 0
    assert r.short_outputs == 0  # ignore_eos honoured: every request got max_tokens
    for p in (r.ttft_ms, r.e2e_ms, r.tpot_ms):
        assert p.p50 is not None and 0 < p.p50 <= p.p90 <= p.p99
    assert r.ttft_ms.p50 <= r.e2e_ms.p50
    assert r.hit_rate_source == "metrics"
    assert r.cache_hit_rate is not None and 0 <= r.cache_hit_rate <= 1
    json.dumps(r.to_json(), allow_nan=False)  # strict JSON: no NaN anywhere


# ---- against a real server -----------------------------------------------------------------
def test_shared_prefix_run(server: str, models: dict[str, Path]) -> None:
    r = asyncio.run(run_benchmark(_config(server, models)))
    _sane(r, 8)
    assert r.total_output_tokens == 8 * GSP.output_len
    # 2 groups x 4 prompts: at least the 3 repeats per group hit their 96-word prefix.
    assert r.cache_hit_rate > 0.3
    assert r.itl_ms.p50 is not None and r.itl_ms.p50 > 0
    assert set(r.per_model) == {"a"} and r.per_model["a"].requests == 8
    # The server's work over the run: batches, runner compute, prompt tokens prefilled.
    work = r.server_counters
    assert work["radixmux_model_steps"] >= GSP.output_len
    assert 0 < work["radixmux_prompt_tokens_computed"] < r.total_input_tokens
    assert r.runner_busy is not None and 0 < r.runner_busy <= 1.05


def test_multi_turn_chat_resends_the_conversation(server: str, models: dict[str, Path]) -> None:
    mt = MultiTurnParams(
        num_conversations=2,
        turns=3,
        num_groups=1,
        system_prompt_len=48,
        question_len=8,
        output_len=4,
    )
    r = asyncio.run(
        run_benchmark(
            _config(server, models, workload="multi-turn", api="chat", multi_turn=mt, concurrency=2)
        )
    )
    _sane(r, 6)
    # Later turns resend earlier ones, so most of their prompt is cached.
    assert r.cache_hit_rate > 0.3


def test_multi_model_shift_moves_share(server: str, models: dict[str, Path]) -> None:
    sh = ShiftParams(
        num_requests=10,
        shares=(0.8, 0.2),
        groups_per_model=2,
        system_prompt_len=48,
        question_len=8,
        output_len=4,
    )
    r = asyncio.run(run_benchmark(_shift_config(server, models, sh, concurrency=3)))
    _sane(r, 10)
    assert r.per_model["a"].requests == r.per_model["b"].requests == 5
    assert all(f.hit_rate is not None for f in r.per_model.values())


def test_bad_model_is_counted_as_errors(server: str, models: dict[str, Path]) -> None:
    cfg = _config(server, models, models=["nope"], gsp=GSPParams(1, 2, 8, 4, 2), warmup_requests=0)
    r = asyncio.run(run_benchmark(cfg))
    assert r.errors == 2 and r.completed == 0
    assert r.error_samples and r.error_samples[0].startswith("HTTP 4")


def test_model_urls_route_each_model_to_its_server(server: str, models: dict[str, Path]) -> None:
    """Per-model URLs (mode 5: one peer server per model): "b" goes to a closed
    port and fails, "a" still reaches the real server and succeeds."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sh = ShiftParams(8, (0.5, 0.5), 1, 24, 4, 2)
    cfg = _shift_config(
        server, models, sh, warmup_requests=0, model_urls={"a": server, "b": closed}
    )
    r = asyncio.run(run_benchmark(cfg))
    assert r.per_model["a"].requests == 4 and r.per_model["b"].requests == 0
    assert r.errors == 4 and r.completed == 4
    assert r.hit_rate_source != "metrics"  # the closed "server" has no /metrics


def test_metrics_scrape_reads_token_counters(server: str) -> None:
    import httpx

    async def scrape() -> dict[str, tuple[float, float]] | None:
        async with httpx.AsyncClient(trust_env=False) as client:
            return await scrape_hit_counters(client, server, ["a", "b"])

    counters = asyncio.run(scrape())
    assert counters is not None and set(counters) == {"a", "b"}
    assert all(queried >= matched >= 0 for queried, matched in counters.values())


# ---- workloads ---------------------------------------------------------------------------
def test_workloads_are_deterministic_and_shaped(models: dict[str, Path]) -> None:
    words = vocabulary_words(str(models["a"]))
    one = generated_shared_prefix(words, "m", GSP, seed=3)
    assert one == generated_shared_prefix(words, "m", GSP, seed=3)
    assert [s.group for s in one] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len({s.system for s in one}) == 2 and len({s.turns for s in one}) == 8
    assert all(len(s.system.split()) == 96 and len(s.turns[0].split()) == 8 for s in one)
    shuffled = generated_shared_prefix(words, "m", GSPParams(2, 4, 96, 8, 4, shuffle=True), 3)
    assert sorted(shuffled, key=lambda s: s.turns) == sorted(one, key=lambda s: s.turns)
    assert [s.group for s in shuffled] != [s.group for s in one]
    zipf = generated_shared_prefix(words, "m", GSPParams(4, 50, 8, 4, 2, "zipf", 1.2), 0)
    counts = [sum(s.group == g for s in zipf) for g in range(4)]
    assert counts[0] > counts[3] and sum(counts) == 200
    assert math.isclose(sum(zipf_weights(4, 1.2)), 1.0)

    shift = multi_model_shift(words, ["x", "y"], ShiftParams(20, (0.8, 0.2), 2, 8, 4, 2), 0)
    first, second = shift[:10], shift[10:]
    assert sum(s.model == "x" for s in first) == 8 and sum(s.model == "x" for s in second) == 2
    assert len({s.system for s in shift if s.model == "x"}) <= 2


def test_multi_tenant_rotates_the_hot_model_and_shares_prompts(models: dict[str, Path]) -> None:
    words = vocabulary_words(str(models["a"]))
    names = ["t0", "t1", "t2", "t3"]
    p = TenantParams(200, 4, 1.5, 2, 1, 0.3, 8, 4, 2)
    load = multi_tenant(words, names, p, seed=5)
    assert load == multi_tenant(words, names, p, seed=5) and len(load) == 200
    for phase in range(4):
        sent = [s.model for s in load if s.phase == phase]
        counts = {m: sent.count(m) for m in names}
        # The hottest model moves one tenant per phase.
        assert max(counts, key=counts.__getitem__) == names[phase], counts
    shared = {s.system for s in load if s.group == p.private_groups}
    assert len(shared) == 1
    assert {s.model for s in load if s.group == p.private_groups} == set(names)
    for m in names:
        own = {s.system for s in load if s.model == m and s.group < p.private_groups}
        assert len(own) == 2 and not own & shared
    assert len({s.system for s in load}) == 4 * 2 + 1


def test_completion_prompt_resends_history() -> None:
    text = completion_prompt("sys", ["q1", "q2"], ["r1"])
    assert text == "sys\n\nUser: q1\nAssistant:r1\n\nUser: q2\nAssistant:"


# ---- compare's report --------------------------------------------------------------------
def _result(label: str, tps: float, hit: float | None, errors: int = 0) -> BenchResult:
    p = Percentiles(10.0, 20.0, 30.0, 12.0)
    return BenchResult(
        label,
        "generated-shared-prefix",
        "http://x",
        ["m"],
        4,
        4 - errors,
        errors,
        [],
        1.0,
        4.0,
        100.0,
        tps,
        100,
        int(tps),
        0,
        p,
        p,
        p,
        p,
        hit,
        "metrics",
        {"m": ModelFigures(4, tps, hit)},
        {},
    )


def _setup(tmp_path: Path) -> compare.Setup:
    return compare.Setup(("smollm2",), "bfloat16", compare.QUICK, 0, tmp_path / "logs")


def test_peers_absent_are_reported_not_skipped(tmp_path: Path) -> None:
    ours = compare.ConfigResult("radixmux cache", "radixmux", [], _result("ours", 50, 0.8))
    rep = compare.mode_peers(_setup(tmp_path), ours, None, "bench/peers.py not present")
    assert [c.label for c in rep.configs] == ["radixmux cache", "vllm", "llamacpp", "transformers"]
    assert all(c.unavailable == "bench/peers.py not present" for c in rep.configs[1:])
    assert len(rep.targets) == 3 and all(t.verdict == "n/a" for t in rep.targets)
    assert "unavailable: bench/peers.py not present" in compare.format_report([rep])


def test_peer_that_cannot_start_gives_its_reason(tmp_path: Path) -> None:
    class PeerUnavailable(Exception):
        pass

    def start_peer(kind: str, *args: object) -> object:
        if kind == "b":
            raise RuntimeError("crashed")
        raise PeerUnavailable(f"{kind}: not installed")

    fake = SimpleNamespace(PEERS=("a", "b"), PeerUnavailable=PeerUnavailable, start_peer=start_peer)
    ours = compare.ConfigResult("radixmux cache", "radixmux", [], _result("ours", 50, 0.8))
    rep = compare.mode_peers(_setup(tmp_path), ours, fake, "")  # type: ignore[arg-type]
    assert [c.unavailable for c in rep.configs[1:]] == ["a: not installed", "RuntimeError: crashed"]


def test_targets_json_and_plot(tmp_path: Path) -> None:
    rep = compare.ModeReport(1, "cache")
    on = compare.ConfigResult("on", "radixmux", [], _result("on", 60, 0.9))
    off = compare.ConfigResult("off", "radixmux", [], _result("off", 10, 0.0))
    rep.configs += [on, off]
    rep.targets.append(compare.Target(1, "x", "6x", compare._verdict(True, on.result, off.result)))
    rep.targets.append(compare.Target(1, "y", "1x", compare._verdict(False, on.result, off.result)))
    bad = _result("bad", 60, 0.9, errors=1)
    rep.targets.append(compare.Target(1, "z", "?", compare._verdict(True, bad, off.result)))
    assert [t.verdict for t in rep.targets] == ["PASS", "MISS", "n/a"]
    text = compare.format_report([rep])
    assert "[PASS] mode 1: x" in text and "[MISS] mode 1: y" in text
    data = compare.report_json([rep], {"quick": True})
    assert [t["verdict"] for t in data["targets"]] == ["PASS", "MISS", "n/a"]
    cfg = data["modes"][0]["configs"][0]["result"]
    for key in (
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "ttft_ms",
        "itl_ms",
        "e2e_ms",
        "cache_hit_rate",
        "errors",
    ):
        assert key in cfg
    png = compare.plot([rep], tmp_path / "c.png")
    assert png is not None and png.stat().st_size > 1000


@pytest.mark.timeout(360)  # two servers start one after the other, on shared cores
def test_compare_mode_tenants_runs_unified_and_static(tmp_path: Path) -> None:
    folders = [make_tiny_model_dir(tmp_path / f"t{i}", seed=30 + i) for i in range(2)]
    setup = compare.Setup(
        tuple(map(str, folders)), "float32", compare.QUICK, 0, tmp_path / "logs", progress=False
    )
    # The peer arm without a peer module records why, and its targets are n/a.
    rep = compare.mode_tenants(
        setup, 2, None, "no peers here", peer_kinds=("vllm",), sharing_arm=False
    )
    labels = [c.label for c in rep.configs]
    assert labels == ["unified x2", "static x2", "vllm x2 (KV and cores split)"]
    assert rep.configs[2].unavailable == "no peers here"
    for c in rep.configs[:2]:
        r = c.result
        assert r is not None and r.errors == 0, c.unavailable or r.error_samples
        assert r.completed == compare.QUICK.tenant.num_requests
        assert set(r.per_model) == {"t0", "t1"}
    # Both ran cleanly, so each target against static got a verdict (PASS or
    # MISS); the absent peer's two are n/a.
    assert [t.passed is not None for t in rep.targets] == [True, True, False, False]
    short = compare.mode_tenants(dataclasses.replace(setup, sources=setup.sources[:1]), 2)
    assert short.targets[0].measured == "needs 2 models, got 1" and not short.configs
