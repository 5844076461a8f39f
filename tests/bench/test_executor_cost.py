"""P11's benchmark runs end to end on a small setting and reports every
figure; speed itself is the benchmark's business, not a test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from bench import gpu_check

REPO = Path(__file__).resolve().parents[2]


def test_executor_cost_reports_decode_and_sampling_figures(tmp_path):
    out = tmp_path / "p11.json"
    cmd = [sys.executable, "-m", "bench.executor_cost", "--requests", "8", "--contexts", "64", "256",
           "--steps", "5", "--warmup", "2", "--sample-rows", "8", "--sample-reps", "3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["sampling"], r["context"]) for r in report["decode"]] == [
        ("greedy", 64), ("greedy", 256), ("T0.8 top-p0.9 seeded", 64), ("T0.8 top-p0.9 seeded", 256)]
    for r in report["decode"]:
        assert r["steps"] == 5 and 0 < r["host_ms_median"] <= r["host_ms_p90"], r
    assert set(report["context_ratio"]) == {"greedy", "T0.8 top-p0.9 seeded"}
    assert report["sampling"]["rows"] == 8 and report["sampling"]["median_ms"] > 0
    assert "sampling 8 rows" in proc.stdout


def test_gpu_check_refuses_to_run_without_cuda(capsys, tmp_path):
    if torch.cuda.is_available():
        return  # the refusal is what this machine cannot show; make gpu-check itself runs here
    assert gpu_check.main(["--out-dir", str(tmp_path / "gpu")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "gpu").exists(), "nothing should be written without a GPU"
