"""Reasoning formats, one module each, chosen by GATEWAY_REASONING_PARSER:
the thinking a reasoning model writes between `<think>` and `</think>`
comes back as `reasoning_content`, the rest as `content`, as vLLM returns
them.

`scan(text, final) -> Thought` is monotone, as the tool-call scans are
(gateway_svc/tool_parsers/__init__.py): as the text grows, the reasoning and
the content it returns only grow at their ends, so a stream sends what each
scan adds and agrees with the non-streamed answer.
"""

from __future__ import annotations

from types import ModuleType

from gateway_svc.reasoning import deepseek_r1, qwen3
from gateway_svc.reasoning.common import Thought

PARSERS: dict[str, ModuleType] = {"qwen3": qwen3, "deepseek_r1": deepseek_r1}

__all__ = ["PARSERS", "Thought"]
