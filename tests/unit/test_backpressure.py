import pytest

from scheduler_svc.backpressure import AdmissionLimits, Overloaded, ThroughputEstimator, check_admission

LIMITS = AdmissionLimits(max_queued_requests=10, max_queued_tokens=1000, max_queue_delay_ms=2000)


def warmed(tokens_per_s: float) -> ThroughputEstimator:
    est = ThroughputEstimator()
    for _ in range(10):
        est.observe(int(tokens_per_s), 1.0)
    return est


def test_request_within_every_bound_is_admitted():
    check_admission(LIMITS, warmed(1000), num_queued_requests=3, num_queued_tokens=500, num_prompt_tokens=100)


def test_full_queue_is_refused_with_a_retry_hint():
    with pytest.raises(Overloaded, match="queue is full") as exc:
        check_admission(LIMITS, warmed(1000), 10, 100, 10)
    assert exc.value.retry_after_ms > 0


def test_queued_token_bound_is_enforced():
    with pytest.raises(Overloaded, match="exceed the limit of 1000"):
        check_admission(LIMITS, warmed(1000), 1, 950, 100)


def test_predicted_time_to_first_token_beyond_the_limit_is_refused():
    # 900 queued + 50 own tokens at 100 tokens/s = 9.5 s > 2 s.
    with pytest.raises(Overloaded, match="predicted time to first token 9500 ms") as exc:
        check_admission(LIMITS, warmed(100), 2, 900, 50)
    assert exc.value.retry_after_ms == 7501


def test_no_prediction_before_enough_steps_were_measured():
    est = ThroughputEstimator()
    est.observe(1, 1.0)
    check_admission(LIMITS, est, 2, 900, 50)


def test_estimator_smooths_towards_recent_rates():
    est = warmed(100)
    for _ in range(50):
        est.observe(1000, 1.0)
    assert 900 < est.tokens_per_s <= 1000


def test_prefill_heavy_steps_set_the_rate_once_seen():
    est = ThroughputEstimator()
    for _ in range(5):
        est.observe(256, 1.0)  # decode steps: 256 tokens/s
    assert est.tokens_per_s == 256
    est.observe(2048, 1.0, num_prefill_tokens=2000)  # a prefill step: 2048 tokens/s
    assert est.tokens_per_s == 2048
    est.observe(100, 1.0)  # later decode steps no longer drag it down
    assert est.tokens_per_s == 2048 and est.num_steps == 7
