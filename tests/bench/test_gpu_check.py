"""make gpu-check's plan: which parts run on which machine, what
summary.json says about each, and the time budget. The parts themselves
need CUDA; here subprocess.run stands in for them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from bench import gpu_check


def test_every_part_has_a_time_limit_and_together_they_fit_nine_minutes(tmp_path):
    assert set(gpu_check.parts(tmp_path, 64)) == set(gpu_check.LIMITS)
    assert sum(gpu_check.LIMITS.values()) <= 9 * 60, gpu_check.LIMITS


def _fake_parts(monkeypatch, device_count: int) -> list[list[str]]:
    """Pretends to be a CUDA machine with device_count devices whose parts
    all pass; returns the commands run."""
    ran: list[list[str]] = []

    def run(cmd, **kwargs):
        ran.append(cmd)
        if "bench.tensor_parallel" in cmd:
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({
                "median_output_throughput": {"1": 100.0, "2": 150.0}, "ratio": 1.5,
                "greedy_agreement": [{"round": 0, "identical": 64, "compared": 64}]}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(gpu_check, "cuda_device", lambda: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: device_count)
    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    return ran


def test_one_gpu_skips_p13_and_summary_says_why(monkeypatch, tmp_path):
    ran = _fake_parts(monkeypatch, device_count=1)
    assert gpu_check.main(["--out-dir", str(tmp_path)]) == 0
    assert not any("bench.tensor_parallel" in cmd for cmd in ran), "P13 ran on a machine with one GPU"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device_count"] == 1
    p13 = summary["parts"]["tensor_parallel_p13"]
    assert "returncode" not in p13 and "at least 2 CUDA devices" in p13["skipped"] and "sees 1" in p13["skipped"], p13
    assert all(summary["parts"][name]["returncode"] == 0 for name in gpu_check.LIMITS if name != "tensor_parallel_p13")


@pytest.mark.parametrize("device_count", [2, 8])
def test_two_or_more_gpus_run_p13_and_summary_carries_its_ratio(monkeypatch, tmp_path, device_count):
    ran = _fake_parts(monkeypatch, device_count)
    assert gpu_check.main(["--out-dir", str(tmp_path)]) == 0
    [p13_cmd] = [cmd for cmd in ran if "bench.tensor_parallel" in cmd]
    assert p13_cmd[p13_cmd.index("--size") + 1] == "2", p13_cmd
    p13 = json.loads((tmp_path / "summary.json").read_text())["parts"]["tensor_parallel_p13"]
    assert p13["returncode"] == 0 and "skipped" not in p13, p13
    assert p13["ratio"] == 1.5 and p13["greedy_agreement"][0]["identical"] == 64, p13
