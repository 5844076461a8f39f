"""Mistral's calls: `[TOOL_CALLS]` and then either a JSON array of
`{"name": ..., "arguments": {...}}` (tokenizer v3) or `name[ARGS]{...}`
calls (v11 and later). The text before the marker is the content.

`[TOOL_CALLS]` and `[ARGS]` are special tokens in Mistral's tokenizers,
and the scheduler decodes text without special tokens, so they are usually
gone: an output that opens with a `[` is read as a call array too, and a
name directly followed by an object as a v11 call. Everything from the
marker (or that opening `[`) on is held until the output ends, since only
then is it known to be calls; what does not parse stays content.
"""

from __future__ import annotations

import json
import re

from gateway_svc.partial import held_prefix_len
from gateway_svc.tool_parsers.common import (
    Function,
    Grammar,
    Scan,
    ToolCall,
    call_from_object,
    call_grammar,
    skip_whitespace,
)

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_DECODER = json.JSONDecoder()


def _array(text: str, i: int) -> list[ToolCall] | None:
    try:
        items, end = _DECODER.raw_decode(text, i)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items or skip_whitespace(text, end) != len(text):
        return None
    calls = [call_from_object(item) for item in items]
    return None if any(c is None for c in calls) else calls


def _named(text: str, i: int) -> list[ToolCall] | None:
    """`name[ARGS]{...}` calls, separated by whitespace or more markers."""
    found = []
    while i < len(text):
        name = _NAME.match(text, i)
        if name is None:
            return None
        i = name.end()
        if text.startswith(ARGS, i):
            i += len(ARGS)
        try:
            arguments, i = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        call = call_from_object({"name": name.group(), "arguments": arguments})
        if call is None:
            return None
        found.append(call)
        i = skip_whitespace(text, i)
        if text.startswith(MARKER, i):
            i = skip_whitespace(text, i + len(MARKER))
    return found or None


def scan(text: str, final: bool) -> Scan:
    marker = text.find(MARKER)
    if marker >= 0:
        region, body = marker, marker + len(MARKER)
    elif text.lstrip().startswith("["):
        region = body = len(text) - len(text.lstrip())
    elif final:
        return Scan(text)
    else:
        return Scan(text[:len(text) - held_prefix_len(text, MARKER)])
    if not final:
        return Scan(text[:region])
    start = skip_whitespace(text, body)
    found = _array(text, start) if text.startswith("[", start) else _named(text, start)
    return Scan(text[:region], tuple(found)) if found else Scan(text)


def forced_grammar(functions: list[Function], parallel: bool) -> Grammar:
    """A JSON array of calls. The gateway cannot name the `[TOOL_CALLS]`
    special token in a grammar (it does not know its id), so the forced
    output starts at the array, which the scan reads as calls."""
    return call_grammar(functions, arguments_key="arguments", separator=", ", parallel=parallel,
                        opening="[", closing="]")
