"""P13's script end to end on tiny-random: both sizes served through the
real services, the summary complete. Checks the tool, not speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tensor_parallel_bench_serves_both_sizes_and_writes_the_ratio(tmp_path):
    out = tmp_path / "p13.json"
    cmd = [sys.executable, "-m", "bench.tensor_parallel", "--model", "tiny-random", "--num-requests", "4",
           "--rounds", "1", "--out", str(out), "--", "--prompt-median", "8", "--prompt-min", "4", "--prompt-max", "16",
           "--output-median", "4", "--output-min", "2", "--output-max", "8"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "TP2/TP1 = " in proc.stdout, proc.stdout

    summary = json.loads(out.read_text())
    assert [(r["round"], r["size"]) for r in summary["runs"]] == [(0, 1), (0, 2)], summary["runs"]
    for run in summary["runs"]:
        assert run["completed"] == run["num_requests"] == 4, run
        report = json.loads(Path(run["report"]).read_text())
        assert report["config"]["executor_env"]["EXECUTOR_TENSOR_PARALLEL_SIZE"] == str(run["size"]), report["config"]
        assert report["server"]["kv_blocks_held_after"] == 0, f"TP={run['size']} leaked KV blocks"
    assert set(summary["median_output_throughput"]) == {"1", "2"}
    assert summary["ratio"] == pytest.approx(summary["median_output_throughput"]["2"]
                                             / summary["median_output_throughput"]["1"])
    # fp32 on the CPU: two ranks' partial sums differ from one rank's whole
    # sum by rounding only; over 4 short requests a near-tie it could flip
    # is very unlikely.
    [agreement] = summary["greedy_agreement"]
    assert agreement["compared"] == 4 and agreement["identical"] == 4, \
        f"TP=2 greedy tokens differ from TP=1's: {agreement}"
