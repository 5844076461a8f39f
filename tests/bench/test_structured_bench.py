"""P14's script end to end on tiny-random: both runs served through the
real services, every constrained output checked against its schema and
every unconstrained one against the unconstrained run, the mask costs
reported. Checks the tool, not speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_structured_bench_reports_both_runs_their_ratio_and_the_mask_cost(tmp_path):
    out = tmp_path / "p14.json"
    cmd = [sys.executable, "-m", "bench.structured", "--model", "tiny-random", "--num-requests", "6",
           "--rounds", "1", "--len-scale", "0.1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "P14 tiny-random" in proc.stdout and "us per constrained row" in proc.stdout, proc.stdout
    summary = json.loads(out.read_text())
    assert [(r["round"], r["kind"]) for r in summary["rounds"]] == [(0, "plain"), (0, "constrained")]
    assert all(r["completed"] == 6 for r in summary["rounds"])
    assert summary["ratio"] > 0 and summary["mask_us_per_row"] > 0
    [masked] = [r for r in summary["rounds"] if r["kind"] == "constrained"]
    assert masked["llmsched_executor_constraint_mask_rows_total"] > 0, "no row was masked"
