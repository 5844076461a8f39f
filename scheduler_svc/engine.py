"""The engine loop: the only code that mutates scheduler state.

gRPC handlers never touch the Scheduler directly. They queue adds and
aborts, which the loop applies at the next step boundary, so a step being
planned never sees its requests change under it.

The loop keeps up to SCHEDULER_MAX_PLANS_IN_FLIGHT plans on the step
stream: it sends the plan for step N+1 before the result of step N
arrives, so the executor finds its next plan waiting when a step ends, and
detokenizing and streaming to clients happen while it computes. The
executor applies plans and returns results strictly in order.

What to send when, admission and what a result does are decided by the
synchronous EngineCore (engine_core.py), which the simulator drives too;
this module adds the I/O: the step stream, request streams, reconnection,
tracing and metrics. It reads time only through its Clock (clock.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry import trace
from tokenizers import Tokenizer

from llmsched.errors import StartupError
from llmsched.llguidance_tokenizer import make_tokenizer
from llmsched.security import channel_credentials
from llmsched.tracing import Tracing, traceparent_of
from llmsched.v1 import executor_pb2 as epb
from scheduler_svc import telemetry
from scheduler_svc.clock import SYSTEM_CLOCK, Clock
from scheduler_svc.config import SchedulerSettings
from scheduler_svc.engine_core import (CoreListener, EngineCore, InFlightStep, PlanCounts, TurnKind, core_limits,
                                       scheduler_config)
from scheduler_svc.executor_client import ExecutorClient, ExecutorUnavailable
from scheduler_svc.output_processor import RequestDelta, RequestOutputState
from scheduler_svc.plan import SampledToken, SchedulerOutput, StepOutcome
from scheduler_svc.request import Request, RequestStatus
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.structured_output import ConstraintCompiler
from scheduler_svc.tenants import parse_weights

log = logging.getLogger(__name__)


class Unavailable(Exception):
    """No executor can serve right now."""


@dataclass(slots=True)
class RequestStream:
    """A live request's output channel to its Generate handler."""

    state: RequestOutputState
    telemetry: telemetry.RequestTelemetry
    # Who may Abort it: a digest of the API key that created it (None when
    # API keys are off).
    owner: str | None = None
    queue: asyncio.Queue[RequestDelta] = field(default_factory=asyncio.Queue)


def make_executor_client(settings: SchedulerSettings, clock: Clock = SYSTEM_CLOCK) -> ExecutorClient:
    return ExecutorClient(
        settings.executor_address,
        settings.max_message_bytes,
        channel_credentials(settings.executor_tls_ca, settings.executor_tls_cert, settings.executor_tls_key),
        keepalive_s=settings.executor_keepalive_s,
        clock=clock,
    )


