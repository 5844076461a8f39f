"""Request ids and the request log of the HTTP layer.

Every response carries `X-Request-Id`: the client's own when it sent a
valid one, else a fresh one. The same id is the scheduler's request id (one
Generate call; `<id>-<i>` when a request fans out into several), the
response body's `id` (`chatcmpl-<id>`, `cmpl-<id>`), the `llmsched.request_id`
attribute of both services' spans, and the `request_id` of both services'
request-log lines, so one request can be followed through all of them.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass

from opentelemetry import trace

from llmsched.logs import REQUESTS, log_request

HEADER = "x-request-id"
# What a client's id may be: it travels on as gRPC metadata values, span
# attributes and log fields, and is echoed back as a header.
VALID_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Probes and scrapes would drown the log.
NOT_LOGGED = frozenset({"/health", "/metrics"})

log = logging.getLogger(REQUESTS)


@dataclass(slots=True)
class RequestRecord:
    """What the request-log line says of one HTTP request; the handlers fill
    in what they learn, the middleware the status and the time."""

    request_id: str
    route: str
    tenant: str | None = None
    reason: str | None = None  # why it was refused or failed
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None

    def fields(self, status: int, latency_s: float) -> dict[str, object]:
        return {"request_id": self.request_id, "tenant": self.tenant, "route": self.route, "status": status,
                "latency_ms": round(latency_s * 1000, 1), "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "output_tokens": self.output_tokens,
                "finish_reason": self.finish_reason, "reason": self.reason}


def record_of(request) -> RequestRecord | None:
    """The record of a Starlette request, set by RequestLogMiddleware."""
    return request.scope.get("state", {}).get("request_record")


class RequestLogMiddleware:
    """Plain ASGI, like the metrics middleware, so that a streamed response
    is logged when its stream ends and disconnects still reach handlers."""

    def __init__(self, app, enabled: bool):
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers") or ()).get(HEADER.encode(), b"").decode("latin-1")
        request_id = sent if VALID_ID.fullmatch(sent) else uuid.uuid4().hex
        record = RequestRecord(request_id, f"{scope['method']} {scope['path']}")
        scope.setdefault("state", {})["request_record"] = record
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute("llmsched.request_id", request_id)
        status = [500]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (HEADER.encode(), request_id.encode())]}
            await send(message)

        started = time.perf_counter()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.enabled and scope["path"] not in NOT_LOGGED:
                log_request(log, record.fields(status[0], time.perf_counter() - started))
