"""The gateway's HTTP span is the parent of the scheduler's Generate span
in one trace, which also holds the scheduler step that admitted the request
and the executor's step under it; Generate links to every step span that
ran it; both the HTTP and the Generate span carry the X-Request-Id. All exported by the real processes to the in-test OTLP receiver."""

from __future__ import annotations

from concurrent import futures

import grpc
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from llmsched.launch import launch
from tests.integration.test_observability import Receiver, wait_for

pytestmark = pytest.mark.slow


def test_http_span_is_the_parent_of_generate_which_links_to_scheduler_and_executor_steps(stories_path):
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_TRACES_EXPORTER": "otlp", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    services = launch(executor_env={"EXECUTOR_MODEL": str(stories_path), "EXECUTOR_NUM_THREADS": "1", **otel},
                      scheduler_env=otel, gateway_env=otel, with_gateway=True).start()
    try:
        client = openai.OpenAI(base_url=services.gateway_url + "/v1", api_key="unused", max_retries=0)
        raw = client.completions.with_raw_response.create(model="stories260K", prompt="Once upon a time",
                                                          max_tokens=5, temperature=0, stream=True)
        request_id = raw.headers["x-request-id"]
        assert len("".join(c.choices[0].text for c in raw.parse())) > 0
        assert wait_for(lambda: receiver.named("Generate") and receiver.named("executor.step")
                        and [s for svc, s in receiver.spans if svc == "gateway" and
                             s.kind == trace_pb2.Span.SPAN_KIND_SERVER]), "spans never arrived"
    finally:
        services.stop()
        server.stop(0)
    http = [s for svc, s in receiver.spans if svc == "gateway" and s.kind == trace_pb2.Span.SPAN_KIND_SERVER]
    assert len(http) == 1 and "/v1/completions" in http[0].name, [s.name for s in http]
    trace_id = http[0].trace_id
    in_trace = {s.span_id: (svc, s) for svc, s in receiver.spans if s.trace_id == trace_id}
    generate = [s for svc, s in in_trace.values() if svc == "scheduler" and s.name == "Generate"]
    assert len(generate) == 1, "the scheduler's Generate span must be in the HTTP request's trace"
    # The id the client sees in X-Request-Id is the one both spans carry.
    for span in (http[0], generate[0]):
        attrs = {a.key: a.value.string_value for a in span.attributes}
        assert attrs.get("llmsched.request_id") == request_id, f"{span.name}: {attrs}"
    # Generate's parent is the gateway's gRPC client span, whose parent chain reaches the HTTP span.
    parent = generate[0].parent_span_id
    chain = []
    while parent in in_trace:
        svc, span = in_trace[parent]
        chain.append((svc, span.name))
        if span.span_id == http[0].span_id:
            break
        parent = span.parent_span_id
    assert chain and chain[-1] == ("gateway", http[0].name), f"Generate's ancestors: {chain}"
    assert chain[0][0] == "gateway" and "Generate" in chain[0][1], "a gRPC client span wraps the call"
    # A step serves many requests, so step spans are traces of their own that
    # each request's Generate span links to (the scheduler's design); the
    # executor's step spans are children of the scheduler's.
    steps = {s.span_id: s for svc, s in receiver.spans if svc == "scheduler" and s.name == "scheduler.step"}
    linked = [steps[link.span_id] for link in generate[0].links if link.span_id in steps]
    assert linked, "Generate must link to the scheduler.step spans that ran it"
    step_ids = {s.span_id for s in linked}
    executor_steps = [s for svc, s in receiver.spans if svc == "executor" and s.name == "executor.step"
                      and s.parent_span_id in step_ids]
    assert executor_steps, "the linked scheduler steps must have executor.step children"
    assert all(s.trace_id == steps[s.parent_span_id].trace_id for s in executor_steps)
    # The step that admitted the request is Generate's child, so the
    # request's own trace holds a scheduler step and the executor's under it.
    admitting = [s for svc, s in in_trace.values() if svc == "scheduler" and s.name == "scheduler.step"
                 and s.parent_span_id == generate[0].span_id]
    assert len(admitting) == 1, "the admitting scheduler.step must be a child of Generate, in the HTTP trace"
    assert [s for svc, s in in_trace.values() if svc == "executor" and s.name == "executor.step"
            and s.parent_span_id == admitting[0].span_id], "the executor's step must be in the HTTP trace too"
