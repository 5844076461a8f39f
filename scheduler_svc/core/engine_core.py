"""The engine's decisions, without I/O: what to send the executor when, and
what a step's result does. Synchronous; the time comes in as an argument.

Both the asyncio Engine (engine.py: gRPC streams, tracing, metrics) and the
simulator (simulator/, virtual time against a step-cost model) drive this
one object, so the simulator runs the rules the server runs:

- up to max_plans_in_flight plans on the step stream: while fewer are in
  flight and there is work, plan and send; otherwise apply the oldest
  result; otherwise wait for new input;
- adds and aborts are queued by submit/abort and applied at the start of
  the next turn, so a step being planned never sees its requests change;
- admission control (backpressure.py) judges each submitted request from
  the queue and the measured step time;
- a failed step makes its requests suspects, retried alone; a request that
  fails twice ends with an error.

Effects (streams, spans, metrics) belong to the driver, which the core
tells through a CoreListener.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

from scheduler_svc.core.backpressure import AdmissionLimits, Overloaded, StepTimeEstimator, check_admission
from scheduler_svc.core.plan import PromptOutput, SampledToken, StepPlan, StepResult
from scheduler_svc.core.policy import parse_weights
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig

if TYPE_CHECKING:  # read by attribute only: the core does not load pydantic-settings
    from scheduler_svc.config import SchedulerSettings

log = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlightStep:
    """A plan sent whose result has not been applied yet."""

    out: StepPlan
    span: Any  # the driver's handle on the step (a tracing span; None in the simulator)
    sent_at: float
    blocks_allocated: int
    blocks_freed: int


@dataclass(frozen=True, slots=True)
class PlanCounts:
    """What planning one step did to the prefix cache, in blocks."""

    num_queried_blocks: int = 0
    num_hit_blocks: int = 0
    num_host_hit_blocks: int = 0


class TurnKind(enum.Enum):
    SEND = "send"  # Turn.step is planned and in flight: send it now
    RECEIVE = "receive"  # wait for the oldest plan's result, then on_result
    AGAIN = "again"  # the plan only preempted; what it freed lets the next one run
    WAIT = "wait"  # nothing to do until a submit or an abort
    STUCK = "stuck"  # work, but nothing runnable and nothing in flight: wait for new input


@dataclass(slots=True)
class Turn:
    kind: TurnKind
    step: InFlightStep | None = None


class CoreListener:
    """What the core tells its driver. Every method is a no-op here."""

    def plan_started(self) -> Any:
        """Just before schedule(); the value comes back in planned()."""

    def planned(self, step: InFlightStep, started: Any, counts: PlanCounts) -> Any:
        """A step was scheduled (possibly empty: then it is not sent).
        Returns the step's span."""

    def tokens(self, tokens: list[SampledToken], num_dropped: int) -> None:
        """A result's new tokens, matched to their requests."""

    def prompt_outputs(self, outputs: list[PromptOutput]) -> None:
        """What a result read from prompt positions (prompt logprobs,
        embeddings; an embedding's request has finished), before its tokens."""

    def swaps_applied(self, step: InFlightStep, outcome: StepResult) -> None:
        """A result whose plan copied blocks between the tiers was applied."""

    def step_applied(self, step: InFlightStep, outcome: StepResult, elapsed: float) -> None:
        """A result that ran requests was applied; elapsed is its step time."""

    def step_discarded(self, step: InFlightStep) -> None:
        pass

    def step_failed(self, step: InFlightStep, error: str) -> None:
        pass

    def step_done(self, step: InFlightStep) -> None:
        """Last call for a step whose result arrived, whatever it held."""

    def request_failed(self, request_id: str, code: str, message: str) -> None:
        """The request ended with an error (its stream ends with code)."""

    def aborted(self, request: Request) -> None:
        pass


