"""Constraints and tools on the request side, without a server: each field
becomes the one GenerateRequest.structured, bad ones are refused naming the
client's field before anything is sent, and the scheduler's refusals of a
constraint come back naming that field too."""

from __future__ import annotations

import json

import grpc
import pytest
from pydantic import ValidationError

from executor_svc.chat_template import CHATML_TEMPLATE
from gateway_svc import chat_template, constraints, tools
from gateway_svc.errors import from_rpc_error
from gateway_svc.openai_format import ChatFormat
from gateway_svc.protocol import ChatCompletionRequest, CompletionRequest, RequestError, param_of
from gateway_svc.tool_parsers import hermes
from tests.chat_templates import LLAMA3_STYLE, QWEN25_TOOLS
from tests.unit.test_gateway_protocol import FakeRpcError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def _completion(**fields) -> CompletionRequest:
    body = CompletionRequest.model_validate({"prompt": "x", **fields})
    body.check_inert_fields()
    return body


def _chat(**fields) -> ChatCompletionRequest:
    body = ChatCompletionRequest.model_validate({"messages": USER, **fields})
    body.check_inert_fields()
    return body


@pytest.mark.parametrize("fields, kind, param, value", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     "json_schema", "response_format.json_schema.schema", SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", "structured_outputs.json", SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", "structured_outputs.json", SCHEMA),
    ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs.json_object", True),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "structured_outputs.regex", "[a-z]+"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", "structured_outputs.choice", ["yes", "no"]),
    ({"structured_outputs": {"grammar": "start: \"a\""}}, "grammar", "structured_outputs.grammar", "start: \"a\""),
    ({"guided_json": SCHEMA}, "json_schema", "guided_json", SCHEMA),
    ({"guided_regex": "\\d+"}, "regex", "guided_regex", "\\d+"),
    ({"guided_choice": ["a", "b"]}, "choice", "guided_choice", ["a", "b"]),
    ({"guided_grammar": "start: \"a\""}, "grammar", "guided_grammar", "start: \"a\""),
])
def test_each_field_becomes_the_one_structured_constraint(fields, kind, param, value):
    for body in (_completion(**fields), _chat(**fields)):
        constraint = constraints.from_request(body)
        assert (constraint.kind, constraint.param) == (kind, param)
        assert constraint.structured.WhichOneof("constraint") == kind
        got = getattr(constraint.structured, kind)
        if kind == "json_schema":
            got = json.loads(got)
        elif kind == "choice":
            got = list(got.values)
        assert got == value


def test_no_constraint_for_text_or_nothing():
    assert constraints.from_request(_completion()) is None
    assert constraints.from_request(_completion(response_format={"type": "text"})) is None
    assert constraints.from_request(_completion(structured_outputs={"json_object": False})) is None


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1]"}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"minimum": "low"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
])
def test_bad_constraints_are_refused_naming_the_field(fields, param):
    with pytest.raises(RequestError) as exc:
        constraints.from_request(_completion(**fields))
    assert exc.value.param == param and exc.value.message.startswith(param)


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_object", "extra": 1}}, "response_format.extra"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_choice": "yes"}, "guided_choice"),
])
def test_shapes_we_do_not_implement_are_refused_by_name(fields, param):
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"prompt": "x", **fields})
    assert param_of(exc.value.errors()[0]["loc"]) == param


def test_the_schedulers_refusal_names_the_clients_field():
    constraint = constraints.from_request(_completion(guided_regex="a("))
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "structured.regex: unclosed group",
                                      (("llmsched-field", "structured.regex"),)), {}, constraint)
    assert (err.status, err.param, err.message) == (400, "guided_regex", "guided_regex: unclosed group")


# ----- tools ------------------------------------------------------------------

def test_tool_choice_none_auto_required_and_named():
    none = tools.plan(_chat(tools=[WEATHER], tool_choice="none"), "hermes")
    assert none.tools == [WEATHER] and none.parser is None and none.constraint is None
    auto = tools.plan(_chat(tools=[WEATHER, CLOCK]), "hermes")
    assert auto.parser is hermes and auto.constraint is None and auto.parallel
    assert auto.tools == [WEATHER, CLOCK], "the template gets the tools exactly as sent"
    required = tools.plan(_chat(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False), "hermes")
    grammar = required.constraint.structured.grammar
    assert required.constraint.kind == "tool_call" and not required.parallel
    assert '\\"get_weather\\"' in grammar and '\\"get_time\\"' in grammar and grammar.startswith("start: call\n")
    named = tools.plan(_chat(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {
        "name": "get_time"}}), "llama3_json")
    assert '\\"get_time\\"' in named.constraint.structured.grammar
    assert "get_weather" not in named.constraint.structured.grammar
    # A function without parameters takes an empty object.
    assert '"additionalProperties": false' in named.constraint.structured.grammar
    assert named.constraint.line_params == {4: "tools[1].function.parameters"}
    assert named.constraint.structured.grammar.startswith("start: call\n"), "a named function is called once"
    assert tools.plan(_chat(), "hermes") == tools.plan(_chat(tool_choice="auto"), "hermes") == tools.NO_TOOLS


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [CLOCK, {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[1].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice.function.name"),
])
def test_bad_tools_are_refused_naming_the_field(fields, param):
    with pytest.raises(RequestError) as exc:
        tools.plan(_chat(**fields), "hermes")
    assert exc.value.param == param


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]}, "tools[0].function.returns"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
])
def test_tool_shapes_we_do_not_implement_are_refused_by_name(fields, param):
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate({"messages": USER, **fields})
    assert param_of(exc.value.errors()[0]["loc"]) == param


def test_a_forced_calls_compile_error_names_the_tool():
    plan = tools.plan(_chat(tools=[CLOCK, WEATHER], tool_choice="required"), "hermes")
    line = next(n for n, p in plan.constraint.line_params.items() if p == "tools[1].function.parameters")
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT,
                                      f"structured.grammar: at {line}(9): Unimplemented keys: [\"not\"]",
                                      (("llmsched-field", "structured.grammar"), ("llmsched-grammar-line", str(line)))),
                         ChatFormat.fields, plan.constraint)
    assert err.param == "tools[1].function.parameters"
    assert err.message == f"tools[1].function.parameters: at {line}(9): Unimplemented keys: [\"not\"]"


def test_assistant_calls_and_tool_results_reach_the_template_as_transformers_expects():
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"}]})
    call, result = (m.for_template(i) for i, m in enumerate(body.messages))
    assert call["tool_calls"] == [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    assert result["tool_call_id"] == "call_1" and result["role"] == "tool"
    bad = ChatCompletionRequest.model_validate({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]})
    with pytest.raises(RequestError) as exc:
        bad.messages[0].for_template(0)
    assert exc.value.param == "messages[0].tool_calls[0].function.arguments"


def test_a_template_that_never_reads_tools_refuses_them():
    plan = tools.plan(_chat(tools=[WEATHER]), "hermes")
    for template in (CHATML_TEMPLATE, QWEN25_TOOLS):
        tools.check_template(chat_template.names_read(template), plan, [])
    with pytest.raises(RequestError) as exc:
        tools.check_template(chat_template.names_read(LLAMA3_STYLE), plan, [])
    assert exc.value.param == "tools"
    with pytest.raises(RequestError) as exc:
        tools.check_template(chat_template.names_read(LLAMA3_STYLE), tools.NO_TOOLS,
                             [{"role": "user"}, {"role": "assistant", "tool_calls": [{}]}])
    assert exc.value.param == "messages[1].tool_calls"
