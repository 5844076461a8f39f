"""bench/report.py, the greedy comparison and CLI helpers, on synthetic
runs: no server, no model."""

from __future__ import annotations

import json
import math

import pytest

from bench import cli
from bench.baselines import BaselineResult, compare_outputs
from bench.client import RequestResult, RunResult
from bench.report import (baseline_record, format_speculative, format_table, speculative_record,
                          speculative_summary_line, summarize, without_nan, write_json)


def _result(i, status="ok", send=0.0, chunks=((1.0, 1), (1.5, 1), (2.0, 2)), prompt=10, cached=0):
    r = RequestResult(i, f"r{i}", 0.0, 4, prompt, send_s=send, status=status, prompt_tokens=prompt,
                      cached_prompt_tokens=cached)
    for t, k in chunks:
        r.chunk_times.append(t)
        r.chunk_tokens.append(k)
        r.output_ids.extend([7] * k)
    r.end_s = chunks[-1][0] if chunks else send
    return r


def test_summary_counts_rejected_and_failed_apart_from_completed():
    results = [_result(0), _result(1, cached=5), _result(2, status="rejected", chunks=()),
               _result(3, status="failed", chunks=())]
    s = summarize(RunResult(results, duration_s=2.0, started_unix=0.0))
    assert (s["num_requests"], s["completed"], s["rejected"], s["failed"]) == (4, 2, 1, 1)
    assert s["total_output_tokens"] == 8 and s["output_throughput"] == pytest.approx(4.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["cached_prompt_tokens"] == 5 and s["cached_prompt_fraction"] == pytest.approx(0.25)
    assert s["ttft_ms"]["p50"] == pytest.approx(1000.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(1000.0 / 3)
    assert s["itl_ms"]["count"] == 6


def test_summary_of_a_run_where_everything_failed_has_no_latencies_but_no_crash():
    s = summarize(RunResult([_result(0, status="failed", chunks=())], duration_s=0.0, started_unix=0.0))
    assert s["completed"] == 0 and math.isnan(s["ttft_ms"]["p99"])
    report = {"summary": s, "workload": {"name": "mixed"}, "mode": "offline", "config": {"model": "m"},
              "baselines": [], "requests": []}
    assert "TTFT" in format_table(report)


def test_ratio_is_ours_over_baseline():
    b = BaselineResult("hf-static", wall_s=4.0, num_requests=2, output_tokens=100, outputs=[[1], [2]])
    rec = baseline_record(b, {"output_throughput": 50.0, "request_throughput": 1.0}, None)
    assert rec["ratio_output_throughput"] == pytest.approx(2.0)
    assert rec["ratio_request_throughput"] == pytest.approx(2.0)


def test_json_report_has_no_nan_tokens(tmp_path):
    path = tmp_path / "r.json"
    write_json({"a": math.nan, "b": [1.0, math.nan], "c": {"d": math.nan}}, path)
    assert "NaN" not in path.read_text()
    assert json.loads(path.read_text()) == {"a": None, "b": [1.0, None], "c": {"d": None}}
    assert without_nan((1, math.nan)) == [1, None]


def test_compare_outputs_reports_where_greedy_outputs_part():
    m = compare_outputs([0, 1, 2], [[1, 2, 3], [1, 2, 3], [1, 2]], [[1, 2, 3], [1, 9, 3], [1, 2, 3]])
    assert [(x.index, x.first_diff, x.ours_len, x.theirs_len) for x in m] == [(1, 1, 3, 3), (2, 2, 2, 3)]


def test_env_pairs_split_on_the_first_equals_sign():
    assert cli.parse_env_pairs(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    with pytest.raises(SystemExit):
        cli.parse_env_pairs(["NOEQUALS"])


def test_offline_unless_a_rate_is_given():
    assert cli.resolve_rate(cli.parse_args([])) is None
    assert cli.resolve_rate(cli.parse_args(["--request-rate", "3"])) == 3.0


def test_overload_without_a_rate_is_refused():
    with pytest.raises(SystemExit, match="overload needs"):
        cli.resolve_rate(cli.parse_args(["--workload", "overload"]))


def test_rate_from_a_previous_report_uses_the_factor(tmp_path):
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps({"summary": {"request_throughput": 10.0}}))
    assert cli.resolve_rate(cli.parse_args(["--capacity-from", str(prev)])) == pytest.approx(7.0)
    over = cli.parse_args(["--workload", "overload", "--capacity-from", str(prev)])
    assert cli.resolve_rate(over) == pytest.approx(20.0)


def test_scale_options_shrink_the_workload_and_overrides_win():
    args = cli.parse_args(["--num-requests", "50", "--prompt-len-scale", "0.125", "--output-len-scale", "0.125",
                           "--output-max", "20"])
    work = cli.build_workload(args, 8192, rate=None)
    assert len(work.requests) == 50
    assert all(2 <= r.prompt_len <= 128 and 1 <= r.max_tokens <= 20 for r in work.requests)
    assert all(r.arrival_s == 0.0 for r in work.requests)


def test_shared_prefix_scaling_and_explicit_lengths():
    args = cli.parse_args(["--workload", "shared-prefix", "--num-requests", "3", "--prompt-len-scale", "0.25",
                           "--shared-output-len", "5"])
    work = cli.build_workload(args, 8192, rate=None)
    assert {(r.prompt_len, r.max_tokens) for r in work.requests} == {(128 + 8, 5)}


def test_speculative_record_compares_each_round_between_the_stacks():
    def run(*results):
        return RunResult(list(results), duration_s=2.0, started_unix=0.0)

    differs = _result(1)
    differs.output_ids[2] = 9
    runs = [(0, "off", run(_result(0), _result(1))), (0, "ngram", run(_result(0), differs)),
            (1, "ngram", run(_result(0), _result(1))), (1, "off", run(_result(0), _result(1, status="failed")))]
    acceptance = {"steps": 4.0, "accepted": 2.0, "drafted": 8.0, "mean_acceptance_length": 1.5}
    rec = speculative_record(runs, acceptance, sources_equal=None)
    greedy = rec["greedy"]
    # Round 1's failed request is not compared; round 0's second differs.
    assert (greedy["compared"], greedy["identical"], greedy["equal"]) == (3, 2, False)
    assert greedy["mismatches"] == ['round 0: {"request": 1, "first_diff_token": 2, "ours_len": 4, "theirs_len": 4}']
    assert [(r["round"], r["stack"]) for r in rec["runs"]] == [(0, "off"), (0, "ngram"), (1, "ngram"), (1, "off")]
    assert rec["median"]["off"]["output_throughput"] == pytest.approx(3.0)  # 8 and 4 tokens in 2 s
    assert rec["ratio_output_throughput"] == pytest.approx(4.0 / 3.0)
    assert rec["median"]["ngram"]["ms_per_output_token"] == pytest.approx(250.0)
    report = {"speculative": {"method": "ngram", "tokens": 4, "rounds": 2, **rec}, "workload": {"name": "mixed"}, "mode": "offline",
              "config": {"model": "m", "max_concurrency": None}}
    assert "Mean acceptance length" in format_speculative(report) and "1.50" in format_speculative(report)
    assert "greedy outputs identical: False" in speculative_summary_line(report)
    assert speculative_record(runs[2:], acceptance, sources_equal=False)["greedy"]["equal"] is False
