"""The engine's metrics and step spans: what EngineCore reports about each
plan and result (CoreListener), turned into Prometheus figures and
OpenTelemetry spans. The engine composes it with its own listener (which
feeds the request streams) through engine_core.Tee; request-level figures
live in telemetry.RequestTelemetry, which each stream carries."""

from __future__ import annotations

from collections import Counter

from opentelemetry import trace

from llmsched.tracing import Tracing
from scheduler_svc import telemetry
from scheduler_svc.core.clock import Clock
from scheduler_svc.core.engine_core import CoreListener, InFlightStep, PlanCounts
from scheduler_svc.core.plan import SampledToken, StepPlan, StepResult
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.streams import Streams


class EngineTelemetry(CoreListener):
    def __init__(self, tracing: Tracing, clock: Clock, streams: Streams, max_tenant_labels: int):
        self.tracing = tracing
        self.clock = clock
        self.streams = streams
        self.scheduler: Scheduler | None = None
        telemetry.TenantLabels.limit = max_tenant_labels
        # Per tenant, the (prompt, output) tokens served already published.
        self._tenants_published: dict[str, tuple[int, int]] = {}
        # Per cause, the tokens recomputed already published (the scheduler
        # counts them; planned() publishes what grew).
        self._recomputed_published: dict[str, int] = {}
        self._accepted_published: Counter[int] = Counter()
        self._drafts_published = self._accepted_tokens_published = 0
        self._lookahead_published = (0, 0)

    def attach(self, scheduler: Scheduler) -> None:
        """A new scheduler (a first connect, or another model): its counts start at 0."""
        self.scheduler = scheduler
        self._recomputed_published = {}
        # The speculative-decoding counts already published.
        self._accepted_published: Counter[int] = Counter()
        self._drafts_published = self._accepted_tokens_published = 0
        self._lookahead_published = (0, 0)

    def plan_started(self) -> int:
        return self.clock.time_ns()

    def planned(self, step: InFlightStep, started: int | None, counts: PlanCounts) -> trace.Span:
        out = step.out
        span = self._step_span(out, self.clock.time_ns() if started is None else started)
        if started is None:
            return span  # a plan of forgets alone
        sched = self.scheduler
        block_size = sched.config.block_size
        telemetry.PREFIX_QUERIES.inc(counts.num_queried_blocks * block_size)
        telemetry.PREFIX_HITS.labels("device").inc(counts.num_hit_blocks * block_size)
        telemetry.PREFIX_HITS.labels("host").inc(counts.num_host_hit_blocks * block_size)
        # Recomputes counted since the last plan: this one's preemptions,
        # and copies that failed in the results applied since.
        for cause, n in sched.num_recomputed_tokens.items():
            telemetry.RECOMPUTED_TOKENS.labels(cause).inc(n - self._recomputed_published.get(cause, 0))
        self._recomputed_published = dict(sched.num_recomputed_tokens)
        for req in out.preempted:
            self.streams.get(req.request_id).telemetry.on_preempted(req.preempted_by)
        if out.is_empty:
            span.end()
            return span
        for req, _ in out.scheduled():
            self.streams.get(req.request_id).telemetry.on_scheduled(span)
        return span

    def _step_span(self, out: StepPlan, started_ns: int) -> trace.Span:
        """A step serves many requests, so every request's Generate span
        links to the steps that ran it. A step that admits requests is also
        the child of the first one's Generate span, so that request's trace
        holds the step (and the executor's step under it) that prefilled
        it; other steps are traces of their own."""
        parent = None
        if self.tracing.enabled and out.new_requests:
            stream = self.streams.get(out.new_requests[0].request.request_id)
            if stream is not None:
                parent = trace.set_span_in_context(stream.telemetry.span)
        return self.tracing.tracer.start_span("scheduler.step", context=parent, start_time=started_ns)

    def tokens(self, tokens: list[SampledToken], num_dropped: int) -> None:
        telemetry.DROPPED_TOKENS.inc(num_dropped)
        sched = self.scheduler
        if sched.accepted_lengths != self._accepted_published:
            self._publish_speculation(sched)
        granted, ran = sched.num_lookahead_steps, sched.num_lookahead_steps_run
        if (granted, ran) != self._lookahead_published:
            telemetry.LOOKAHEAD_STEPS.labels("run").inc(ran - self._lookahead_published[1])
            telemetry.LOOKAHEAD_STEPS.labels("not_run").inc(granted - ran - (self._lookahead_published[0]
                                                                             - self._lookahead_published[1]))
            self._lookahead_published = (granted, ran)
        if sched.kv.host is not None:
            telemetry.HOST_KV_USAGE.set(1.0 - sched.num_free_host_blocks / sched.kv.host.num_blocks)

    def _publish_speculation(self, sched) -> None:
        """The scheduler's speculative-decoding counts since the last result."""
        for length, steps in (sched.accepted_lengths - self._accepted_published).items():
            for _ in range(steps):
                telemetry.SPEC_ACCEPTED_LENGTH.observe(length)
        telemetry.SPEC_DRAFT_TOKENS.inc(sched.num_draft_tokens - self._drafts_published)
        telemetry.SPEC_ACCEPTED_TOKENS.inc(sched.num_accepted_tokens - self._accepted_tokens_published)
        telemetry.SPEC_MEAN_ACCEPTANCE.set(1 + sched.num_accepted_tokens / max(1, sched.accepted_lengths.total()))
        self._accepted_published = Counter(sched.accepted_lengths)
        self._drafts_published, self._accepted_tokens_published = sched.num_draft_tokens, sched.num_accepted_tokens

    def swaps_applied(self, step: InFlightStep, outcome: StepResult) -> None:
        telemetry.record_swaps(step.out.swaps, len(outcome.failed_swap_outs) + len(outcome.failed_swap_ins))

    def step_applied(self, step: InFlightStep, outcome: StepResult, elapsed: float) -> None:
        sched, out, step_span = self.scheduler, step.out, step.span
        swaps = out.swaps
        telemetry.STEP_DURATION.observe(elapsed)
        telemetry.record_load(sched.load(), sched.config.num_kv_blocks)
        if sched.lora is not None:
            telemetry.record_lora(sched.lora, out, outcome)
        telemetry.record_tenants(sched.policy.served, self._tenants_published, sched.waiting.waiting_by_tenant(),
                                 Counter(r.tenant for r in sched.running), sched.policy.counters)
        if self.tracing.enabled:
            entries = out.entries.values()
            decode = sum(1 for e in entries if e.num_tokens - e.num_lookahead == 1 and e.start >= e.request.num_prompt_tokens)
            lookahead = sum(e.num_lookahead for e in entries)
            verified = [(n, a) for _, n, a in outcome.verified_drafts if n]
            # A multi-step plan fixes no draft count: its steps draft into
            # the slots they have left, so its drafts are those verified.
            planned_drafts = sum(n for n, _ in verified) if out.multi_step else lookahead
            step_span.set_attributes({
                "llmsched.step_id": out.step_id,
                "llmsched.num_requests": len(entries),
                "llmsched.num_new_requests": len(out.new_requests),
                "llmsched.num_constrained_requests": sum(1 for e in entries if e.request.constraint is not None),
                "llmsched.num_decode_tokens": decode,
                "llmsched.num_prefill_tokens": out.total_num_scheduled_tokens - decode - lookahead,
                "llmsched.multi_step.lookahead_planned": lookahead if out.multi_step else 0,
                # Speculation: drafts the plan allowed, those the executor
                # verified, and how many of those were accepted.
                "llmsched.spec.drafts_planned": planned_drafts,
                "llmsched.spec.drafts_verified": sum(n for n, _ in verified),
                "llmsched.spec.drafts_accepted": sum(a for _, a in verified),
                "llmsched.num_preempted": out.num_preempted,
                "llmsched.blocks_allocated": step.blocks_allocated,
                "llmsched.blocks_freed": step.blocks_freed,
                "llmsched.blocks_swapped_out": len(swaps.out_host) if swaps else 0,
                "llmsched.blocks_swapped_in": len(swaps.in_host) if swaps else 0,
                "llmsched.swap_failures": len(outcome.failed_swap_outs) + len(outcome.failed_swap_ins),
                "llmsched.executor.swap_ms": outcome.swap_ns / 1e6,
                "llmsched.executor.forward_ms": outcome.forward_ns / 1e6,
                "llmsched.executor.sample_ms": outcome.sample_ns / 1e6,
            })

    def step_discarded(self, step: InFlightStep) -> None:
        step.span.add_event("discarded")

    def step_failed(self, step: InFlightStep, error: str) -> None:
        step.span.set_status(trace.Status(trace.StatusCode.ERROR, error))

    def step_done(self, step: InFlightStep) -> None:
        step.span.end()

    def executor_lost(self, steps: list[InFlightStep], reason: str) -> None:
        """Plans in flight when the executor was lost: their results never come."""
        for step in steps:
            step.span.add_event("executor_lost", {"error": reason})
            step.span.end()
