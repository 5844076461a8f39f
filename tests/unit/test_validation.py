import math

import pytest

from llmsched.v1 import scheduler_pb2 as spb
from scheduler_svc.validation import InvalidRequest, Limits, sampling_from_proto, validate_prompt

LIMITS = Limits(vocab_size=512, max_model_len=512, max_logprobs=20, max_stop_strings=4, max_stop_string_chars=8,
                max_stop_token_ids=4)


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
