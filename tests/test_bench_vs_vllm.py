"""Fast tests of ``bench/vs_vllm.py``: reading vLLM's results, the goals, the table.

No server and no vLLM are needed: the results below are trimmed from what
``vllm bench serve --save-result`` (vLLM 0.32) wrote in a smoke run. The one
test that runs vLLM's CLI (its ``--help``, to catch flag drift) is skipped
where ``python -m bench.peers install vllm`` has not been run.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest

from bench import peers, vs_vllm, vs_vllm_sweep

# ``vllm bench serve --quick`` smoke run, prefix_repetition at concurrency 4
# (trimmed to the fields vs_vllm reads; figures from a busy shared machine).
RADIXMUX_JSON = {
    "backend": "openai",
    "num_prompts": 8,
    "max_concurrency": 4,
    "completed": 8,
    "failed": 0,
    "duration": 8.60722771299993,
    "total_input_tokens": 8800,
    "total_output_tokens": 256,
    "request_throughput": 0.9294514176634594,
    "output_throughput": 29.7424453652307,
    "median_ttft_ms": 1745.2190344999963,
    "p99_ttft_ms": 4191.274722969947,
    "median_tpot_ms": 65.3397286451606,
    "p99_tpot_ms": 108.84507623032098,
    "median_itl_ms": 38.47371500000918,
    "median_e2el_ms": 4187.733789499987,
    "errors": ["", "", "", "", "", "", "", ""],
}
VLLM_JSON = {
    "backend": "openai",
    "num_prompts": 8,
    "max_concurrency": 4,
    "completed": 8,
    "failed": 0,
    "duration": 21.519123674999946,
    "total_input_tokens": 8800,
    "total_output_tokens": 256,
    "request_throughput": 0.37176235058744883,
    "output_throughput": 11.896395218798363,
    "median_ttft_ms": 3715.8604534999995,
    "p99_ttft_ms": 11526.71833853995,
    "median_tpot_ms": 148.46080512902958,
    "p99_tpot_ms": 335.61171556064403,
    "median_itl_ms": 81.28042450005069,
    "median_e2el_ms": 10706.562304000045,
    "errors": ["", "", "", "", "", "", "", ""],
}


def run(data: dict, engine: str = "radixmux", dataset: str = "prefix_repetition", c: int = 4):
    return vs_vllm.RunResult.from_vllm(data, dataset, c, engine)


def test_reads_vllm_result_json() -> None:
    r = run(RADIXMUX_JSON)
    assert (r.completed, r.failed, r.num_prompts) == (8, 0, 8)
    assert r.output_throughput == pytest.approx(29.74, abs=0.01)
    assert r.ttft_p50_ms == pytest.approx(1745.2, abs=0.1)
    assert r.tpot_p50_ms == pytest.approx(65.34, abs=0.01)
    assert r.error_samples == [] and r.ok
    # Failed requests: their errors are kept (deduplicated) and the run is not ok.
    bad = run({**RADIXMUX_JSON, "failed": 2, "errors": ["", "Bad Request", "Bad Request"]})
    assert bad.error_samples == ["Bad Request"] and not bad.ok


def test_goal_passes_and_misses_with_reasons() -> None:
    ours, peer = run(RADIXMUX_JSON), run(VLLM_JSON, "vllm")
    v = vs_vllm.judge(ours, peer, 1.2)
    assert v.passed is True and v.verdict == "PASS" and v.misses == []
    assert v.throughput_ratio == pytest.approx(29.74 / 11.90, rel=1e-3)
    assert v.ttft_ratio < 1 and v.tpot_ratio < 1
    # Swapped roles: every part of the goal is missed, and each says why.
    v = vs_vllm.judge(run(VLLM_JSON), run(RADIXMUX_JSON, "vllm"), 1.0)
    assert v.verdict == "MISS"
    assert [m.split()[0] for m in v.misses] == ["out", "TPOT", "TTFT"]
    # Equal TTFT is not "better"; equal TPOT is within the goal.
    v = vs_vllm.judge(run(RADIXMUX_JSON), run(RADIXMUX_JSON, "vllm"), 1.0)
    assert v.misses == ["TTFT p50 1.00x vLLM's (not lower)"]


def test_no_verdict_without_clean_runs() -> None:
    failed = run({**VLLM_JSON, "failed": 1}, "vllm")
    v = vs_vllm.judge(run(RADIXMUX_JSON), failed, 1.2)
    assert v.passed is None and v.verdict == "n/a" and "vllm: 1 failed" in v.misses[0]
    gone = vs_vllm.RunResult("random", 1, "radixmux", 2, unavailable="server did not start")
    v = vs_vllm.judge(gone, run(VLLM_JSON, "vllm", "random", 1), 1.0)
    assert v.passed is None and math.isnan(v.throughput_ratio)
    assert v.to_json()["throughput_ratio"] is None  # NaN is not JSON


def test_rows_pair_each_radixmux_configuration_with_vllm() -> None:
    results = [
        run(RADIXMUX_JSON),
        run({**RADIXMUX_JSON, "output_throughput": 12.0}, "radixmux --chunked-prefill-size 256"),
        run(VLLM_JSON, "vllm"),
        run(RADIXMUX_JSON, dataset="random"),  # no vLLM run of this row: no verdict
    ]
    verdicts = vs_vllm.judge_all(results)
    assert [(v.engine, v.verdict) for v in verdicts] == [
        ("radixmux", "PASS"),
        ("radixmux --chunked-prefill-size 256", "MISS"),
    ]
    assert verdicts[0].throughput_goal == 1.2  # prefix_repetition's goal
    table = vs_vllm.format_table(results, verdicts)
    assert "= radixmux / vllm" in table and "2.50x" in table and "PASS" in table
    assert "MISS (out tok/s 1.01x < 1.2x)" in table
    goals = vs_vllm.format_goals(verdicts)
    assert goals.splitlines()[0].startswith("[PASS] prefix_repetition c=4 radixmux")


def test_plot_writes_png(tmp_path: Path) -> None:
    results = [run(RADIXMUX_JSON), run(VLLM_JSON, "vllm"), run(RADIXMUX_JSON, c=1)]
    path = vs_vllm.plot(results, tmp_path / "p.png")
    assert path is not None and path.stat().st_size > 0
    assert vs_vllm.plot([], tmp_path / "none.png") is None


def client_args(dataset: str = "prefix_repetition") -> list[str]:
    endpoint = vs_vllm.Endpoint("http://127.0.0.1:9", "smollm2")
    return vs_vllm.client_args(
        endpoint,
        Path("/models/smollm2"),
        vs_vllm.DATASETS[dataset],
        16,
        32,
        7,
        0.0,
        Path("/tmp/out/r.json"),
    )


def test_client_arguments() -> None:
    args = client_args()
    assert args[:2] == ["bench", "serve"]

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert value("--backend") == "openai" and value("--endpoint") == "/v1/completions"
    assert value("--dataset-name") == "prefix_repetition"
    assert value("--prefix-repetition-prefix-len") == "1000"
    assert value("--prefix-repetition-num-prefixes") == "4"
    assert value("--max-concurrency") == "16" and value("--num-prompts") == "32"
    assert value("--tokenizer") == "/models/smollm2" and value("--model") == "smollm2"
    assert value("--result-dir") == "/tmp/out" and value("--result-filename") == "r.json"
    assert "--ignore-eos" in args and "--save-result" in args
    assert "--random-input-len" not in args
    assert "--random-input-len" in client_args("random")
    # Extra shapes run vLLM's random dataset under their own row name.
    extra = client_args("random_long_out")
    assert extra[extra.index("--dataset-name") + 1] == "random"
    assert extra[extra.index("--random-range-ratio") + 1] == "0.5"
    assert extra.count("--dataset-name") == 1


def test_default_grid_is_the_issues_and_runs_off_the_table_are_sized() -> None:
    assert vs_vllm.parse_args([]).datasets == ["prefix_repetition", "random"]
    ds = vs_vllm.DATASETS["random_long_out"]
    assert ds.num_prompts(16, quick=False) == ds.prompts[16]
    assert ds.num_prompts(64, quick=False) == 256 and ds.num_prompts(64, quick=True) == 64


def test_grid_sizes_and_seeds() -> None:
    prefixes = vs_vllm.DATASETS["prefix_repetition"].params["prefix-repetition-num-prefixes"]
    for ds in vs_vllm.DATASETS.values():
        for table in (ds.prompts, ds.quick_prompts):
            assert set(table) == set(vs_vllm.CONCURRENCIES)
            if ds.name == "prefix_repetition":  # vLLM sends num_prompts // prefixes each
                assert all(n % prefixes == 0 for n in table.values())
    seeds = {
        vs_vllm.run_seed(0, d, c) for d in vs_vllm.DATASETS.values() for c in vs_vllm.CONCURRENCIES
    }
    assert len(seeds) == len(vs_vllm.DATASETS) * len(vs_vllm.CONCURRENCIES)


def test_interleaved_rounds_get_fresh_seeds_and_median_figures() -> None:
    seeds = {vs_vllm.run_seed(0, vs_vllm.DATASETS["random"], 4, r) for r in range(3)}
    assert len(seeds) == 3  # no round reuses another's prompts
    rounds = []
    for r, tput in enumerate((10.0, 30.0, 20.0)):
        one = run(RADIXMUX_JSON)
        one.output_throughput, one.round = tput, r
        rounds.append(one)
    peer = [run(VLLM_JSON, engine="vllm") for _ in range(3)]
    (ours,) = [m for m in vs_vllm.median_over_rounds(rounds + peer) if m.engine == "radixmux"]
    assert ours.round == -1 and ours.output_throughput == 20.0
    assert ours.completed == 3 * RADIXMUX_JSON["completed"] and ours.ok
    # One round that did not run makes the row unavailable, not a median of the rest.
    rounds[1] = vs_vllm.RunResult("prefix_repetition", 4, "radixmux", 8, unavailable="boom")
    (ours,) = [m for m in vs_vllm.median_over_rounds(rounds) if m.engine == "radixmux"]
    assert not ours.ok and ours.unavailable == "boom"


def test_engines_from_flags() -> None:
    def labels(argv: list[str]) -> list[str]:
        return [e.label for e in vs_vllm.engines_of(vs_vllm.parse_args(argv))]

    assert labels([]) == ["radixmux", "vllm"]
    assert labels(["--engines", "radixmux", "--server-args", "--chunked-prefill-size 256"]) == [
        "radixmux --chunked-prefill-size 256"
    ]
    both = ["--server-args", "", "--server-args=--disable-radix-cache"]
    assert labels(both) == ["radixmux", "radixmux --disable-radix-cache", "vllm"]


@pytest.mark.skipif(not peers.is_installed("vllm"), reason="vLLM peer not installed")
def test_vllm_cli_takes_every_flag_we_pass() -> None:
    """vLLM's own ``bench serve --help`` lists every flag vs_vllm passes (catches drift)."""
    cmd = peers.vllm_cli_command(["bench", "serve", "--help=all"])
    env = {**os.environ, **vs_vllm.OFFLINE_ENV}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    flags = {a for ds in vs_vllm.DATASETS for a in client_args(ds) if a.startswith("--")}
    missing = sorted(f for f in flags if f not in out.stdout)
    assert missing == []


