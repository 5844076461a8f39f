"""The runner's persistent request rows: growth, reuse, the plans' diffs,
and the checks that refuse plans contradicting them."""

import pytest
import torch

from executor_svc.step.runner import NewRequestData, PlanError, StepPlan
from executor_svc.step.sampler import SamplingSettings
from tests.unit.test_runner_vs_hf import BLOCK, GREEDY, make_runner


class FakeScheduler:
    """Drives a runner like the scheduler does: requests join at given steps,
    prefill in chunks, get blocks one at a time as they grow, and finish
    after their own number of tokens."""

    def __init__(self, runner):
        self.runner, self.next_block, self.step = runner, 0, 0
        self.waiting: list[tuple[int, int, list[int], int]] = []  # (join step, handle, prompt, max_new)
        self.live: dict[int, dict] = {}
        self.outputs: dict[int, list[int]] = {}
        self.finished: list[int] = []  # sent with the next plan, as the scheduler does

    def add(self, join_step, handle, prompt, max_new):
        self.waiting.append((join_step, handle, prompt, max_new))

    def _blocks_for(self, st, upto):
        new = []
        while len(st["blocks"]) * BLOCK < upto:
            st["blocks"].append(self.next_block)
            new.append(self.next_block)
            self.next_block += 1
        return new

    def run(self, chunk=4):
        while self.waiting or self.live:
            inp = StepPlan(step_id=self.step, finished_handles=self.finished)
            for item in [w for w in self.waiting if w[0] <= self.step]:
                self.waiting.remove(item)
                _, h, prompt, max_new = item
                st = dict(tokens=list(prompt), computed=0, blocks=[], max_new=max_new)
                n = min(chunk, len(prompt))
                self._blocks_for(st, n)
                inp.new_requests.append(NewRequestData(h, list(prompt), list(st["blocks"]), 0, n, GREEDY, 0))
                st["computed"] = n
                self.live[h] = st
                self.outputs[h] = []
            for h, st in self.live.items():
                if any(r.handle == h for r in inp.new_requests):
                    continue
                n = min(chunk, len(st["tokens"]) - st["computed"])
                for b in self._blocks_for(st, st["computed"] + n):
                    inp.new_block_handles.append(h)
                    inp.new_block_ids.append(b)
                inp.cached_handles.append(h)
                inp.cached_num_scheduled_tokens.append(n)
                st["computed"] += n
            out = self.runner.execute(inp)
            for h, t in zip(out.sampled_handles, out.sampled_token_ids):
                self.live[h]["tokens"].append(t)
                self.outputs[h].append(t)
            self.finished = [h for h, st in self.live.items() if len(self.outputs[h]) >= st["max_new"]]
            for h in self.finished:
                del self.live[h]
            self.step += 1
        return self.outputs


