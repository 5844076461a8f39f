"""The n-gram proposer and the executor's greedy verification of drafts,
in process (issue 36, first part); through both services:
tests/integration/test_speculative.py."""

from __future__ import annotations

import numpy as np
import pytest

from executor_svc.config import ExecutorSettings
from executor_svc.loading import speculative_ngram
from executor_svc.step.ngram import propose
from executor_svc.step.runner import NewRequestData, PlanError, StepPlan
from llmsched.errors import StartupError
from tests.oracle import hf_greedy
from tests.unit.test_runner_vs_hf import GREEDY, make_runner


@pytest.mark.parametrize("tokens, k, want", [
    ([5, 6, 7, 8, 5, 6], 3, [7, 8, 5]),  # the tail 5 6 was followed by 7 8 5
    ([2, 3, 9, 2, 3, 4, 2, 3], 2, [4, 2]),  # of two matches as long, the latest wins
    ([1, 2, 3, 4], 2, [4, 4]),  # no match: the last token repeated
    ([5, 6, 7, 5, 6], 4, [7, 5, 6, 6]),  # fewer tokens after the match than asked: padded
], ids=["follow", "latest", "none", "padded"])
def test_ngram_proposes_what_followed_the_latest_earlier_match_of_the_tail(tokens, k, want):
    assert propose(np.array(tokens), k, 2, 4).tolist() == want


def test_longer_matches_are_tried_first():
    # Tail 3 4: the 2-gram "3 4" was followed by 7, the 1-gram "4" last by 8.
    assert propose(np.array([3, 4, 7, 4, 8, 3, 4]), 1, 1, 2).tolist() == [7]


def test_greedy_verification_yields_the_tokens_plain_decoding_would(stories_path):
    """A request decoded by steps of 1 + 3 drafts produces HF's greedy
    tokens, however many drafts each step accepts."""
    runner = make_runner(str(stories_path))
    runner.ngram = (2, 4)
    prompt = [1, 403, 407, 261, 378]
    out = runner.execute(StepPlan(0, [NewRequestData(0, prompt, list(range(32)), 0, len(prompt), GREEDY, 0)]))
    tokens, steps = list(out.sampled_token_ids), 1
    while len(tokens) < 60:
        out = runner.execute(StepPlan(steps, cached_handles=[0], cached_num_scheduled_tokens=[4], draft_handles=[0],
                                      draft_counts=[3]))
        assert set(out.sampled_handles) == {0} and 1 <= len(out.sampled_token_ids) <= 4
        tokens += out.sampled_token_ids
        steps += 1
    assert tokens[:60] == hf_greedy(str(stories_path), prompt, 60, ignore_eos=True)[:60]


def test_drafts_for_an_executor_that_does_not_speculate_fail_the_plan(stories_path):
    runner = make_runner(str(stories_path))
    runner.execute(StepPlan(0, [NewRequestData(0, [1, 2, 3], list(range(4)), 0, 3, GREEDY, 0)]))
    with pytest.raises(PlanError, match="does not speculate"):
        runner.execute(StepPlan(1, cached_handles=[0], cached_num_scheduled_tokens=[3], draft_handles=[0],
                                draft_counts=[2]))


@pytest.mark.parametrize("env, message", [
    ({"speculative_method": "mtp"}, "EXECUTOR_SPECULATIVE_METHOD=mtp is not implemented yet"),
    ({"speculative_method": "ngram", "speculative_ngram_min": 5, "speculative_ngram_max": 3},
     "EXECUTOR_SPECULATIVE_NGRAM_MIN=5 exceeds"),
], ids=["method-not-implemented", "window-upside-down"])
def test_a_speculative_setting_not_implemented_is_refused_by_name(env, message):
    with pytest.raises(StartupError, match=message):
        speculative_ngram(ExecutorSettings(**env), 1, True)
    assert speculative_ngram(ExecutorSettings(), 1, True) is None
    with pytest.raises(StartupError, match="TENSOR_PARALLEL_SIZE"):
        speculative_ngram(ExecutorSettings(speculative_method="ngram"), 2, True)
