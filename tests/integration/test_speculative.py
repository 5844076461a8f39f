"""Speculative decoding through both services (issue 36: n-gram drafts):
greedy output equals HF's token for token, with requests speculating
beside ones that cannot, prompts prefilled in chunks, preemption by
recompute in a small pool, and cancellations; a seeded sampled request
yields the same tokens and logprobs whether it speculates or not; the
drafts are really accepted (the metrics say so). Constrained requests
(JSON schema, regex, and the grammar the gateway sends for tool_choice
required) speculate too: each yields what it yields without drafts, every
output validates, and greedy neighbours still equal HF."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from gateway_svc import tools
from gateway_svc.protocol import ChatCompletionRequest
from gateway_svc.tool_parsers import hermes
from llmsched.v1 import scheduler_pb2 as spb
from tests.constrained_cases import ADD, AGES, PET
from tests.integration.conftest import scheduler_metric, start_services
from tests.oracle import STORY_PROMPTS, hf_greedy

pytestmark = pytest.mark.slow
# A stop string no story contains: the request's output is unchanged, and
# it is searched for after every token a speculative step yields.
NEVER = "@@never@@"



def forced_call() -> spb.StructuredOutput:
    """What the gateway sends the scheduler for tool_choice required."""
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Add 2 and 3."}],
                                                 "tools": [ADD], "tool_choice": "required",
                                                 "parallel_tool_calls": False})
    return tools.plan(body, "hermes").constraint.structured


def is_pet(text: str) -> bool:
    value = json.loads(text)
    return value.keys() == {"age", "pet"} and 1 <= value["age"] <= 99 and value["pet"] in ("cat", "dog")


def is_add_call(text: str) -> bool:
    scan = hermes.scan(text, final=True)
    if scan.content or len(scan.calls) != 1 or scan.calls[0].name != "add":
        return False
    arguments = json.loads(scan.calls[0].arguments)
    return arguments.keys() == {"a", "b"} and all(0 <= v <= 9 for v in arguments.values())


# Each kind: its constraint, a check of a whole output, and a prompt that
# holds text the constraint takes, for the proposer to draft from.
CONSTRAINED = {
    "json_schema": (spb.StructuredOutput(json_schema=json.dumps(PET)), is_pet,
                    'Lily said {"age":7,"pet":"dog"} and Tom said '),
    "regex": (spb.StructuredOutput(regex=AGES), lambda text: re.fullmatch(AGES, text) is not None,
              "Lily is 12. Tom is 34. Then "),
    "tool_call": (forced_call(), is_add_call,
                  'Sum: <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 8}}\n</tool_call> Now: '),
}


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


@pytest.fixture(scope="module")
def plain(stories_path):
    """The same model and settings, not speculating: what the speculating
    stack's outputs must equal where HF is no oracle (sampled requests)."""
    services, client = start_services(str(stories_path), executor_env={"EXECUTOR_NUM_KV_BLOCKS": "40"},
                                      scheduler_env={"SCHEDULER_MAX_PREFILL_CHUNK": "16"})
    yield client
    client.channel.close()
    services.stop()


def test_greedy_output_with_ngram_speculation_equals_hf_under_chunking_preemption_and_cancels(speculating):
    services, client = speculating
    ids = {p: list(client.stub.Tokenize(spb.TokenizeRequest(prompt=p), timeout=10).token_ids) for p in STORY_PROMPTS}
    # Greedy requests speculate, with logprobs or a stop string (that never
    # matches) or neither.
    extra = [{}, {}, {"logprobs": 1}, {"stop": [NEVER]}]
    cases = [(p, {"max_tokens": 60, "temperature": 0, **extra[i % 4]})
             for i, p in enumerate(STORY_PROMPTS + STORY_PROMPTS[:7])]

    def run(case):
        prompt, sampling = case
        return client.generate(prompt=prompt, sampling=sampling, timeout=120)[0]

    with ThreadPoolExecutor(len(cases) + 3) as pool:
        results = pool.map(run, cases)
        list(pool.map(client.cancel_after, STORY_PROMPTS[:3]))
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


def test_a_seeded_sampled_request_yields_the_same_tokens_and_logprobs_speculating_or_not(speculating, plain):
    """Each verified position draws with the uniform plain decoding would
    use there, so drafts change how many tokens a step yields, never which.
    The same seeded request is sent to the speculating stack and to the
    plain one, four at once."""
    services, client = speculating

    def run(case):
        prompt, seed, on, extra = case
        call = on.stub.Generate(spb.GenerateRequest(prompt=prompt, sampling=spb.SamplingParams(
            max_tokens=80, temperature=0.8, top_p=0.95, seed=seed, logprobs=2, ignore_eos=True, **extra)),
            timeout=120)
        return [(lp.token_id, lp.logprob, list(lp.top_token_ids)) for resp in call for lp in resp.logprobs]

    # Half of them with a logit_bias, min_tokens and penalties, applied at
    # each verified position as at that output index (the penalties
    # counting the drafts before it).
    extras = [{}, {"logit_bias": {403: 3.0}, "min_tokens": 60, "frequency_penalty": 0.3, "presence_penalty": 0.2,
                   "repetition_penalty": 1.1}]
    cases = [(p, 100 + i, on, extras[i % 2]) for i, p in enumerate(STORY_PROMPTS[:4]) for on in (client, plain)]
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


