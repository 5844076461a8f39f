"""Prometheus metrics of the HTTP layer, served on the gateway's own
/metrics. Token and queue figures live on the scheduler's endpoint."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Paths outside this set are counted as "other", so that scanners cannot
# grow the label set without bound.
ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/v1/models",
                       "/health", "/metrics"})

REQUESTS = Counter("llmsched_gateway_requests_total", "HTTP requests answered, by endpoint and status code.",
                   ["endpoint", "code"])
LATENCY = Histogram("llmsched_gateway_request_duration_seconds",
                    "Time from request to the last byte of the response (the whole stream when streaming).",
                    ["endpoint"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
IN_FLIGHT = Gauge("llmsched_gateway_requests_in_flight", "HTTP requests being answered.", ["endpoint"])
# Counted once the scheduler has accepted the request (a refused constraint
# is a 400, counted by REQUESTS).
CONSTRAINED_REQUESTS = Counter(
    "llmsched_gateway_constrained_requests_total",
    "Requests sent with an output constraint, by kind: json_schema, json_object, regex, choice, grammar, "
    "or tool_call (tool_choice required or a named function).", ["kind"])
TOOL_CALLS = Counter("llmsched_gateway_tool_calls_total", "Tool calls read out of model outputs and returned, "
                     "by tool-call parser.", ["parser"])


def render() -> bytes:
    return generate_latest()


class MetricsMiddleware:
    """Plain ASGI, so that a streamed response is timed to its end and the
    disconnect events still reach the handlers."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        status = [500]

        async def send_and_watch(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        started = time.perf_counter()
        IN_FLIGHT.labels(endpoint).inc()
        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            IN_FLIGHT.labels(endpoint).dec()
            REQUESTS.labels(endpoint, str(status[0])).inc()
            LATENCY.labels(endpoint).observe(time.perf_counter() - started)
