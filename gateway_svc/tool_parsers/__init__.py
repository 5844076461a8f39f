"""Tool-call formats, one module each, chosen by GATEWAY_TOOL_CALL_PARSER.
A module does two things with its format: `scan` reads calls out of the
model's output (tool_choice `auto`, and the forced ones), and
`forced_grammar` writes the grammar that makes the model call
(tool_choice `required` or a named function).

`scan(text, final)` is monotone: as `text` grows, the content it
returns only grows at its end and its calls only grow in number, and
`final=True` (the output is complete) extends every earlier answer. A
stream sends what each scan adds; a non-streamed answer is the final scan
of the whole output. So streamed and non-streamed answers agree by
construction: a call is sent once complete, and one that turns out
malformed is never half-sent, it stays in the content as the model wrote it.
"""

from __future__ import annotations

from types import ModuleType

from gateway_svc.tool_parsers import hermes, llama3_json, mistral
from gateway_svc.tool_parsers.common import Function, Grammar, Scan, ToolCall

PARSERS: dict[str, ModuleType] = {"hermes": hermes, "llama3_json": llama3_json, "mistral": mistral}

__all__ = ["PARSERS", "Function", "Grammar", "Scan", "ToolCall"]
