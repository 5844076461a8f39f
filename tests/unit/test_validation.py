import math

import pytest

from llmsched.v1 import scheduler_pb2 as spb
from scheduler_svc.validation import InvalidRequest, Limits, sampling_from_proto, validate_prompt

LIMITS = Limits(vocab_size=512, max_model_len=512, max_logprobs=20, max_stop_strings=4, max_stop_string_chars=8,
                max_stop_token_ids=4, max_logit_bias=4)


def sampling(**kw):
    return sampling_from_proto(spb.SamplingParams(**kw), LIMITS)


def test_unset_fields_take_documented_defaults():
    s = sampling()
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (16, 1.0, 1.0, 0, None)


def test_zero_temperature_is_greedy_and_explicit_values_are_kept():
    s = sampling(temperature=0.0, top_p=0.5, seed=7)
    assert (s.temperature, s.top_p, s.seed) == (0.0, 0.5, 7)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": math.nan}, "sampling.temperature"),
        ({"temperature": math.inf}, "sampling.temperature"),
        ({"temperature": -0.5}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"max_tokens": 100000}, "sampling.max_tokens"),
        ({"logprobs": 21}, "sampling.logprobs"),
        ({"stop": ["a"] * 5}, "sampling.stop"),
        ({"stop": [""]}, "sampling.stop[0]"),
        ({"stop": ["x" * 9]}, "sampling.stop[0]"),
        ({"stop_token_ids": [600]}, "sampling.stop_token_ids[0]"),
        ({"stop_token_ids": [1] * 5}, "sampling.stop_token_ids"),
        ({"presence_penalty": 2.5}, "sampling.presence_penalty"),
        ({"presence_penalty": math.nan}, "sampling.presence_penalty"),
        ({"frequency_penalty": -2.5}, "sampling.frequency_penalty"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
        ({"repetition_penalty": -1.0}, "sampling.repetition_penalty"),
        ({"repetition_penalty": math.inf}, "sampling.repetition_penalty"),
        ({"min_p": 1.5}, "sampling.min_p"),
        ({"min_p": -0.1}, "sampling.min_p"),
        ({"min_tokens": 17}, "sampling.min_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "sampling.min_tokens"),
        ({"logit_bias": {600: 1.0}}, "sampling.logit_bias"),
        ({"logit_bias": {5: 100.5}}, "sampling.logit_bias"),
        ({"logit_bias": {5: math.nan}}, "sampling.logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(5)}}, "sampling.logit_bias"),
        ({"top_k": 513}, "sampling.top_k"),
    ],
)
def test_bad_sampling_field_is_named_in_the_error(kwargs, field):
    with pytest.raises(InvalidRequest) as exc:
        sampling(**kwargs)
    assert exc.value.field == field and str(exc.value).startswith(field)


@pytest.mark.parametrize(
    "msg, field",
    [
        (spb.GenerateRequest(), "prompt"),
        (spb.GenerateRequest(prompt="hi", prompt_token_ids=[1]), "prompt"),
        (spb.GenerateRequest(prompt_token_ids=[1, 512]), "prompt_token_ids[1]"),
        (spb.GenerateRequest(prompt="x", request_id="r" * 300), "request_id"),
    ],
)
def test_bad_prompt_field_is_named_in_the_error(msg, field):
    with pytest.raises(InvalidRequest) as exc:
        validate_prompt(msg, LIMITS)
    assert exc.value.field == field


def test_sampling_parity_fields_are_kept_and_default_off():
    s = sampling()
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p, s.min_tokens, s.logit_bias) == (
        0.0, 0.0, 1.0, 0.0, 0, ())
    s = sampling(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.5, min_p=0.25, min_tokens=16,
                 logit_bias={9: -100, 3: 100})
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p, s.min_tokens) == (
        -2.0, 2.0, 1.5, 0.25, 16)
    assert s.logit_bias == ((3, 100.0), (9, -100.0))
