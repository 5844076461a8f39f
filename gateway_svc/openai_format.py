"""OpenAI's response shapes, one format per endpoint, chosen once per
request: CompletionFormat (`text_completion`) and ChatFormat
(`chat.completion`, with reasoning and tool calls). app.py routes and fans
out; a format turns the scheduler's responses into choices, chunks and
usage, and names the client's fields in the scheduler's errors."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from types import ModuleType

from gateway_svc import metrics
from gateway_svc.chat_output import ChatDelta, ChatOutput
from llmsched.v1 import scheduler_pb2 as spb

FINISH_REASONS = {
    spb.FINISH_REASON_STOP: "stop",
    spb.FINISH_REASON_LENGTH: "length",
    # Aborted by the server (shutdown, a lost executor); vLLM's name for it.
    spb.FINISH_REASON_ABORT: "abort",
}


@dataclass(slots=True)
class Sample:
    """One Generate call: choice `index`, sample `sub` of its prompt."""

    index: int
    sub: int
    call: object
    text: str = ""
    logprobs: list = field(default_factory=list)  # of spb.TokenLogprobs
    finish_reason: str | None = None
    usage: spb.Usage | None = None
    output: ChatOutput | None = None  # chat only: reasoning, content and calls read from the text
    num_tokens: int = 0  # received so far: the count of a call cut short, which has no usage
    stop_string: str = ""  # the stop string that ended the call, if one did

    def add(self, resp: spb.GenerateResponse) -> None:
        self.num_tokens += len(resp.token_ids)
        self.text += resp.text
        self.logprobs.extend(resp.logprobs)
        if resp.finish_reason:
            self.finish_reason = FINISH_REASONS[resp.finish_reason]
        if resp.HasField("usage"):
            self.usage = resp.usage
        if resp.stop_string:
            self.stop_string = resp.stop_string


def usage(samples: list[Sample]) -> dict:
    # A prompt counts once however many samples it had, as vLLM counts it.
    firsts = [s.usage for s in samples if s.sub == 0 and s.usage is not None]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(s.usage.completion_tokens for s in samples if s.usage is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in firsts)}}


def _completion_logprobs(entries, k: int, offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e.token)
        token_lps.append(e.logprob)
        tops.append(dict(zip(e.top_tokens[:k], e.top_logprobs[:k])))
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(entries, k: int) -> dict:
    return {"content": [
        {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                          for t, lp in zip(e.top_tokens[:k], e.top_logprobs[:k])]}
        for e in entries
    ]}


def _finish(resp: spb.GenerateResponse) -> str | None:
    return FINISH_REASONS.get(resp.finish_reason) if resp.finish_reason else None


class CompletionFormat:
    object = "text_completion"
    chunk_object = "text_completion"
    # The scheduler's GenerateRequest fields as the client wrote them.
    fields: dict[str, str | None] = {}

    def __init__(self, num_logprobs: int | None):
        self.num_logprobs = num_logprobs  # top alternatives shown; None = no logprobs

    def start(self, sample: Sample) -> None:
        pass

    def opening_choices(self, sample: Sample) -> list[dict]:
        return []

    def choice(self, sample: Sample) -> dict:
        k = self.num_logprobs
        return {"index": sample.index, "text": sample.text,
                "logprobs": _completion_logprobs(sample.logprobs, k, 0) if k is not None else None,
                "finish_reason": sample.finish_reason}

    def delta_choices(self, sample: Sample, resp: spb.GenerateResponse) -> list[dict]:
        """The chunks' choices for one response, already added to sample."""
        finish = _finish(resp)
        if not (resp.text or resp.logprobs or finish):
            return []  # bytes of an incomplete character, held back
        k = self.num_logprobs
        offset = len(sample.text) - len(resp.text)
        logprobs = _completion_logprobs(resp.logprobs, k, offset) if k is not None else None
        return [{"index": sample.index, "text": resp.text, "logprobs": logprobs, "finish_reason": finish}]


class ChatFormat:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    fields = {"logprobs": "top_logprobs", "prompt": "messages"}

    def __init__(self, num_logprobs: int | None, tool_parser: ModuleType | None = None,
                 reasoning_parser: ModuleType | None = None, parallel_tool_calls: bool = True,
                 parser_name: str = ""):
        self.num_logprobs = num_logprobs
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.parallel_tool_calls = parallel_tool_calls
        self.parser_name = parser_name  # a metrics label

    def start(self, sample: Sample) -> None:
        sample.output = ChatOutput(self.tool_parser, self.reasoning_parser, self.parallel_tool_calls)

    def _finish_reason(self, sample: Sample, finish: str | None) -> str | None:
        # A complete output that called tools ends with "tool_calls", as
        # OpenAI's does; one cut short keeps "length".
        return "tool_calls" if finish == "stop" and sample.output.calls else finish

    def _count_calls(self, calls: list) -> None:
        if calls:
            metrics.TOOL_CALLS.labels(self.parser_name).inc(len(calls))

    def opening_choices(self, sample: Sample) -> list[dict]:
        return [{"index": sample.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]

    def choice(self, sample: Sample) -> dict:
        out = sample.output
        out.update(sample.text, final=True)
        self._count_calls(out.calls)
        message = {"role": "assistant", "content": out.message_content()}
        if out.reasoning_parser is not None:
            message["reasoning_content"] = out.reasoning or None
        if out.calls:
            message["tool_calls"] = [{"id": _call_id(), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in out.calls]
        k = self.num_logprobs
        return {"index": sample.index, "message": message,
                "logprobs": _chat_logprobs(sample.logprobs, k) if k is not None else None,
                "finish_reason": self._finish_reason(sample, sample.finish_reason)}

    def delta_choices(self, sample: Sample, resp: spb.GenerateResponse) -> list[dict]:
        finish = _finish(resp)
        if not (resp.text or resp.logprobs or finish):
            return []  # bytes of an incomplete character, held back
        out = sample.output
        first_call = len(out.calls)
        delta = out.update(resp.text, final=finish is not None)
        self._count_calls(delta.calls)
        deltas = _deltas(delta, first_call)
        if not deltas and (resp.logprobs or finish):
            deltas = [{}]
        k = self.num_logprobs
        logprobs = _chat_logprobs(resp.logprobs, k) if k is not None else None
        choices = [{"index": sample.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if choices:
            # The tokens' logprobs and the end ride on the last chunk.
            choices[-1]["logprobs"] = logprobs
            choices[-1]["finish_reason"] = self._finish_reason(sample, finish)
        return choices


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _deltas(delta: ChatDelta, first_call: int) -> list[dict]:
    """The chunk deltas for what one update added: reasoning and content in
    one, then each call in two, as OpenAI streams them: its index, id and
    name first, its arguments next."""
    out = []
    text = {}
    if delta.reasoning:
        text["reasoning_content"] = delta.reasoning
    if delta.content:
        text["content"] = delta.content
    if text:
        out.append(text)
    for i, call in enumerate(delta.calls, start=first_call):
        out.append({"tool_calls": [{"index": i, "id": _call_id(), "type": "function",
                                    "function": {"name": call.name, "arguments": ""}}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
    return out
