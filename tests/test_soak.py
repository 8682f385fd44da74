"""The soak and chaos harness (``bench/soak.py``, issue 9) for two minutes on tiny models.

The real two-model server runs as a subprocess on a small arena under the
harness's whole mixed load (shared prefixes, multi-turn chats, abandoned
streams, bursts that outgrow the arena, disconnects during tokenization, bad
input, invalidations and flushes); a minute in, model ``a``'s runner is
SIGKILLed (one kill, so ``b``'s runner lives through the memory check from the
halfway point to the end). Every check the harness makes must pass, and the run
must have exercised what it claims (a kill and a restart, every kind of
request, eviction and retraction, a runner in the memory check), so the test
cannot pass vacuously. The judging logic also has fast tests on hand-made records.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import soak

ROOT = Path(__file__).resolve().parents[1]

RUN_TIMEOUT_S = 1200  # start (~40 s), 2 min of load, end phase, stop; slow when shared

pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S + 60)


def test_two_minute_soak_passes_every_check(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "2", "--tiny"]
    proc = subprocess.run(
        [*cmd, "--kill-every", "60", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    tail = f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert out.exists(), tail
    data = json.loads(out.read_text())

    failed = [f"{c['name']}: {c['detail']}" for c in data["checks"] if not c["passed"]]
    assert not failed, "\n".join(failed)
    assert data["passed"] and proc.returncode == 0, tail
    assert out.with_suffix(".png").exists()

    # Not vacuous: a runner was killed and came back, every kind of request was
    # made, most were answered, and a runner's memory was compared.
    assert len(data["kills"]) >= 1, data["kills"]
    assert all(k["t_serving"] is not None for k in data["kills"])
    assert any(role.startswith("runner b#") for role in data["rss"]["growth"]), data["rss"]
    kinds = data["requests_by_kind"]
    assert all(kinds.get(kind, 0) > 0 for kind in soak.REQUEST_KINDS), kinds
    statuses = data["requests_by_status"]
    assert statuses.get("200", 0) > 50 and statuses.get("400", 0) > 0, statuses
    assert any(p["phase"] == "during" and p["status"] == 200 for p in data["probes"])


# ---- the judging logic on hand-made records (milliseconds, no server) -------------------
def _rec(outcome: str, status: int = 200, **kw: object) -> soak.RequestRecord:
    rec = soak.RequestRecord("t", "shared_prefix", "a", "/v1/completions", False, 10.0, 0)
    rec.t_end, rec.outcome, rec.status = 12.0, outcome, status
    for key, value in kw.items():
        setattr(rec, key, value)
    return rec


def _names(rec: soak.RequestRecord, windows: list[soak.Outage]) -> list[str]:
    return sorted(name for name, _ in soak.problems(rec, windows))


def test_problems_judges_every_kind_of_answer() -> None:
    down = [soak.Outage("a", 11.0, 30.0)]
    assert _names(_rec("ok"), []) == []
    assert _names(_rec("abandoned"), []) == []
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
    assert soak.model_states(503, body, names) == {"a": "serving", "b": "restarting"}
    assert soak.model_states(503, {"status": "starting"}, names)["a"] == "starting"
    assert soak.model_states(200, {"status": "ok"}, names) == {"a": "serving", "b": "serving"}
    older = {"status": "unhealthy", "down": {"b": "runner b#0 exited"}}
    assert soak.model_states(503, older, names) == {"a": "serving", "b": "down"}


def test_rss_growth_is_judged_over_each_process_warm_life() -> None:
    steady = soak.ProcessSeries(1, "front", [-1.0, 60.0, 120.0], [100, 100, 104])
    assert soak.rss_growth(steady, 60.0, 120.0) == pytest.approx(0.04)
    # Restarted at 45 s: warm from 105 s, too short a window to judge by 120 s...
    restarted = soak.ProcessSeries(2, "runner a#0", [45.0, 60.0, 120.0], [50, 400, 420])
    assert soak.rss_growth(restarted, 60.0, 120.0) is None
    # ...but judged over its own life when it lives long enough, load excluded.
    longer = soak.ProcessSeries(2, "runner a#0", [45.0, 60.0, 110.0, 200.0], [50, 400, 420, 430])
    assert soak.rss_growth(longer, 60.0, 200.0) == pytest.approx(430 / 420 - 1)
    # Killed at 150 s: judged up to its death.
    killed = soak.ProcessSeries(3, "runner b#0", [-1.0, 60.0, 150.0], [100, 100, 110])
    assert soak.rss_growth(killed, 60.0, 200.0) == pytest.approx(0.10)
    assert soak.rss_baseline_s(120.0) == 60.0 and soak.rss_baseline_s(1800.0) == 120.0
