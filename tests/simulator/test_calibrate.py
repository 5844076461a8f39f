"""Calibration: synthetic plans the executor accepts, the fit with held-out
points, and one small calibration against a real executor."""

from __future__ import annotations

import random

import pytest

from simulator.calibrate import GridPoint, Measurement, PlanWriter, calibrate, default_grid, fit_measurements, scenario
from simulator.cost_model import FEATURES, LinearCostModel, StepShape
from simulator.profile import load_profile


def test_scenarios_name_valid_handles_and_blocks_and_give_them_back():
    w = PlanWriter(num_blocks=64, block_size=16, vocab_size=512)
    shapes = []
    for p in (GridPoint("prefill", 2, 32, 16), GridPoint("decode", 3, 40), GridPoint("mix", 2, 0, 20, 16)):
        for plan, shape in scenario(w, p, 2):
            if shape is not None:
                shapes.append(shape.rows)
            for n in plan.new_requests:
                assert len(n.block_ids) * 16 >= n.num_computed_tokens + n.num_scheduled_tokens
                assert all(3 <= t < 512 for t in n.token_ids)
            assert set(plan.cached_handles) <= set(w.tables) | set(plan.finished_handles)
    assert shapes[:2] == [((32, 16), (32, 16))] * 2
    assert shapes[2:4] == [((1, 40), (1, 40), (1, 40)), ((1, 41), (1, 41), (1, 41))]
    assert shapes[4] == ((16, 0), (1, 20), (1, 20))
    assert not w.tables and sorted(w.free_blocks) == list(range(64))


def test_the_default_grid_covers_prefill_decode_and_mixes_within_the_context():
    grid = default_grid(512)
    assert {p.kind for p in grid} == {"prefill", "decode", "mix"}
    assert all(p.context + p.length < 512 for p in grid if p.kind == "prefill")
    assert max(p.rows for p in grid if p.kind == "decode") == 256
    assert len(default_grid(1 << 20)) > len(grid)


def test_the_fit_is_scored_on_points_it_never_saw():
    truth = LinearCostModel((2e-3, 1e-5, 1e-7, 3e-5, 5e-7, 0.0))
    rng = random.Random(0)
    ms = []
    for p in default_grid(512):
        rows = [(p.length, p.context)] * p.rows if p.kind == "prefill" else [(1, p.length or p.context)] * p.rows
        if p.kind == "mix":
            rows.append((p.chunk, 0))
        shape = StepShape(tuple(rows))
        ms += [Measurement(p, shape, truth.step_seconds(shape) * rng.uniform(0.97, 1.03)) for _ in range(3)]
    fit = fit_measurements(ms)
    assert fit.holdout_points == len(default_grid(512)) // 5
    assert fit.holdout_mape_points < 3 and fit.holdout_mape_steps < 3
    # The model recovers a truth of its own form (noise may lend
    # the extended one a small per-row cost, and with it the lead).
    base = fit.candidates["base"]["coefficients"]
    for name, t in zip(FEATURES, truth.coefficients):
        assert base[name] == pytest.approx(t, rel=0.2, abs=1e-9), name
    scores = {name: c["holdout_mape_points_pct"] for name, c in fit.candidates.items()}
    assert set(scores) == {"base", "extended"} and fit.holdout_mape_points == min(scores.values())


def test_the_extended_model_is_kept_only_when_it_predicts_held_out_steps_better():
    # A fixed cost per prefill row, which the features cannot carry.
    truth = LinearCostModel((2e-3, 1e-5, 1e-7, 3e-5, 5e-7, 0.0, 1e-3))
    ms = []
    for p in default_grid(512):
        rows = [(p.length, p.context)] * p.rows if p.kind == "prefill" else [(1, p.length or p.context)] * p.rows
        if p.kind == "mix":
            rows.append((p.chunk, 0))
        shape = StepShape(tuple(rows))
        ms += [Measurement(p, shape, truth.step_seconds(shape)) for _ in range(2)]
    fit = fit_measurements(ms)
    assert fit.model == "extended" and fit.holdout_mape_points < 1e-3
    assert fit.candidates["base"]["holdout_mape_points_pct"] > 1
    assert fit.profile_cost.as_dict()["prefill_rows"] == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.slow
def test_calibrate_a_real_executor_writes_a_profile_with_its_provenance(tmp_path):
    grid = [GridPoint("prefill", 1, 32, 0), GridPoint("prefill", 2, 64, 32), GridPoint("decode", 4, 64),
            GridPoint("decode", 16, 128), GridPoint("mix", 4, 0, 64, 32), GridPoint("decode", 1, 32)]
    out = tmp_path / "tiny.json"
    profile = calibrate("tiny-random", {}, out, rounds=1, steps=2, grid=grid, log=lambda msg: None)
    loaded = load_profile(out)
    assert loaded.to_dict() == profile.to_dict() and loaded.calibrated
    p = loaded.provenance
    assert p["source"] == "calibrate" and p["model"] == "tiny-random" and p["device"] == "cpu"
    assert p["tensor_parallel_size"] == 1 and p["executor_env"]["EXECUTOR_NUM_THREADS"] == "1"
    assert p["commit"] and p["dtype"]
    assert loaded.geometry.block_size == 16 and loaded.geometry.max_model_len > 0
    f = loaded.fit
    assert f["num_steps"] == 12 and f["holdout_points"] == 1 and f["features"] == list(FEATURES)
    assert loaded.step_cost.step_seconds(StepShape(((1, 100),))) > 0
