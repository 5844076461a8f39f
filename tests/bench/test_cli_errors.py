"""`python -m bench` fails loudly and briefly: one line on stderr and a
non-zero exit when no server answers, or when no request completes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmsched.launch import free_port

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--model", "tiny-random", "--num-requests", "3", "--prompt-median", "8", "--prompt-min", "4",
         "--prompt-max", "16", "--output-median", "4", "--output-min", "2", "--output-max", "8",
         "--check-requests", "0", "--no-plots", "--no-progress"]


def run_bench(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def test_no_server_listening_is_one_line_and_exit_1(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    proc = run_bench(["--address", address, *SMALL, "--out", str(tmp_path / "r.json")], timeout_s=60)
    assert proc.returncode == 1, f"exit code {proc.returncode}; stderr: {proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = error_lines(proc.stderr)
    assert f"no llmsched scheduler answers at {address}" in line and "UNAVAILABLE" in line, line


@pytest.mark.slow
def test_a_run_where_no_request_completes_exits_1_and_says_why(tmp_path):
    # Prompt ids drawn from a vocabulary larger than the served model's
    # (as with a --model other than the server's): every request is refused.
    out = tmp_path / "r.json"
    proc = run_bench(["--launch", *SMALL, "--vocab-size", "1000000", "--out", str(out)], timeout_s=180)
    assert proc.returncode == 1, f"exit code {proc.returncode}; stderr: {proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = error_lines(proc.stderr)
    assert "none of the 3 requests completed" in line and "INVALID_ARGUMENT" in line, line
    assert out.exists(), "the report of the failed run is still written"


def test_trace_options_are_checked_before_anything_starts():
    from bench.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--workload", "trace"])  # no --trace
    with pytest.raises(SystemExit):
        parse_args(["--trace", "x.csv"])  # a trace without --workload trace
    with pytest.raises(SystemExit):
        parse_args(["--workload", "trace", "--trace", "x.csv", "--request-rate", "3"])
    args = parse_args(["--workload", "trace", "--trace", "x.csv", "--trace-window", "60:120", "--rate-scale", "2"])
    assert (args.trace_window, args.rate_scale, args.length_scale) == ("60:120", 2.0, 1.0)


def test_think_time_is_checked_before_anything_starts():
    from bench.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--workload", "multi-turn", "--think-time", "-1"])
    with pytest.raises(SystemExit):
        parse_args(["--workload", "mixed", "--think-time", "2"])  # no sessions to pause
    assert parse_args(["--workload", "multi-turn", "--think-time", "2"]).think_time == 2.0


def test_copy_and_speculative_options_are_checked_before_anything_starts(capsys):
    from bench.cli import parse_args

    refused = {
        ("--speculative", "4"): "--speculative needs --launch",
        ("--launch", "--speculative", "0"): "K must be at least 1",
        ("--launch", "--speculative", "4", "--endpoint", "openai"): "--speculative needs --endpoint grpc",
        ("--launch", "--speculative", "4", "--baseline", "hf-static"): "not with --baseline",
        ("--launch", "--speculative", "4", "--rounds", "0"): "--rounds must be at least 1",
        ("--rounds", "2"): "--rounds is for --speculative only",
        ("--speculative-method", "mtp"): "choose the speculating stack of --speculative K",
        ("--launch", "--speculative", "4", "--speculative-method", "draft"): "--draft-model goes with",
        ("--launch", "--speculative", "4", "--draft-model", "x"): "--draft-model goes with",
        ("--copy-source-tokens", "40"): "--copy-source-tokens is for --workload copy only",
        ("--workload", "copy", "--copy-output-tokens", "0"): "--copy-output-tokens must be at least 1",
        ("--workload", "copy", "--endpoint", "openai", "http://127.0.0.1:1"): "--workload copy needs --endpoint grpc",
        ("--workload", "copy", "--baseline", "hf-static"): "not implemented for --workload copy",
        ("--workload", "copy", "--dataset", "x.jsonl"): "--dataset replaces the workload",
    }
    for argv, message in refused.items():
        with pytest.raises(SystemExit):
            parse_args(list(argv))
        assert message in capsys.readouterr().err, argv
    args = parse_args(["--workload", "copy"])
    # One stream unless told otherwise, and the documented lengths.
    assert (args.max_concurrency, args.copy_source_tokens, args.copy_output_tokens, args.rounds) == (1, 120, 100, None)
    assert parse_args(["--workload", "copy", "--max-concurrency", "4"]).max_concurrency == 4
    assert parse_args(["--launch", "--speculative", "2"]).rounds == 3
