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
        if "simulator" in cmd:
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"fit": {
                "model": "extended", "holdout_mape_points_pct": 3.5}}))
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


def test_the_moe_and_mla_kernel_bench_imports_and_refuses_to_run_without_cuda(monkeypatch, capsys):
    from bench import moe_kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert moe_kernels.main(["--quick"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    # Active FLOPs: Qwen3-30B-A3B's 8 experts of width 768 on one token.
    assert moe_kernels.moe_flops(1, **moe_kernels.MOE) == 2 * 8 * (2048 * 2 * 768 + 768 * 2048)
    assert moe_kernels.mla_flops(1, 1024, **moe_kernels.MLA) == 2 * 16 * 1024 * (576 + 512)


def test_summary_carries_the_moe_and_mla_kernel_figures(monkeypatch, tmp_path):
    ran = _fake_parts(monkeypatch, device_count=1)
    real_run = gpu_check.subprocess.run

    def run(cmd, **kwargs):
        if "bench.moe_kernels" in cmd:
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({
                "fused_moe": [{"tokens": 1, "ms": {"triton": 0.1}, "triton_vs_dense": 2.0, "ok": True}],
                "quantized_moe": [{"format": "int4", "tokens": 1, "ms": {"int4": 0.05, "bf16": 0.1}, "vs_bf16": 0.5,
                                   "ok": True}],
                "mla_decode": [{"batch": 1, "context": 1024, "ms": {"triton": 0.05}, "triton_vs_dense": 1.5,
                                "ok": True}]}))
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    assert gpu_check.main(["--out-dir", str(tmp_path)]) == 0
    assert any("bench.moe_kernels" in cmd for cmd in ran)
    part = json.loads((tmp_path / "summary.json").read_text())["parts"]["moe_mla_kernels"]
    assert part["fused_moe"][0]["triton_vs_dense"] == 2.0 and part["mla_decode"][0]["context"] == 1024
    assert part["quantized_moe"][0]["format"] == "int4" and part["quantized_moe"][0]["vs_bf16"] == 0.5


def test_a_gpu_calibrates_the_simulator_and_summary_carries_its_error(monkeypatch, tmp_path):
    ran = _fake_parts(monkeypatch, device_count=1)
    assert gpu_check.main(["--out-dir", str(tmp_path)]) == 0
    [cmd] = [cmd for cmd in ran if "simulator" in cmd]
    assert cmd[cmd.index("simulator") + 1] == "calibrate" and cmd[cmd.index("--model") + 1] == "bench-small"
    part = json.loads((tmp_path / "summary.json").read_text())["parts"]["calibrate_sim"]
    assert part["returncode"] == 0 and part["holdout_mape_points_pct"] == 3.5
    assert part["profile"] == str(tmp_path / gpu_check.CALIBRATED_PROFILE)


def test_the_quantized_gemm_bench_imports_and_refuses_to_run_without_cuda(monkeypatch, capsys):
    from bench import quant_gemm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert quant_gemm.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    # Llama-3-8B's o_proj as stored: bf16 2 bytes a weight; FP8 1 and a float32 per 128 x 128 block;
    # int4 half a byte, and a bf16 scale and a uint8 zero per row and 128 columns; NVFP4 half a byte, an
    # FP8 scale per 16 columns and a float32 global scale per row.
    assert quant_gemm.weight_bytes("bf16", 4096, 4096) == 2 * 4096 * 4096
    assert quant_gemm.weight_bytes("fp8_block", 4096, 4096) == 4096 * 4096 + 4 * 32 * 32
    assert quant_gemm.weight_bytes("int4_g128", 4096, 4096) == 4096 * 2048 + 4096 * 32 * 3
    assert quant_gemm.weight_bytes("nvfp4", 4096, 4096) == 4096 * 2048 + 4096 * 256 + 4096 * 4
    assert quant_gemm.gemm_bytes("bf16", 1, 4096, 4096) == 2 * 4096 * 4096 + 2 * 4096 + 2 * 4096


def test_summary_carries_the_quantized_gemm_figures(monkeypatch, tmp_path):
    ran = _fake_parts(monkeypatch, device_count=1)
    real_run = gpu_check.subprocess.run

    def run(cmd, **kwargs):
        if "bench.quant_gemm" in cmd:
            cell = {"ms": 0.02, "tflops": 1.5, "gb_per_s": 3000.0, "vs_bf16": 0.4, "ok": True}
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"gemms": [
                {"m": 1, "n": 4096, "k": 4096, "kernels": {"bf16": {**cell, "vs_bf16": 1.0}, "int4_g128": cell}}]}))
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    assert gpu_check.main(["--out-dir", str(tmp_path)]) == 0
    assert any("bench.quant_gemm" in cmd for cmd in ran)
    part = json.loads((tmp_path / "summary.json").read_text())["parts"]["quant_gemm"]
    assert part["gemms"][0]["int4_g128"]["vs_bf16"] == 0.4 and part["gemms"][0]["bf16"]["gb_per_s"] == 3000.0