class Tee(CoreListener):
    """Two listeners as one, `first` then `second`: a driver composes its
    parts (the engine: metrics and spans, then streams). What planning
    returns (the step's span) is the first one's."""

    def __init__(self, first: CoreListener, second: CoreListener):
        self.first, self.second = first, second

    def plan_started(self) -> Any:
        self.second.plan_started()
        return self.first.plan_started()

    def planned(self, step: InFlightStep, started: Any, counts: PlanCounts) -> Any:
        span = self.first.planned(step, started, counts)
        self.second.planned(step, started, counts)
        return span

    def tokens(self, tokens: list[SampledToken], num_dropped: int) -> None:
        self.first.tokens(tokens, num_dropped)
        self.second.tokens(tokens, num_dropped)

    def prompt_outputs(self, outputs: list[PromptOutput]) -> None:
        self.first.prompt_outputs(outputs)
        self.second.prompt_outputs(outputs)

    def swaps_applied(self, step: InFlightStep, outcome: StepResult) -> None:
        self.first.swaps_applied(step, outcome)
        self.second.swaps_applied(step, outcome)

    def step_applied(self, step: InFlightStep, outcome: StepResult, elapsed: float) -> None:
        self.first.step_applied(step, outcome, elapsed)
        self.second.step_applied(step, outcome, elapsed)

    def step_discarded(self, step: InFlightStep) -> None:
        self.first.step_discarded(step)
        self.second.step_discarded(step)

    def step_failed(self, step: InFlightStep, error: str) -> None:
        self.first.step_failed(step, error)
        self.second.step_failed(step, error)

    def step_done(self, step: InFlightStep) -> None:
        self.first.step_done(step)
        self.second.step_done(step)

    def request_failed(self, request_id: str, code: str, message: str) -> None:
        self.first.request_failed(request_id, code, message)
        self.second.request_failed(request_id, code, message)

    def aborted(self, request: Request) -> None:
        self.first.aborted(request)
        self.second.aborted(request)


@dataclass(frozen=True, slots=True)
class CoreLimits:
    max_plans_in_flight: int
    admission: AdmissionLimits
    max_queued_requests_per_tenant: int = 0


