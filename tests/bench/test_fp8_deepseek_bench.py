"""bench/fp8_deepseek.py end to end on the CPU at its tiny shape: it builds
the random DeepSeek-V3, its FP8 block copy and the dequantized copy, serves
the last two through both services, and reports their figures. On the CPU
both dequantize the same FP8 values with the same function before the same
bf16 matmuls, so their greedy tokens must be identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import fp8_deepseek


@pytest.mark.slow  # starts the services twice: ~20 s on two cores
def test_the_fp8_deepseek_bench_serves_both_checkpoints_and_they_agree(tmp_path, capsys):
    out = tmp_path / "fp8_deepseek.json"
    assert fp8_deepseek.main(["--tiny", "--attention-backend", "torch", "--prompts", "3", "--tokens", "6",
                              "--rounds", "1", "--num-threads", "1", "--executor-env", "EXECUTOR_NUM_KV_BLOCKS=64",
                              "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    fp8, plain = report["checkpoints"]["fp8"], report["checkpoints"]["dequantized"]
    assert fp8["quantization"] == "fp8 blocks [128, 128]" and plain["quantization"] == ""
    # Linears at 1 byte a weight (and a float32 per block) against 2; the
    # embeddings and head, about a third of the tiny model, stay bf16.
    assert fp8["weight_bytes"] < 0.7 * plain["weight_bytes"], (fp8["weight_bytes"], plain["weight_bytes"])
    assert report["agreement"] == {"identical": 3, "compared": 3, "first_difference": []}, report["agreement"]
    for result in (fp8, plain):
        (run,) = result["runs"]
        assert not result["errors"] and [len(t) for t in run["tokens"]] == [6, 6, 6]
        assert result["output_tok_per_s"] > 0 and result["ms_per_token"] > 0
    # Greedy tokens of a random model at a trained model's scale are not one token repeated.
    assert all(len(set(t)) > 1 for t in fp8["runs"][0]["tokens"]), fp8["runs"][0]["tokens"]
    printed = capsys.readouterr().out
    assert "greedy tokens identical on 3 of 3 prompts" in printed and "'fp8 blocks [128, 128]'" in printed


def test_a_launch_that_fails_exits_1_and_the_report_says_why(monkeypatch, tmp_path):
    def serve(model, prompts, tokens, rounds, env):
        if model.name == "dequantized":
            raise RuntimeError("process for 127.0.0.1:1 exited with code 1 before serving")
        return {"weight_bytes": 1, "quantization": "fp8 blocks [128, 128]", "errors": [], "runs": []}

    monkeypatch.setattr(fp8_deepseek, "make_bf16", lambda directory, shape: directory)
    monkeypatch.setattr(fp8_deepseek, "write_fp8", lambda plain, out: out)
    monkeypatch.setattr(fp8_deepseek, "write_dequantized", lambda fp8, out: Path(out))
    monkeypatch.setattr(fp8_deepseek, "serve", serve)
    out = tmp_path / "report.json"
    assert fp8_deepseek.main(["--tiny", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["checkpoints"]["dequantized"]["errors"] == [
        "launch: process for 127.0.0.1:1 exited with code 1 before serving"]
    assert "ratios" not in report
