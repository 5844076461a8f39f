"""Tool-call parsers on canned outputs (well-formed, malformed, partial),
streamed piece by piece against the same text read whole, and the forced-
call grammars they write: compiled by llguidance, walked at random, and
every output reads back as calls whose arguments match their schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from executor_svc.model.builtin import byte_level_tokenizer_json
from gateway_svc.chat_output import ChatOutput
from gateway_svc.constraints import Constraint
from gateway_svc.tool_parsers import PARSERS, Function, hermes, llama3_json, mistral
from llmsched.v1 import scheduler_pb2 as spb
from scheduler_svc.constraints import grammar_line
from tests import grammar_walk

WEATHER = '{"city": "Paris", "days": 3}'

# (parser, output, content, [(name, arguments)])
CASES = [
    # Hermes: calls anywhere, content around them.
    (hermes, "Plain answer.", "Plain answer.", []),
    (hermes, '<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + '}\n</tool_call>', None,
     [("get_weather", WEATHER)]),
    (hermes, 'Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
             '<tool_call>\n{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>', "Let me check.\n\n",
     [("a", "{}"), ("b", '{"x": [1, 2]}')]),
    # Compact JSON is re-written with OpenAI's spacing; so is unicode.
    (hermes, '<tool_call>{"name":"f","arguments":{"q":"caf\\u00e9","n":1}}</tool_call>', None,
     [("f", '{"q": "café", "n": 1}')]),
    # Arguments as a JSON string holding an object.
    (hermes, '<tool_call>{"name": "f", "arguments": "{\\"n\\": 1}"}</tool_call>', None, [("f", '{"n": 1}')]),
    # Malformed: not JSON, no name, arguments not an object: content, as written.
    (hermes, '<tool_call>\n{"name": "f", "arguments": {"n": 1}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {"n": 1}\n</tool_call>', []),
    (hermes, '<tool_call>{"arguments": {}}</tool_call> ok', '<tool_call>{"arguments": {}}</tool_call> ok', []),
    (hermes, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    # A malformed block beside a good one: the good one is a call.
    (hermes, '<tool_call>oops</tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>',
     "<tool_call>oops</tool_call>", [("f", "{}")]),
    # Partial: cut inside a block (max_tokens) is content; a block that only
    # lacks its closing tag is a call.
    (hermes, 'Hi <tool_call>\n{"name": "f", "argum', 'Hi <tool_call>\n{"name": "f", "argum', []),
    (hermes, '<tool_call>\n{"name": "f", "arguments": {}}', None, [("f", "{}")]),
    (hermes, "text ending in <tool_", "text ending in <tool_", []),
    (hermes, "", "", []),
    # Llama 3.x JSON: the whole output is the calls.
    (llama3_json, '{"name": "get_weather", "parameters": ' + WEATHER + '}', None, [("get_weather", WEATHER)]),
    (llama3_json, '<|python_tag|>{"name": "a", "arguments": {}}; {"name": "b", "parameters": {"k": true}}', None,
     [("a", "{}"), ("b", '{"k": true}')]),
    (llama3_json, '  {"name": "a", "parameters": {}} ;  ', None, [("a", "{}")]),
    (llama3_json, "The weather is fine.", "The weather is fine.", []),
    (llama3_json, '{"name": "a", "parameters": {}} and more', '{"name": "a", "parameters": {}} and more', []),
    (llama3_json, '{"answer": 42}', '{"answer": 42}', []),
    (llama3_json, '{"name": "a", "parameters": {"x": ', '{"name": "a", "parameters": {"x": ', []),
    (llama3_json, "<|python_ta", "<|python_ta", []),
    # Mistral: after [TOOL_CALLS], an array (v3) or name[ARGS]{...} (v11);
    # the marker is a special token and usually already gone.
    (mistral, 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER + '}]', "Sure. ",
     [("get_weather", WEATHER)]),
    (mistral, '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"z": null}}]', None,
     [("a", "{}"), ("b", '{"z": null}')]),
    (mistral, '[TOOL_CALLS]get_weather[ARGS]' + WEATHER + '[TOOL_CALLS]b[ARGS]{}', None,
     [("get_weather", WEATHER), ("b", "{}")]),
    (mistral, 'get_weather' + WEATHER, 'get_weather' + WEATHER, []),
    (mistral, '[TOOL_CALLS]get_weather' + WEATHER, None, [("get_weather", WEATHER)]),
    (mistral, "[1, 2, 3]", "[1, 2, 3]", []),
    (mistral, '[TOOL_CALLS][{"name": "a", "arguments": {}}', '[TOOL_CALLS][{"name": "a", "arguments": {}}', []),
    (mistral, "No calls [TOOL_CALLS] here", "No calls [TOOL_CALLS] here", []),
    (mistral, "Almost [TOOL_CAL", "Almost [TOOL_CAL", []),
]


def _read_whole(parser, text: str, parallel: bool = True) -> ChatOutput:
    out = ChatOutput(parser, None, parallel)
    out.update(text, final=True)
    return out


def _streamed(parser, pieces: list[str], parallel: bool = True) -> tuple[str, list]:
    out = ChatOutput(parser, None, parallel)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        delta = out.update(piece, final=i == len(pieces) - 1)
        content += delta.content
        calls += delta.calls
    return content, calls


@pytest.mark.parametrize("parser, text, content, calls", CASES,
                         ids=[f"{c[0].__name__.rsplit('.', 1)[1]}-{i}" for i, c in enumerate(CASES)])
def test_canned_outputs(parser, text, content, calls):
    out = _read_whole(parser, text)
    assert out.message_content() == content
    assert [(c.name, c.arguments) for c in out.calls] == calls
    for c in out.calls:
        assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize("parser, text", [(c[0], c[1]) for c in CASES],
                         ids=[f"{c[0].__name__.rsplit('.', 1)[1]}-{i}" for i, c in enumerate(CASES)])
def test_streamed_piece_by_piece_equals_read_whole(parser, text):
    whole = _read_whole(parser, text)
    expected = (whole.message_content() or "", whole.calls)
    # One character at a time, two at a time, and in two halves at every
    # split point: the scan is monotone, so every cut gives the same answer.
    cuts = [list(text) + [""], [text[i:i + 2] for i in range(0, len(text), 2)] + [""]]
    cuts += [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for pieces in cuts:
        assert _streamed(parser, pieces) == expected, pieces


def test_scans_are_monotone_at_every_prefix():
    for parser, text, _, _ in CASES:
        final = parser.scan(text, final=True)
        for i in range(len(text) + 1):
            early = parser.scan(text[:i], final=False)
            assert final.content.startswith(early.content), (parser.__name__, text[:i])
            assert final.calls[:len(early.calls)] == early.calls, (parser.__name__, text[:i])


def test_parallel_false_returns_the_first_call():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    out = _read_whole(hermes, text, parallel=False)
    assert [c.name for c in out.calls] == ["a"] and out.message_content() is None
    assert _streamed(hermes, [text[:30], text[30:70], text[70:]], parallel=False)[1] == out.calls


def test_whitespace_is_held_until_it_turns_out_to_be_content():
    out = ChatOutput(hermes)
    assert out.update("\n\n", final=False).content == ""
    assert out.update("Hi", final=False).content == "\n\nHi"
    # Only whitespace, and no call: it is the content after all.
    out = ChatOutput(hermes)
    assert out.update("  ", final=False).content == "" and out.update("", final=True).content == "  "
    # Without parsers nothing is held.
    assert ChatOutput().update("  ", final=False).content == "  "


# ----- forced calls: the grammars --------------------------------------------

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                "additionalProperties": False}
FUNCTIONS = [Function("get_weather", WEATHER_SCHEMA, "tools[0].function.parameters"),
             Function("get_time", CLOCK_SCHEMA, "tools[1].function.parameters")]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": CLOCK_SCHEMA}


@pytest.fixture(scope="module")
def tokenizers(stories_path):
    return {"stories260K": grammar_walk.tokenizer((stories_path / "tokenizer.json").read_text()),
            "tiny-random": grammar_walk.tokenizer(byte_level_tokenizer_json(512))}


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_grammar_outputs_read_back_as_valid_calls(tokenizers, name, parallel):
    parser = PARSERS[name]
    for tok_name, tok in tokenizers.items():
        for functions in (FUNCTIONS, FUNCTIONS[:1]):
            grammar = parser.forced_grammar(functions, parallel)
            outputs = grammar_walk.walk(tok, "lark", grammar.text, n=25, seed=len(functions))
            counts = set()
            for text in outputs:
                out = _read_whole(parser, text, parallel)
                assert out.calls and out.message_content() is None, (tok_name, text)
                for call in out.calls:
                    assert call.name in {f.name for f in functions}
                    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
                counts.add(len(out.calls))
                assert _streamed(parser, [text[i:i + 3] for i in range(0, len(text), 3)] + [""], parallel) == (
                    "", out.calls)
            assert counts == {1} if not parallel else counts >= {1}, (tok_name, counts)
            if parallel:
                assert max(counts) > 1, f"{tok_name}: 25 walks never made a second call"


def test_hermes_forced_call_is_written_as_qwen_templates_write_calls(tokenizers):
    grammar = hermes.forced_grammar(FUNCTIONS[1:], parallel=False)
    [text] = grammar_walk.walk(tokenizers["stories260K"], "lark", grammar.text, n=1)
    assert text in ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
                    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_schema_the_engine_refuses_is_blamed_on_its_tool(tokenizers, name):
    unsupported = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}
    functions = [FUNCTIONS[0], Function("odd", unsupported, "tools[1].function.parameters")]
    grammar = PARSERS[name].forced_grammar(functions, parallel=True)
    error = grammar_walk.compile_error(tokenizers["tiny-random"], "lark", grammar.text)
    assert "not" in error
    constraint = Constraint(spb.StructuredOutput(grammar=grammar.text), "tools", "tool_call", grammar.line_params)
    # The scheduler reads the line out of llguidance's message and sends it
    # as a detail (llmsched-grammar-line); the gateway maps it to the tool.
    assert constraint.param_for(grammar_line(error)) == "tools[1].function.parameters"
    assert constraint.param_for(grammar_line("deadline passed")) == "tools"
