"""Traces from both real service processes arrive in an in-test OTLP/gRPC
receiver (the same TraceService Jaeger's OTLP receiver implements), joined
into one trace per step; Prometheus metrics move during a run."""

from __future__ import annotations

import time
import urllib.request
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from llmsched.launch import free_port
from tests.integration.conftest import start_services


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list[tuple[str, trace_pb2.Span]] = []

    def Export(self, request, context):
        for rs in request.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for ss in rs.scope_spans:
                self.spans.extend((service, s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name):
        return [(svc, s) for svc, s in self.spans if s.name == name]


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value"))
    return out


@pytest.fixture(scope="module")
def traced(stories_path):
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    # 12 blocks of 16 tokens: four 60-token requests force a preemption.
    # The executor speculates, so step spans carry draft counts.
    services, client = start_services(str(stories_path), executor_env={
        **otel, "EXECUTOR_NUM_KV_BLOCKS": "12", "EXECUTOR_SPECULATIVE_METHOD": "ngram"}, scheduler_env=otel)
    yield receiver, services, client
    client.channel.close()
    services.stop()
    server.stop(0)


def wait_for(predicate, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_one_trace_joins_request_scheduler_steps_and_executor_steps(traced):
    receiver, _, client = traced
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda i: client.generate(prompt_token_ids=[1, 403, 407, 261, 378 + i],
                                                sampling={"max_tokens": 55, "temperature": 0}), range(4)))
    assert wait_for(lambda: len(receiver.named("Generate")) >= 4 and receiver.named("sample")), "spans never arrived"
    time.sleep(0.5)  # let the last batches land

    sched_steps = {s.span_id: s for svc, s in receiver.named("scheduler.step")}
    exec_steps = receiver.named("executor.step")
    assert {svc for svc, _ in receiver.named("scheduler.step")} == {"scheduler"}
    assert exec_steps and {svc for svc, _ in exec_steps} == {"executor"}
    for _, es in exec_steps:
        parent = sched_steps.get(es.parent_span_id)
        assert parent is not None, "executor.step must be a child of a scheduler.step span"
        assert parent.trace_id == es.trace_id
    exec_ids = {s.span_id for _, s in exec_steps}
    for phase in ("prepare", "forward", "sample"):
        spans = receiver.named(phase)
        assert spans and all(s.parent_span_id in exec_ids for _, s in spans), f"{phase} spans must be executor.step children"
    step = next(iter(sched_steps.values()))
    assert {"llmsched.num_requests", "llmsched.num_prefill_tokens", "llmsched.num_decode_tokens",
            "llmsched.blocks_allocated", "llmsched.blocks_freed"} <= set(attrs(step))
    spec = [(a["llmsched.spec.drafts_planned"], a["llmsched.spec.drafts_verified"], a["llmsched.spec.drafts_accepted"])
            for a in map(attrs, sched_steps.values()) if "llmsched.step_id" in a]  # applied steps
    assert spec and all(planned >= verified >= accepted >= 0 for planned, verified, accepted in spec), spec
    assert sum(accepted for _, _, accepted in spec) > 0, "no step span records an accepted draft"

    generates = [s for _, s in receiver.named("Generate")]
    events = {e.name for g in generates for e in g.events}
    assert {"queued", "first_scheduled", "first_token", "finished", "preempted"} <= events
    for g in generates:
        assert g.kind == trace_pb2.Span.SPAN_KIND_SERVER
        a = attrs(g)
        assert a["gen_ai.request.max_tokens"] == 55 and a["gen_ai.usage.output_tokens"] == 55
        assert a["gen_ai.usage.input_tokens"] == 5 and "gen_ai.request.temperature" in a and "gen_ai.request.top_p" in a
        for key in ("llmsched.queue_time_s", "llmsched.time_to_first_token_s", "llmsched.prefill_time_s",
                    "llmsched.decode_time_s", "llmsched.cached_prompt_tokens"):
            assert key in a, key
        linked = [link.span_id for link in g.links]
        assert linked and all(span_id in sched_steps for span_id in linked), "request spans link to step spans"
        assert len(linked) < a["llmsched.num_steps"], "links are capped, not one per step"


def test_rejected_request_span_carries_the_reason(traced):
    receiver, _, client = traced
    with pytest.raises(grpc.RpcError):
        client.generate(prompt="hi", prompt_token_ids=[1])
    assert wait_for(lambda: any(e.name == "rejected" for _, g in receiver.named("Generate") for e in g.events))


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_move_during_a_run(traced):
    _, services, client = traced
    before_s, before_e = scrape(services.scheduler_metrics_port), scrape(services.executor_metrics_port)
    # 41 prompt tokens: two full blocks to look up in the prefix cache.
    client.generate(prompt_token_ids=[1, *range(300, 340)], sampling={"max_tokens": 12, "temperature": 0})
    after_s, after_e = scrape(services.scheduler_metrics_port), scrape(services.executor_metrics_port)
    for name in ("llmsched_time_to_first_token_seconds_count", "llmsched_e2e_request_latency_seconds_count",
                 "llmsched_request_queue_time_seconds_count", "llmsched_step_duration_seconds_count",
                 "llmsched_request_generation_tokens_sum", 'llmsched_request_success_total{finished_reason="length"}',
                 "llmsched_inter_token_latency_seconds_count", "llmsched_prefix_cache_queries_total"):
        assert metric(after_s, name) > metric(before_s, name), name
    for name in ("llmsched_num_requests_running", "llmsched_num_requests_waiting", "llmsched_kv_cache_usage_ratio",
                 "llmsched_num_preemptions_total", "llmsched_request_rejected_total"):
        assert name in after_s, name
    for name in ("llmsched_executor_forward_seconds_count", "llmsched_executor_sample_seconds_count",
                 "llmsched_executor_busy_seconds_total", "llmsched_executor_idle_between_steps_seconds_total"):
        assert metric(after_e, name) > metric(before_e, name), name


# Alone: it bounds the executor's idle time between steps.
@pytest.mark.alone
def test_executor_idle_leaves_out_time_with_no_requests(traced):
    """P7 counts bubbles while the scheduler has work: a second of no
    requests between two generations is not executor idle time."""
    _, services, client = traced
    client.generate(prompt_token_ids=[1, 300, 301], sampling={"max_tokens": 4, "temperature": 0})
    before = scrape(services.executor_metrics_port)
    time.sleep(1.0)
    client.generate(prompt_token_ids=[1, 302, 303], sampling={"max_tokens": 4, "temperature": 0})
    after = scrape(services.executor_metrics_port)

    def moved(name: str) -> float:
        return metric(after, name) - metric(before, name)

    idle = moved("llmsched_executor_idle_between_steps_seconds_total")
    assert moved("llmsched_executor_busy_seconds_total") > 0
    assert idle < 0.5, f"{idle:.3f} s counted as idle between steps; the 1 s without requests must not be"
