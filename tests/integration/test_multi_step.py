"""Multi-step decode through both services (SCHEDULER_MULTI_STEP_DECODE=4,
issue 37): greedy output equals HF's token for token with requests
arriving, cancelled and finishing mid-run; a seeded sampled request with
penalties and logprobs, and a request cut by a stop string, yield what
a stack with one step per plan yields. In process:
tests/unit/test_multi_step.py and test_multi_step_runner.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from llmsched.v1 import scheduler_pb2 as spb
from tests.integration.conftest import scheduler_metric, start_services
from tests.oracle import STORY_PROMPTS, hf_greedy

pytestmark = pytest.mark.slow
RUN = 'llmsched_multi_step_lookahead_steps_total{outcome="run"}'


@pytest.fixture(scope="module")
def multi_step(stories_path):
    services, client = start_services(str(stories_path), scheduler_env={"SCHEDULER_MULTI_STEP_DECODE": "4"})
    yield services, client
    client.channel.close()
    services.stop()


@pytest.fixture(scope="module")
def one_step(stories_path):
    """The same model, one decode step per plan (the shared stack runs
    the default, multi-step)."""
    services, client = start_services(str(stories_path), scheduler_env={"SCHEDULER_MULTI_STEP_DECODE": "1"})
    yield client
    client.channel.close()
    services.stop()


def test_greedy_multi_step_output_equals_hf_with_arrivals_cancels_and_stops(multi_step):
    services, client = multi_step
    ids = {p: list(client.stub.Tokenize(spb.TokenizeRequest(prompt=p), timeout=10).token_ids) for p in STORY_PROMPTS}
    extra = [{}, {"logprobs": 1}, {"stop": ["@@never@@"]}]
    cases = [(i, p, {"max_tokens": 20 + 7 * i, "temperature": 0, **extra[i % 3]}) for i, p in enumerate(STORY_PROMPTS)]
    ran_before = scheduler_metric(services, RUN)

    def run(case):
        i, prompt, sampling = case
        time.sleep(0.05 * i)  # arrivals while others decode
        return client.generate(prompt=prompt, sampling=sampling, timeout=120)[0]

    with ThreadPoolExecutor(len(cases) + 2) as pool:
        results = pool.map(run, cases)
        list(pool.map(client.cancel_after, STORY_PROMPTS[:2]))
        results = list(results)
    for (_, prompt, sampling), got in zip(cases, results):
        assert got == hf_greedy(client.model, ids[prompt], sampling["max_tokens"]), f"{prompt!r} ({sampling})"
    # A lone request runs multi-step from its second plan on.
    prompt = STORY_PROMPTS[0]
    assert client.generate(prompt=prompt, sampling={"max_tokens": 40, "temperature": 0}, timeout=60)[0] == \
        hf_greedy(client.model, ids[prompt], 40)
    assert scheduler_metric(services, RUN) > ran_before, "no lookahead step ran"
    client.assert_no_leaked_blocks()


def test_sampled_requests_and_stop_strings_yield_what_one_step_per_plan_yields(multi_step, one_step):
    services, client = multi_step
    stop_at = hf_greedy(client.model, list(client.stub.Tokenize(
        spb.TokenizeRequest(prompt=STORY_PROMPTS[1]), timeout=10).token_ids), 30)
    stop = client.stub.Detokenize(spb.DetokenizeRequest(token_ids=stop_at[10:13]), timeout=10).text.strip()

    def run(case):
        prompt, sampling, on = case
        call = on.stub.Generate(spb.GenerateRequest(prompt=prompt, sampling=spb.SamplingParams(**sampling)),
                                timeout=120)
        responses = list(call)
        return ([(lp.token_id, lp.logprob, list(lp.top_token_ids)) for r in responses for lp in r.logprobs],
                [t for r in responses for t in r.token_ids], "".join(r.text for r in responses),
                responses[-1].finish_reason)

    sampled = {"max_tokens": 60, "temperature": 0.8, "top_p": 0.95, "logprobs": 2, "ignore_eos": True,
               "frequency_penalty": 0.3, "repetition_penalty": 1.1}
    cases = [(p, {**sampled, "seed": 100 + i}, on) for i, p in enumerate(STORY_PROMPTS[:3]) for on in (client, one_step)]
    cases += [(STORY_PROMPTS[1], {"max_tokens": 30, "temperature": 0, "stop": [stop]}, on) for on in (client, one_step)]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    for i in range(0, len(cases), 2):
        (lps, tokens, text, finish), (lps2, tokens2, text2, finish2) = results[i], results[i + 1]
        assert tokens == tokens2 and text == text2 and finish == finish2, f"case {i // 2}: outputs differ"
        for (t, lp, top), (t2, lp2, top2) in zip(lps, lps2):
            assert t == t2 and top == top2 and lp == pytest.approx(lp2, abs=1e-3)
    assert results[-1][3] == spb.FINISH_REASON_STOP and len(results[-1][1]) < 30, "the stop string ended it"
    client.assert_no_leaked_blocks()