def test_constrained_requests_speculate_and_yield_what_they_would_without(speculating, plain):
    """Each kind, greedy and seeded, sent to the speculating stack and to
    the plain one, all at once: each pair is equal token for token, every
    output is whole and valid, and the constrained requests accepted
    drafts."""
    services, client = speculating
    samplings = [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.95, "seed": 7}]
    cases = [(kind, sampling, on) for kind in CONSTRAINED for sampling in samplings for on in (client, plain)]

    def run(case):
        kind, sampling, on = case
        structured, _, prompt = CONSTRAINED[kind]
        tokens, text, last, _ = on.generate(prompt=prompt, structured=structured, timeout=120,
                                            sampling={"max_tokens": 100, **sampling})
        return tokens, text, last.finish_reason

    accepted_before = scheduler_metric(services, "llmsched_spec_decode_accepted_tokens_total")
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    accepted = scheduler_metric(services, "llmsched_spec_decode_accepted_tokens_total") - accepted_before
    for i in range(0, len(cases), 2):
        (kind, sampling, _), (speculated, text, finish), (plain, _, _) = cases[i], results[i], results[i + 1]
        assert speculated == plain, f"{kind} {sampling}: tokens differ"
        assert finish == spb.FINISH_REASON_STOP and CONSTRAINED[kind][1](text), f"{kind} {sampling}: {text!r}"
    assert accepted > 0, "no constrained request accepted a draft"
    client.assert_no_leaked_blocks()


def test_greedy_requests_beside_constrained_neighbours_still_equal_hf(speculating):
    """Half the requests constrained (JSON schema and regex, greedy and
    seeded), half free and greedy, all speculating in the small pool at
    once: the free ones equal HF, every constrained one is whole and
    valid."""
    services, client = speculating
    ids = {p: list(client.stub.Tokenize(spb.TokenizeRequest(prompt=p), timeout=10).token_ids) for p in STORY_PROMPTS}
    kinds = ["json_schema", "regex"]
    samplings = [{"temperature": 0}, {"temperature": 1.0, "seed": 11}]
    neighbours = [(kinds[i % 2], samplings[i // 2 % 2]) for i in range(len(STORY_PROMPTS))]

    def free(prompt):
        return client.generate(prompt=prompt, sampling={"max_tokens": 60, "temperature": 0}, timeout=120)[0]

    def constrained(case):
        kind, sampling = case
        structured, _, prompt = CONSTRAINED[kind]
        _, text, last, _ = client.generate(prompt=prompt, structured=structured, timeout=120,
                                           sampling={"max_tokens": 100, **sampling})
        return text, last.finish_reason

    drafted_before = scheduler_metric(services, "llmsched_spec_decode_draft_tokens_total")
    with ThreadPoolExecutor(2 * len(STORY_PROMPTS)) as pool:
        free_results = pool.map(free, STORY_PROMPTS)
        constrained_results = list(pool.map(constrained, neighbours))
        free_results = list(free_results)
    for prompt, got in zip(STORY_PROMPTS, free_results):
        assert got == hf_greedy(client.model, ids[prompt], 60), repr(prompt)
    for (kind, sampling), (text, finish) in zip(neighbours, constrained_results):
        assert finish == spb.FINISH_REASON_STOP and CONSTRAINED[kind][1](text), f"{kind} {sampling}: {text!r}"
    assert scheduler_metric(services, "llmsched_spec_decode_draft_tokens_total") > drafted_before
    client.assert_no_leaked_blocks()


def test_a_stop_string_completing_mid_step_ends_the_output_as_plain_decoding_does(speculating, plain):
    """Stop strings that the copy-shaped answers reach while drafts are
    being accepted: text, token ids, finish reason and usage equal the
    plain stack's, so the tokens a step yielded after the one completing
    the stop string are neither sent nor counted."""
    services, client = speculating
    opening = [1, 403, 407, 261, 378]
    story = hf_greedy(client.model, opening, 120, ignore_eos=True)
    prompt = opening + story + opening[1:]
    full = client.generate(prompt_token_ids=prompt, sampling={"max_tokens": 100, "temperature": 0,
                                                              "ignore_eos": True})[1]
    words = full.split()
    # Stop strings of several lengths, completing at several places.
    stops = [words[3], " ".join(words[6:8]), words[12][:-1] or words[12], words[20]]
    assert len(set(stops)) == len(stops)

    def run(case):
        stop, on = case
        tokens, text, last, _ = on.generate(prompt_token_ids=prompt, timeout=120, sampling={
            "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stop": [stop]})
        return tokens, text, last.finish_reason, last.stop_string, last.usage.completion_tokens

    accepted_before = scheduler_metric(services, "llmsched_spec_decode_accepted_tokens_total")
    for stop in stops:
        speculated, expected = run((stop, client)), run((stop, plain))
        assert speculated == expected, f"stop {stop!r}"
        assert speculated[2] == spb.FINISH_REASON_STOP and speculated[4] == len(speculated[0])
    assert scheduler_metric(services, "llmsched_spec_decode_accepted_tokens_total") > accepted_before
    client.assert_no_leaked_blocks()
