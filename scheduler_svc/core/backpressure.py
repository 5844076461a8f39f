"""Admission control that protects requests already admitted.

Besides hard bounds on the waiting queue, a request is refused when its
predicted time to first token is too long. Two things hold a queued
request back, and the prediction is the longer of the two:

- compute: running requests take their decode tokens out of every step's
  token budget first; what is left goes to the prompts queued ahead, then
  to its own: ceil(tokens / (budget - running)) steps of the recent step
  duration;
- slots: with the running set full (max_num_seqs), it waits for as many
  requests to finish as are queued ahead of it, at the recent finish rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Weight of the newest step in the step-time average.
EWMA_ALPHA = 0.1
# Steps to measure before the predicted-wait check applies.
MIN_STEPS = 5
# Longest retry hint, so a client is never told to wait for ever.
MAX_RETRY_AFTER_MS = 60_000


class Overloaded(Exception):
    def __init__(self, reason: str, retry_after_ms: int):
        super().__init__(reason)
        self.retry_after_ms = min(max(1, retry_after_ms), MAX_RETRY_AFTER_MS)


def _ewma(old: float, new: float) -> float:
    return new if old == 0.0 else (1 - EWMA_ALPHA) * old + EWMA_ALPHA * new


@dataclass(slots=True)
class StepTimeEstimator:
    """Recent step duration (plan sent to result back) and requests finished
    per step, smoothed. Also what preempting by swap and by recompute cost
    (Scheduler's SwapCost): seconds per token of steps that prefill, and
    per block copied between the device pool and the host tier."""

    step_s: float = 0.0
    finished_per_step: float = 0.0
    num_steps: int = 0
    prefill_token_s: float = 0.0
    swap_block_s: float = 0.0

    def observe(self, seconds: float, num_finished: int = 0, num_tokens: int = 0, num_requests: int = 0) -> None:
        if seconds <= 0:
            return
        if self.num_steps == 0:
            self.step_s, self.finished_per_step = seconds, float(num_finished)
        else:
            self.step_s = (1 - EWMA_ALPHA) * self.step_s + EWMA_ALPHA * seconds
            self.finished_per_step = (1 - EWMA_ALPHA) * self.finished_per_step + EWMA_ALPHA * num_finished
        self.num_steps += 1
        if num_tokens > num_requests:  # some prefill: what recomputing costs
            self.prefill_token_s = _ewma(self.prefill_token_s, seconds / num_tokens)

    def observe_swaps(self, seconds: float, num_blocks: int) -> None:
        if seconds > 0 and num_blocks > 0:
            self.swap_block_s = _ewma(self.swap_block_s, seconds / num_blocks)

    def swap_is_cheaper(self, num_blocks: int, num_tokens: int) -> bool:
        """Copying num_blocks out and back in beats recomputing num_tokens.
        Until both are measured, a copy is taken to be cheaper: it moves
        the blocks' bytes, where a recompute runs the model on every token."""
        if not self.prefill_token_s or not self.swap_block_s:
            return True
        return 2 * num_blocks * self.swap_block_s < num_tokens * self.prefill_token_s

    def predict_wait_s(self, num_tokens_ahead: int, num_running: int, token_budget: int,
                       num_requests_ahead: int = 0, max_num_seqs: int | None = None) -> float | None:
        if self.num_steps < MIN_STEPS:
            return None
        prefill_per_step = max(1, token_budget - num_running)
        wait = math.ceil(num_tokens_ahead / prefill_per_step) * self.step_s
        if max_num_seqs is not None:
            slots_short = num_requests_ahead + 1 - (max_num_seqs - num_running)
            if slots_short > 0 and self.finished_per_step > 0:
                wait = max(wait, slots_short / self.finished_per_step * self.step_s)
        return wait


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_queued_requests: int
    max_queued_tokens: int
    max_queue_delay_ms: float
    token_budget: int  # the scheduler's max_num_batched_tokens
    max_num_seqs: int


def check_admission(
    limits: AdmissionLimits,
    estimator: StepTimeEstimator,
    num_queued_requests: int,
    num_queued_tokens: int,
    num_prompt_tokens: int,
    num_running: int,
    num_requests_ahead: int | None = None,
) -> None:
    """Raises Overloaded with the reason and a retry hint. The wait is
    predicted from the requests ahead of this one (all that are queued,
    unless the policy says fewer) and num_queued_tokens, the tokens ahead."""
    ahead = num_queued_requests if num_requests_ahead is None else num_requests_ahead
    wait_s = estimator.predict_wait_s(num_queued_tokens + num_prompt_tokens, num_running, limits.token_budget,
                                      ahead, limits.max_num_seqs)
    if num_queued_requests + 1 > limits.max_queued_requests:
        raise Overloaded(f"waiting queue is full ({num_queued_requests} requests)", _retry_ms(wait_s))
    if num_queued_tokens + num_prompt_tokens > limits.max_queued_tokens:
        raise Overloaded(
            f"waiting queue holds {num_queued_tokens} tokens; {num_prompt_tokens} more exceed the limit of {limits.max_queued_tokens}",
            _retry_ms(wait_s),
        )
    if limits.max_queue_delay_ms > 0 and wait_s is not None and wait_s * 1000 > limits.max_queue_delay_ms:
        raise Overloaded(
            f"predicted time to first token {wait_s * 1000:.0f} ms exceeds the limit of "
            f"{limits.max_queue_delay_ms:.0f} ms ({num_queued_requests} requests and {num_queued_tokens} tokens "
            f"queued, {num_running} running, "
            f"{estimator.step_s * 1000:.0f} ms per step)",
            int(wait_s * 1000 - limits.max_queue_delay_ms) + 1,
        )


def _retry_ms(wait_s: float | None) -> int:
    """Roughly when a slot frees: a tenth of the queue's predicted drain."""
    return 1000 if wait_s is None else int(wait_s * 100)
