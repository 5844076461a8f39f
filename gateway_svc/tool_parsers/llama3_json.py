"""Llama 3.x JSON calls, as Llama 3.1-3.3's template asks for them: the
whole output is one call, `{"name": "get_weather", "parameters": {...}}`,
or several separated by `;`, optionally after `<|python_tag|>` (a special
token, so usually already gone from the text). `arguments` is accepted in
place of `parameters`.

An output that opens with `{` is held until it ends, since only then is it
known to be calls; anything that does not parse as calls is content.
"""

from __future__ import annotations

import json

from gateway_svc.tool_parsers.common import (
    Function,
    Grammar,
    Scan,
    ToolCall,
    call_from_object,
    call_grammar,
    skip_whitespace,
)

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _calls(text: str, start: int) -> list[ToolCall] | None:
    """The calls, when text[start:] is nothing but calls separated by `;`."""
    found, i = [], skip_whitespace(text, start)
    while True:
        try:
            obj, end = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        call = call_from_object(obj, ("parameters", "arguments"))
        if call is None:
            return None
        found.append(call)
        i = skip_whitespace(text, end)
        if i < len(text) and text[i] == ";":
            i = skip_whitespace(text, i + 1)
        elif i < len(text):
            return None
        if i == len(text):
            return found


def scan(text: str, final: bool) -> Scan:
    body = text.lstrip()
    start = len(text) - len(body)
    if body.startswith(PYTHON_TAG):
        start += len(PYTHON_TAG)
    elif not final and PYTHON_TAG.startswith(body):
        return Scan("")  # nothing yet, or the tag arriving
    if not text[start:].lstrip().startswith("{"):
        if not final and not text[start:].strip():
            return Scan("")
        return Scan(text)
    if not final:
        return Scan("")
    found = _calls(text, start)
    return Scan("", tuple(found)) if found else Scan(text)


def forced_grammar(functions: list[Function], parallel: bool) -> Grammar:
    return call_grammar(functions, arguments_key="parameters", separator="; ", parallel=parallel)
