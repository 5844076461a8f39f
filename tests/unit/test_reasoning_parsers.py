"""Reasoning parsers on canned outputs (whole, cut short, malformed),
streamed piece by piece against the same text read whole, and composed
with a tool-call parser."""

from __future__ import annotations

import pytest

from gateway_svc.chat_output import ChatOutput
from gateway_svc.reasoning import deepseek_r1, qwen3
from gateway_svc.tool_parsers import hermes

# (parser, output, reasoning, content)
CASES = [
    (qwen3, "<think>\nA dog? Yes.\n</think>\n\nA dog.", "\nA dog? Yes.\n", "\n\nA dog."),
    (qwen3, "<think></think>Hi", None, "Hi"),  # an empty thought is no reasoning
    (qwen3, "Just an answer.", None, "Just an answer."),  # thinking off: no <think>
    (qwen3, "<think>cut short by max_tok", "cut short by max_tok", None),
    (qwen3, "<think>ends on a partial </thi", "ends on a partial </thi", None),
    (qwen3, "<thin", None, "<thin"),
    (qwen3, "Text </think> without an opening", None, "Text </think> without an opening"),
    (qwen3, "<think>a</think>b</think>c", "a", "b</think>c"),
    (qwen3, "", None, ""),
    (deepseek_r1, "Thinking first.</think>The answer.", "Thinking first.", "The answer."),
    (deepseek_r1, "<think>\nwritten again\n</think>\n\nok", "\nwritten again\n", "\n\nok"),
    (deepseek_r1, "never closed", "never closed", None),
    (deepseek_r1, "thought</think>\n\n", "thought", None),  # whitespace beside a thought is no content
    (deepseek_r1, "<thi", "<thi", None),
    (deepseek_r1, "", None, None),
]


def _whole(parser, text: str, tools=None) -> ChatOutput:
    out = ChatOutput(tools, parser)
    out.update(text, final=True)
    return out


def _streamed(parser, pieces: list[str], tools=None) -> tuple[str, str, list]:
    out = ChatOutput(tools, parser)
    reasoning, content, calls = "", "", []
    for i, piece in enumerate(pieces):
        delta = out.update(piece, final=i == len(pieces) - 1)
        reasoning, content, calls = reasoning + delta.reasoning, content + delta.content, calls + delta.calls
    return reasoning, content, calls


@pytest.mark.parametrize("parser, text, reasoning, content", CASES,
                         ids=[f"{c[0].__name__.rsplit('.', 1)[1]}-{i}" for i, c in enumerate(CASES)])
def test_canned_outputs(parser, text, reasoning, content):
    out = _whole(parser, text)
    assert (out.reasoning or None, out.message_content()) == (reasoning, content)


@pytest.mark.parametrize("parser, text", [(c[0], c[1]) for c in CASES],
                         ids=[f"{c[0].__name__.rsplit('.', 1)[1]}-{i}" for i, c in enumerate(CASES)])
def test_streamed_piece_by_piece_equals_read_whole(parser, text):
    whole = _whole(parser, text)
    expected = (whole.reasoning or "", whole.message_content() or "", [])
    for pieces in [list(text) + [""], *([text[:i], text[i:]] for i in range(len(text) + 1))]:
        assert _streamed(parser, pieces) == expected, pieces


def test_thought_then_tool_call():
    text = '<think>Need the weather.</think>\n<tool_call>\n{"name": "w", "arguments": {"c": "Rome"}}\n</tool_call>'
    whole = _whole(qwen3, text, tools=hermes)
    assert whole.reasoning == "Need the weather." and whole.message_content() is None
    assert [(c.name, c.arguments) for c in whole.calls] == [("w", '{"c": "Rome"}')]
    for i in range(len(text) + 1):
        assert _streamed(qwen3, [text[:i], text[i:]], tools=hermes) == ("Need the weather.", "", whole.calls)
