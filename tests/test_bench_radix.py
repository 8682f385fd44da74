"""Smoke test: the radix benchmark runs end to end and writes its report."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_radix_quick(tmp_path: Path) -> None:
    out = tmp_path / "radix.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_radix", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "match 2,048-token request" in proc.stdout
    report = json.loads(out.read_text())
    assert {"phases", "targets"} <= set(report)
    assert len(report["targets"]) == 3
    assert all(t["measured"] > 0 for t in report["targets"])
    assert out.with_suffix(".png").exists()