def test_summary_carries_the_fp8_deepseek_run_s_figures(monkeypatch, tmp_path):
    ran = _fake_parts(monkeypatch, device_count=1)
    real_run = gpu_check.subprocess.run

    def run(cmd, **kwargs):
        if "bench.fp8_deepseek" in cmd:
            figures = {"output_tok_per_s": 900.0, "ms_per_token": 4.0, "errors": [], "runs": []}
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({
                "checkpoints": {"fp8": {**figures, "weight_bytes": 93, "quantization": "fp8 blocks [128, 128]"},
                                "dequantized": {**figures, "weight_bytes": 152, "quantization": ""}},
                "ratios": {"output_tok_per_s": 1.0, "ms_per_token": 1.0, "weight_bytes": 93 / 152},
                "agreement": {"identical": 60, "compared": 64, "first_difference": [30, 41, 50, 63]}}))
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    assert gpu_check.main(["--out-dir", str(tmp_path), "--num-requests", "64"]) == 0
    [cmd] = [cmd for cmd in ran if "bench.fp8_deepseek" in cmd]
    assert cmd[cmd.index("--attention-backend") + 1] == "triton" and cmd[cmd.index("--prompts") + 1] == "64"
    part = json.loads((tmp_path / "summary.json").read_text())["parts"]["fp8_deepseek_e2e"]
    assert part["returncode"] == 0 and part["greedy_identical"] == 60 and part["greedy_compared"] == 64
    assert part["fp8"]["quantization"] == "fp8 blocks [128, 128]" and part["dequantized"]["weight_bytes"] == 152
    assert part["fp8_over_bf16"]["weight_bytes"] == 93 / 152 and "errors" not in part["fp8"]


def test_a_gpu_runs_the_copy_workload_speculating_and_summary_carries_the_ratio(monkeypatch, tmp_path):
    ran = _fake_parts(monkeypatch, device_count=1)
    real_run = gpu_check.subprocess.run

    def run(cmd, **kwargs):
        if "--speculative" in cmd:
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"speculative": {
                "method": "ngram", "ratio_output_throughput": 1.8,
                "median": {"off": {"ms_per_output_token": 9.0}, "ngram": {"ms_per_output_token": 5.0}},
                "acceptance": {"mean_acceptance_length": 2.5}, "greedy": {"equal": True}}}))
        if "bench.mtp_deepseek" in cmd:
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"speculative": {
                "method": "mtp", "ratio_output_throughput": 0.7,
                "median": {"off": {"ms_per_output_token": 9.0}, "mtp": {"ms_per_output_token": 12.0}},
                "acceptance": {"mean_acceptance_length": 1.0}, "greedy": {"equal": True}}}))
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    assert gpu_check.main(["--out-dir", str(tmp_path)]) == 0
    [cmd] = [cmd for cmd in ran if "--speculative" in cmd]
    assert cmd[cmd.index("--workload") + 1] == "copy" and "EXECUTOR_ATTENTION_BACKEND=triton" in cmd
    parts = json.loads((tmp_path / "summary.json").read_text())["parts"]
    part = parts["speculative_e2e"]
    assert part["ratio_output_throughput"] == 1.8 and part["mean_acceptance_length"] == 2.5 and part["greedy_equal"]
    assert part["ms_per_token"] == {"off": 9.0, "ngram": 5.0}
    [cmd] = [cmd for cmd in ran if "bench.mtp_deepseek" in cmd]
    assert "EXECUTOR_ATTENTION_BACKEND=triton" in cmd
    assert parts["speculative_mtp_e2e"]["ms_per_token"] == {"off": 9.0, "mtp": 12.0}


def test_a_gpu_measures_what_batch_invariant_mode_costs_and_summary_carries_the_ratio(monkeypatch, tmp_path):
    ran = _fake_parts(monkeypatch, device_count=1)
    real_run = gpu_check.subprocess.run

    def run(cmd, **kwargs):
        if "bench.batch_invariant" in cmd:
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({
                "median_ratio": 0.93, "tokens_per_s": {"off": [1000.0], "on": [930.0]},
                "stable_requests": {"off": 63, "on": 64}}))
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    assert gpu_check.main(["--out-dir", str(tmp_path)]) == 0
    [cmd] = [cmd for cmd in ran if "bench.batch_invariant" in cmd]
    assert "EXECUTOR_ATTENTION_BACKEND=triton" in cmd and cmd[cmd.index("--model") + 1] == "bench-small"
    part = json.loads((tmp_path / "summary.json").read_text())["parts"]["batch_invariant_e2e"]
    assert part["on_over_off"] == 0.93 and part["stable_requests"]["on"] == 64


def test_the_lora_kernel_bench_imports_and_refuses_to_run_without_cuda(monkeypatch, capsys):
    from bench import lora_kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert lora_kernels.main(["--quick"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    # Its layer, on the CPU: adapters of ranks 8, 16 and 64 in slots 0-2, zero past each rank.
    lora = lora_kernels.make_layer(torch.device("cpu"), torch.float32)
    assert lora.slot_ranks[:4] == [8, 16, 64, 0] and lora.a.shape == (8, 3, 64, 4096)
    assert lora.a[0, :, 8:].abs().sum() == 0 and lora.b[1, 16:].abs().sum() == 0 and lora.b[2].abs().sum() > 0


def test_a_gpu_runs_the_lora_kernels_and_summary_carries_their_figures(monkeypatch, tmp_path):
    ran = _fake_parts(monkeypatch, device_count=1)
    real_run = gpu_check.subprocess.run

    def run(cmd, **kwargs):
        if "bench.lora_kernels" in cmd:
            ms = {"no_lora_layer": 0.02, "base_only": 0.021, "mixed_triton": 0.03, "mixed_torch": 0.2}
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"lora": [
                {"tokens": 1, "ms": ms, "base_only_over_no_lora": 1.05, "mixed_triton_over_base": 1.43,
                 "max_abs_diff": 0.01, "scale": 4.0, "ok": True}]}))
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    assert gpu_check.main(["--out-dir", str(tmp_path)]) == 0
    [cmd] = [cmd for cmd in ran if "bench.lora_kernels" in cmd]
    assert "--quick" in cmd
    part = json.loads((tmp_path / "summary.json").read_text())["parts"]["lora_kernels"]
    assert part["returncode"] == 0 and part["lora"][0]["base_only_over_no_lora"] == 1.05
    assert part["lora"][0]["ms"]["mixed_torch"] == 0.2 and "scale" not in part["lora"][0]
