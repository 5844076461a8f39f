"""Hermes-style calls, as Qwen2.5, Qwen3, many fine-tunes and the built-in
models' ChatML template write them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, anywhere in the output; the text outside the blocks is
the content. A block whose JSON is not a call stays in the content as the
model wrote it. A block the output ends inside is a call if what follows
its tag is one (the model stopped before the closing tag), else content.
"""

from __future__ import annotations

import json

from gateway_svc.partial import held_prefix_len
from gateway_svc.tool_parsers.common import Function, Grammar, Scan, ToolCall, call_from_object, call_grammar

START, END = "<tool_call>", "</tool_call>"


def _call(body: str) -> ToolCall | None:
    try:
        return call_from_object(json.loads(body))
    except json.JSONDecodeError:
        return None


def scan(text: str, final: bool) -> Scan:
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while True:
        start = text.find(START, pos)
        if start < 0:
            tail = text[pos:]
            content.append(tail if final else tail[:len(tail) - held_prefix_len(tail, START)])
            break
        content.append(text[pos:start])
        end = text.find(END, start + len(START))
        if end < 0 and not final:
            break  # a block still open: what it holds is known at its end
        body_end = end if end >= 0 else len(text)
        block_end = end + len(END) if end >= 0 else len(text)
        call = _call(text[start + len(START):body_end])
        if call is not None:
            calls.append(call)
        else:
            content.append(text[start:block_end])
        pos = block_end
    return Scan("".join(content), tuple(calls))


def forced_grammar(functions: list[Function], parallel: bool) -> Grammar:
    """One block per call, blocks separated by a newline, as Qwen2.5's
    template writes an assistant's calls."""
    return call_grammar(functions, arguments_key="arguments", separator="\n", parallel=parallel,
                        prefix=START + "\n", suffix="\n" + END)
