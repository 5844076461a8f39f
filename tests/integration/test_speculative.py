"""Speculative decoding through both services (issue 36, first part:
n-gram drafts, greedy verification): the output equals HF's greedy output
token for token, with requests speculating beside ones that cannot,
prompts prefilled in chunks, preemption by recompute in a small pool, and
cancellations; the drafts are really accepted (the metrics say so)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from llmsched.v1 import scheduler_pb2 as spb
from tests.integration.conftest import scheduler_metric, start_services
from tests.oracle import STORY_PROMPTS, hf_greedy

pytestmark = pytest.mark.slow


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
    # Greedy requests speculate; those asking for logprobs decode one token
    # per step beside them.
    cases = [(p, {"max_tokens": 60, "temperature": 0, **({"logprobs": 1} if i % 4 == 3 else {})})
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
        assert got == hf_greedy(client.model, ids[prompt], 60), f"{prompt!r} ({'logprobs' if 'logprobs' in sampling else 'speculating'})"
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
