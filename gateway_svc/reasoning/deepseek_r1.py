"""DeepSeek-R1 and the models that think like it (R1 distills, QwQ,
Qwen3-*-Thinking-2507): the output starts inside the thought, whose
`<think>` the chat template already wrote into the prompt (a `<think>` the
model writes again is dropped), and runs to `</think>`. An output without
`</think>` is all reasoning, as vLLM returns it.
"""

from __future__ import annotations

from gateway_svc.reasoning.common import START, Thought, split_thought


def scan(text: str, final: bool) -> Thought:
    if not final and len(text) < len(START) and START.startswith(text):
        return Thought("", "")  # nothing yet, or `<think>` arriving
    return split_thought(text, len(START) if text.startswith(START) else 0, final)
