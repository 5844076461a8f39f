"""Tool calling on the request side: `tools`, `tool_choice` and
`parallel_tool_calls` checked and turned into a ToolChoice: the tools the
chat template renders, the parser that reads calls back out of the output,
and, for tool_choice `required` or a named function, the grammar that makes
the model call (sent as `structured.grammar`, in the format of
GATEWAY_TOOL_CALL_PARSER, with each function's arguments held to its
parameter schema)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import ModuleType

from gateway_svc.protocol import ChatCompletionRequest, RequestError
from gateway_svc.constraints import Constraint, json_schema_of
from gateway_svc.tool_parsers import PARSERS, Function
from llmsched.v1 import scheduler_pb2 as spb

# OpenAI's rule for function names; it also keeps them plain in a grammar.
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# A function that takes nothing (OpenAI: `parameters` left out).
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    tools: list[dict] | None  # for the chat template, as the client sent them
    parser: ModuleType | None  # reads calls out of the output; None: no calls (tool_choice none)
    parallel: bool
    constraint: Constraint | None  # a forced call's grammar


NO_TOOLS = ToolChoice(None, None, True, None)


def _choice(value, names: list[str]) -> str | None:
    """`none`, `auto`, `required`, or None for a named function (which
    _named returns)."""
    if value is None:
        return "auto" if names else "none"
    if isinstance(value, str):
        if value not in CHOICES:
            raise RequestError("tool_choice", f"tool_choice={value!r}: use none, auto, required or "
                                              '{"type": "function", "function": {"name": ...}}')
        if value == "required" and not names:
            raise RequestError("tool_choice", "tool_choice=required needs tools")
        return value
    return None


def _named(value, names: list[str]) -> str:
    if (not isinstance(value, dict) or set(value) != {"type", "function"} or value["type"] != "function"
            or not isinstance(value["function"], dict) or set(value["function"]) != {"name"}):
        raise RequestError("tool_choice", 'a named tool_choice is {"type": "function", "function": {"name": ...}}')
    name = value["function"]["name"]
    if name not in names:
        raise RequestError("tool_choice.function.name", f"no tool is named {name!r}"
                           + (f" (tools: {', '.join(names)})" if names else " (the request has no tools)"))
    return name


def _functions(body: ChatCompletionRequest) -> list[Function]:
    functions, seen = [], set()
    for i, tool in enumerate(body.tools or []):
        name = tool.function.name
        if not FUNCTION_NAME.fullmatch(name):
            raise RequestError(f"tools[{i}].function.name",
                               f"{name!r}: a function name is 1 to 64 of a-z, A-Z, 0-9, _ and -")
        if name in seen:
            raise RequestError(f"tools[{i}].function.name", f"two tools are named {name!r}")
        seen.add(name)
        param = f"tools[{i}].function.parameters"
        parameters = tool.function.parameters
        if parameters is None:
            parameters = NO_PARAMETERS
        else:
            json_schema_of(parameters, param)
            if parameters.get("type", "object") != "object":
                raise RequestError(param, f"{param}: arguments are a JSON object, so the schema's type must be "
                                          f"'object', not {parameters['type']!r}")
        functions.append(Function(name, parameters, param))
    return functions


def plan(body: ChatCompletionRequest, parser_name: str) -> ToolChoice:
    functions = _functions(body)
    names = [f.name for f in functions]
    choice = _choice(body.tool_choice, names)
    if choice is None:
        named = _named(body.tool_choice, names)
        forced = [f for f in functions if f.name == named]
    if not functions:
        return NO_TOOLS
    tools = [t.model_dump(exclude_unset=True, by_alias=True) for t in body.tools]
    parallel = body.parallel_tool_calls is not False
    if choice == "none":
        # The tools are still in the prompt, as OpenAI and vLLM render them;
        # the output is returned as written.
        return ToolChoice(tools, None, parallel, None)
    parser = PARSERS[parser_name]
    if choice == "auto":
        return ToolChoice(tools, parser, parallel, None)
    # A named function is called once, as vLLM and OpenAI do; `required`
    # may call several tools unless parallel_tool_calls is false.
    grammar = parser.forced_grammar(forced, False) if choice is None else parser.forced_grammar(functions, parallel)
    constraint = Constraint(spb.StructuredOutput(grammar=grammar.text), "tools", "tool_call", grammar.line_params)
    return ToolChoice(tools, parser, parallel, constraint)


def check_template(template_reads: frozenset[str], plan: ToolChoice, messages: list[dict]) -> None:
    """A template that never reads `tools` (or `tool_calls`) would drop them
    from the prompt without a word: refused by name instead."""
    if plan.tools and "tools" not in template_reads:
        raise RequestError("tools", "the model's chat template cannot render tools (it never reads `tools`)")
    for i, message in enumerate(messages):
        if message.get("tool_calls") and "tool_calls" not in template_reads:
            raise RequestError(f"messages[{i}].tool_calls",
                               "the model's chat template cannot render tool calls (it never reads `tool_calls`)")
