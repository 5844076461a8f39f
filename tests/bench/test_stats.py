"""bench/stats.py: percentiles, per-request latency figures, Poisson
arrivals and the throughput timeline."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from bench.stats import (
    Distribution,
    inter_token_latencies,
    percentile,
    poisson_arrivals,
    throughput_timeline,
    tpot,
    ttft,
)


@pytest.mark.parametrize("values", [[5.0], [3.0, 1.0], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [0.1, 7.5, 2.2, 2.2, 9.9, -1]])
@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_agrees_with_numpy_linear_interpolation(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_nan_not_an_exception():
    assert math.isnan(percentile([], 50))


def test_percentile_rejects_q_outside_0_to_100():
    with pytest.raises(ValueError, match="percentile q"):
        percentile([1.0], 101)


def test_percentile_does_not_reorder_the_callers_list():
    values = [3.0, 1.0, 2.0]
    percentile(values, 50)
    assert values == [3.0, 1.0, 2.0]


def test_distribution_summarizes_and_scales_to_ms():
    d = Distribution.of([0.001, 0.002, 0.003]).scaled(1000)
    assert (d.count, d.mean, d.p50, d.max) == (3, pytest.approx(2.0), pytest.approx(2.0), pytest.approx(3.0))
    empty = Distribution.of([])
    assert empty.count == 0 and math.isnan(empty.p99)


def test_ttft_counts_from_send_to_first_token_chunk():
    assert ttft(1.0, [1.25, 1.5]) == pytest.approx(0.25)
    assert ttft(1.0, []) is None


def test_tpot_excludes_the_first_token():
    # 5 tokens: first at 1.0, last at 2.0 -> 4 gaps over 1 s.
    assert tpot(0.5, [1.0, 1.5, 2.0], 5) == pytest.approx(0.25)


def test_tpot_undefined_for_single_token_outputs():
    assert tpot(0.0, [1.0], 1) is None


def test_itl_is_one_gap_per_token_after_the_first():
    assert inter_token_latencies([1.0, 1.1, 1.3], [1, 1, 1]) == pytest.approx([0.1, 0.2])


def test_itl_spreads_a_merged_chunk_over_its_tokens():
    # A chunk of 4 tokens 0.4 s after the previous one: four gaps of 0.1.
    assert inter_token_latencies([1.0, 1.4], [1, 4]) == pytest.approx([0.1] * 4)


def test_itl_extra_tokens_in_first_chunk_are_zero_gaps():
    assert inter_token_latencies([1.0, 1.3], [3, 1]) == pytest.approx([0.0, 0.0, 0.3])


def test_itl_sums_to_e2e_minus_ttft_so_mean_itl_equals_tpot():
    times, tokens = [0.2, 0.25, 0.6, 0.61, 1.0], [2, 1, 3, 1, 2]
    gaps = inter_token_latencies(times, tokens)
    n = sum(tokens)
    assert len(gaps) == n - 1
    assert sum(gaps) == pytest.approx(times[-1] - times[0])
    assert statistics.mean(gaps) == pytest.approx(tpot(0.0, times, n))


def test_itl_ignores_responses_without_tokens():
    assert inter_token_latencies([1.0, 1.2, 1.5], [1, 0, 1]) == pytest.approx([0.5])


def test_itl_rejects_mismatched_lists():
    with pytest.raises(ValueError):
        inter_token_latencies([1.0], [1, 1])


def test_poisson_same_seed_same_schedule():
    assert poisson_arrivals(5.0, 42, num=100) == poisson_arrivals(5.0, 42, num=100)


def test_poisson_different_seed_different_schedule():
    assert poisson_arrivals(5.0, 1, num=20) != poisson_arrivals(5.0, 2, num=20)


def test_poisson_is_not_disturbed_by_the_global_random_state():
    import random

    first = poisson_arrivals(5.0, 7, num=10)
    random.seed(999)
    random.random()
    assert poisson_arrivals(5.0, 7, num=10) == first


def test_poisson_mean_rate_matches_the_requested_rate():
    rate = 8.0
    arrivals = poisson_arrivals(rate, 0, num=20_000)
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert len(arrivals) / arrivals[-1] == pytest.approx(rate, rel=0.03)


def test_poisson_gaps_are_exponential_not_regular():
    gaps = np.diff([0.0, *poisson_arrivals(2.0, 3, num=20_000)])
    # Exponential: standard deviation equals the mean (coefficient of variation 1).
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)


def test_poisson_duration_bounds_the_stream():
    arrivals = poisson_arrivals(10.0, 0, duration_s=5.0)
    assert all(t < 5.0 for t in arrivals)
    assert 30 < len(arrivals) < 70  # 50 expected; 7 sigma either way


def test_poisson_needs_a_bound_and_a_positive_rate():
    with pytest.raises(ValueError, match="num or duration_s"):
        poisson_arrivals(1.0, 0)
    with pytest.raises(ValueError, match="positive"):
        poisson_arrivals(0.0, 0, num=3)


def test_throughput_timeline_conserves_tokens():
    events = [(0.1, 5), (0.9, 3), (1.5, 2), (9.99, 4), (10.0, 1)]
    bucket, rates = throughput_timeline(events, duration_s=10.0)
    assert bucket == pytest.approx(0.5)  # short run: a twentieth of it
    assert sum(r * bucket for r in rates) == pytest.approx(15)


def test_throughput_timeline_uses_one_second_buckets_for_long_runs():
    bucket, rates = throughput_timeline([(0.5, 10), (29.5, 20)], duration_s=30.0)
    assert bucket == 1.0 and len(rates) == 30 and rates[0] == 10 and rates[-1] == 20
