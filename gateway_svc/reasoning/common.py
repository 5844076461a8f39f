"""What the reasoning formats share: the markers and the split of a text
that is inside the thought."""

from __future__ import annotations

from dataclasses import dataclass

from gateway_svc.partial import held_prefix_len

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class Thought:
    reasoning: str | None  # None: the output does not think
    content: str


def split_thought(text: str, start: int, final: bool) -> Thought:
    """text[start:] is inside the thought: up to `</think>` it is reasoning,
    after it content. An output that ends inside the thought (max_tokens)
    is all reasoning."""
    end = text.find(END, start)
    if end >= 0:
        return Thought(text[start:end], text[end + len(END):])
    reasoning = text[start:]
    if not final:
        reasoning = reasoning[:len(reasoning) - held_prefix_len(reasoning, END)]
    return Thought(reasoning, "")