def prompts(n):
    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(2, 500, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_many_requests_joining_and_finishing_match_each_request_alone(stories_path):
    """24 requests (more than the 16 rows the runner starts with, so rows
    grow), joining at staggered steps and finishing at different lengths,
    so rows free up, get reused and a step's rows are not contiguous."""
    ps = prompts(24)
    max_news = [3 + (i * 7) % 9 for i in range(24)]
    batched = FakeScheduler(make_runner(str(stories_path), num_blocks=512))
    for i, p in enumerate(ps):
        batched.add(join_step=(i * 3) % 7, handle=1000 + i, prompt=p, max_new=max_news[i])
    got = batched.run()
    assert batched.runner.rows.capacity >= 32, "rows did not grow past their initial 16"
    alone_runner = make_runner(str(stories_path), num_blocks=64)
    for i, p in enumerate(ps):
        alone_runner.reset()
        alone = FakeScheduler(alone_runner)
        alone.add(0, 7, p, max_news[i])
        want = alone.run()[7]
        assert got[1000 + i] == want, f"request {i} (prompt {p}) drew {got[1000 + i]} in the batch, {want} alone"


def test_reset_forgets_requests_and_reuses_rows(stories_path):
    runner = make_runner(str(stories_path))
    runner.execute(StepPlan(0, [NewRequestData(5, [1, 2, 3], [0], 0, 3, GREEDY, 0)]))
    runner.reset()
    with pytest.raises(PlanError, match="handle 5"):
        runner.execute(StepPlan(1, cached_handles=[5], cached_num_scheduled_tokens=[1]))
    out = runner.execute(StepPlan(2, [NewRequestData(6, [1, 2, 3], [0], 0, 3, GREEDY, 0)]))
    assert out.sampled_handles == [6] and runner.rows.handle_rows == {6: 0}


def test_a_request_scheduled_twice_in_one_step_is_rejected(stories_path):
    runner = make_runner(str(stories_path))
    runner.execute(StepPlan(0, [NewRequestData(1, [1, 2, 3], [0], 0, 2, GREEDY, 0)]))
    with pytest.raises(PlanError, match="twice"):
        runner.execute(StepPlan(1, cached_handles=[1, 1], cached_num_scheduled_tokens=[1, 1]))


def test_a_step_past_the_block_table_is_rejected(stories_path):
    runner = make_runner(str(stories_path))
    with pytest.raises(PlanError, match="block table of 1 blocks cannot hold 5 tokens"):
        runner.execute(StepPlan(0, [NewRequestData(1, [1, 2, 3, 4, 5], [0], 0, 5, GREEDY, 0)]))


def test_a_block_for_an_unknown_request_is_rejected(stories_path):
    runner = make_runner(str(stories_path))
    with pytest.raises(PlanError, match="handle 3"):
        runner.execute(StepPlan(0, new_block_handles=[3], new_block_ids=[1]))


def test_a_prompt_longer_than_max_model_len_is_rejected(stories_path):
    runner = make_runner(str(stories_path))
    n = runner.max_model_len + 1
    with pytest.raises(PlanError, match="exceed max_model_len"):
        runner.execute(StepPlan(0, [NewRequestData(1, [1] * n, list(range(-(-n // BLOCK))), 0, 1, GREEDY, 0)]))


def test_a_request_at_max_model_len_is_not_computed_further(stories_path):
    runner = make_runner(str(stories_path), num_blocks=256)
    n = runner.max_model_len
    blocks = list(range(-(-(n + 1) // BLOCK)))
    out = runner.execute(StepPlan(0, [NewRequestData(1, [1] * n, blocks, n - 1, 1, GREEDY, 0)]))
    assert out.sampled_handles == [1], "the last position should still sample"
    with pytest.raises(PlanError, match="past max_model_len"):
        runner.execute(StepPlan(1, cached_handles=[1], cached_num_scheduled_tokens=[1]))


def test_fault_injection_fires_on_the_token():
    runner = make_runner("tiny-random")
    runner.fail_on_token = 7
    with pytest.raises(RuntimeError, match="injected fault"):
        runner.execute(StepPlan(0, [NewRequestData(1, [1, 7, 3], [0], 0, 3, GREEDY, 0)]))


def test_seeded_request_resent_after_preemption_continues_its_stream(stories_path):
    """A seeded request preempted and re-sent with its generated tokens (as
    the scheduler does) draws what it would have drawn uninterrupted."""
    seeded = SamplingSettings(temperature=0.8, top_p=0.9, top_k=0, seed=42, logprobs=0)
    prompt = [1, 403, 407, 261, 378]

    def decode(runner, handle, steps):
        out_tokens = []
        for s in range(steps):
            out = runner.execute(StepPlan(s + 1, cached_handles=[handle], cached_num_scheduled_tokens=[1]))
            out_tokens += out.sampled_token_ids
        return out_tokens

    blocks = list(range(8))
    a = make_runner(str(stories_path))
    first = a.execute(StepPlan(0, [NewRequestData(1, prompt, blocks, 0, len(prompt), seeded, 0)])).sampled_token_ids
    uninterrupted = first + decode(a, 1, 8)

    b = make_runner(str(stories_path))
    head = uninterrupted[:4]
    resent = NewRequestData(2, prompt + head, blocks, 0, len(prompt) + len(head), seeded, len(head))
    tail = b.execute(StepPlan(0, [resent])).sampled_token_ids + decode(b, 2, 4)
    assert head + tail == uninterrupted


def test_plain_greedy_steps_take_the_argmax_without_a_sampling_batch(stories_path, monkeypatch):
    """Greedy rows with nothing else to apply skip SamplingBatch; a row that
    wants logprobs (or penalties) in the step sends the whole step through it."""
    from executor_svc.step import sampler
    from tests.oracle import hf_greedy

    built = []
    from_arrays = sampler.SamplingBatch.from_arrays.__func__
    monkeypatch.setattr(sampler.SamplingBatch, "from_arrays",
                        classmethod(lambda cls, *a, **k: built.append(1) or from_arrays(cls, *a, **k)))
    runner = make_runner(str(stories_path))
    prompt = [1, 403, 407, 261, 378]
    out = runner.execute(StepPlan(step_id=0, new_requests=[NewRequestData(0, prompt, list(range(8)), 0, 5, GREEDY, 0)]))
    tokens = list(out.sampled_token_ids)
    for step in range(1, 10):
        out = runner.execute(StepPlan(step_id=step, cached_handles=[0], cached_num_scheduled_tokens=[1]))
        tokens += out.sampled_token_ids
    assert tokens == hf_greedy(str(stories_path), prompt, 10)
    assert built == [], "a plain greedy step built a SamplingBatch"
    assert out.logprobs is None
    wants = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=2)
    wanting = NewRequestData(1, prompt, list(range(8, 16)), 0, 5, wants, 0)
    out = runner.execute(StepPlan(step_id=10, new_requests=[wanting], cached_handles=[0],
                                  cached_num_scheduled_tokens=[1]))
    assert built, "a step with a logprobs row did not go through SamplingBatch"
    assert out.logprobs is not None and len(out.logprobs) == 2
