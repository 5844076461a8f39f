import pytest

from scheduler_svc.core.backpressure import (
    MAX_RETRY_AFTER_MS, AdmissionLimits, Overloaded, StepTimeEstimator, check_admission,
)

LIMITS = AdmissionLimits(max_queued_requests=10, max_queued_tokens=10_000, max_queue_delay_ms=2000, token_budget=1000,
                         max_num_seqs=1000)


def warmed(step_s: float, finished_per_step: int = 0) -> StepTimeEstimator:
    est = StepTimeEstimator()
    for _ in range(10):
        est.observe(step_s, finished_per_step)
    return est


def test_request_within_every_bound_is_admitted():
    # 1,500 tokens at 1,000 per step: 2 steps of 0.5 s.
    check_admission(LIMITS, warmed(0.5), num_queued_requests=3, num_queued_tokens=1400, num_prompt_tokens=100,
                    num_running=0)


def test_full_queue_is_refused_with_a_retry_hint():
    with pytest.raises(Overloaded, match="queue is full") as exc:
        check_admission(LIMITS, warmed(0.5), 10, 100, 10, num_running=0)
    assert exc.value.retry_after_ms > 0


def test_queued_token_bound_is_enforced():
    with pytest.raises(Overloaded, match="exceed the limit of 10000"):
        check_admission(LIMITS, warmed(0.1), 1, 9950, 100, num_running=0)


def test_running_decodes_shrink_the_prefill_budget_and_lengthen_the_wait():
    # 1,500 tokens, 1,000 - 900 running = 100 per step: 15 steps x 0.5 s = 7.5 s > 2 s.
    with pytest.raises(Overloaded, match="predicted time to first token 7500 ms") as exc:
        check_admission(LIMITS, warmed(0.5), 2, 1400, 100, num_running=900)
    assert exc.value.retry_after_ms == 5501
    # The same queue with nothing running takes 2 steps: admitted.
    check_admission(LIMITS, warmed(0.5), 2, 1400, 100, num_running=0)


def test_a_running_set_that_fills_the_budget_predicts_a_long_wait_with_a_capped_hint():
    with pytest.raises(Overloaded) as exc:
        check_admission(LIMITS, warmed(0.5), 0, 0, 500, num_running=1000)
    assert exc.value.retry_after_ms == MAX_RETRY_AFTER_MS


def test_no_prediction_before_enough_steps_were_measured():
    est = StepTimeEstimator()
    est.observe(100.0)
    check_admission(LIMITS, est, 2, 9000, 50, num_running=999)


def test_estimator_smooths_towards_recent_step_times():
    est = warmed(0.1)
    for _ in range(50):
        est.observe(1.0)
    assert 0.9 < est.step_s <= 1.0


def test_with_the_running_set_full_the_wait_is_for_slots_to_free():
    limits = AdmissionLimits(100, 10_000, 2000, token_budget=1000, max_num_seqs=8)
    # 8 running of 8, 5 queued ahead: 6 must finish; one finishes per step
    # of 0.5 s, so 3 s, although the prompts need one step of compute.
    with pytest.raises(Overloaded, match="predicted time to first token 3000 ms"):
        check_admission(limits, _finishing(0.5, every=1), 5, 200, 50, num_running=8)
    # Slots free: admitted.
    check_admission(limits, _finishing(0.5, every=1), 0, 0, 50, num_running=3)


def _finishing(step_s: float, every: int) -> StepTimeEstimator:
    est = StepTimeEstimator()
    for i in range(400):
        est.observe(step_s, 1 if i % every == 0 else 0)
    return est
