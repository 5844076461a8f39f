"""The live requests' output channels: one queue per request, which its
Generate handler reads. The engine loop writes to them when a result's
tokens are applied (detokenizing and stop strings through
output_processor.py) and when a request ends."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from scheduler_svc.core.plan import PromptOutput, SampledToken
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.output_processor import RequestDelta, RequestOutputState


@dataclass(slots=True)
class RequestStream:
    """A live request's output channel to its Generate handler."""

    state: RequestOutputState
    telemetry: telemetry.RequestTelemetry
    # Who may Abort it: a digest of the API key that created it (None when
    # API keys are off).
    owner: str | None = None
    queue: asyncio.Queue[RequestDelta] = field(default_factory=asyncio.Queue)


class Streams:
    """Every live request's stream, by request id. `idle` is set whenever
    none is live (drain waits on it)."""

    def __init__(self):
        self._streams: dict[str, RequestStream] = {}
        self.idle = asyncio.Event()
        self.idle.set()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._streams))

    def get(self, request_id: str) -> RequestStream | None:
        return self._streams.get(request_id)

    def add(self, request_id: str, stream: RequestStream) -> None:
        self._streams[request_id] = stream
        self.idle.clear()

    def emit(self, tokens: list[SampledToken], stop: Callable[[Request, int], None]) -> None:
        """A result's tokens, as text deltas to their streams. A request whose
        stop string appeared is finished through stop(request, num_cut),
        num_cut being the tokens of this result after the one that
        completed it."""
        by_request: dict[str, list[SampledToken]] = {}
        for t in tokens:
            by_request.setdefault(t.request.request_id, []).append(t)
        for request_id, toks in by_request.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            req = toks[0].request
            stream.telemetry.on_tokens(len(toks))
            delta = stream.state.on_tokens(toks)
            if stream.state.stopped_by_string and (not req.status.is_finished or delta.num_cut):
                stop(req, delta.num_cut)
            # A stop string that completes on the last allowed token still
            # reports STOP: RequestOutputState.finish decides the reason.
            if req.status.is_finished:
                self.finish(req, delta)
            else:
                stream.queue.put_nowait(delta)

    def emit_prompt_outputs(self, outputs: list[PromptOutput]) -> None:
        """Prompt logprobs wait in their request's state for its first
        tokens; an embedding ends its (finished) request's stream."""
        for output in outputs:
            stream = self._streams.get(output.request.request_id)
            if stream is None:
                continue
            if output.embedding is not None:
                self.finish(output.request, RequestDelta(embedding=output.embedding))
            else:
                stream.state.on_prompt_logprobs(output)

    def finish(self, req: Request, delta: RequestDelta) -> None:
        """Ends a finished request's stream with its last text and usage."""
        stream = self._pop(req.request_id)
        if stream is not None:
            delta = stream.state.finish(delta, req.status)
            stream.telemetry.on_finished(
                delta.finish_status, req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_prompt_tokens
            )
            stream.queue.put_nowait(delta)

    def fail(self, request_id: str, code: str, message: str) -> None:
        """Ends a stream with an error (no usage, no detokenizer flush)."""
        stream = self._pop(request_id)
        if stream is not None:
            req = stream.state.request
            stream.telemetry.on_finished(
                RequestStatus.FINISHED_ERROR, req.num_prompt_tokens, len(req.output_token_ids),
                req.num_cached_prompt_tokens
            )
            stream.queue.put_nowait(RequestDelta(finish_status=RequestStatus.FINISHED_ERROR, error=(code, message)))

    def _pop(self, request_id: str) -> RequestStream | None:
        stream = self._streams.pop(request_id, None)
        if not self._streams:
            self.idle.set()
        return stream