class EngineCore:
    def __init__(self, limits: CoreLimits, listener: CoreListener | None = None):
        self.limits = limits
        self.listener = listener or CoreListener()
        self.scheduler: Scheduler | None = None
        self.step_time = StepTimeEstimator()
        self.in_flight: deque[InFlightStep] = deque()
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        # When the executor last answered a step, to time each step from
        # when the executor could start it.
        self.last_result_at = 0.0
        # True from a wait with no work until the next plan is sent, which
        # then carries StepPlan.after_idle (see executor.proto).
        self._waited_idle = True

    # ----- the scheduler's life ----------------------------------------------

    def attach(self, config: SchedulerConfig) -> Scheduler:
        """A scheduler for an executor of this KV geometry. It weighs a swap
        against a recompute with the step times this core measures."""
        self.scheduler = Scheduler(config, swap_cost=self.step_time)
        return self.scheduler

    def detach(self) -> None:
        """The executor came back with another model or geometry: nothing the
        scheduler holds means anything to it. The driver has ended every
        request already."""
        self.scheduler = None

    # ----- input, at any time between turns ---------------------------------

    @property
    def num_pending_adds(self) -> int:
        return len(self._pending_adds)

    def submit(self, request: Request) -> None:
        """Queues a request for the next turn. Raises ValueError when it can
        never fit, Overloaded when admission control sheds it."""
        self.check(request)
        self.enqueue(request)

    def enqueue(self, request: Request) -> None:
        """Queues a request check() let in."""
        self._pending_adds.append(request)

    def check(self, request: Request) -> None:
        """Raises ValueError when the request can never fit, Overloaded when
        admission control sheds it now."""
        sched = self.scheduler
        reason = sched.fits(request.num_prompt_tokens, request.sampling.max_tokens)
        if reason:
            raise ValueError(reason)
        pending_tokens = sum(r.num_tokens for r in self._pending_adds)
        requests_ahead, tokens_ahead = sched.waiting.ahead_for(request)
        per_tenant = self.limits.max_queued_requests_per_tenant
        if per_tenant:
            queued = sched.waiting.num_waiting_of(request.tenant) + sum(
                1 for r in self._pending_adds if r.tenant == request.tenant)
            if queued + 1 > per_tenant:
                raise Overloaded(f"tenant {request.tenant!r} has {queued} requests waiting, its limit "
                                 "(SCHEDULER_MAX_QUEUED_REQUESTS_PER_TENANT)", 1000)
        check_admission(
            self.limits.admission,
            self.step_time,
            num_queued_requests=len(sched.waiting) + len(self._pending_adds),
            num_queued_tokens=tokens_ahead + pending_tokens,
            num_requests_ahead=requests_ahead + len(self._pending_adds),
            num_prompt_tokens=request.num_prompt_tokens,
            num_running=len(sched.running),
        )

    def abort(self, request_id: str) -> None:
        self._pending_aborts.append(request_id)

    def clear_pending(self) -> None:
        self._pending_adds.clear()
        self._pending_aborts.clear()

    # ----- runtime LoRA adapters (lora_registry.py), between turns -----------

    def adapter_users(self, key: str) -> list[str]:
        """Ids of the live requests that run with the adapter: queued,
        running (parked ones too) or not yet added."""
        live = self.scheduler.requests.values() if self.scheduler is not None else ()
        return [r.request_id for r in chain(live, self._pending_adds) if r.adapter == key]

    def release_adapter(self, key: str) -> bool:
        """An unloaded adapter leaves the scheduler once no live request uses
        it and no plan in flight names it (LoraSlots.forget); returns
        whether it has, after which the executor may forget it."""
        if self.adapter_users(key):
            return False
        lora = self.scheduler.lora if self.scheduler is not None else None
        return lora is None or lora.forget(key)

    def fail_adapter(self, key: str, code: str, message: str) -> None:
        """Ends every live request of an adapter the executor no longer
        serves (it would not take it back after a restart)."""
        users = set(self.adapter_users(key))
        self._pending_adds = [r for r in self._pending_adds if r.request_id not in users]
        for request_id in users:
            if self.scheduler is not None:
                self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            self.listener.request_failed(request_id, code, message)

    # ----- the turn ---------------------------------------------------------

    def apply_pending(self) -> None:
        sched = self.scheduler
        adds, self._pending_adds = self._pending_adds, []
        for req in adds:
            if sched is None:
                self.listener.request_failed(req.request_id, "UNAVAILABLE", "no executor is connected")
                continue
            sched.add_request(req)
        aborts, self._pending_aborts = self._pending_aborts, []
        for request_id in aborts:
            req = sched.finish_request(request_id, RequestStatus.FINISHED_ABORTED) if sched else None
            if req is not None:
                self.listener.aborted(req)

    def next_turn(self) -> Turn:
        """Sends a plan while fewer than the limit are in flight, else waits
        for the oldest result, else for new work. Call apply_pending first."""
        sched = self.scheduler
        if sched is None:
            return self._wait(TurnKind.WAIT)
        if len(self.in_flight) < self.limits.max_plans_in_flight and sched.has_work:
            step = self._plan(sched)
            if not step.out.is_empty:
                return Turn(TurnKind.SEND, step)
            if self.in_flight:
                return Turn(TurnKind.RECEIVE)
            if step.out.num_preempted:
                return Turn(TurnKind.AGAIN)
            # Nothing runnable and nothing in flight: cannot happen while
            # every admitted request fits the pool alone.
            return self._wait(TurnKind.STUCK)
        if self.in_flight:
            return Turn(TurnKind.RECEIVE)
        forgets = sched.flush_forgets()
        if forgets is not None:
            step = InFlightStep(forgets, None, 0.0, 0, 0)
            step.span = self.listener.planned(step, None, PlanCounts())
            self.in_flight.append(step)
            return Turn(TurnKind.SEND, step)
        return self._wait(TurnKind.WAIT)

    def _wait(self, kind: TurnKind) -> Turn:
        self._waited_idle = True
        return Turn(kind)

    def _plan(self, sched: Scheduler) -> InFlightStep:
        """Schedules the next step. An empty one is not sent: what it must
        tell the executor to forget waits for the next plan."""
        kv = sched.kv
        allocated, released = kv.pool.num_allocated, kv.pool.num_released
        queried, hits, host_hits = kv.num_queried_blocks, kv.num_hit_blocks, kv.num_host_hit_blocks
        started = self.listener.plan_started()
        out = sched.schedule()
        step = InFlightStep(out, None, 0.0, kv.pool.num_allocated - allocated, kv.pool.num_released - released)
        # Admissions look up the prefix cache while planning.
        counts = PlanCounts(kv.num_queried_blocks - queried, kv.num_hit_blocks - hits,
                            kv.num_host_hit_blocks - host_hits)
        step.span = self.listener.planned(step, started, counts)
        if not out.is_empty:
            self.in_flight.append(step)
        return step

    def take_after_idle(self) -> bool:
        """Whether the plan about to be sent is the first after a wait with
        no work (StepPlan.after_idle)."""
        after_idle, self._waited_idle = self._waited_idle, False
        return after_idle

    def on_sent(self, step: InFlightStep, now: float) -> None:
        step.sent_at = now

    def on_result(self, outcome: StepResult, now: float) -> InFlightStep:
        """Applies the result of the oldest plan in flight."""
        sched = self.scheduler
        step = self.in_flight.popleft()
        out = step.out
        # The executor could start this step once it was sent and the one
        # before it was done.
        elapsed = now - max(step.sent_at, self.last_result_at)
        self.last_result_at = now
        try:
            if out.executor_epoch != sched.executor_epoch or outcome.discarded:
                # Planned before the executor's state was reset: its
                # requests have been requeued for recompute already.
                self.listener.step_discarded(step)
                return step
            if outcome.error:
                self.listener.step_failed(step, outcome.error)
                self.on_step_error(out, outcome.error)
                return step
            self._fail_constrained(sched, out, outcome.request_errors)
            live_before = len(sched.requests)
            sched.confirm_swaps(out, outcome.failed_swap_outs, outcome.failed_swap_ins)
            if outcome.prompt_logprobs or outcome.embeddings:
                self.listener.prompt_outputs(sched.apply_prompt_outputs(out, outcome.prompt_logprobs,
                                                                        outcome.embeddings))
            dropped = sched.num_dropped_tokens
            tokens = sched.update_from_output(out, outcome.sampled, outcome.failed_swap_outs, outcome.failed_swap_ins,
                                              outcome.verified_drafts)
            self.listener.tokens(tokens, sched.num_dropped_tokens - dropped)
            swaps = out.swaps
            if swaps is not None:
                # What a copy costs decides between swapping and recomputing
                # (Scheduler.swap_cost is this estimator).
                self.step_time.observe_swaps(outcome.swap_ns / 1e9, len(swaps.out_host) + len(swaps.in_host))
                self.listener.swaps_applied(step, outcome)
            if not out.entries:
                return step  # a plan of forgets (Scheduler.flush_forgets) or of copies alone: no step to time
            self.step_time.observe(elapsed, num_finished=live_before - len(sched.requests),
                                   num_tokens=out.total_num_scheduled_tokens, num_requests=len(out.entries))
            self.listener.step_applied(step, outcome, elapsed)
            return step
        finally:
            self.listener.step_done(step)

    def _fail_constrained(self, sched: Scheduler, out: StepPlan, errors: list[tuple[int, str]]) -> None:
        """Ends the requests whose constraint failed on the executor (their
        tokens of this step are then stale and dropped)."""
        for handle, message in errors:
            e = out.entries.get(handle)
            if e is None or e.is_stale:
                continue
            log.error("constraint of request %s failed on the executor: %s", e.request.request_id, message)
            if sched.finish_request(e.request.request_id, RequestStatus.FINISHED_ERROR):
                self.listener.request_failed(e.request.request_id, "INTERNAL", f"constraint failed: {message}")

    def on_step_error(self, out: StepPlan, error: str) -> None:
        """The executor failed this step and dropped all request state.
        Every request is recomputed; the step's requests become suspects and
        are retried in steps of their own, so only a request that fails
        again, alone, ends with INTERNAL."""
        log.error("step %d failed on the executor: %s", out.step_id, error)
        sched = self.scheduler
        for e in out.entries.values():
            if e.is_stale:
                continue
            req = e.request
            req.num_failed_steps += 1
            if req.num_failed_steps >= 2 and sched.finish_request(req.request_id, RequestStatus.FINISHED_ERROR):
                self.listener.request_failed(req.request_id, "INTERNAL", f"executor step failed twice: {error}")
        # The executor process lives on, and with it what its host tier holds.
        sched.reset_executor_state(host_lost=False)

    def drop_in_flight(self) -> list[InFlightStep]:
        """The executor is gone: results of plans in flight will never come."""
        steps = list(self.in_flight)
        self.in_flight.clear()
        return steps


