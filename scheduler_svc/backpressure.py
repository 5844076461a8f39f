"""Admission control that protects requests already admitted.

Besides hard bounds on the waiting queue, a request is refused when its
predicted time to first token is too long: the prompt tokens queued ahead
of it, plus its own, divided by the prefill throughput the executor has
recently sustained. The estimate only counts work; it does not model slots
freeing up in the running set.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest step in the throughput average.
EWMA_ALPHA = 0.1
# Steps to measure before the predicted-wait check applies.
MIN_STEPS = 5
# A step counts as prefill-heavy with at least this many prompt tokens,
# making up at least half of the step.
PREFILL_STEP_MIN_TOKENS = 64


class Overloaded(Exception):
    def __init__(self, reason: str, retry_after_ms: int):
        super().__init__(reason)
        self.retry_after_ms = retry_after_ms


@dataclass(slots=True)
class ThroughputEstimator:
    """How fast queued prompt tokens get computed, in tokens per second of
    step time, smoothed.

    Queued work is prompt tokens, and prompts are computed in big prefill
    chunks, far faster per token than one-token decodes. So steps where
    prefill dominates give the estimate; until one has been seen, every
    step does (a pessimistic start).
    """

    tokens_per_s: float = 0.0
    num_steps: int = 0
    num_prefill_steps: int = 0

    def observe(self, num_tokens: int, seconds: float, num_prefill_tokens: int = 0) -> None:
        if seconds <= 0 or num_tokens <= 0:
            return
        rate = num_tokens / seconds
        prefill_heavy = num_prefill_tokens * 2 >= num_tokens and num_prefill_tokens >= PREFILL_STEP_MIN_TOKENS
        if prefill_heavy:
            first = self.num_prefill_steps == 0
            self.num_prefill_steps += 1
        elif self.num_prefill_steps == 0:
            first = self.num_steps == 0
        else:
            self.num_steps += 1
            return
        self.tokens_per_s = rate if first else (1 - EWMA_ALPHA) * self.tokens_per_s + EWMA_ALPHA * rate
        self.num_steps += 1

    def predict_wait_s(self, num_tokens_ahead: int) -> float | None:
        if self.num_steps < MIN_STEPS or self.tokens_per_s <= 0:
            return None
        return num_tokens_ahead / self.tokens_per_s


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_queued_requests: int
    max_queued_tokens: int
    max_queue_delay_ms: float


def check_admission(
    limits: AdmissionLimits,
    estimator: ThroughputEstimator,
    num_queued_requests: int,
    num_queued_tokens: int,
    num_prompt_tokens: int,
) -> None:
    """Raises Overloaded with the reason and a retry hint."""
    if num_queued_requests + 1 > limits.max_queued_requests:
        raise Overloaded(f"waiting queue is full ({num_queued_requests} requests)", _retry_ms(estimator, num_queued_tokens))
    if num_queued_tokens + num_prompt_tokens > limits.max_queued_tokens:
        raise Overloaded(
            f"waiting queue holds {num_queued_tokens} tokens; {num_prompt_tokens} more exceed the limit of {limits.max_queued_tokens}",
            _retry_ms(estimator, num_queued_tokens),
        )
    if limits.max_queue_delay_ms > 0:
        wait_s = estimator.predict_wait_s(num_queued_tokens + num_prompt_tokens)
        if wait_s is not None and wait_s * 1000 > limits.max_queue_delay_ms:
            raise Overloaded(
                f"predicted time to first token {wait_s * 1000:.0f} ms exceeds the limit of "
                f"{limits.max_queue_delay_ms:.0f} ms ({num_queued_tokens} tokens queued at "
                f"{estimator.tokens_per_s:.0f} tokens/s)",
                int(wait_s * 1000 - limits.max_queue_delay_ms) + 1,
            )


def _retry_ms(estimator: ThroughputEstimator, num_queued_tokens: int) -> int:
    """Roughly when a slot frees: a tenth of the queue's drain time."""
    wait_s = estimator.predict_wait_s(num_queued_tokens)
    return 1000 if wait_s is None else max(1, int(wait_s * 100))
