"""What the tool-call formats share: the call and scan types, reading one
call out of decoded JSON, and writing a forced-call grammar."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# How a tool's arguments are written under a forced call: the separators of
# json.dumps, which chat templates' `tojson` uses for the calls the model
# saw in its prompts; llguidance's default is compact, with no spaces.
ARGUMENT_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class Scan:
    """What a text holds so far: the content outside the calls and the
    complete calls, in order."""

    content: str
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class Function:
    """One tool as a forced-call grammar needs it."""

    name: str
    parameters: dict  # JSON Schema of the arguments object
    param: str  # the request field holding that schema, named in errors


@dataclass(frozen=True, slots=True)
class Grammar:
    text: str  # llguidance's Lark dialect
    line_params: dict[int, str] = field(default_factory=dict)  # line (1-based) -> request field


def call_from_object(obj, argument_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """A call from a decoded `{"name": ..., "arguments": {...}}`, or None
    when it is not one. Arguments written as a JSON string holding an
    object are accepted too (some fine-tunes do that)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    if key is None:
        return None
    arguments = obj[key]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def lark_string(text: str) -> str:
    """A Lark string literal; JSON's escapes are Lark's."""
    return json.dumps(text, ensure_ascii=False)


def arguments_rule(name: str, function: Function) -> str:
    """`name: %json {...}`: the arguments object, laid out as the model saw
    calls written (a schema's own x-guidance wins)."""
    schema = {"type": "object", **function.parameters}
    own = function.parameters.get("x-guidance")
    schema["x-guidance"] = {**ARGUMENT_LAYOUT, **(own if isinstance(own, dict) else {})}
    return f"{name}: %json {json.dumps(schema, ensure_ascii=False)}"


def call_grammar(functions: list[Function], *, arguments_key: str, separator: str, parallel: bool,
                 prefix: str = "", suffix: str = "", opening: str = "", closing: str = "") -> Grammar:
    """`opening call (separator call)* closing`, one call when not parallel;
    a call is `prefix{"name": "f", "<arguments_key>": <f's arguments>}suffix`
    for one of the functions."""
    repeat = f" ({lark_string(separator)} call)*" if parallel else ""
    start = " ".join(x for x in (opening and lark_string(opening), "call" + repeat, closing and lark_string(closing))
                     if x)
    lines = [f"start: {start}", "call: " + " | ".join(f"fn_{i}" for i in range(len(functions)))]
    line_params = {}
    for i, function in enumerate(functions):
        head = f"{prefix}{{\"name\": {json.dumps(function.name)}, {json.dumps(arguments_key)}: "
        lines.append(f"fn_{i}: {lark_string(head)} args_{i} {lark_string('}' + suffix)}")
        lines.append(arguments_rule(f"args_{i}", function))
        line_params[len(lines)] = function.param
    return Grammar("\n".join(lines) + "\n", line_params)
