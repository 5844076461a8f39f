"""The scheduler's half of constrained decoding (scheduler_svc/constraints.py): the
`structured` field's shape, compiling against stories260K's tokenizer,
refusals naming the field and llguidance's reason, the time limit, and the
cache by content. No processes, no torch."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from llguidance import LLMatcher

from llmsched.llguidance_tokenizer import make_tokenizer
from llmsched.v1 import scheduler_pb2 as spb
from scheduler_svc import constraints as so
from scheduler_svc.validation import InvalidRequest, spec_from_proto
from tests.conftest import STORIES

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer((STORIES / "tokenizer.json").read_text(), 512, [2])


def compiler(tokenizer, timeout_s=10.0, cache_size=8):
    return so.ConstraintCompiler(tokenizer, timeout_s, cache_size)


def compile_(c, **constraint):
    return asyncio.run(c.compile(spec_from_proto(spb.StructuredOutput(**constraint))))


@pytest.mark.parametrize("constraint, field, why", [
    ({}, "structured", "set one of"),
    ({"json_object": False}, "structured.json_object", "must be true"),
    ({"regex": ""}, "structured.regex", "empty"),
    ({"choice": spb.Choice()}, "structured.choice.values", "at least one"),
    ({"choice": spb.Choice(values=["a", ""])}, "structured.choice.values[1]", "empty string"),
], ids=["nothing-set", "json-object-false", "empty-regex", "empty-choice", "empty-choice-string"])
def test_a_malformed_structured_field_is_refused_naming_it(constraint, field, why):
    with pytest.raises(InvalidRequest) as exc:
        spec_from_proto(spb.StructuredOutput(**constraint))
    assert exc.value.field == field and why in exc.value.message


@pytest.mark.parametrize("constraint, field, why", [
    ({"json_schema": "{not json"}, "structured.json_schema", "not valid JSON"),
    ({"json_schema": "[1, 2]"}, "structured.json_schema", "object or a boolean"),
    ({"json_schema": json.dumps({"type": "object", "if": {}})}, "structured.json_schema", "Unimplemented keys"),
    ({"json_schema": json.dumps({"type": "string", "format": "bogus"})}, "structured.json_schema", "format"),
    ({"regex": "a(b"}, "structured.regex", "unclosed group"),
    ({"grammar": "start: ("}, "structured.grammar", "Expected"),
    ({"grammar": "start: undefined_rule"}, "structured.grammar", "undefined_rule"),
], ids=["json-syntax", "schema-not-an-object", "unsupported-keyword", "unknown-format", "bad-regex",
        "grammar-syntax", "grammar-undefined-rule"])
def test_a_constraint_that_does_not_compile_is_refused_with_llguidances_reason(tokenizer, constraint, field, why):
    with pytest.raises(InvalidRequest) as exc:
        compile_(compiler(tokenizer), **constraint)
    assert exc.value.field == field and why in exc.value.message, exc.value


@pytest.mark.parametrize("constraint, valid, invalid", [
    ({"json_schema": json.dumps(SCHEMA)}, '{"n":7}', '{"n":10}'),
    ({"json_object": True}, '{"a":[1,{}]}', "[1]"),
    ({"regex": "[0-9]{3}-[a-z]+"}, "123-ab", "12-ab"),
    ({"choice": spb.Choice(values=['say "yes"', "no"])}, 'say "yes"', "yes"),
    ({"grammar": 'start: "x" NUM\nNUM: /[0-9]+/'}, "x42", "y42"),
], ids=["json-schema", "json-object", "regex", "choice-with-a-quote", "lark"])
def test_each_kind_compiles_to_a_grammar_that_accepts_exactly_its_language(tokenizer, constraint, valid, invalid):
    compiled = compile_(compiler(tokenizer), **constraint)

    def accepts(text: str) -> bool:
        m = LLMatcher(tokenizer, compiled.grammar)
        return m.consume_tokens(tokenizer.tokenize_str(text)) and m.is_accepting()

    assert accepts(valid) and not accepts(invalid)


def test_json_is_compact_unless_the_schema_says_otherwise(tokenizer):
    compiled = compile_(compiler(tokenizer), json_schema=json.dumps(SCHEMA))
    m = LLMatcher(tokenizer, compiled.grammar)
    assert not m.consume_tokens(tokenizer.tokenize_str('{ "n": 7}')), "whitespace between tokens is not allowed"
    flexible = {**SCHEMA, "x-guidance": {"whitespace_flexible": True}}
    m = LLMatcher(tokenizer, compile_(compiler(tokenizer), json_schema=json.dumps(flexible)).grammar)
    assert m.consume_tokens(tokenizer.tokenize_str('{ "n": 7}')) and m.is_accepting()


def test_a_constraint_over_its_time_limit_is_refused_and_not_cached(tokenizer, monkeypatch):
    grammar_of = so.grammar_of

    def slow(spec):
        time.sleep(0.3)  # a compile that takes longer than the limit
        return grammar_of(spec)

    monkeypatch.setattr(so, "grammar_of", slow)
    c = compiler(tokenizer, timeout_s=0.05)
    for _ in range(2):  # the late result is not cached: refused the same way again
        with pytest.raises(InvalidRequest) as exc:
            compile_(c, json_schema=json.dumps(SCHEMA))
        assert exc.value.field == "structured.json_schema" and "did not compile within" in exc.value.message


def test_compiled_constraints_and_refusals_are_cached_by_content_lru(tokenizer):
    c = compiler(tokenizer, cache_size=2)
    hits = so.COMPILE_CACHE_HITS._value.get()
    first = compile_(c, regex="a+")
    assert compile_(c, regex="a+") is first
    with pytest.raises(InvalidRequest):
        compile_(c, regex="(")
    with pytest.raises(InvalidRequest):
        compile_(c, regex="(")
    assert so.COMPILE_CACHE_HITS._value.get() - hits == 2
    compile_(c, regex="b+")  # evicts the least recently used: "a+"
    assert compile_(c, regex="a+") is not first


def test_a_grammar_error_carries_the_line_llguidance_blamed(tokenizer):
    with pytest.raises(InvalidRequest) as exc:
        compile_(compiler(tokenizer), grammar='start: a\na: "x" b\nb: %json {"type": "object", "not": {}}\n')
    assert exc.value.field == "structured.grammar"
    assert exc.value.grammar_line == so.grammar_line(exc.value.message) == 3, exc.value.message
    with pytest.raises(InvalidRequest) as exc:
        compile_(compiler(tokenizer), json_schema="{not json")  # refused before any grammar is built
    assert exc.value.grammar_line is None
