"""One chat sample's output as the API returns it: the reasoning, the
content and the tool calls, read from the text as it streams in.

The reasoning parser splits the thought off first, and the tool-call
parser reads the calls out of the rest. Both scans are monotone (see
gateway_svc/tool_parsers/__init__.py), so `update` sends only what each new
piece of text adds, and a non-streamed answer is one final `update` of the
whole text: the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

from gateway_svc.tool_parsers import ToolCall


@dataclass(slots=True)
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ChatOutput:
    def __init__(self, tool_parser: ModuleType | None = None, reasoning_parser: ModuleType | None = None,
                 parallel_tool_calls: bool = True):
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.parallel_tool_calls = parallel_tool_calls
        self.text = ""
        self.reasoning: str | None = None
        self.content = ""
        self.calls: list[ToolCall] = []
        self._sent_reasoning = 0
        self._sent_content = 0

    @property
    def parsing(self) -> bool:
        return self.tool_parser is not None or self.reasoning_parser is not None

    def update(self, text: str, final: bool) -> ChatDelta:
        """Takes the next piece of text (`final`: the output ends with it)
        and returns what it adds."""
        self.text += text
        reasoning, content, calls = None, self.text, ()
        if self.reasoning_parser is not None:
            thought = self.reasoning_parser.scan(self.text, final)
            reasoning, content = thought.reasoning, thought.content
        if self.tool_parser is not None:
            scan = self.tool_parser.scan(content, final)
            content, calls = scan.content, scan.calls
        if not self.parallel_tool_calls:
            # At most one call is returned; a model that writes more under
            # tool_choice auto gets its first, as vLLM does.
            calls = calls[:1]
        delta = ChatDelta(calls=list(calls[len(self.calls):]))
        self.calls.extend(delta.calls)
        self.reasoning = reasoning
        if reasoning:
            delta.reasoning = reasoning[self._sent_reasoning:]
            self._sent_reasoning = len(reasoning)
        self.content = content
        # Content that is only whitespace is held while a parser runs: beside
        # calls or a thought it is no content at all (null), and only the end
        # tells.
        if not self.parsing or content.strip() or (final and not self._content_is_null()):
            delta.content = content[self._sent_content:]
            self._sent_content = len(content)
        return delta

    def _content_is_null(self) -> bool:
        return self.parsing and not self.content.strip() and (bool(self.calls) or self.reasoning is not None)

    def message_content(self) -> str | None:
        """The final content: null when nothing but whitespace is left
        beside calls or a thought."""
        return None if self._content_is_null() else self.content
