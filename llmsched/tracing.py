"""OpenTelemetry set-up shared by both services, configured only by the
standard variables:

- OTEL_TRACES_EXPORTER: otlp | console | none. Unset means otlp when
  OTEL_EXPORTER_OTLP_ENDPOINT is set, else none.
- OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER
  (read by the SDK itself), OTEL_BSP_* for batching.

With tracing off the tracer is a no-op, and `enabled` is False so hot paths
can skip building attributes at all.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

PROPAGATOR = TraceContextTextMapPropagator()
# How long a stop may wait for the last spans to reach the collector. The
# SDK alone waits up to 30 s on one that is down (10 s per batch export).
SHUTDOWN_TIMEOUT_S = 2.0


@dataclass(slots=True)
class Tracing:
    tracer: trace.Tracer
    enabled: bool
    provider: object | None = None
    exporter: object | None = None

    def shutdown(self) -> None:
        """Flushes what is queued for at most SHUTDOWN_TIMEOUT_S, then gives
        up on the rest."""
        if self.provider is None:
            return
        flush = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
        flush.start()
        flush.join(SHUTDOWN_TIMEOUT_S)
        if flush.is_alive():
            # Ends the export's retry wait and closes its channel, so the
            # export in flight fails now rather than at its deadline.
            self.exporter.shutdown()
            flush.join(0.5)


def exporter_name() -> str:
    name = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not name:
        return "otlp" if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") else "none"
    return name


def setup_tracing(default_service_name: str) -> Tracing:
    name = exporter_name()
    if name == "none":
        return Tracing(trace.NoOpTracer(), enabled=False)
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    elif name == "console":
        exporter = ConsoleSpanExporter()
    else:
        raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: expected otlp, console or none")
    service = os.environ.get("OTEL_SERVICE_NAME") or default_service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider.get_tracer("llmsched"), enabled=True, provider=provider, exporter=exporter)


class _MetadataGetter(Getter):
    """Reads W3C trace headers from gRPC invocation metadata."""

    def get(self, carrier, key):
        return [v for k, v in carrier if k == key] or None

    def keys(self, carrier):
        return [k for k, _ in carrier]


def context_from_metadata(metadata) -> object:
    return PROPAGATOR.extract(metadata or (), getter=_MetadataGetter())


def traceparent_of(span: trace.Span) -> str:
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str):
    return PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
