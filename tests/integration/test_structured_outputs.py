"""Structured outputs through the gateway with the official `openai`
client, against real processes on tiny-random and stories260K, whose free
output is essentially never valid JSON: 100 of 100 constrained samples at
temperature 1.0 are valid (json_schema, regex, choice, grammar; json_object
samples are valid whenever they end, but a random model rarely ends a
free-form object: measured in its test), the same requests without the
constraint are not (so the checks can fail), and bad constraints are
refused naming the client's field with nothing queued."""

from __future__ import annotations

import json
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import jsonschema
import openai
import pytest

from tests.integration.conftest import num_admitted, start_gateway_stack

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time, there was a little dog named Max. He liked to"

# Nested objects, enums, integer ranges, arrays with length bounds and
# required fields; bounded strings and no extra properties, so that every
# sample ends.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6},
                           "floor": {"type": "integer", "minimum": -2, "maximum": 40}},
            "required": ["city", "floor"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "home", "tags"],
    "additionalProperties": False,
}
REGEX = r"(yes|no): [0-9]{1,3} (apples|pears)( and [0-9]{1,2} plums)?"
CHOICES = ["cat", "dog", "a very small bird"]
GRAMMAR = 'start: greeting " " NAME "!"\ngreeting: "hello" | "good day"\nNAME: /[a-z]{1,6}/\n'


def _is_person(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


@dataclass(frozen=True)
class Kind:
    spellings: list[dict]  # request bodies' extras, one per way of asking
    valid: Callable[[str], bool]
    max_tokens: int


KINDS = {
    "json_schema": Kind([{"response_format": {"type": "json_schema",
                                              "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
                         {"structured_outputs": {"json": PERSON}}, {"guided_json": json.dumps(PERSON)}],
                        _is_person, 200),
    "json_object": Kind([{"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}],
                        _is_object, 200),
    "regex": Kind([{"structured_outputs": {"regex": REGEX}}, {"guided_regex": REGEX}],
                  lambda t: re.fullmatch(REGEX, t) is not None, 40),
    "choice": Kind([{"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}],
                   lambda t: t in CHOICES, 24),
    "grammar": Kind([{"structured_outputs": {"grammar": GRAMMAR}}, {"guided_grammar": GRAMMAR}],
                    lambda t: re.fullmatch(r"(hello|good day) [a-z]{1,6}!", t) is not None, 24),
}


@pytest.fixture(scope="module", params=["tiny-random", "stories260K"])
def stack(request, stories_path):
    stack = start_gateway_stack("tiny-random" if request.param == "tiny-random" else str(stories_path))
    yield stack
    stack.stop()


def _hundred(stack, extras: Callable[[int], dict], max_tokens: int) -> list:
    """100 samples at temperature 1.0: 10 concurrent requests of n=10, each
    with its own seed."""
    def one(i: int):
        out = stack.openai.completions.create(model=stack.model, prompt=PROMPT, n=10, temperature=1.0,
                                              max_tokens=max_tokens, seed=1000 * i, extra_body=extras(i))
        return sorted(out.choices, key=lambda c: c.index)

    with ThreadPoolExecutor(max_workers=10) as pool:
        return [c for choices in pool.map(one, range(10)) for c in choices]


@pytest.mark.parametrize("kind", sorted(set(KINDS) - {"json_object"}))
def test_100_of_100_constrained_samples_are_valid_and_free_ones_are_not(stack, kind):
    spec = KINDS[kind]
    samples = _hundred(stack, lambda i: spec.spellings[i % len(spec.spellings)], spec.max_tokens)
    ends = Counter(c.finish_reason for c in samples)
    bad = [(c.text, c.finish_reason) for c in samples if c.finish_reason != "stop" or not spec.valid(c.text)]
    assert not bad, f"{len(bad)} of 100 invalid or unfinished (finish reasons {dict(ends)}): {bad[:3]}"
    free = _hundred(stack, lambda i: {}, spec.max_tokens)
    assert sum(spec.valid(c.text) for c in free) == 0, "the free samples must fail the check, or it proves nothing"
    stack.grpc.assert_no_leaked_blocks()


def test_json_object_samples_that_end_are_objects(stack):
    """Not 100 of 100: a random model at temperature 1.0 rarely closes a
    free-form object, since nothing bounds its keys and strings. Measured
    (these requests: 10 of n=10, seeds 0-9000): tiny-random ends 40 of 100
    within 200 tokens, 48 within 500, 61 within 1,000 and 73 within 1,900;
    stories260K 0 within 200 and 2 within 480 (its context is 512). Every
    sample that ends is a valid object, and every one cut short opens one."""
    spec = KINDS["json_object"]
    samples = _hundred(stack, lambda i: spec.spellings[i % len(spec.spellings)], spec.max_tokens)
    ended = [c.text for c in samples if c.finish_reason == "stop"]
    assert all(spec.valid(text) for text in ended), [t for t in ended if not spec.valid(t)][:3]
    # Cut short, an output is an unfinished object: it opens one.
    assert all(c.text.startswith("{") for c in samples if c.finish_reason == "length")
    if stack.model == "tiny-random":
        assert len(ended) >= 30, f"only {len(ended)} of 100 ended (40 measured)"
    free = _hundred(stack, lambda i: {}, spec.max_tokens)
    assert sum(spec.valid(c.text) for c in free) == 0
    stack.grpc.assert_no_leaked_blocks()


def test_chat_response_format_json_schema(stack):
    """tiny-random's built-in ChatML holds every reply to the schema;
    stories260K has no chat template, so chat is refused naming it."""
    chat = dict(model=stack.model, messages=[{"role": "user", "content": "Describe a person."}], n=16,
                temperature=1.0, seed=3, max_tokens=200, response_format={"type": "json_schema", "json_schema": {
                    "name": "person", "schema": PERSON, "strict": True}})
    if stack.model != "tiny-random":
        with pytest.raises(openai.BadRequestError) as exc:
            stack.openai.chat.completions.create(**chat)
        assert exc.value.body["param"] == "messages" and "no chat template" in exc.value.body["message"]
        return
    out = stack.openai.chat.completions.create(**chat)
    assert all(c.finish_reason == "stop" and _is_person(c.message.content) for c in out.choices)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),  # invalid JSON Schema (the gateway's meta-schema check)
    ({"guided_json": {"type": "object", "properties": {"n": {"not": {"type": "string"}}}}},
     "guided_json"),  # a keyword the engine does not implement (the scheduler's compile)
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"grammar": "start: greeting NAME\n"}}, "structured_outputs.grammar"),
    ({"guided_grammar": "start: \"a\" (\n"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),  # two constraints
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_constraints_get_a_400_naming_the_field_and_nothing_is_queued(stack, extra, param):
    admitted = num_admitted(stack.services)
    with pytest.raises(openai.BadRequestError) as exc:
        stack.openai.completions.create(model=stack.model, prompt=PROMPT, max_tokens=8, extra_body=extra)
    body = exc.value.body
    assert body["param"] == param and body["message"].startswith(param), body
    assert body["type"] == "invalid_request_error"
    assert num_admitted(stack.services) == admitted, "the refused request must not have been queued"
    stack.grpc.assert_no_leaked_blocks()
