"""The simulator: the real scheduler and engine core in virtual time against
a step-cost model (simulator/sim.py), its report, and its repeatability."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.traces import Trace, TraceOptions, TraceRecord, read_trace
from llmsched.assets import AZURE_CONV, MOONCAKE_CONV
from simulator.__main__ import main as sim_main
from simulator.__main__ import scheduler_settings
from simulator.cost_model import LinearCostModel
from simulator.profile import Geometry, HostCost, Profile, load_profile
from simulator.sim import simulate

REPO = Path(__file__).resolve().parents[2]


def profile(step_s=0.01, per_token=0.0, host=HostCost(), num_kv_blocks=256, max_model_len=512, host_blocks=0,
            swap_s=0.0) -> Profile:
    return Profile("test", True, {"model": "test-model", "device": "cpu", "tensor_parallel_size": 1},
                   Geometry(16, num_kv_blocks, max_model_len, 512, host_blocks),
                   LinearCostModel((step_s, per_token, 0.0, per_token, 0.0, swap_s)), host)


def trace(*records: tuple[float, int, int]) -> Trace:
    recs = [TraceRecord(i, t, p, o) for i, (t, p, o) in enumerate(records)]
    return Trace("memory", "azure", TraceOptions(), recs, 0)


def chunk_times(result, i=0):
    return [round(t, 9) for t in result.run.results[i].chunk_times]


def test_a_lone_request_runs_its_steps_back_to_back():
    r = simulate(profile(), scheduler_settings({}), trace((0.5, 20, 4)))
    assert chunk_times(r) == [0.51, 0.52, 0.53, 0.54]
    res = r.run.results[0]
    assert res.status == "ok" and res.completion_tokens == 4 and res.send_s == 0.5 and res.end_s == pytest.approx(0.54)
    assert r.server.num_steps == 4 and r.server.num_free_kv_blocks == 256


def test_the_schedulers_host_time_paces_steps_only_beyond_the_executors():
    slow_host = HostCost(per_step_s=0.03)
    # Two plans in flight: the cadence is the slower of executor and scheduler.
    r = simulate(profile(host=slow_host), scheduler_settings({}), trace((0.5, 20, 4)))
    assert chunk_times(r) == [0.54, 0.57, 0.6, 0.63]
    # One plan in flight: plan, run, update in turn, so the two add up.
    r = simulate(profile(host=slow_host), scheduler_settings({"SCHEDULER_MAX_PLANS_IN_FLIGHT": "1"}),
                 trace((0.5, 20, 4)))
    assert chunk_times(r) == [0.54, 0.58, 0.62, 0.66]
    # A fast scheduler hides behind the executor; only the stream latency shows.
    r = simulate(profile(host=HostCost(per_step_s=0.004, stream_latency_s=0.001)), scheduler_settings({}),
                 trace((0.5, 20, 4)))
    assert chunk_times(r) == [0.515, 0.525, 0.535, 0.545]


def test_batching_costs_what_the_model_says_per_token():
    # Two requests arriving together share every step.
    r = simulate(profile(step_s=0.01, per_token=0.001), scheduler_settings({}), trace((0.0, 10, 3), (0.0, 10, 3)))
    # Prefill step: 0.01 + 20 x 0.001; then two decode rows per step.
    assert chunk_times(r, 0) == chunk_times(r, 1) == [0.03, 0.042, 0.054]


def test_admission_control_and_a_small_pool_behave_as_in_the_server():
    # Eight requests at once into a pool that holds two: preemption and
    # queueing, and with SCHEDULER_MAX_QUEUED_REQUESTS=3 the rest is shed.
    records = [(0.0, 60, 40) for _ in range(8)]
    r = simulate(profile(num_kv_blocks=12), scheduler_settings({"SCHEDULER_MAX_QUEUED_REQUESTS": "3"}),
                 trace(*records))
    statuses = [x.status for x in r.run.results]
    assert statuses.count("rejected") == 5 and statuses.count("ok") == 3
    assert r.server.num_free_kv_blocks == 12
    r = simulate(profile(num_kv_blocks=12), scheduler_settings({}), trace(*records))
    assert all(x.status == "ok" and x.completion_tokens == 40 for x in r.run.results)
    assert r.server.num_preemptions > 0


def test_a_host_tier_swaps_victims_out_and_in_and_the_copies_cost_time():
    records = [(0.0, 60, 40) for _ in range(8)]
    swap = scheduler_settings({"SCHEDULER_PREEMPTION_MODE": "swap"})
    r = simulate(profile(num_kv_blocks=12, host_blocks=64, swap_s=1e-3), swap, trace(*records))
    assert all(x.status == "ok" and x.completion_tokens == 40 for x in r.run.results)
    s = r.server
    assert s.num_preemptions_swap > 0 and s.num_preemptions_recompute == 0 and s.recomputed_tokens == 0
    # Out: the victims and the prefix blocks the device pool evicts (spills);
    # in: the victims.
    assert s.swapped_blocks_out > s.swapped_blocks_in > 0
    assert s.swap_s == pytest.approx(1e-3 * (s.swapped_blocks_out + s.swapped_blocks_in))
    assert s.num_free_host_kv_blocks == 64
    # The same work recomputing its victims instead: the copies' time is
    # what separates the two runs' executor time.
    free = simulate(profile(num_kv_blocks=12, host_blocks=64, swap_s=0.0), swap, trace(*records))
    assert free.server.swapped_blocks_out == s.swapped_blocks_out
    assert s.executor_busy_s == pytest.approx(free.server.executor_busy_s + s.swap_s)


def test_an_unknown_or_misspelt_setting_is_refused_by_name():
    with pytest.raises(SystemExit, match="unknown scheduler setting 'SCHEDULER_MAX_BATCHED_TOKENS'"):
        scheduler_settings({"SCHEDULER_MAX_BATCHED_TOKENS": "1"})


def test_mooncake_prefixes_are_cached_as_the_trace_shares_them():
    moon = read_trace(MOONCAKE_CONV,
                      TraceOptions(window=(0, 60), length_scale=1 / 32, max_model_len=512))
    r = simulate(profile(num_kv_blocks=4096), scheduler_settings({}), moon)
    done = [x for x in r.run.results if x.ok]
    assert len(done) == len(moon.records)
    cached = sum(x.cached_prompt_tokens for x in done) / sum(x.prompt_tokens for x in done)
    # At most what the trace shares: prompt tokens in hash blocks seen before
    # (a block is cached only once computed, and one token is always left).
    seen, shared = set(), 0
    for rec in moon.records:
        for i, h in enumerate(rec.hash_ids):
            shared += min(rec.block_tokens, rec.prompt_len - i * rec.block_tokens) if h in seen else 0
            seen.add(h)
    assert 0.02 < cached <= shared / sum(rec.prompt_len for rec in moon.records)


def _run_cli(tmp_path, name, extra=(), env=None):
    out = tmp_path / f"{name}.json"
    argv = ["run", "--profile", "roofline/llama-3.1-8b_h100_tp1", "--trace",
            str(AZURE_CONV), "--trace-window", "0:40", "--length-scale", "0.5",
            "--out", str(out), *extra]
    if env is None:
        assert sim_main(argv) == 0
    else:
        proc = subprocess.run([sys.executable, "-m", "simulator", *argv], cwd=REPO, capture_output=True, text=True,
                              timeout=120, env={**os.environ, **env})
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "UNCALIBRATED" in proc.stdout
    return out


def test_runs_are_bit_for_bit_repeatable_and_labelled_uncalibrated(tmp_path):
    # Two processes with different hash seeds (set and dict orders differ).
    first = _run_cli(tmp_path, "a", ["--no-plots"], env={"PYTHONHASHSEED": "1"})
    second = _run_cli(tmp_path, "b", ["--no-plots"], env={"PYTHONHASHSEED": "12345"})
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    a["config"]["out"] = b["config"]["out"] = None
    assert a == b
    assert a["mode"] == "simulated, uncalibrated roofline"
    assert "UNCALIBRATED" in a["server"]["before"]["executor_instance_id"]
    s = a["summary"]
    assert s["completed"] == s["num_requests"] > 50 and s["ttft_ms"]["p99"] > 0


def test_bench_plots_draw_a_simulated_report(tmp_path):
    pytest.importorskip("matplotlib")
    out = _run_cli(tmp_path, "plotted", ["--trace-max-requests", "30"])
    assert (tmp_path / "plotted_latency_cdf.png").stat().st_size > 0
    assert (tmp_path / "plotted_throughput.png").stat().st_size > 0
    assert json.loads(out.read_text())["summary"]["completed"] == 30


def test_sweep_finds_the_highest_rate_meeting_the_target(tmp_path):
    out = tmp_path / "sweep.json"
    assert sim_main(["sweep", "--profile", "roofline/llama-3.1-8b_h100_tp1", "--trace",
                     str(AZURE_CONV), "--trace-window", "0:20", "--length-scale", "0.5",
                     "--setting", "SCHEDULER_MAX_NUM_SEQS", "--values", "2", "16", "--target", "ttft_ms.p99<=150",
                     "--iterations", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    few, many = (row["best"] for row in rows)
    assert few["figure"] <= 150 and many["figure"] <= 150
    # Two running requests at a time serve far less than sixteen.
    assert many["request_rate"] > 2 * few["request_rate"]
    for row in rows:
        higher = [t for t in row["tried"] if t["rate_scale"] > row["best"]["rate_scale"]]
        assert higher and all(t["figure"] is None or t["figure"] > 150 or t["rejected"] for t in higher)


def test_shipped_roofline_profiles_are_current_and_uncalibrated():
    from simulator import roofline

    for name, prof in roofline.all_profiles().items():
        if prof is None:
            assert name.startswith("llama-3.1-70b") and name.endswith(("tp1", "h100_tp2"))
            continue
        shipped = load_profile(f"roofline/{name}")
        assert shipped.to_dict() == prof.to_dict(), f"run python -m simulator roofline --write ({name})"
        assert not shipped.calibrated and "UNCALIBRATED" in shipped.label
        assert shipped.geometry.num_kv_blocks * 16 >= 131072


def test_the_simulator_never_imports_torch():
    code = ("import sys\nimport simulator.__main__, simulator.sim, simulator.report, simulator.calibrate\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
            "assert not bad, f'torch imported: {bad[:5]}'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
