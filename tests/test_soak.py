"""The soak and chaos harness (``python -m bench.soak``) for 60 seconds on tiny
models, with its hostile clients (``--hostile``).

The real two-model server runs as a subprocess on a small arena under the
harness's whole mixed load (shared prefixes, multi-turn chats, abandoned
streams, bursts that outgrow the arena, disconnects during tokenization, bad
input, invalidations and flushes); 30 seconds in, model ``a``'s runner is
SIGKILLed (one kill, so ``b``'s runner lives through the memory check from the
halfway point to the end). Beside that load run the hostile clients (lists at
and past every bound, slow and stalled readers, model changes under streams
that are never read, cross-site request shapes, traps in the disk store), and
before it they run alone beside a probe of the idle server's latency. One run
holds both, so the suite pays for one server's start, load and end phase.

Every check the harness makes must pass, and the run must have exercised what
it claims (a kill and a restart, every kind of request, eviction and
retraction, a runner in the memory check, every hostile class, a drain that
met streams in flight, traps in namespace directories), so the test cannot
pass vacuously. The judging logic, the stream parsing and the trap
bookkeeping also have fast tests on hand-made data.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak.checks import problems, rss_baseline_s, rss_growth
from bench.soak.cli import parse_args
from bench.soak.config import REQUEST_KINDS
from bench.soak.hostile.checks import drain_check, stall_check
from bench.soak.hostile.config import DRAIN_SLACK_S, EXTRA, HOSTILE_KINDS, TINY_HOSTILE
from bench.soak.hostile.records import ChangeRecord, HostileRun, StateCheck
from bench.soak.hostile.streams import Dechunker, judge_events
from bench.soak.hostile.traps import make_canary, plant_traps, trap_problems
from bench.soak.monitor import model_states
from bench.soak.records import Outage, ProcessSeries, RequestRecord, RunState

ROOT = Path(__file__).resolve().parents[1]

# Start, the hostile clients alone (12 s), 60 s of load, end phase,
# a restart on the same disk store, stop; slow when the machine is shared.
RUN_TIMEOUT_S = 1500

pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 60)

HOSTILE_CHECKS = (
    "hostile_bounds_refused",
    "hostile_at_bound_served",
    "hostile_no_5xx",
    "hostile_cross_site_refused",
    "hostile_slow_readers",
    "hostile_drains_end",
    "hostile_disk_traps_intact",
    "hostile_stall_ratio",
)
TIMED_CHECKS = frozenset({"hostile_stall_ratio"})


# Its memory check judges growth over 30 seconds: another test's load beside it
# slows the warm-up into that window.
@pytest.mark.alone
def test_short_soak_passes_every_check(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    # A minute of load: every client, a model-change cycle, bursts and cache
    # ops come round more than once in it (the 30-minute bench run is the long one).
    cmd = [sys.executable, "-m", "bench.soak", "--minutes", "1", "--tiny"]
    proc = subprocess.run(
        [*cmd, "--hostile", "--kill-every", "30", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    tail = f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert out.exists(), tail
    data = json.loads(out.read_text())

    # The stall ratio is a speed figure: on a shared 2-core machine a 60-second
    # tiny run measures the neighbours; the 30-minute bench run judges it. Here
    # only that it was measured (its probes answered) is asserted.
    failed = [
        f"{c['name']}: {c['detail']}"
        for c in data["checks"]
        if not c["passed"] and c["name"] not in TIMED_CHECKS
    ]
    assert not failed, "\n".join(failed)
    for check in data["checks"]:
        if check["name"] in TIMED_CHECKS:
            assert "too few probes" not in check["detail"], check["detail"]
    assert proc.returncode == (0 if data["passed"] else 1), tail
    assert out.with_suffix(".png").exists()

    # Not vacuous: a runner was killed and came back, every kind of request was
    # made, most were answered, and a runner's memory was compared.
    assert len(data["kills"]) >= 1, data["kills"]
    assert all(k["t_serving"] is not None for k in data["kills"])
    assert any(role.startswith("runner b#") for role in data["rss"]["growth"]), data["rss"]
    kinds = data["requests_by_kind"]
    assert all(kinds.get(kind, 0) > 0 for kind in REQUEST_KINDS), kinds
    statuses = data["requests_by_status"]
    assert statuses.get("200", 0) > 50 and statuses.get("400", 0) > 0, statuses
    assert any(p["phase"] == "during" and p["status"] == 200 for p in data["probes"])

    # The hostile clients: every check ran, every class sent requests, a drain
    # met streams still in flight, traps sat in namespace directories, the state
    # was compared before and after, the server restarted on the same store.
    assert {c["name"] for c in data["checks"]} >= set(HOSTILE_CHECKS)
    hostile = data["hostile"]
    by_kind = hostile["requests_by_kind_and_status"]
    assert all(by_kind[kind] for kind in HOSTILE_KINDS), by_kind
    assert by_kind["bound_past"].get("400", 0) > 10, by_kind["bound_past"]
    assert any(c["aborted"] for c in hostile["changes"] if c["op"] != "load"), hostile["changes"]
    assert len(hostile["trapped_directories"]) >= 3, hostile["trapped_directories"]
    assert [s["when"] for s in hostile["state_checks"]] == ["before", "after"]
    assert hostile["restart"]["ready"] and hostile["restart"]["exit_code"] == 0
    assert {"idle", "hostile", "load"} <= hostile["stall"].keys(), hostile["stall"]
    # Removed after a pass; kept for a look when a check failed (a timed one may).
    kept = Path(data["config"]["hostile_dir"])
    assert kept.exists() == (not data["passed"]), data["passed"]
    shutil.rmtree(kept, ignore_errors=True)


# ---- the judging logic on hand-made records (milliseconds, no server) -------------------
def _rec(outcome: str, status: int = 200, **kw: object) -> RequestRecord:
    rec = RequestRecord("t", "shared_prefix", "a", "/v1/completions", False, 10.0, 0)
    rec.t_end, rec.outcome, rec.status = 12.0, outcome, status
    for key, value in kw.items():
        setattr(rec, key, value)
    return rec


def _names(rec: RequestRecord, windows: list[Outage]) -> list[str]:
    return sorted(name for name, _ in problems(rec, windows))


def test_problems_judges_every_kind_of_answer() -> None:
    down = [Outage("a", 11.0, 30.0)]
    assert _names(_rec("ok"), []) == []
    assert _names(_rec("abandoned"), []) == []
    assert _names(_rec("drain_cut"), []) == []  # cut at an unload's drain timeout (hostile)
    assert _names(_rec("error", 429, error_code=429), []) == []
    assert _names(_rec("error", 503, error_code=503), down) == []
    assert _names(_rec("error", 503, error_code=503), []) == ["503_only_while_down"]
    assert _names(_rec("stream_error", error_code=503), down) == []
    assert _names(_rec("error", 500, error_code=500), down) == ["status_ok_4xx_429_503"]
    leaked = _rec("stream_error", error_code=500, detail='Traceback: File "x.py"')
    assert _names(leaked, []) == ["no_internals_in_errors", "status_ok_4xx_429_503"]
    assert _names(_rec("timeout", 0), []) == ["no_hangs"]
    assert _names(_rec("incomplete"), []) == ["complete_answers"]
    assert _names(_rec("transport", 0), []) == ["no_connection_errors"]
    bad = {"case": "top_k > vocab", "expected_status": 400, "expected_param": "top_k"}
    assert _names(_rec("error", 400, error_param="top_k", **bad), []) == []
    assert _names(_rec("error", 400, error_param="top_p", **bad), []) == ["bad_input_rejected"]
    assert _names(_rec("ok", **bad), []) == ["bad_input_rejected"]
    assert _names(_rec("error", 503, error_code=503, **bad), down) == ["bad_input_rejected"]


def test_model_states_from_the_contract_and_from_older_servers() -> None:
    names = ["a", "b"]
    body = {"status": "degraded", "models": {"a": "serving", "b": "restarting"}}
    assert model_states(503, body, names) == {"a": "serving", "b": "restarting"}
    assert model_states(503, {"status": "starting"}, names)["a"] == "starting"
    assert model_states(200, {"status": "ok"}, names) == {"a": "serving", "b": "serving"}
    older = {"status": "unhealthy", "down": {"b": "runner b#0 exited"}}
    assert model_states(503, older, names) == {"a": "serving", "b": "down"}


def test_rss_growth_is_judged_over_each_process_warm_life() -> None:
    steady = ProcessSeries(1, "front", [-1.0, 60.0, 120.0], [100, 100, 104])
    assert rss_growth(steady, 60.0, 120.0) == pytest.approx(0.04)
    # Restarted at 45 s: warm from 105 s, too short a window to judge by 120 s...
    restarted = ProcessSeries(2, "runner a#0", [45.0, 60.0, 120.0], [50, 400, 420])
    assert rss_growth(restarted, 60.0, 120.0) is None
    # ...but judged over its own life when it lives long enough, load excluded.
    longer = ProcessSeries(2, "runner a#0", [45.0, 60.0, 110.0, 200.0], [50, 400, 420, 430])
    assert rss_growth(longer, 60.0, 200.0) == pytest.approx(430 / 420 - 1)
    # Killed at 150 s: judged up to its death.
    killed = ProcessSeries(3, "runner b#0", [-1.0, 60.0, 150.0], [100, 100, 110])
    assert rss_growth(killed, 60.0, 200.0) == pytest.approx(0.10)
    # A 90-second run: each process is judged over the second half of its life.
    short = ProcessSeries(4, "runner b#0", [-1.0, 45.0, 90.0], [100, 100, 102])
    assert rss_growth(short, 45.0, 90.0) == pytest.approx(0.02)
    assert rss_growth(restarted, 45.0, 90.0) is None  # warm at 90 s: no window left
    assert rss_baseline_s(120.0) == 60.0 and rss_baseline_s(1800.0) == 120.0


# ---- the hostile-client mode: its parsing and bookkeeping ----------------------------------


def _chunked(body: bytes, rng: random.Random) -> list[bytes]:
    """``body`` in HTTP/1.1 chunked encoding, cut into random pieces as a socket gives them."""
    wire, i = bytearray(), 0
    while i < len(body):
        n = rng.randint(1, 300)
        wire += b"%x\r\n" % len(body[i : i + n]) + body[i : i + n] + b"\r\n"
        i += n
    wire += b"0\r\n\r\n"
    cuts = sorted(rng.sample(range(1, len(wire)), 20))
    return [bytes(wire[a:b]) for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]


def _generate_events(tokens: int, deltas: bool) -> list[dict[str, object]]:
    """Streamed /generate chunks with cumulative text and ids; logprobs as deltas or not."""
    events = []
    for i in range(1, tokens + 1):
        new = range(i - 1, i) if deltas else range(i)
        finish = {"type": "length", "length": tokens} if i == tokens else None
        meta = {
            "finish_reason": finish,
            "output_token_logprobs": [[-0.5, 100 + k, "w"] for k in new],
            "output_top_logprobs": [[[-1.0, 5, "x"]] * 20 for _ in new],
        }
        events.append({"text": "w" * i, "output_ids": list(range(100, 100 + i)), "meta_info": meta})
    return events


def _sse(events: list[object]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def test_hostile_stream_parsing_judges_streams_and_logprob_deltas() -> None:
    rng = random.Random(5)
    rec = _rec("")
    body = _sse(_generate_events(6, deltas=True)) + b"data: [DONE]\n\n"
    decoder = Dechunker()
    for piece in _chunked(body, rng):
        decoder.feed(piece)
    assert decoder.done and bytes(decoder.data) == body
    facts = judge_events(rec, bytes(decoder.data), True)
    assert rec.outcome == "ok" and facts == {"tokens": 6, "entries": 6, "widest": 20}
    # Logprobs re-sent in full every chunk (the quadratic stream): entries > tokens.
    cumulative = _sse(_generate_events(6, deltas=False)) + b"data: [DONE]\n\n"
    assert judge_events(_rec(""), cumulative, True)["entries"] == 21
    # A stream cut before [DONE]; an error event, then [DONE].
    cut = _rec("")
    judge_events(cut, _sse(_generate_events(3, deltas=True)), False)
    assert cut.outcome == "incomplete" and cut.detail == "stream cut"
    err = {"error": {"message": "unloaded", "type": "service_unavailable", "param": None}}
    err["error"]["code"] = 503
    failed = _rec("")
    judge_events(failed, _sse([err]) + b"data: [DONE]\n\n", True)
    assert failed.outcome == "stream_error" and failed.error_code == 503


def test_hostile_traps_report_every_change(tmp_path: Path) -> None:
    """Planted files, directories, FIFOs and links, and canaries outside the store:
    untouched, nothing is reported; each kind of damage is."""
    store = tmp_path / "store"
    (store / "v1" / "0123456789abcdef").mkdir(parents=True)
    profile = TINY_HOSTILE
    hs = HostileRun(profile, store, tmp_path / "canary", "", "")
    make_canary(hs)
    assert plant_traps(hs) == 3  # the store, v1, one namespace
    assert plant_traps(hs) == 0  # each planted once
    assert trap_problems(hs) == []

    by_kind = {t.kind: Path(t.path) for t in hs.traps if "0123456789abcdef" in t.path}
    by_kind["fifo"].unlink()  # deleted
    link = by_kind["symlink"]
    link.unlink()
    link.write_text("replaced")  # a link replaced by a file
    next(hs.canary.glob("*.kv")).unlink()  # a canary deleted through a link
    problems = trap_problems(hs)
    assert any("is gone" in p for p in problems), problems
    assert any("no longer a symlink" in p for p in problems), problems
    assert any("canaries outside the store changed" in p for p in problems), problems


def _hostile_run(tmp_path: Path) -> RunState:
    config = parse_args(["--tiny", "--hostile", "--port", "1"])
    run = RunState(config, None, {}, [], 0.0, asyncio.Event())  # type: ignore[arg-type]
    profile = TINY_HOSTILE
    run.hostile = HostileRun(profile, tmp_path, tmp_path, "", "")
    return run


def _probe(run: RunState, phase: str, seconds: float) -> None:
    rec = run.new_record("stall_probe", "stall_probe", "a", "/v1/completions", False)
    rec.case, rec.outcome, rec.e2e, rec.t_end = phase, "ok", seconds, rec.t_start + seconds


def test_hostile_stall_verdict_is_the_hostile_window_against_idle(tmp_path: Path) -> None:
    run = _hostile_run(tmp_path)
    for seconds in (0.10, 0.11, 0.09):
        _probe(run, "idle", seconds)
    for seconds in (0.25, 0.28, 0.2):
        _probe(run, "hostile", seconds)
    _probe(run, "load", 5.0)  # the soak's own load: reported, not judged
    for seconds in (0.5, 0.6, 0.55):  # idle again, on a machine busy with other work
        _probe(run, "idle_after", seconds)
    check = stall_check(run)
    assert check.passed and "2.50x idle" in check.detail, check.detail  # the quieter idle
    for seconds in (0.4, 0.5, 0.45):
        _probe(run, "hostile", seconds)
    assert not stall_check(run).passed


def test_hostile_drain_verdict_needs_a_drain_that_met_streams_and_ended(tmp_path: Path) -> None:
    run = _hostile_run(tmp_path)
    hs = run.hostile
    hs.states.append(StateCheck("after", 17, True, {}, ["a", "b"]))
    hs.changes = [ChangeRecord("unload", 5.0, 0.3, 200, 0)]
    assert not drain_check(run).passed  # no drain met a stream in flight
    hs.changes.append(ChangeRecord("reload", 9.0, 14.0, 200, 2))
    assert drain_check(run).passed
    limit = hs.profile.drain_timeout_s + DRAIN_SLACK_S
    hs.changes.append(ChangeRecord("unload", 30.0, limit + 1, 200, 2))
    assert not drain_check(run).passed  # one took too long
    hs.changes.pop()
    hs.states[-1].served = ["a", "b", EXTRA]
    assert not drain_check(run).passed  # the extra model left behind
