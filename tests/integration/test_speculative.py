"""Speculative decoding through both services (issue 36: n-gram drafts):
greedy output equals HF's token for token, with requests speculating
beside ones that cannot, prompts prefilled in chunks, preemption by
recompute in a small pool, and cancellations; a seeded sampled request
yields the same tokens and logprobs whether it speculates or not; the
drafts are really accepted (the metrics say so)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from llmsched.v1 import scheduler_pb2 as spb
from tests.integration.conftest import scheduler_metric, start_services
from tests.oracle import STORY_PROMPTS, hf_greedy

pytestmark = pytest.mark.slow
# A stop string no story contains: the request's output is unchanged, but
# it cannot speculate (a stop string may end it mid-step).
NEVER = "@@never@@"


@pytest.fixture(scope="module")
def speculating(stories_path):
    """stories260K drafting up to 4 tokens by n-gram, prompts in chunks of
    16, and a pool of 40 blocks of 16 tokens: 16 requests of 60 tokens need
    more, so some are preempted (by recompute: no host tier)."""
    services, client = start_services(str(stories_path), executor_env={
        "EXECUTOR_SPECULATIVE_METHOD": "ngram", "EXECUTOR_SPECULATIVE_TOKENS": "4", "EXECUTOR_NUM_KV_BLOCKS": "40"},
        scheduler_env={"SCHEDULER_MAX_PREFILL_CHUNK": "16", "SCHEDULER_SPECULATIVE_MAX_BATCH": "64"})
    yield services, client
    client.channel.close()
    services.stop()


def test_greedy_output_with_ngram_speculation_equals_hf_under_chunking_preemption_and_cancels(speculating):
    services, client = speculating
    ids = {p: list(client.stub.Tokenize(spb.TokenizeRequest(prompt=p), timeout=10).token_ids) for p in STORY_PROMPTS}
    # Greedy requests speculate, logprobs or not; those with a stop string
    # (that never matches) decode one token per step beside them.
    extra = [{}, {}, {"logprobs": 1}, {"stop": [NEVER]}]
    cases = [(p, {"max_tokens": 60, "temperature": 0, **extra[i % 4]})
             for i, p in enumerate(STORY_PROMPTS + STORY_PROMPTS[:7])]

    def run(case):
        prompt, sampling = case
        return client.generate(prompt=prompt, sampling=sampling, timeout=120)[0]

    def cancelled(prompt):
        call = client.stub.Generate(spb.GenerateRequest(prompt=prompt, sampling=spb.SamplingParams(
            max_tokens=200, temperature=0)), timeout=60)
        next(call)
        next(call)
        call.cancel()

    with ThreadPoolExecutor(len(cases) + 3) as pool:
        results = pool.map(run, cases)
        list(pool.map(cancelled, STORY_PROMPTS[:3]))
        results = list(results)
    for (prompt, sampling), got in zip(cases, results):
        assert got == hf_greedy(client.model, ids[prompt], 60), f"{prompt!r} ({sampling})"
    drafted = scheduler_metric(services, "llmsched_spec_decode_draft_tokens_total")
    accepted = scheduler_metric(services, "llmsched_spec_decode_accepted_tokens_total")
    assert drafted > 0 and accepted > 0, f"no draft was accepted ({accepted} of {drafted})"
    assert client.info().num_preemptions > 0, "the small pool should have preempted some requests"
    client.assert_no_leaked_blocks()


def test_an_answer_that_copies_its_prompt_yields_several_tokens_per_step(speculating):
    """The `copy` shape: stories260K's own greedy continuation placed back
    in the prompt after its opening, then the opening again; the model
    copies it for a while (about 16 tokens: it is tiny), and its drafts,
    looked up in the prompt, are accepted: 1.6 tokens per step here."""
    services, client = speculating
    opening = [1, 403, 407, 261, 378]
    story = hf_greedy(client.model, opening, 120, ignore_eos=True)
    prompt = opening + story + opening[1:]
    steps_before = scheduler_metric(services, "llmsched_spec_decode_accepted_length_count")
    accepted_before = scheduler_metric(services, "llmsched_spec_decode_accepted_tokens_total")
    tokens = client.generate(prompt_token_ids=prompt, sampling={"max_tokens": 100, "temperature": 0,
                                                                "ignore_eos": True}, timeout=120)[0]
    assert tokens == hf_greedy(client.model, prompt, 100, ignore_eos=True)
    steps = scheduler_metric(services, "llmsched_spec_decode_accepted_length_count") - steps_before
    accepted = scheduler_metric(services, "llmsched_spec_decode_accepted_tokens_total") - accepted_before
    assert steps > 0 and (steps + accepted) / steps > 1.5, f"{accepted} drafts accepted over {steps} steps"


def test_a_seeded_sampled_request_yields_the_same_tokens_and_logprobs_speculating_or_not(speculating):
    """Each verified position draws with the uniform plain decoding would
    use there, so drafts change how many tokens a step yields, never which.
    The same seeded request is sent speculating, and with a stop string
    that never matches (so it decodes one token per step), four at once."""
    services, client = speculating

    def run(case):
        prompt, seed, stop = case
        call = client.stub.Generate(spb.GenerateRequest(prompt=prompt, sampling=spb.SamplingParams(
            max_tokens=80, temperature=0.8, top_p=0.95, seed=seed, logprobs=2, ignore_eos=True, stop=stop)),
            timeout=120)
        return [(lp.token_id, lp.logprob, list(lp.top_token_ids)) for resp in call for lp in resp.logprobs]

    cases = [(p, 100 + i, stop) for i, p in enumerate(STORY_PROMPTS[:4]) for stop in ([], [NEVER])]
    steps_before = scheduler_metric(services, "llmsched_spec_decode_accepted_length_count")
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    for i in range(0, len(cases), 2):
        speculated, plain = results[i], results[i + 1]
        assert len(speculated) == len(plain) == 80
        assert [t for t, _, _ in speculated] == [t for t, _, _ in plain], f"{cases[i][0]!r}: tokens differ"
        for (_, lp, top), (_, lp2, top2) in zip(speculated, plain):
            assert top == top2 and lp == pytest.approx(lp2, abs=1e-3)
    assert scheduler_metric(services, "llmsched_spec_decode_accepted_length_count") > steps_before, (
        "the sampled requests never verified a draft")
    client.assert_no_leaked_blocks()
