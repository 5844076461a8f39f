"""The bench tools end to end against services they launch: `python -m
bench --launch` on tiny-random with a tiny hf-static baseline, the single
stream, and the agent APIs' latency and Responses store memory runs. Checks
the reports are complete, not speed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SUMMARY_KEYS = {"num_requests", "completed", "rejected", "failed", "duration_s", "request_throughput",
                "output_throughput", "total_token_throughput", "total_prompt_tokens", "total_output_tokens",
                "cached_prompt_tokens", "cached_prompt_fraction", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms",
                "queue_ms", "timeline"}
REQUEST_KEYS = {"index", "request_id", "status", "error", "finish_reason", "prompt_len", "max_tokens",
                "prompt_tokens", "completion_tokens", "output_tokens", "cached_prompt_tokens", "arrival_s", "send_s",
                "end_s", "ttft_s", "tpot_s", "e2e_s", "chunk_times_s", "chunk_tokens"}


@pytest.mark.slow
def test_launch_run_writes_a_complete_report_with_a_baseline(tmp_path):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "bench", "--launch", "--model", "tiny-random", "--num-requests", "5",
           "--prompt-median", "8", "--prompt-min", "4", "--prompt-max", "24",
           "--output-median", "4", "--output-min", "2", "--output-max", "8",
           "--baseline", "hf-static", "--hf-static-batch-size", "2", "--check-requests", "2",
           "--out", str(out), "--no-plots"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Output token throughput" in proc.stdout and "hf-static" in proc.stdout

    report = json.loads(out.read_text())
    assert {"mode", "workload", "config", "environment", "summary", "server", "correctness", "baselines",
            "requests"} <= set(report)
    s = report["summary"]
    assert SUMMARY_KEYS <= set(s)
    assert s["completed"] == 5 and s["failed"] == 0 and s["rejected"] == 0
    assert {"mean", "p50", "p90", "p99"} <= set(s["ttft_ms"])
    assert len(report["requests"]) == 5
    for r in report["requests"]:
        assert REQUEST_KEYS <= set(r)
        assert r["output_tokens"] == r["max_tokens"] == sum(r["chunk_tokens"])
    assert report["server"]["kv_blocks_held_after"] == 0
    assert 0 < report["server"]["p6_kv_utilisation"] <= 1
    assert 0 <= report["server"]["p7_executor_idle_fraction"] < 1
    [b] = report["baselines"]
    assert b["name"] == "hf-static" and b["output_tokens"] == s["total_output_tokens"]
    assert b["ratio_output_throughput"] > 0
    assert b["agreement"]["compared"] == 5
    assert report["correctness"]["per_baseline"]["hf-static"]["checked"] == 2
    assert (tmp_path / "report.services.log").exists()


@pytest.mark.slow
def test_openai_endpoint_run_through_a_launched_gateway(tmp_path):
    out = tmp_path / "openai.json"
    cmd = [sys.executable, "-m", "bench", "--launch", "--endpoint", "openai", "--model", "tiny-random",
           "--num-requests", "4", "--prompt-median", "8", "--prompt-min", "4", "--prompt-max", "24",
           "--output-median", "4", "--output-min", "2", "--output-max", "8", "--text-prompts",
           "--out", str(out), "--no-plots", "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    s = report["summary"]
    assert s["completed"] == 4 and s["failed"] == 0 and report["config"]["endpoint"] == "openai"
    for r in report["requests"]:
        # ignore_eos: exactly max_tokens each, counted from usage.
        assert r["output_tokens"] == r["completion_tokens"] == r["max_tokens"] == sum(r["chunk_tokens"])
        assert r["prompt_tokens"] > 0 and r["ttft_s"] is not None
    assert report["server"]["kv_blocks_held_after"] == 0


def test_openai_endpoint_refuses_baselines_it_cannot_check():
    proc = subprocess.run([sys.executable, "-m", "bench", "--endpoint", "openai", "http://127.0.0.1:1",
                           "--baseline", "hf-static"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--baseline needs --endpoint grpc" in proc.stderr


@pytest.mark.slow
def test_single_stream_reports_each_configuration_against_hf_with_equal_tokens(tmp_path, stories_path):
    # Compile off only: the compiled decode steps' tokens are checked against
    # HF by test_oracle and test_compiled_decode, and a compile here cost
    # this test most of its 40-60 s.
    out = tmp_path / "single.json"
    cmd = [sys.executable, "-m", "bench.single_stream", "--model", str(stories_path), "--tokens", "6",
           "--repeats", "1", "--plans-in-flight", "1", "--plans-in-flight", "2", "--torch-compile", "off",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["hf_generate_ms_per_token"] > 0
    assert set(report["ours"]) == {"1-in-flight-compile-off", "2-in-flight-compile-off"}
    for name, run in report["ours"].items():
        assert run["tokens_equal_hf"], name
        assert run["ms_per_token"] > 0 and len(run["runs_ms"]) == 1, name
        assert run["executor_idle_us_per_plan"] > 0, name


@pytest.mark.slow
def test_agent_api_overhead_times_the_three_apis_on_equal_answers(tmp_path):
    out = tmp_path / "agent.json"
    cmd = [sys.executable, "-m", "bench.agent_api_overhead", "--rounds", "5", "--warmup", "1", "--max-tokens", "4",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mismatches"] == [], "the APIs answered the same conversation differently"
    assert report["output_tokens"] > 0 and len(report["round_seconds"]) == 5
    assert set(report["per_api"]) == {"chat", "responses", "messages"}
    for api, s in report["per_api"].items():
        assert 0 < s["p50_ms"] <= s["p90_ms"], api
    for key in ("added_over_chat_ms", "gateway_cpu_added_over_chat_ms"):
        assert set(report[key]) == {"responses", "messages"}, key
        assert all(math.isfinite(d["p50_ms"]) for d in report[key].values()), key
    assert all(s["p50_ms"] > 0 for s in report["gateway_cpu_per_api"].values())


@pytest.mark.slow
def test_response_store_memory_run_evicts_down_to_the_cap(tmp_path):
    out = tmp_path / "store.json"
    cmd = [sys.executable, "-m", "bench.response_store_memory", "--responses", "200", "--cap", "50", "--threads", "4",
           "--max-output-tokens", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["checks"] == {"num_still_stored": 50, "num_still_stored_is_cap": True, "first_sent_is_gone": True,
                                "last_batch_is_stored": True}
    assert [s["stored"] for s in report["samples"]] == [50, 100, 150, 200]
    assert all(s["rss_kib"] > 0 for s in report["samples"]) and report["rss_when_full_kib"] > 0
    assert math.isfinite(report["growth_after_full"])


@pytest.mark.slow
def test_speculative_bench_runs_both_stacks_on_equal_greedy_tokens(tmp_path):
    out = tmp_path / "p21.json"
    cmd = [sys.executable, "-m", "bench.speculative", "--rounds", "1", "--story-tokens", "24", "--copy-tokens", "16",
           "--streams", "4", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["greedy_equal"], "speculation changed a greedy output"
    assert report["drafts"] > 0 and report["mean_acceptance_length"] >= 1
    assert report["copy_speedup"] > 0 and report["mixed_ratio"] > 0


@pytest.mark.slow
def test_speculative_copy_run_reports_both_stacks_acceptance_and_equal_greedy_outputs(tmp_path, stories_path):
    out = tmp_path / "spec.json"
    cmd = [sys.executable, "-m", "bench", "--launch", "--model", str(stories_path), "--workload", "copy",
           "--num-requests", "2", "--copy-source-tokens", "40", "--copy-output-tokens", "20", "--speculative", "4",
           "--rounds", "1", "--check-requests", "1", "--out", str(out), "--no-plots", "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "greedy outputs identical: True" in proc.stdout
    report = json.loads(out.read_text())
    assert report["workload"]["name"] == "copy" and "opening again" in report["workload"]["prompts"]
    sp = report["speculative"]
    assert [(r["round"], r["stack"]) for r in sp["runs"]] == [(0, "off"), (0, "ngram")]
    for run in sp["runs"]:
        assert run["summary"]["completed"] == 2 and run["output_throughput"] > 0, run["stack"]
        for r in run["requests"]:
            # The opening, its 40-token story and the opening again; 20 tokens out.
            assert r["prompt_len"] > 40 and r["output_tokens"] == 20
    for name in ("off", "ngram"):
        assert sp["median"][name]["ms_per_output_token"] > 0 and sp["median"][name]["ttft_ms_p50"] > 0, name
        assert sp["server"][name]["kv_blocks_held_after"] == 0, name
    assert sp["ratio_output_throughput"] > 0
    # The model copies its own story: some drafts are accepted.
    assert sp["acceptance"]["drafted"] > 0 and sp["acceptance"]["mean_acceptance_length"] > 1
    assert sp["greedy"] == {"compared": 2, "identical": 2, "mismatches": [], "copy_sources_equal": True,
                            "equal": True}
    assert (tmp_path / "spec.off.services.log").exists() and (tmp_path / "spec.ngram.services.log").exists()


@pytest.mark.slow
def test_batch_invariant_bench_runs_both_stacks_and_the_modes_tokens_repeat_every_round(tmp_path):
    """Through the real services: the mode's executor passes its start-up
    self-test, its scheduler learns the mode in the handshake, and every
    request gets the same tokens in both rounds (the command exits 1 if not)."""
    out = tmp_path / "p22.json"
    cmd = [sys.executable, "-m", "bench.batch_invariant", "--rounds", "2", "--streams", "6", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["stable_requests"]["on"] == 6
    assert len(report["tokens_per_s"]["on"]) == len(report["tokens_per_s"]["off"]) == 2
    assert report["median_ratio"] > 0