def core_limits(settings: SchedulerSettings) -> CoreLimits:
    return CoreLimits(
        max_plans_in_flight=settings.max_plans_in_flight,
        admission=AdmissionLimits(
            settings.max_queued_requests, settings.max_queued_tokens, settings.max_queue_delay_ms,
            token_budget=settings.max_num_batched_tokens, max_num_seqs=settings.max_num_seqs,
        ),
        max_queued_requests_per_tenant=settings.max_queued_requests_per_tenant,
    )


def scheduler_config(settings: SchedulerSettings, num_kv_blocks: int, block_size: int,
                     max_model_len: int, num_host_blocks: int = 0, speculative_tokens: int = 0,
                     batch_invariant: bool = False, lora_adapters: tuple[str, ...] = (),
                     max_loras: int = 0, runtime_lora: bool = False) -> SchedulerConfig:
    """The scheduler's configuration: the executor's KV geometry (from its
    handshake: device pool, host tier) and the SCHEDULER_* settings."""
    return SchedulerConfig(
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_prefill_chunk=settings.max_prefill_chunk,
        policy=settings.policy,
        enable_prefix_caching=settings.enable_prefix_caching,
        num_host_blocks=num_host_blocks,
        preemption_mode=settings.preemption_mode,
        speculative_tokens=speculative_tokens,
        speculative_max_batch=settings.speculative_max_batch,
        multi_step_decode=settings.multi_step_decode,
        multi_step_max_batch=settings.multi_step_max_batch,
        batch_invariant=batch_invariant,
        lora_adapters=tuple(lora_adapters),
        max_loras=max_loras,
        runtime_lora=runtime_lora,
        lora_quantum_steps=settings.lora_quantum_steps,
        prompt_token_weight=settings.prompt_token_weight,
        output_token_weight=settings.output_token_weight,
        tenant_weights=tuple(parse_weights(settings.tenant_weights).items()),
    )
