"""Turns sampled tokens into what the client sees: text deltas, stop
strings, logprobs, prompt logprobs, an embedding and the final usage."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from scheduler_svc.core.plan import PromptOutput, SampledToken
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.detokenizer import IncrementalDetokenizer, StopStringMatcher


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(slots=True)
class RequestDelta:
    """What one response of the Generate stream carries."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[tuple[int, float, list[int], list[float]]] = field(default_factory=list)
    finish_status: RequestStatus | None = None
    usage: Usage | None = None
    stop_string: str | None = None  # on the last delta: the stop string that ended the request
    # Set when the request ends with an error status for the client.
    error: tuple[str, str] | None = None  # (grpc status name, message)
    # Every prompt token's, the first with a NaN logprob, once (GenerateResponse.prompt_logprobs).
    prompt_logprobs: list[tuple[int, float, list[int], list[float]]] = field(default_factory=list)
    embedding: list[float] | None = None  # an embedding request's pooled vector, on its last delta
    # Tokens of the step cut after the one that completed a stop string
    # (not sent; the scheduler drops them from the request's output).
    num_cut: int = 0

    def merge(self, later: "RequestDelta") -> None:
        self.token_ids += later.token_ids
        self.text += later.text
        self.logprobs += later.logprobs
        self.finish_status = later.finish_status or self.finish_status
        self.usage = later.usage or self.usage
        self.stop_string = later.stop_string or self.stop_string
        self.error = later.error or self.error
        self.prompt_logprobs += later.prompt_logprobs
        self.embedding = later.embedding or self.embedding


class RequestOutputState:
    def __init__(self, request: Request, tokenizer: Tokenizer):
        self.request = request
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
        self.stops = StopStringMatcher(request.sampling.stop)
        self.stopped_by_string = False
        self.num_tokens = 0  # output tokens seen so far
        # Prompt logprobs as they arrive, entry i for prompt token i (the
        # first has none: NaN); sent with the first tokens. A recompute after
        # a preemption sends positions again, which are skipped.
        self.prompt_logprobs: list[tuple[int, float, list[int], list[float]]] = []
        if request.sampling.prompt_logprobs is not None:
            self.prompt_logprobs.append((request.prompt_token_ids[0], math.nan, [], []))
        self.prompt_logprobs_sent = False

    def on_prompt_logprobs(self, output: PromptOutput) -> None:
        skip = len(self.prompt_logprobs) - output.first  # entries already known
        if 0 <= skip < len(output.logprobs):
            self.prompt_logprobs += output.logprobs[skip:]

    def _take_prompt_logprobs(self, delta: RequestDelta) -> None:
        if self.request.sampling.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            delta.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, []
            self.prompt_logprobs_sent = True

    def on_tokens(self, tokens: list[SampledToken]) -> RequestDelta:
        """Text for new tokens. Sets stopped_by_string when a stop string
        appears; the scheduler then finishes the request. A speculative
        step's several tokens are searched one at a time: those after the
        one completing a stop string are cut from the delta (num_cut says
        how many), as decoding one token per step would never have made
        them."""
        delta = RequestDelta(token_ids=[t.token_id for t in tokens])
        self._take_prompt_logprobs(delta)
        for t in tokens:
            if t.logprobs is not None:
                lp, top_ids, top_lps = t.logprobs
                delta.logprobs.append((t.token_id, lp, top_ids, top_lps))
        if not self.stopped_by_string:
            # min_tokens, as vLLM reads it: a stop string counts only when
            # the token completing it is the min_tokens-th or a later one,
            # so the text of the tokens before that is never searched.
            unsearched = max(0, self.request.sampling.min_tokens - 1 - self.num_tokens)
            head, tail = delta.token_ids[:unsearched], delta.token_ids[unsearched:]
            if head:
                delta.text = self.detok.add_tokens(head)
            # With stop strings, a token at a time, to know which one
            # completes a stop string; without, the whole tail at once.
            pieces = [tail[i:i + 1] for i in range(len(tail))] if self.stops.stop else [tail] if tail else []
            for i, piece in enumerate(pieces):
                text, self.stopped_by_string = self.stops.feed(self.detok.add_tokens(piece))
                delta.text += text
                if self.stopped_by_string:
                    keep = len(head) + i + 1
                    delta.num_cut = len(delta.token_ids) - keep
                    del delta.token_ids[keep:], delta.logprobs[keep:]
                    break
        self.num_tokens += len(delta.token_ids)
        return delta

    def finish(self, delta: RequestDelta, status: RequestStatus) -> RequestDelta:
        if self.num_tokens < self.request.sampling.min_tokens - 1 and status != RequestStatus.FINISHED_ABORTED:
            delta.text += self.detok.flush()  # cut short (max_model_len) before stop strings count
        elif not self.stopped_by_string and status != RequestStatus.FINISHED_ABORTED:
            text, self.stopped_by_string = self.stops.feed(self.detok.flush())
            delta.text += text + ("" if self.stopped_by_string else self.stops.flush())
        if self.stopped_by_string and status == RequestStatus.FINISHED_LENGTH:
            # The stop string completed on the last allowed token.
            status = RequestStatus.FINISHED_STOPPED
        req = self.request
        if status != RequestStatus.FINISHED_ABORTED:
            self._take_prompt_logprobs(delta)
        delta.finish_status = status
        if self.stopped_by_string:
            delta.stop_string = self.stops.matched
        delta.usage = Usage(req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_prompt_tokens)
        return delta
