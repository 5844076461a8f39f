"""Executor metrics and per-step spans.

The runner measures its phases with perf_counter; the spans are built after
the fact from those durations, so the runner itself knows nothing of
tracing.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace
from prometheus_client import Counter, Histogram

from llmsched.tracing import Tracing, context_from_traceparent

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

PREPARE = Histogram("llmsched_executor_prepare_seconds", "Building the step's input tensors", buckets=_BUCKETS)
FORWARD = Histogram("llmsched_executor_forward_seconds", "Model forward pass and logits", buckets=_BUCKETS)
SAMPLE = Histogram("llmsched_executor_sample_seconds", "Sampling", buckets=_BUCKETS)
IDLE = Histogram("llmsched_executor_idle_seconds",
                 "Gap between one step's end and the next step's start, while the scheduler had work",
                 buckets=_BUCKETS)
BUSY_TOTAL = Counter("llmsched_executor_busy_seconds", "Time spent computing steps")
IDLE_TOTAL = Counter("llmsched_executor_idle_between_steps_seconds",
                     "Time between consecutive steps of one stream while the scheduler had work "
                     "(P7: idle / (idle + busy))")
STEPS = Counter("llmsched_executor_steps", "Steps executed, by outcome", ["outcome"])
SWAP = Histogram("llmsched_executor_swap_seconds",
                 "Copies between the device pool and the host KV tier, per step that has any", buckets=_BUCKETS)
SWAPPED_BLOCKS = Counter("llmsched_executor_swapped_blocks", "KV blocks copied to (out) and from (in) the host tier",
                         ["direction"])
SWAPPED_BYTES = Counter("llmsched_executor_swapped_bytes",
                        "Bytes copied to (out) and from (in) the host tier, over all tensor-parallel ranks",
                        ["direction"])
SWAP_FAILURES = Counter("llmsched_executor_swap_failures", "Block copies between the tiers that failed")
for _direction in ("out", "in"):  # exported at 0 from the start
    SWAPPED_BLOCKS.labels(_direction)
    SWAPPED_BYTES.labels(_direction)


@dataclass(frozen=True, slots=True)
class SwapStats:
    """A step's copies between the device pool and the host KV tier."""

    blocks_out: int
    blocks_in: int
    block_bytes: int  # over all tensor-parallel ranks
    num_failed: int
    swap_ns: int


class StepTelemetry:
    """Tracks idle gaps between steps of one step stream."""

    def __init__(self, tracing: Tracing):
        self.tracing = tracing
        self._last_end: float | None = None

    def stream_started(self) -> None:
        self._last_end = None

    def record(self, traceparent: str, step_id: int, after_idle: bool, started_wall_ns: int, started: float,
               ended: float, prepare_ns: int, forward_ns: int, sample_ns: int, num_tokens: int,
               error: str | None, swaps: SwapStats | None = None) -> None:
        # After a wait with no work (StepPlan.after_idle) the gap is not a
        # bubble between steps: the server simply had nothing to do.
        if self._last_end is not None and not after_idle:
            gap = max(0.0, started - self._last_end)
            IDLE.observe(gap)
            IDLE_TOTAL.inc(gap)
        self._last_end = ended
        BUSY_TOTAL.inc(ended - started)
        STEPS.labels("error" if error else "ok").inc()
        if not error:
            PREPARE.observe(prepare_ns / 1e9)
            FORWARD.observe(forward_ns / 1e9)
            SAMPLE.observe(sample_ns / 1e9)
            if swaps is not None:
                SWAP.observe(swaps.swap_ns / 1e9)
                SWAPPED_BLOCKS.labels("out").inc(swaps.blocks_out)
                SWAPPED_BLOCKS.labels("in").inc(swaps.blocks_in)
                SWAPPED_BYTES.labels("out").inc(swaps.blocks_out * swaps.block_bytes)
                SWAPPED_BYTES.labels("in").inc(swaps.blocks_in * swaps.block_bytes)
                SWAP_FAILURES.inc(swaps.num_failed)
        if not self.tracing.enabled:
            return
        tracer = self.tracing.tracer
        end_wall_ns = started_wall_ns + int((ended - started) * 1e9)
        attributes = {"llmsched.step_id": step_id, "llmsched.num_tokens": num_tokens}
        if swaps is not None:
            attributes.update({"llmsched.blocks_swapped_out": swaps.blocks_out,
                               "llmsched.blocks_swapped_in": swaps.blocks_in,
                               "llmsched.swap_failures": swaps.num_failed})
        span = tracer.start_span("executor.step", context=context_from_traceparent(traceparent),
                                 start_time=started_wall_ns, attributes=attributes)
        ctx = trace.set_span_in_context(span)
        t = started_wall_ns
        # On the CPU the copies run before the step's preparation; on CUDA
        # beside it, on a side stream (drawn first all the same).
        phases = [("swap", swaps.swap_ns)] if swaps is not None else []
        for name, ns in phases + [("prepare", prepare_ns), ("forward", forward_ns), ("sample", sample_ns)]:
            tracer.start_span(name, context=ctx, start_time=t).end(end_time=t + ns)
            t += ns
        if error:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        span.end(end_time=end_wall_ns)