class Engine(CoreListener):
    def __init__(
        self,
        settings: SchedulerSettings,
        tracing: Tracing,
        client: ExecutorClient,
        on_serving_change: Callable[[bool], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ):
        self.settings = settings
        self.tracing = tracing
        self.client = client
        self.clock = clock
        self.core = EngineCore(core_limits(settings), self)
        self.info: epb.HandshakeResponse | None = None
        self.tokenizer: Tokenizer | None = None
        # Compiles `structured` constraints against the model's tokenizer.
        self.constraints: ConstraintCompiler | None = None
        self.max_token_chars = 1
        self._streams: dict[str, RequestStream] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        # Set (with the reason) when the executor is found gone; the loop
        # then recovers at its next turn.
        self._lost_reason: str | None = None
        self._health_watch: asyncio.Task | None = None
        self._on_serving_change = on_serving_change or (lambda serving: None)
        self._serving: bool | None = None
        self.connected = False
        self.draining = False
        # Set by stop(): the loop ends at its next turn instead of recovering.
        # Cancelling it is not enough on its own: Python 3.11's
        # asyncio.wait_for drops a cancellation when the awaited result
        # arrives at the same moment (fixed in 3.12), and a loop that was
        # waiting for a step's result then went on, found the stream closed,
        # reconnected and waited for input until CLOSE_TIMEOUT_S.
        self._stopping = False
        # Set whenever no request is live; drain() waits on it.
        self._idle = asyncio.Event()
        self._idle.set()
        # Progress watchdog: when work is pending but no step completed for
        # stall_timeout_s, health reports NOT_SERVING.
        self._last_progress = clock.monotonic()
        self.stalled = False
        self._watchdog: asyncio.Task | None = None
        # SCHEDULER_POLICY=fair's tenant weights, read at each connect: a bad
        # value stops the start now rather than at the first connect.
        parse_weights(settings.tenant_weights)
        telemetry.TenantLabels.limit = settings.max_tenant_labels
        # Per tenant, the (prompt, output) tokens served already published.
        self._tenants_published: dict[str, tuple[int, int]] = {}
        # Per cause, the tokens recomputed already published (the scheduler
        # counts them; planned() publishes what grew).
        self._recomputed_published: dict[str, int] = {}

    @property
    def scheduler(self) -> Scheduler | None:
        return self.core.scheduler

    # ----- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        await self._connect(self.settings.executor_connect_timeout_s, check=self._refuse_unsupported)
        self._task = asyncio.create_task(self._run(), name="engine-loop")
        self._watchdog = asyncio.create_task(self._watch_progress(), name="engine-watchdog")

    async def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        tasks = [t for t in (self._task, self._watchdog, self._health_watch) if t is not None]
        for task in tasks:
            task.cancel()
        # Closing the executor's channel ends the step and health streams, so
        # a task that missed its cancellation returns with an error (and the
        # loop, seeing _stopping, ends).
        await self.client.close()
        if tasks:
            await asyncio.wait(tasks)
        if self.constraints is not None:
            self.constraints.close()

    async def drain(self, timeout_s: float) -> None:
        """Graceful shutdown: refuse new requests, let live ones finish for
        up to timeout_s, then abort the rest (their streams end with
        FINISH_REASON_ABORT)."""
        self.draining = True
        self._update_health()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            live = list(self._streams)
            log.warning("drain timeout: aborting %d requests", len(live))
            for request_id in live:
                self.abort(request_id)
            try:
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except asyncio.TimeoutError:
                self._fail_all("UNAVAILABLE", "server shut down")

    def _update_health(self) -> None:
        serving = self.connected and not self.stalled and not self.draining
        if serving != self._serving:
            self._serving = serving
            self._on_serving_change(serving)

    async def _watch_progress(self) -> None:
        timeout = self.settings.stall_timeout_s
        while True:
            # A timer, not a poll for work: it only judges elapsed time.
            await asyncio.sleep(timeout / 4)
            sched = self.scheduler
            busy = sched is not None and sched.has_work
            stalled = busy and self.clock.monotonic() - self._last_progress > timeout
            if stalled != self.stalled:
                log.warning("no step completed for %.0fs with work pending" if stalled else "progress resumed", timeout)
                self.stalled = stalled
                self._update_health()

    def _refuse_unsupported(self, info: epb.HandshakeResponse) -> None:
        """At start-up: settings this executor cannot serve are refused by
        name, rather than quietly served otherwise."""
        if self.settings.preemption_mode == "swap" and not info.num_host_kv_blocks:
            raise StartupError(f"SCHEDULER_PREEMPTION_MODE=swap: the executor at {self.settings.executor_address} "
                               "has no host KV tier (EXECUTOR_HOST_KV_CACHE_MEMORY_MB=0); give it one, or use "
                               "auto or recompute")

    async def _connect(self, timeout_s: float, check: Callable[[epb.HandshakeResponse], None] | None = None) -> None:
        info = await self.client.connect(timeout_s, check)
        if self.scheduler is not None and self.info is not None:  # a reconnect
            if _geometry(info) != _geometry(self.info):
                self._fail_all("UNAVAILABLE", "the executor came back with a different model or KV geometry")
                self.core.scheduler = None
            elif info.num_host_kv_blocks != self.info.num_host_kv_blocks:
                # _recover emptied the host tier already (the process is gone
                # with its memory), so only its size changes: requests go on,
                # recomputing what they lost as after any restart.
                log.warning("the executor came back with a host KV tier of %d blocks (was %d)",
                            info.num_host_kv_blocks, self.info.num_host_kv_blocks)
                self.scheduler.replace_host_tier(info.num_host_kv_blocks)
                self._warn_swap_without_host(info)
        if self.scheduler is None:
            self.core.scheduler = Scheduler(
                scheduler_config(self.settings, info.num_kv_blocks, info.block_size, info.max_model_len,
                                 info.num_host_kv_blocks),
                swap_cost=self.core.step_time,
            )
            self._recomputed_published = {}
            self._warn_swap_without_host(info)
            self.tokenizer = Tokenizer.from_str(info.tokenizer_json)
            # Bounds the characters a prompt of max_model_len tokens can have.
            self.max_token_chars = max(1, max(len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True)))
            if self.constraints is not None:
                self.constraints.close()
            # Building llguidance's tokenizer walks the whole vocabulary.
            lltok = await asyncio.to_thread(make_tokenizer, info.tokenizer_json, info.vocab_size,
                                            list(info.eos_token_ids))
            self.constraints = ConstraintCompiler(lltok, self.settings.constraint_compile_timeout_s,
                                                  self.settings.constraint_cache_size)
        self.info = info
        self.connected = True
        self.core.last_result_at = self.clock.perf_counter()
        if not self._stopping:  # a reconnect that stop() overtook leaves no watch behind
            self._health_watch = asyncio.create_task(self._watch_executor(), name="executor-health-watch")
        self._last_progress = self.clock.monotonic()
        self._update_health()
        log.info(
            "connected to executor %s (%s): model=%s kv_blocks=%d host_kv_blocks=%d block_size=%d max_model_len=%d",
            info.instance_id, self.settings.executor_address, info.model, info.num_kv_blocks, info.num_host_kv_blocks,
            info.block_size, info.max_model_len,
        )

    def _warn_swap_without_host(self, info: epb.HandshakeResponse) -> None:
        # At start-up this is refused (start()); an executor that comes back
        # without its host tier is served, recomputing victims.
        if self.settings.preemption_mode == "swap" and not info.num_host_kv_blocks and self.info is not None:
            log.warning("SCHEDULER_PREEMPTION_MODE=swap, but the executor has no host KV tier "
                        "(EXECUTOR_HOST_KV_CACHE_MEMORY_MB=0): preempted requests recompute")

    # ----- called by gRPC handlers ----------------------------------------

    def is_live(self, request_id: str) -> bool:
        return request_id in self._streams

    def submit(self, request: Request, span: trace.Span, owner: str | None = None) -> RequestStream:
        """Queues a validated request. Raises ValueError when it can never
        fit, Overloaded when admission control sheds it, Unavailable when no
        executor is connected."""
        sched = self.scheduler
        if self.draining:
            raise Unavailable("the server is shutting down")
        if not self.connected or sched is None:
            raise Unavailable("no executor is connected")
        if request.request_id in self._streams:
            raise ValueError(f"request_id {request.request_id!r} is already live")
        self.core.check(request)
        stream = RequestStream(
            state=RequestOutputState(request, self.tokenizer),
            telemetry=telemetry.RequestTelemetry(span, self.tracing.enabled, request.tenant, self.clock),
            owner=owner,
        )
        stream.telemetry.on_queued(request.num_prompt_tokens)
        self._streams[request.request_id] = stream
        self._idle.clear()
        self.core.enqueue(request)
        self._wakeup.set()
        return stream

    def abort(self, request_id: str, owner: str | None = None) -> bool:
        """Ends a live request at the next step boundary. Idempotent. Only
        the owner (the API key that created it) may abort it; to anyone
        else it does not exist."""
        stream = self._streams.get(request_id)
        if stream is None or stream.owner != owner:
            return False
        self.core.abort(request_id)
        self._wakeup.set()
        return True

    # ----- the loop --------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self._turn()
            except Exception:
                if self._stopping:
                    return  # the step stream closed under it
                # A bug must not leave every stream hanging: fail what is
                # live (blocks are freed and the executor told) and go on.
                log.exception("engine step crashed; failing live requests")
                self._fail_all("INTERNAL", "internal scheduler error")
                # Results of plans in flight can no longer be matched: start
                # the executor over on a fresh stream.
                self._executor_lost("internal scheduler error")

    async def _turn(self) -> None:
        """One turn, as EngineCore.next_turn decides: send a plan, apply the
        oldest result, or wait for new work."""
        self.core.apply_pending()
        if self._lost_reason is not None:
            await self._recover(self._lost_reason)
            return
        turn = self.core.next_turn()
        if turn.kind is TurnKind.SEND:
            await self._send(turn.step)
        elif turn.kind is TurnKind.RECEIVE:
            await self._receive()
        elif turn.kind is TurnKind.STUCK:
            # Nothing runnable and nothing in flight: waiting here instead
            # of spinning keeps it visible.
            log.error("scheduler has work but scheduled nothing; waiting for new input")
            await self._wait_for_input()
        elif turn.kind is TurnKind.WAIT:
            await self._wait_for_input()
            self._last_progress = self.clock.monotonic()
        # TurnKind.AGAIN: what the plan freed lets the next one run.

    async def _wait_for_input(self) -> None:
        # Only ever reached with nothing in flight (see EngineCore.next_turn).
        self._wakeup.clear()
        await self._wakeup.wait()

    # ----- what the core tells the engine (CoreListener) -------------------

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
            self._streams[req.request_id].telemetry.on_preempted(req.preempted_by)
        if out.is_empty:
            span.end()
            return span
        for req, _ in out.scheduled():
            self._streams[req.request_id].telemetry.on_scheduled(span)
        return span

    def _step_span(self, out: SchedulerOutput, started_ns: int) -> trace.Span:
        """A step serves many requests, so every request's Generate span
        links to the steps that ran it. A step that admits requests is also
        the child of the first one's Generate span, so that request's trace
        holds the step (and the executor's step under it) that prefilled
        it; other steps are traces of their own."""
        parent = None
        if self.tracing.enabled and out.new_requests:
            stream = self._streams.get(out.new_requests[0].request.request_id)
            if stream is not None:
                parent = trace.set_span_in_context(stream.telemetry.span)
        return self.tracing.tracer.start_span("scheduler.step", context=parent, start_time=started_ns)

    def tokens(self, tokens: list[SampledToken], num_dropped: int) -> None:
        self._last_progress = self.clock.monotonic()
        telemetry.DROPPED_TOKENS.inc(num_dropped)
        self._emit(tokens)
        sched = self.scheduler
        if sched.kv.host is not None:
            telemetry.HOST_KV_USAGE.set(1.0 - sched.num_free_host_blocks / sched.kv.host.num_blocks)

    def swaps_applied(self, step: InFlightStep, outcome: StepOutcome) -> None:
        telemetry.record_swaps(step.out.swaps, len(outcome.failed_swap_outs) + len(outcome.failed_swap_ins))

    def step_applied(self, step: InFlightStep, outcome: StepOutcome, elapsed: float) -> None:
        sched, out, step_span = self.scheduler, step.out, step.span
        swaps = out.swaps
        telemetry.STEP_DURATION.observe(elapsed)
        block_size = sched.config.block_size
        tables = sched.kv.block_tables
        telemetry.record_load(
            len(sched.running), len(sched.waiting), sched.num_free_blocks, sched.config.num_kv_blocks,
            tokens_held=sum(min(r.num_computed_tokens, r.num_tokens) for r in sched.running),
            slots_allocated=block_size * sum(len(tables[r.request_id]) for r in sched.running),
        )
        telemetry.record_tenants(sched.policy.served, self._tenants_published, sched.waiting.waiting_by_tenant(),
                                 Counter(r.tenant for r in sched.running), sched.policy.counters)
        if self.tracing.enabled:
            entries = out.entries.values()
            decode = sum(1 for e in entries if e.num_tokens == 1 and e.start >= e.request.num_prompt_tokens)
            step_span.set_attributes({
                "llmsched.step_id": out.step_id,
                "llmsched.num_requests": len(entries),
                "llmsched.num_new_requests": len(out.new_requests),
                "llmsched.num_constrained_requests": sum(1 for e in entries if e.request.constraint is not None),
                "llmsched.num_decode_tokens": decode,
                "llmsched.num_prefill_tokens": out.total_num_scheduled_tokens - decode,
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

    def request_failed(self, request_id: str, code: str, message: str) -> None:
        self._end_stream(request_id, _error_delta(code, message))

    def aborted(self, request: Request) -> None:
        self._finish_stream(request, RequestDelta())

    # ----- the step stream --------------------------------------------------

    async def _send(self, step: InFlightStep) -> None:
        after_idle = self.core.take_after_idle()
        traceparent = traceparent_of(step.span) if self.tracing.enabled else ""
        try:
            await asyncio.wait_for(self.client.send(step.out, after_idle, traceparent), self.settings.step_timeout_s)
        except (ExecutorUnavailable, asyncio.TimeoutError) as exc:
            self._executor_lost(str(exc) or f"could not send a step within {self.settings.step_timeout_s}s")
            return
        self.core.on_sent(step, self.clock.perf_counter())

    async def _receive(self) -> None:
        try:
            outcome = await asyncio.wait_for(self.client.receive(), self.settings.step_timeout_s)
        except (ExecutorUnavailable, asyncio.TimeoutError) as exc:
            # A timeout (the executor stopped answering) has an empty message.
            self._executor_lost(str(exc) or f"no step result within {self.settings.step_timeout_s}s")
            return
        self.core.on_result(outcome, self.clock.perf_counter())

    def _executor_lost(self, reason: str) -> None:
        """Noted here, handled by the loop's next turn (see _recover)."""
        if self._lost_reason is None:
            self._lost_reason = reason
        self._wakeup.set()

    async def _watch_executor(self) -> None:
        """Follows the executor's health while connected, idle or busy, so
        health turns NOT_SERVING when it dies or freezes with no traffic."""
        reason = await self.client.watch_health()
        self._executor_lost(reason)

    def _end_in_flight(self, reason: str) -> None:
        for step in self.core.drop_in_flight():
            step.span.add_event("executor_lost", {"error": reason})
            step.span.end()

    def _emit(self, tokens: list[SampledToken]) -> None:
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
            if stream.state.stopped_by_string and not req.status.is_finished:
                self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
            # A stop string that completes on the last allowed token still
            # reports STOP: RequestOutputState.finish decides the reason.
            if req.status.is_finished:
                self._finish_stream(req, delta)
            else:
                stream.queue.put_nowait(delta)

    def _pop_stream(self, request_id: str) -> RequestStream | None:
        stream = self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()
        return stream

    def _finish_stream(self, req: Request, delta: RequestDelta) -> None:
        stream = self._pop_stream(req.request_id)
        if stream is not None:
            delta = stream.state.finish(delta, req.status)
            stream.telemetry.on_finished(
                delta.finish_status, req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_prompt_tokens
            )
            stream.queue.put_nowait(delta)

    def _end_stream(self, request_id: str, delta: RequestDelta) -> None:
        """Ends a stream with an error delta (no usage, no detokenizer flush)."""
        stream = self._pop_stream(request_id)
        if stream is not None:
            req = stream.state.request
            stream.telemetry.on_finished(
                RequestStatus.FINISHED_ERROR, req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_prompt_tokens
            )
            stream.queue.put_nowait(delta)

    async def _recover(self, reason: str) -> None:
        """The executor is gone: keep every request, reconnect, recompute.
        Results of plans in flight will never come; their requests are
        requeued with everything else."""
        if self._stopping:
            return  # stop() closed the connection: nothing to recover
        log.warning("executor lost: %s", reason)
        self.connected = False
        self._update_health()
        if self._health_watch is not None:
            self._health_watch.cancel()
            # asyncio.wait, not `await task` in a try: a CancelledError caught
            # there could be this loop's own (stop() cancelling it), and
            # swallowing it would leave the loop running past its stop.
            await asyncio.wait({self._health_watch})
            self._health_watch = None
        self._lost_reason = None  # the watch may have noted the same loss
        self._end_in_flight(reason)
        if self.scheduler is not None:
            # Whether the same process answers again or not, what it holds
            # cannot be trusted: its host tier counts as gone too.
            self.scheduler.reset_executor_state(host_lost=True)
        try:
            await self._connect(self.settings.executor_reconnect_timeout_s)
        except ExecutorUnavailable as exc:
            log.error("%s; failing in-flight requests", exc)
            self._fail_all("UNAVAILABLE", f"executor unavailable: {exc}")
            # Keep trying in the background; new requests get UNAVAILABLE
            # meanwhile (connected is False).
            while not self.connected and not self._stopping:
                try:
                    await self._connect(self.settings.executor_reconnect_timeout_s)
                except ExecutorUnavailable:
                    pass

    def _fail_all(self, code: str, message: str) -> None:
        sched = self.scheduler
        for request_id in list(self._streams):
            if sched is not None:
                sched.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            self._end_stream(request_id, _error_delta(code, message))
        self.core.clear_pending()
        self._idle.set()

    # ----- introspection ---------------------------------------------------

    def server_info(self) -> dict:
        sched, info = self.scheduler, self.info
        if sched is None or info is None:
            return {}
        return {
            "model": info.model,
            "max_model_len": info.max_model_len,
            "block_size": info.block_size,
            "num_kv_blocks": info.num_kv_blocks,
            "num_free_kv_blocks": sched.num_free_blocks,
            "num_host_kv_blocks": info.num_host_kv_blocks,
            "num_free_host_kv_blocks": sched.num_free_host_blocks,
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting) + self.core.num_pending_adds,
            "executor_instance_id": info.instance_id,
            "num_preemptions": sched.num_preemptions,
            "chat_template": info.chat_template,
            "bos_token": info.bos_token,
            "eos_token": info.eos_token,
            "architecture": info.architecture,
            "rope_type": info.rope_type,
            "tensor_parallel_size": info.tensor_parallel_size or 1,  # 0: an executor older than the field
        }


def _geometry(info: epb.HandshakeResponse) -> tuple:
    """What the live requests' state depends on. Not the host tier's size:
    it comes back empty after a restart anyway."""
    return (info.model, info.block_size, info.num_kv_blocks, info.max_model_len, info.vocab_size)


def _error_delta(code: str, message: str) -> RequestDelta:
    return RequestDelta(finish_status=RequestStatus.FINISHED_ERROR, error=(code, message))