@pytest.mark.skipif(not peers.is_installed("vllm"), reason="vLLM peer not installed")
def test_vllm_bench_client_gets_the_greedy_text_curl_gets(tmp_path: Path) -> None:
    """vLLM's own benchmark client (``vllm bench serve``, OpenAI completions,
    streaming) pointed at radixmux: every request succeeds and each generated
    text equals what a plain non-streamed HTTP request for the same prompt gets."""
    import json

    import httpx

    from bench.tiny_models import make_tiny_model_dir
    from radixmux.runtime.client.engine import Engine

    folder = make_tiny_model_dir(tmp_path / "m", seed=3)
    prompts = [f"Story {i}: the lighthouse keeper and the {w} sea" for i, w in enumerate("abcdef")]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    engine = Engine(model=[f"{folder},name=m"], kv_cache_bytes=8 << 20, dtype="float32")
    url = f"http://127.0.0.1:{engine.args.port}"
    try:
        args = ["bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions"]
        args += ["--base-url", url, "--model", "m", "--tokenizer", str(folder)]
        args += ["--dataset-name", "custom", "--dataset-path", str(data), "--skip-chat-template"]
        args += [
            "--disable-shuffle",
            "--custom-output-len",
            "8",
            "--num-prompts",
            str(len(prompts)),
        ]
        args += ["--max-concurrency", "2", "--ignore-eos", "--temperature", "0"]
        args += ["--save-result", "--save-detailed", "--result-dir", str(tmp_path)]
        args += ["--result-filename", "r.json"]
        env = {**os.environ, **vs_vllm.OFFLINE_ENV}
        out = subprocess.run(
            peers.vllm_cli_command(args), capture_output=True, text=True, timeout=600, env=env
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        result = json.loads((tmp_path / "r.json").read_text())
        assert result["completed"] == len(prompts) and result["failed"] == 0, result["errors"]
        body = {"model": "m", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        direct = [
            httpx.post(f"{url}/v1/completions", json={**body, "prompt": p}, timeout=60).json()[
                "choices"
            ][0]["text"]
            for p in prompts
        ]
        assert result["generated_texts"] == direct
    finally:
        engine.shutdown()


# ---- the sweep's shapes (no vLLM, no model: the limits are given) --------------------
LIMITS = vs_vllm_sweep.ShapeLimits(context=8192, kv_tokens=46_603)  # SmolLM2 bf16, 1 GiB


def test_sweep_shapes_are_seeded_and_within_the_ranges() -> None:
    shapes = vs_vllm_sweep.draw_shapes(60, 7, LIMITS)
    assert shapes == vs_vllm_sweep.draw_shapes(60, 7, LIMITS)  # reproducible
    assert shapes != vs_vllm_sweep.draw_shapes(60, 8, LIMITS)
    assert vs_vllm_sweep.draw_shapes(5, 7, LIMITS) == shapes[:5]  # a longer sweep extends it
    assert {s.dataset for s in shapes} == {"prefix_repetition", "random"}
    assert len({s.name for s in shapes}) == len(shapes)
    for s in shapes:
        assert 1 <= s.concurrency <= 64 and 128 <= s.prompt_len <= 4000
        assert 16 <= s.output_len <= 512 and s.prompt_len + s.output_len <= LIMITS.context
        assert vs_vllm_sweep.fits(s, LIMITS)
        if s.dataset == "prefix_repetition":
            assert 0.5 * s.prompt_len - 1 <= s.prefix_len <= 0.95 * s.prompt_len + 1
            assert s.num_prefixes in (1, 2, 4, 8) and s.suffix_len >= 1
            held = s.num_prefixes * s.prefix_len + s.concurrency * (s.suffix_len + s.output_len)
            assert s.num_prompts % s.num_prefixes == 0 and s.quick_prompts % s.num_prefixes == 0
        else:
            assert s.prefix_len == s.num_prefixes == 0
            held = s.concurrency * (s.prompt_len + s.output_len)
        assert held <= vs_vllm_sweep.KV_FILL * LIMITS.kv_tokens
    # Log-uniform concurrency: small and large both drawn, not only the middle.
    assert min(s.concurrency for s in shapes) <= 2 and max(s.concurrency for s in shapes) >= 32


def test_sweep_prompts_are_bounded() -> None:
    for s in vs_vllm_sweep.draw_shapes(60, 3, LIMITS):
        step = max(s.num_prefixes, 1)
        assert s.concurrency <= s.num_prompts <= max(2 * s.concurrency, 8) + step - 1
        assert s.concurrency <= s.quick_prompts <= s.num_prompts
        own = s.prompt_len - s.prefix_len + s.output_len
        tokens = s.num_prefixes * s.prefix_len + s.num_prompts * own
        # Over the budget only where one prompt per client already is.
        if s.num_prompts >= s.concurrency + step:
            assert tokens <= vs_vllm_sweep.TOKEN_BUDGET + step * own
    # The rule itself: 2 per client, at least 8, cut by the budget, never below 1 per client.
    assert vs_vllm_sweep.num_prompts(1, 0, 100, 0, quick=False) == 8
    assert vs_vllm_sweep.num_prompts(20, 0, 100, 0, quick=False) == 40
    assert vs_vllm_sweep.num_prompts(20, 0, 4000, 0, quick=False) == 20
    assert vs_vllm_sweep.num_prompts(3, 0, 100, 4, quick=False) == 8
    assert vs_vllm_sweep.num_prompts(1, 0, 100, 0, quick=True) == 2


def test_sweep_refuses_limits_nothing_fits() -> None:
    with pytest.raises(ValueError, match="no shape fits"):
        vs_vllm_sweep.draw_shapes(1, 0, vs_vllm_sweep.ShapeLimits(8192, 100))


def test_sweep_rows_get_their_own_dataset_seed_and_goal() -> None:
    shapes = vs_vllm_sweep.draw_shapes(12, 1, LIMITS)
    datasets = {s.name: vs_vllm.sweep_dataset(s) for s in shapes}
    seeds = {
        vs_vllm.run_seed(0, datasets[s.name], s.concurrency, r) for s in shapes for r in (0, 1)
    }
    grid = {vs_vllm.run_seed(0, d, c) for d in vs_vllm.DATASETS.values() for c in (1, 4, 16)}
    assert len(seeds) == 2 * len(shapes) and not seeds & grid
    for s in shapes:
        ds = datasets[s.name]
        args = ds.args
        assert args[args.index("--dataset-name") + 1] == s.dataset
        assert ds.num_prompts(s.concurrency, quick=False) == s.num_prompts
        if s.dataset == "prefix_repetition":
            assert ds.throughput_goal == 1.5
            assert ds.params["prefix-repetition-suffix-len"] == s.prompt_len - s.prefix_len
        else:
            assert ds.throughput_goal == 1.2 and ds.params["random-input-len"] == s.prompt_len
    with pytest.raises(SystemExit):
        vs_vllm.parse_args(["--sweep", str(vs_vllm.MAX_SWEEP + 1)])


def test_sweep_rows_rerun_chosen_shapes_unchanged() -> None:
    args = vs_vllm.parse_args(["--sweep", "6", "--sweep-seed", "1", "--sweep-rows", "5", "1"])
    every = vs_vllm_sweep.draw_shapes(6, 1, LIMITS)
    assert vs_vllm.sweep_shapes(args, LIMITS) == [every[1], every[5]]
    assert vs_vllm.sweep_shapes(vs_vllm.parse_args(["--sweep", "6"]), LIMITS) == (
        vs_vllm_sweep.draw_shapes(6, 0, LIMITS)
    )
    with pytest.raises(SystemExit):
        vs_vllm.parse_args(["--sweep", "6", "--sweep-rows", "6"])


def test_sweep_reports_every_row_and_the_worst(tmp_path: Path) -> None:
    a, b = vs_vllm_sweep.draw_shapes(2, 2, LIMITS)
    datasets = {s.name: vs_vllm.sweep_dataset(s) for s in (a, b)}
    good, slow = run(RADIXMUX_JSON, dataset=a.name), run(VLLM_JSON, "vllm", dataset=a.name)
    # Row b: radixmux only 1.3x vLLM's throughput and a higher TPOT.
    ours_b = run({**RADIXMUX_JSON, "output_throughput": 1.3 * VLLM_JSON["output_throughput"],
                  "median_tpot_ms": 200.0}, dataset=b.name)  # fmt: skip
    results = [good, slow, ours_b, run(VLLM_JSON, "vllm", dataset=b.name)]
    verdicts = vs_vllm.judge_all(results, datasets)
    assert [v.verdict for v in verdicts] == ["PASS", "MISS"]
    worst = {w.metric: w for w in vs_vllm_sweep.worst_rows([a, b], verdicts)}
    # Throughput per dataset (a is prefix_repetition, b random: each its own goal).
    assert (a.dataset, b.dataset) == ("prefix_repetition", "random")
    assert worst["output tok/s (random)"].row.dataset == b.name
    assert worst["output tok/s (random)"].ratio == pytest.approx(1.3)
    assert worst["output tok/s (prefix_repetition)"].row.dataset == a.name
    assert worst["TPOT p50"].row.dataset == b.name and worst["TPOT p50"].ratio > 1
    assert set(worst) == {
        "output tok/s (prefix_repetition)",
        "output tok/s (random)",
        "TPOT p50",
        "TTFT p50",
    }
    text = vs_vllm_sweep.format_sweep([a, b], verdicts)
    assert a.describe() in text and "worst output tok/s (random)" in text
    assert "[MISS] sweep, radixmux: 1 of 2 rows pass" in text
    assert "MISS (>= 1.2x): TPOT p50 1.35x vLLM's" in text
    assert vs_vllm_sweep.overall(verdicts[:1]) is True and vs_vllm_sweep.overall([]) is None
    report = vs_vllm.sweep_json([a, b], LIMITS, 2, verdicts)
    assert report["shapes"][1]["name"] == b.name and len(report["worst"]) == 4
    png = vs_vllm_sweep.plot_ratios([a, b], verdicts, tmp_path / "s.png")
    assert png is not None and png.stat().st_size > 0
    assert vs_vllm_sweep.plot_ratios([a, b], [], tmp_path / "none.png") is None
    # radixmux alone: the shapes are listed, nothing judged.
    alone = vs_vllm_sweep.format_sweep([a, b], [], quick=True)
    assert "(not compared)" in alone and f"n={a.quick_prompts}" in alone
