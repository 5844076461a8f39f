"""The step-cost model: features of a plan, Lawson-Hanson NNLS against a
brute-force reference, and fitting on relative errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from simulator.cost_model import BASE_FEATURES, FEATURES, LinearCostModel, StepShape, fit, mape, nnls
from tests.factories import make_requests, make_scheduler


def brute_force_nnls(a, b):
    """The best least-squares solution over every subset of free variables
    whose unconstrained solution is non-negative: slow and obviously right."""
    best, best_x = np.inf, np.zeros(a.shape[1])
    for k in range(a.shape[1] + 1):
        for free in itertools.combinations(range(a.shape[1]), k):
            x = np.zeros(a.shape[1])
            if free:
                x[list(free)] = np.linalg.lstsq(a[:, list(free)], b, rcond=None)[0]
            if (x >= -1e-12).all():
                r = np.linalg.norm(a @ x - b)
                if r < best - 1e-12:
                    best, best_x = r, x
    return best_x


@pytest.mark.parametrize("seed", range(20))
def test_nnls_matches_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    m, n = rng.integers(3, 12), rng.integers(1, 6)
    a = rng.normal(size=(m, n))
    b = rng.normal(size=m)
    x = nnls(a, b)
    assert (x >= 0).all()
    ref = brute_force_nnls(a, b)
    assert np.linalg.norm(a @ x - b) <= np.linalg.norm(a @ ref - b) + 1e-9


def test_nnls_recovers_a_non_negative_truth_exactly():
    rng = np.random.default_rng(1)
    a = rng.uniform(size=(40, 5))
    truth = np.array([0.5, 0.0, 2.0, 0.0, 1.5])
    np.testing.assert_allclose(nnls(a, a @ truth), truth, atol=1e-9)


def test_features_of_a_scheduled_plan():
    sched = make_scheduler(max_prefill_chunk=32, max_num_batched_tokens=64)
    a, b = make_requests(2, prompt_len=20, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    shape = StepShape.of_plan(out)
    assert shape.rows == ((20, 0), (20, 0))
    # step, prefill tokens, chunk x context, decode rows, decode context, swaps, prefill rows
    assert shape.features() == (1.0, 40.0, 800.0, 0.0, 0.0, 0.0, 2.0)
    sched.update_from_output(out, [(h, 5, None) for h in out.sampling_handles()])
    shape = StepShape.of_plan(sched.schedule())
    assert shape.features() == (1.0, 0.0, 0.0, 2.0, 42.0, 0.0, 0.0)


def test_fit_recovers_coefficients_and_scores_relative_error():
    truth = LinearCostModel((2e-3, 1e-5, 1e-9, 3e-5, 1e-8, 0.0))
    shapes = [StepShape(tuple((n, ctx) for _ in range(rows)))
              for n in (1, 16, 128) for ctx in (0, 100, 400) for rows in (1, 8, 32)]
    xs = [s.features() for s in shapes]
    ys = [truth.predict(x) for x in xs]
    model = fit(xs, ys)
    assert mape(model, xs, ys) < 1e-6
    assert model.coefficients[FEATURES.index("swapped_blocks")] == 0.0  # never measured: stays 0
    noisy = [y * (1.1 if i % 2 else 0.9) for i, y in enumerate(ys)]
    assert 9 < mape(truth, xs, noisy) < 11


def test_negative_coefficients_and_unknown_features_are_refused():
    with pytest.raises(ValueError, match="non-negative"):
        LinearCostModel((1.0, -1.0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="unknown cost features"):
        LinearCostModel.from_dict({"steps": 1.0})


def test_the_base_model_leaves_the_extended_features_at_zero():
    # A profile of the six coefficients reads the per-row cost as 0.
    assert LinearCostModel((1.0, 2.0, 3.0, 4.0, 5.0, 6.0)).as_dict()["prefill_rows"] == 0.0
    assert LinearCostModel.from_dict({"step": 1.0}).coefficients == (1.0,) + (0.0,) * (len(FEATURES) - 1)
    truth = LinearCostModel((2e-3, 1e-5, 1e-9, 3e-5, 1e-8, 0.0, 4e-4))
    shapes = [StepShape(tuple((n, ctx) for _ in range(rows)))
              for n in (1, 16, 128) for ctx in (0, 100, 400) for rows in (1, 8, 32)]
    xs = [s.features() for s in shapes]
    ys = [truth.predict(x) for x in xs]
    base = fit(xs, ys, BASE_FEATURES)
    assert base.as_dict()["prefill_rows"] == 0.0 and mape(base, xs, ys) > 1
    extended = fit(xs, ys)
    assert mape(extended, xs, ys) < 1e-6
