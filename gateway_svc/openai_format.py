"""OpenAI's response shapes, one format per endpoint, chosen once per
request: CompletionFormat (`text_completion`) and ChatFormat
(`chat.completion`, with reasoning and tool calls). app.py routes and fans
out; a format turns the scheduler's responses into choices, chunks and
usage, and names the client's fields in the scheduler's errors."""

from __future__ import annotations

import math
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
    prompt_logprobs: list = field(default_factory=list)  # of spb.TokenLogprobs, one per prompt token
    # echo with max_tokens 0: the call generates one token to compute the
    # prompt, which is not the client's: no text, logprobs or usage.
    drop_output: bool = False

    def add(self, resp: spb.GenerateResponse) -> None:
        self.prompt_logprobs.extend(resp.prompt_logprobs)
        if self.drop_output:
            if resp.finish_reason:
                self.finish_reason = _prompt_only_finish(FINISH_REASONS[resp.finish_reason])
            if resp.HasField("usage"):
                self.usage = spb.Usage(prompt_tokens=resp.usage.prompt_tokens,
                                       cached_prompt_tokens=resp.usage.cached_prompt_tokens)
            return
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


def _prompt_only_finish(finish: str | None) -> str | None:
    # Nothing was generated because max_tokens (0) said so, whatever ended
    # the one token computed; an abort stays one.
    return "length" if finish in ("stop", "length") else finish


def _finite(logprob: float) -> float:
    # JSON has no -Infinity; vLLM clamps to -9999 too.
    return max(logprob, -9999.0)


def _completion_logprobs(entries, k: int, offset: int) -> dict:
    """OpenAI's legacy logprobs of `entries` (text_offset counting on from
    `offset`). The first prompt token (NaN: nothing before it predicts it)
    has null logprob and top_logprobs, as OpenAI's echo has."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e.token)
        if math.isnan(e.logprob):
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(_finite(e.logprob))
            tops.append({t: _finite(lp) for t, lp in zip(e.top_tokens[:k], e.top_logprobs[:k])})
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _joined(first: dict, then: dict) -> dict:
    return {key: first[key] + then[key] for key in first}


def vllm_prompt_logprobs(entries, k: int) -> list:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then for
    each one {token id: {"logprob", "rank", "decoded_token"}} with the
    prompt token first and its top k alternatives after. A rank is the
    1-based place among the alternatives; the prompt token's is null when
    it is not among them (the scheduler does not compute it)."""
    out = []
    for e in entries:
        if math.isnan(e.logprob):
            out.append(None)
            continue
        top = list(zip(e.top_token_ids[:k], e.top_logprobs[:k], e.top_tokens[:k]))
        ranks = {t: rank for rank, (t, _, _) in enumerate(top, 1)}
        entry = {str(e.token_id): {"logprob": _finite(e.logprob), "rank": ranks.get(e.token_id),
                                   "decoded_token": e.token}}
        for t, lp, text in top:
            entry.setdefault(str(t), {"logprob": _finite(lp), "rank": ranks[t], "decoded_token": text})
        out.append(entry)
    return out


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
    """With `echo` each choice's text starts with its prompt's, and its
    logprobs with the prompt tokens' (as OpenAI's legacy API and vLLM).
    text_offset adds up the token texts, the prompt's first, as vLLM's
    does: a BOS spelled `<s>` or a first word's leading space counts,
    though the prompt's text lacks them."""

    object = "text_completion"
    chunk_object = "text_completion"
    # The scheduler's GenerateRequest fields as the client wrote them.
    fields: dict[str, str | None] = {}

    def __init__(self, num_logprobs: int | None, echo: list[str] | None = None, n: int = 1,
                 prompt_only: bool = False, num_prompt_logprobs: int | None = None):
        self.num_logprobs = num_logprobs  # top alternatives shown; None = no logprobs
        self.echo = echo  # each prompt's text, returned before its completions; None = no echo
        self.n = n  # samples per prompt: choice i belongs to prompt i // n
        self.prompt_only = prompt_only  # echo with max_tokens 0
        self.num_prompt_logprobs = num_prompt_logprobs  # vLLM's prompt_logprobs extra; None = not asked
        self._echoed: set[int] = set()  # streamed choices whose prompt went out

    def start(self, sample: Sample) -> None:
        sample.drop_output = self.prompt_only

    def opening_choices(self, sample: Sample) -> list[dict]:
        return []

    def response_fields(self, samples: list[Sample]) -> dict:
        return {}

    def _prefix(self, sample: Sample) -> str:
        return self.echo[sample.index // self.n] if self.echo is not None else ""

    def _logprobs(self, sample: Sample, prompt_entries, entries, offset: int) -> dict | None:
        """The logprobs of `prompt_entries` (echo only) and then `entries`,
        `offset` characters into the completion's tokens."""
        k = self.num_logprobs
        if k is None:
            return None
        if self.echo is None:
            return _completion_logprobs(entries, k, offset)
        offset += sum(len(e.token) for e in sample.prompt_logprobs)
        return _joined(_completion_logprobs(prompt_entries, k, 0), _completion_logprobs(entries, k, offset))

    def choice(self, sample: Sample) -> dict:
        choice = {"index": sample.index, "text": self._prefix(sample) + sample.text,
                  "logprobs": self._logprobs(sample, sample.prompt_logprobs, sample.logprobs, 0),
                  "finish_reason": sample.finish_reason}
        if self.num_prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(sample.prompt_logprobs, self.num_prompt_logprobs)
        return choice

    def delta_choices(self, sample: Sample, resp: spb.GenerateResponse) -> list[dict]:
        """The chunks' choices for one response, already added to sample.
        The echoed prompt rides on a choice's first chunk, with the prompt
        logprobs that came on its first response."""
        finish, text, entries = _finish(resp), resp.text, list(resp.logprobs)
        if sample.drop_output:
            finish, text, entries = _prompt_only_finish(finish), "", []
        prefix, prompt_entries = "", []
        if self.echo is not None and sample.index not in self._echoed:
            self._echoed.add(sample.index)
            prefix, prompt_entries = self._prefix(sample), sample.prompt_logprobs
        if not (prefix or text or entries or finish):
            return []  # bytes of an incomplete character, held back
        offset = len(sample.text) - len(text)
        return [{"index": sample.index, "text": prefix + text,
                 "logprobs": self._logprobs(sample, prompt_entries, entries, offset), "finish_reason": finish}]


class ChatFormat:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    fields = {"logprobs": "top_logprobs", "prompt": "messages"}

    def __init__(self, num_logprobs: int | None, tool_parser: ModuleType | None = None,
                 reasoning_parser: ModuleType | None = None, parallel_tool_calls: bool = True,
                 parser_name: str = "", num_prompt_logprobs: int | None = None):
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs  # vLLM's prompt_logprobs extra; None = not asked
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

    def response_fields(self, samples: list[Sample]) -> dict:
        """vLLM's prompt_logprobs: on the response, not the choices, since
        all of them share the one prompt."""
        if self.num_prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(samples[0].prompt_logprobs, self.num_prompt_logprobs)}

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
