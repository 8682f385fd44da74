"""``@pytest.mark.alone`` under pytest-xdist: a real two-worker pytest run of a
small generated suite, whose tests log when they run; the alone test's
interval overlaps no other test's, and the others did run side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

TESTS = Path(__file__).resolve().parent

CONFTEST = """
from alone_turns import AloneTurns

def pytest_configure(config):
    config.addinivalue_line("markers", "alone: no other test beside it")
    config.pluginmanager.register(AloneTurns(), "radixmux-alone-turns")
"""

# Each test appends [name, start, end] to the log (one line, one write: atomic).
BODY = """
import json, os, time
import pytest

def span(name, seconds):
    t0 = time.time()
    time.sleep(seconds)
    line = json.dumps([name, t0, time.time()]) + "\\n"
    with open(os.environ["SPANS"], "a") as f:
        f.write(line)
"""


def test_an_alone_test_has_the_machine_to_itself(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    # Two files (loadfile puts them on both workers); the alone test sits in
    # the middle of one, so the other worker is busy when its turn comes.
    (suite / "test_a.py").write_text(
        BODY
        + "".join(f"def test_a{i}():\n    span('a{i}', 0.3)\n" for i in range(4))
        + "@pytest.mark.alone\ndef test_a_alone():\n    span('alone', 1.0)\n"
        + "".join(f"def test_a{i}():\n    span('a{i}', 0.3)\n" for i in range(4, 8))
    )
    (suite / "test_b.py").write_text(
        BODY + "".join(f"def test_b{i}():\n    span('b{i}', 0.3)\n" for i in range(12))
    )
    spans = tmp_path / "spans.jsonl"
    env = {
        **os.environ,
        "SPANS": str(spans),
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
        + ["--dist", "loadfile", "-c", os.devnull, "--rootdir", str(suite), str(suite)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {name: (t0, t1) for name, t0, t1 in map(json.loads, spans.read_text().splitlines())}
    assert len(runs) == 21, sorted(runs)
    start, end = runs.pop("alone")
    beside = [name for name, (t0, t1) in runs.items() if t0 < end and t1 > start]
    assert not beside, f"ran beside the alone test: {beside}"
    # Not vacuous: the two workers did run tests at the same time.
    a = [span for name, span in runs.items() if name.startswith("a")]
    b = [span for name, span in runs.items() if name.startswith("b")]
    assert any(t0 < u1 and u0 < t1 for t0, t1 in a for u0, u1 in b)
