"""Multi-step decode on the executor (ModelRunner._execute_multi_step): a
plan whose rows hold lookahead slots runs that many more decode steps (or,
with multi_step_drafts, steps that verify drafts) and returns every step's
tokens, the same tokens and logprobs as one step per plan (greedy: HF's),
and ends a row's run at a stop token, every row's when a plan waiting
needs the scheduler. Scheduling: test_multi_step.py."""

from __future__ import annotations

import time

import pytest

from executor_svc.step.ngram import NgramProposer
from executor_svc.step.runner import NewRequestData, PlanError, StepPlan, StepResult
from executor_svc.step.sampler import SamplingSettings
from tests.oracle import hf_greedy
from tests.unit.test_runner_vs_hf import GREEDY, make_runner

PROMPTS = [[1, 403, 407, 261, 378], [1, 65, 322, 90, 261, 505, 300]]
SAMPLED = SamplingSettings(temperature=1.0, top_p=0.9, top_k=0, seed=1234, logprobs=2, frequency_penalty=0.4)


def decode(runner, sampling: list[SamplingSettings], num_tokens: int, lookahead: list[int],
           stop_token_ids: list[int] = (), drafts: int = 0) -> tuple[dict, dict, int]:
    """Each prompt decoded to num_tokens tokens by plans that grant
    request h lookahead[h] slots (all 0: one step per plan), the way the
    scheduler plans them: 1 + slots tokens each, blocks for all, each step
    verifying up to drafts drafts. Returns each request's tokens, logprobs
    and the plans run."""
    news = [NewRequestData(h, p, list(range(16 * h, 16 * h + 16)), 0, len(p), s, 0)
            for h, (p, s) in enumerate(zip(PROMPTS, sampling))]
    out = runner.execute(StepPlan(0, news))
    tokens = {h: [] for h in range(len(PROMPTS))}
    logprobs = {h: [] for h in range(len(PROMPTS))}
    steps = 1
    while True:
        for i, (h, t) in enumerate(zip(out.sampled_handles, out.sampled_token_ids)):
            tokens[h].append(t)
            logprobs[h].append(out.logprobs[i] if out.logprobs else None)
        left = [h for h in tokens if len(tokens[h]) < num_tokens]
        if not left:
            break
        k = [min(lookahead[h], num_tokens - len(tokens[h]) - 1) for h in left]
        out = runner.execute(StepPlan(steps, cached_handles=left, cached_num_scheduled_tokens=[1 + n for n in k],
                                      draft_handles=[h for h, n in zip(left, k) if n],
                                      draft_counts=[n for n in k if n], multi_step=any(k),
                                      stop_token_ids=list(stop_token_ids), multi_step_drafts=drafts if any(k) else 0))
        steps += 1
    runner.execute(StepPlan(steps, finished_handles=list(tokens)))
    return tokens, logprobs, steps


@pytest.fixture(scope="module")
def runner(stories_path):
    return make_runner(str(stories_path))


def test_greedy_multi_step_decode_yields_hf_s_tokens(runner, stories_path):
    plain, _, plain_plans = decode(runner, [GREEDY, GREEDY], 24, [0, 0])
    multi, _, multi_plans = decode(runner, [GREEDY, GREEDY], 24, [3, 1])
    assert multi == plain
    assert multi_plans < plain_plans / 1.5
    for h, p in enumerate(PROMPTS):
        want = hf_greedy(str(stories_path), p, 24, ignore_eos=True)
        assert plain[h] == want[:len(plain[h])]


def test_seeded_sampling_with_penalties_and_logprobs_is_the_same_per_step_or_per_plan(runner):
    """Each step draws with the uniform of its (seed, output position), and
    penalties count every token sampled before it, as one step per plan."""
    plain, plain_lps, _ = decode(runner, [SAMPLED, GREEDY], 30, [0, 0])
    multi, multi_lps, _ = decode(runner, [SAMPLED, GREEDY], 30, [4, 2])
    assert multi == plain
    for (lp, ids, top), (lp2, ids2, top2) in zip(multi_lps[0], plain_lps[0]):
        assert ids == ids2 and lp == pytest.approx(lp2, abs=1e-4) and top == pytest.approx(top2, abs=1e-4)
    other, _, _ = decode(runner, [SamplingSettings(1.0, 0.9, 0, seed=99, logprobs=0), GREEDY], 30, [4, 2])
    assert other[0] != plain[0], "another seed draws other tokens (else the test could not fail)"


