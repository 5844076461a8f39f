"""Penalties, logit_bias, min_tokens and min_p through both services, on
the shared stories260K stack (issue 35, part 3)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from llmsched.v1 import scheduler_pb2 as spb
from tests.oracle import hf_greedy, hf_greedy_penalised

ONCE = [1, 403, 407, 261, 378]  # "Once upon a time"
DOG = [1, 291, 376, 400, 428]  # "The little dog"
EOS = 2


def test_greedy_repetition_penalty_matches_hf_generate_alone_and_batched(stories):
    tokens, _, last, _ = stories.generate(prompt="Once upon a time", sampling={
        "max_tokens": 40, "temperature": 0, "repetition_penalty": 1.3})
    want = hf_greedy_penalised(stories.model, ONCE, 40, 1.3)
    assert tokens == want
    assert tokens != hf_greedy(stories.model, ONCE, 40)
    # Penalised and plain requests in the same batches, of several lengths,
    # so penalty slots are taken and freed while rows come and go.
    cases = [(p[: 3 + i % 3], 1.3 if i % 2 == 0 else None, 10 + 4 * i) for i, p in enumerate([ONCE, DOG] * 4)]

    def run(case):
        prompt, penalty, max_tokens = case
        sampling = {"max_tokens": max_tokens, "temperature": 0}
        if penalty is not None:
            sampling["repetition_penalty"] = penalty
        return stories.generate(prompt_token_ids=prompt, sampling=sampling)[0]

    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        results = list(pool.map(run, cases))
    for (prompt, penalty, max_tokens), got in zip(cases, results):
        want = (hf_greedy(stories.model, prompt, max_tokens) if penalty is None
                else hf_greedy_penalised(stories.model, prompt, max_tokens, penalty))
        assert got == want, f"prompt of {len(prompt)} tokens, repetition_penalty={penalty}"
    stories.assert_no_leaked_blocks()


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_frequency_and_presence_penalties_change_the_output(stories, penalty):
    plain, _, _, _ = stories.generate(prompt_token_ids=ONCE, sampling={"max_tokens": 40, "temperature": 0})
    got, _, _, _ = stories.generate(prompt_token_ids=ONCE, sampling={"max_tokens": 40, "temperature": 0, penalty: 2.0})
    assert got != plain
    # Each repeat costs the token a logit of 2: fewer repeats than greedy.
    assert len(got) - len(set(got)) < len(plain) - len(set(plain))


def test_logit_bias_of_100_forces_its_token(stories):
    tokens, _, _, _ = stories.generate(prompt_token_ids=ONCE, sampling={
        "max_tokens": 6, "temperature": 1.0, "seed": 3, "logit_bias": {42: 100.0}})
    assert tokens == [42] * 6


def test_min_tokens_holds_back_eos_and_stop_token_ids(stories):
    forced_eos = {"max_tokens": 20, "temperature": 0, "logit_bias": {EOS: 100.0}}
    tokens, _, last, _ = stories.generate(prompt_token_ids=ONCE, sampling=forced_eos)
    assert tokens == [EOS] and last.finish_reason == spb.FINISH_REASON_STOP
    tokens, _, last, _ = stories.generate(prompt_token_ids=ONCE, sampling={**forced_eos, "min_tokens": 5})
    assert len(tokens) == 6 and EOS not in tokens[:5] and tokens[5] == EOS
    assert last.finish_reason == spb.FINISH_REASON_STOP
    forced_stop = {"max_tokens": 20, "temperature": 0, "logit_bias": {42: 100.0}, "stop_token_ids": [42],
                   "min_tokens": 3}
    tokens, _, last, _ = stories.generate(prompt_token_ids=ONCE, sampling=forced_stop)
    assert len(tokens) == 4 and tokens[3] == 42 and 42 not in tokens[:3]


def test_min_tokens_holds_back_stop_strings(stories):
    # Greedy: ", there was a little girl named Lily. ..."
    _, text, last, _ = stories.generate(prompt_token_ids=ONCE, sampling={
        "max_tokens": 20, "temperature": 0, "stop": ["there"]})
    assert text == ", " and last.finish_reason == spb.FINISH_REASON_STOP
    tokens, text, _, _ = stories.generate(prompt_token_ids=ONCE, sampling={
        "max_tokens": 20, "temperature": 0, "stop": ["there"], "min_tokens": 8})
    assert text.startswith(", there was a little girl") and len(tokens) >= 8
    assert "there" not in text[len(", there"):], "a later stop string still stops it"
    stories.assert_no_leaked_blocks()


def test_min_p_keeps_only_the_likely_tokens(stories):
    # min_p = 1 keeps only the most likely token: sampling turns greedy.
    tokens, _, _, _ = stories.generate(prompt_token_ids=DOG, sampling={
        "max_tokens": 20, "temperature": 1.5, "seed": 7, "min_p": 1.0})
    assert tokens == hf_greedy(stories.model, DOG, 20)


@pytest.mark.parametrize("sampling, field", [
    ({"min_tokens": 5, "max_tokens": 4}, "sampling.min_tokens"),
    ({"logit_bias": {600: 1.0}}, "sampling.logit_bias"),
    ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
])
def test_bad_values_are_refused_by_field_name(stories, sampling, field):
    with pytest.raises(grpc.RpcError) as exc:
        stories.generate(prompt_token_ids=ONCE, sampling=sampling)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith(field)


def test_min_tokens_with_a_constraint_is_refused_by_name(stories):
    with pytest.raises(grpc.RpcError) as exc:
        stories.generate(prompt_token_ids=ONCE, sampling={"min_tokens": 2},
                         structured=spb.StructuredOutput(json_object=True))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details().startswith("sampling.min_tokens")
