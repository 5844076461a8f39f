"""Qwen3 (the hybrid thinking models): the model opens its thought itself,
`<think>...</think>` at the very start of the output. An output that does
not open with `<think>` (thinking switched off, which the template does by
writing an empty thought into the prompt) is all content.

Qwen3-*-Thinking-2507, QwQ and others whose template opens the thought in
the prompt write only `</think>`: use `deepseek_r1` for them.
"""

from __future__ import annotations

from gateway_svc.reasoning.common import START, Thought, split_thought


def scan(text: str, final: bool) -> Thought:
    if text.startswith(START):
        return split_thought(text, len(START), final)
    if not final and START.startswith(text):
        return Thought("", "")  # nothing yet, or `<think>` arriving
    return Thought(None, text)