@pytest.fixture(scope="module")
def speculating(stories_path):
    return make_runner(str(stories_path), proposer=NgramProposer(1, 3))


def counting_verifications(runner) -> list[tuple[int, int, int]]:
    """Every (handle, verified, accepted) the runner's plans report from now on."""
    seen, execute = [], runner.execute

    def counting(plan):
        result = execute(plan)
        seen.extend(result.verified_drafts)
        return result

    runner.execute = counting
    return seen


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded-penalties-logprobs"])
def test_steps_that_verify_drafts_in_one_plan_yield_one_step_per_plan_s_tokens(runner, speculating, sampling):
    """Each step of the run verifies up to 3 n-gram drafts within the row's
    slots; tokens (greedy: HF's, shown above) and logprobs are plain
    decoding's, in fewer plans than multi-step decode alone needs."""
    plain, plain_lps, plain_plans = decode(runner, [sampling, GREEDY], 40, [0, 0])
    multi, _, multi_plans = decode(runner, [sampling, GREEDY], 40, [3, 3])
    seen = counting_verifications(speculating)
    try:
        spec, spec_lps, spec_plans = decode(speculating, [sampling, GREEDY], 40, [3 + 3, 3 + 3], drafts=3)
    finally:
        del speculating.execute
    assert spec == plain
    for got, want in zip(spec_lps[0], plain_lps[0]):
        assert got == want or (got[1] == want[1] and got[0] == pytest.approx(want[0], abs=1e-4))
    verified, accepted = sum(v for _, v, _ in seen), sum(a for _, _, a in seen)
    assert 0 < accepted <= verified and all(v <= 3 for _, v, _ in seen), (verified, accepted)
    assert sum(h == 0 for h, _, _ in seen) > spec_plans, "a verifying step's report for each step of a plan"
    assert spec_plans < multi_plans < plain_plans


def test_a_stop_token_ends_the_row_s_run_and_the_next_plan_goes_on_from_there(runner):
    plain, _, _ = decode(runner, [GREEDY, GREEDY], 12, [0, 0])
    stop = plain[0][2]
    news = [NewRequestData(h, p, list(range(16 * h, 16 * h + 16)), 0, len(p), GREEDY, 0) for h, p in enumerate(PROMPTS)]
    runner.execute(StepPlan(0, news))
    out = runner.execute(StepPlan(1, cached_handles=[0, 1], cached_num_scheduled_tokens=[5, 5], draft_handles=[0, 1],
                                  draft_counts=[4, 4], multi_step=True, stop_token_ids=[stop]))
    got = {h: [t for g, t in zip(out.sampled_handles, out.sampled_token_ids) if g == h] for h in (0, 1)}
    assert got[0] == plain[0][1:3], "row 0 stops with the stop token"
    assert got[1] == plain[1][1:6] or stop in got[1]
    # The scheduler planned the next step as if row 0 ran all 5 steps; the
    # executor runs it from where row 0 is.
    out = runner.execute(StepPlan(2, cached_handles=[0], cached_num_scheduled_tokens=[3], draft_handles=[0],
                                  draft_counts=[2], multi_step=True))
    assert out.sampled_token_ids == plain[0][3:6]
    runner.execute(StepPlan(3, finished_handles=[0, 1]))


def test_a_waiting_arrival_ends_every_run_and_a_waiting_forget_ends_that_row_s(runner):
    plain, _, _ = decode(runner, [GREEDY, GREEDY], 8, [0, 0])
    try:
        runner.run_interrupts = lambda: (True, ())
        ended, _, plans = decode(runner, [GREEDY, GREEDY], 8, [3, 3])
        assert ended == plain and plans == 8, "one token per plan, and nothing lost"
        runner.run_interrupts = lambda: (False, {1})  # a plan received forgets handle 1
        news = [NewRequestData(h, p, list(range(16 * h, 16 * h + 16)), 0, len(p), GREEDY, 0)
                for h, p in enumerate(PROMPTS)]
        runner.execute(StepPlan(0, news))
        out = runner.execute(StepPlan(1, cached_handles=[0, 1], cached_num_scheduled_tokens=[4, 4],
                                      draft_handles=[0, 1], draft_counts=[3, 3], multi_step=True))
        assert out.sampled_handles == [0] * 4 + [1] and out.sampled_token_ids == plain[0][1:5] + plain[1][1:2]
        assert out.num_forwards == 4, "row 0's four tokens took four forwards"
        runner.execute(StepPlan(2, finished_handles=[0, 1]))
    finally:
        runner.run_interrupts = None


def test_the_step_loop_tells_a_run_what_plans_received_bring():
    from executor_svc.step.step_loop import RunInterrupts

    interrupts = RunInterrupts()
    decode_plan = StepPlan(1, cached_handles=[0], cached_num_scheduled_tokens=[1])
    forget = StepPlan(2, finished_handles=[3])
    arrival = StepPlan(3, [NewRequestData(4, PROMPTS[0], [0], 0, 5, GREEDY, 0)])
    for plan in (decode_plan, forget, arrival):
        interrupts.received(plan)
    arriving, finished = interrupts.pending()
    assert arriving and set(finished) == {3}
    interrupts.started(decode_plan)
    interrupts.started(forget)
    assert interrupts.pending()[0] and not interrupts.pending()[1]
    interrupts.started(arrival)
    assert interrupts.pending() == (False, {})


def test_a_run_on_the_event_loop_ends_at_its_deadline_and_one_on_the_thread_has_none():
    """Inline, no plan is received during the run: a deadline
    (INLINE_RUN_MAX_S) ends it instead, so a waiting arrival is not held
    for the whole run."""
    from executor_svc.step import step_loop

    class Clocked:
        """Runs a multi-step plan's steps, asking pending() before each later one."""

        def __init__(self, loop):
            self.loop, self.steps = loop, []

        def run(self, plan):
            self.steps.append(time.perf_counter())
            while self.loop.interrupts.pending()[0] is False and len(self.steps) < 50:
                time.sleep(0.002)
                self.steps.append(time.perf_counter())
            return StepResult(plan.step_id, [], [], None, 0, 0, 0, num_forwards=len(self.steps))

    loop = step_loop.StepLoop.__new__(step_loop.StepLoop)
    loop.interrupts, loop.last_decode_s = step_loop.RunInterrupts(), 0.0
    loop.executor = Clocked(loop)
    plan = StepPlan(1, cached_handles=[0], cached_num_scheduled_tokens=[2], draft_handles=[0], draft_counts=[1],
                    multi_step=True)
    loop.run(plan, inline=True)
    took = loop.executor.steps[-1] - loop.executor.steps[0]
    assert step_loop.INLINE_RUN_MAX_S <= took < step_loop.INLINE_RUN_MAX_S + 0.05, took
    loop.executor.steps = []
    loop.run(plan)
    assert len(loop.executor.steps) == 50, "a run on the step thread got a deadline"


def test_lookahead_slots_that_are_not_the_row_s_next_decode_are_refused(runner):
    runner.execute(StepPlan(0, [NewRequestData(0, PROMPTS[0], list(range(16)), 0, 3, GREEDY, 0)]))
    with pytest.raises(PlanError, match="does not sample"):
        runner.execute(StepPlan(1, cached_handles=[0], cached_num_scheduled_tokens=[3], draft_handles=[0],
                                draft_counts=[2], multi_step=True))
    runner.reset()
    with pytest.raises(PlanError, match="not 3"):
        runner.execute(StepPlan(0, [NewRequestData(0, PROMPTS[0], list(range(16)), 0, 5, GREEDY, 0)]))
        runner.execute(StepPlan(1, cached_handles=[0], cached_num_scheduled_tokens=[2], draft_handles=[0],
                                draft_counts=[2], multi_step=True))
    runner.reset()
