"""The executor's step core, free of gRPC: in what order and on which thread
each decoded plan runs, and what running one plan means beyond the model
(the failed epoch, the tensor-parallel fan-out, telemetry).

`StepExecutor.run` runs one plan and never raises. `StepLoop` owns the step
thread and the rule that decides, per plan, whether it runs there or on the
event loop itself. `PlanQueue` is one step stream's plans in arrival order:
it starts each on the step thread as soon as it arrives, unless it is to run
inline, and gives the results back in plan order. The gRPC service
(executor_svc/service.py) only converts messages and feeds the queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Callable, TypeVar

from executor_svc.step.runner import ModelRunner, StepPlan, StepResult
from executor_svc.telemetry import StepTelemetry, SwapStats
from executor_svc.tensor_parallel import LORA_FORGET, RESET, STEP

log = logging.getLogger(__name__)

T = TypeVar("T")

# A CPU decode step runs on the event loop only while the last decode step
# took less than this. Against a longer step the thread's hand-off (a few
# hundred microseconds) is small, and the loop must stay free to answer
# health checks: a decode step of a large model on CPU can take seconds.
INLINE_DECODE_MAX_S = 0.02

# A multi-step run on the event loop ends after the step that reaches this
# much time: meanwhile no plan is received, so a new request or a cancel
# could not end it early (RunInterrupts), and would wait for all of it.
# Against the hand-off a run saves (about 0.2-0.3 ms a plan on a CPU),
# continuing past it would gain a few percent at most.
INLINE_RUN_MAX_S = 0.005


@dataclass(slots=True)
class UndecodablePlan:
    """A plan whose message could not be turned into a StepPlan: it is
    answered, in its turn, as a failed step."""

    step_id: int
    epoch: int
    traceparent: str
    after_idle: bool
    wire: bytes
    error: Exception


Plan = StepPlan | UndecodablePlan


def decode_only(plan: Plan) -> bool:
    """One token for each request the executor already holds, after its
    speculative drafts if it has any: such a step costs about what a decode
    step does, so it runs where decode steps run."""
    if not isinstance(plan, StepPlan) or plan.new_requests:
        return False
    drafts = dict(zip(plan.draft_handles, plan.draft_counts))
    return all(n == 1 + drafts.get(h, 0) for h, n in zip(plan.cached_handles, plan.cached_num_scheduled_tokens))


class RunInterrupts:
    """What the plans received and not yet started bring that a multi-step
    run (ModelRunner._execute_multi_step) heeds between its steps: a new
    request ends every row's run, so the scheduler admits it sooner; a
    finished handle (a cancel, or a request that ended) ends that row's,
    whose tokens would be dropped. A plan run inline cannot be overtaken
    by one not yet received: only runs on the step thread see them, and
    an inline run ends at its deadline instead (INLINE_RUN_MAX_S)."""

    def __init__(self) -> None:
        self.clear()
        # perf_counter() after which the run in progress ends; None: no limit.
        self.deadline: float | None = None

    def clear(self) -> None:
        self.num_arrivals = 0
        self.finished: Counter[int] = Counter()

    def received(self, plan: Plan) -> None:
        if isinstance(plan, StepPlan):
            self.num_arrivals += bool(plan.new_requests)
            self.finished.update(plan.finished_handles)

    def started(self, plan: Plan) -> None:
        if isinstance(plan, StepPlan):
            self.num_arrivals -= bool(plan.new_requests) and self.num_arrivals > 0
            self.finished.subtract(plan.finished_handles)
            self.finished = +self.finished

    def pending(self) -> tuple[bool, Counter[int]]:
        """(whether every row's run ends: a new request waits, or the
        deadline passed; the handles a waiting plan finishes)."""
        late = self.deadline is not None and time.perf_counter() >= self.deadline
        return self.num_arrivals > 0 or late, self.finished


def num_scheduled_tokens(plan: Plan) -> int:
    if isinstance(plan, UndecodablePlan):
        return 0
    return sum(r.num_scheduled_tokens for r in plan.new_requests) + sum(plan.cached_num_scheduled_tokens)


class StepExecutor:
    """Runs one plan at a time on the runner, on whichever thread calls it."""

    def __init__(self, runner: ModelRunner, telemetry: StepTelemetry, tp=None, host_kv_block_bytes: int = 0):
        self.runner, self.telemetry = runner, telemetry
        # Rank 0 of a tensor-parallel group forwards plans and resets to the
        # other ranks (tensor_parallel.py); None on one device.
        self.tp = tp
        self.tp_size = tp.size if tp else 1
        self.host_kv_block_bytes = host_kv_block_bytes
        # Epoch of the last plan that failed (StepPlan.epoch); plans of that
        # epoch still arriving are discarded. Touched only by whichever runs
        # the steps, one at a time.
        self.failed_epoch: int | None = None

    def reset(self) -> None:
        """Forgets every request on every rank, and every runtime LoRA
        adapter: a new step stream starts, and its scheduler registers its
        own (RegisterLoraAdapter)."""
        self._reset_ranks()
        self.failed_epoch = None
        lora = self.runner.lora
        if lora is not None and lora.runtime_dir:
            lora.forget_runtime()
            if self.tp:
                self.tp.send(LORA_FORGET)

    def _reset_ranks(self) -> None:
        self.runner.reset()
        if self.tp:
            self.tp.send(RESET)

    def run(self, plan: Plan) -> StepResult:
        if plan.epoch == self.failed_epoch:
            # Sent before the scheduler learnt of the failure: it names
            # requests forgotten since. The scheduler ignores this result.
            return StepResult.discarded(plan.step_id)
        started_wall, started = time.time_ns(), time.perf_counter()
        try:
            if self.tp:
                # The other ranks decode and run the same plan (tp_worker.py).
                self.tp.send(STEP, plan.wire)
            if isinstance(plan, UndecodablePlan):
                raise plan.error
            result = self.runner.execute(plan)
        except Exception as exc:  # the executor must survive a bad step
            log.exception("step %d failed", plan.step_id)
            # Request state may be half-applied: forget it all, on every
            # rank, so the scheduler recomputes from a clean slate.
            self._reset_ranks()
            self.failed_epoch = plan.epoch
            result = StepResult.failed(plan.step_id, f"{type(exc).__name__}: {exc}")
        ended = time.perf_counter()
        self.telemetry.record(plan.traceparent, plan.step_id, plan.after_idle, started_wall, started, ended,
                              result.prepare_ns, result.forward_ns, result.sample_ns, num_scheduled_tokens(plan),
                              result.error, self._swap_stats(plan, result))
        return result

    def _swap_stats(self, plan: Plan, result: StepResult) -> SwapStats | None:
        if isinstance(plan, UndecodablePlan) or not plan.has_swaps:
            return None
        failed_outs = result.swaps.failed_outs if result.swaps else []
        failed_ins = result.swaps.failed_ins if result.swaps else []
        return SwapStats(len(plan.swap_out_host_blocks) - len(failed_outs),
                         len(plan.swap_in_host_blocks) - len(failed_ins),
                         self.host_kv_block_bytes * self.tp_size, len(failed_outs) + len(failed_ins),
                         result.swaps.swap_ns if result.swaps else 0)


def new_step_thread() -> ThreadPoolExecutor:
    """The thread that loads the model and runs its steps (StepLoop)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")


async def load_on_step_thread(load: Callable[[], T]) -> tuple[T, ThreadPoolExecutor]:
    """load() run on a new step thread; its result and the thread, for the
    StepLoop that runs the steps: one thread starts every OpenMP parallel
    region (StepLoop says why)."""
    thread = new_step_thread()
    return await asyncio.get_running_loop().run_in_executor(thread, load), thread


class StepLoop:
    """One thread runs steps, in plan order, so the event loop stays free to
    receive and decode the next plan, and to answer health checks, while
    the model computes.

    Except decode steps on CPU with one torch thread, which run on the
    event loop itself. A CPU forward keeps the CPU busy, so the thread
    would overlap only the next plan's decoding (microseconds), while the
    hand-off costs hundreds: the two threads pass the GIL back and forth,
    often across cores. Prefill and chunks, which on CPU can take seconds,
    and decode steps once they take INLINE_DECODE_MAX_S or more, keep the
    thread so that health checks are answered meanwhile. On CUDA the host
    waits on the device with the GIL released, and under tensor parallelism
    heartbeats share the thread: both keep it for every step. (Measured:
    docs/architecture.md, "The executor's step".)

    With more than one torch thread, every step keeps the thread (which
    should be the thread that loaded the model: serve() loads there). Each
    thread that starts an OpenMP parallel region gets a team of its own,
    and libgomp, seeing more of its threads than cores, then cuts every
    thread's spin before sleeping from about 300,000 turns to 1,000: each
    of a step's hundred-odd parallel regions then waits for a sleeping
    thread to wake. A Qwen3-0.6B-shaped decode step on two cores: 63 ms
    with one thread starting regions, 107-122 ms with two
    (docs/performance.md, P24)."""

    def __init__(self, executor: StepExecutor, inline_decode: bool, thread: ThreadPoolExecutor | None = None):
        self.executor = executor
        self.inline_decode = inline_decode
        self._thread = thread or new_step_thread()
        # Seconds the last decode step took, wherever it ran. Written by
        # whichever runs steps; a float, so the event loop may read it
        # meanwhile.
        self.last_decode_s = 0.0
        # What plans received and not yet started bring that a multi-step
        # run in progress should heed (RunInterrupts): changed on the event
        # loop (put) and by whichever runs steps, read between steps.
        self.interrupts = RunInterrupts()

    def runs_inline(self, plan: Plan) -> bool:
        return self.inline_decode and self.last_decode_s < INLINE_DECODE_MAX_S and decode_only(plan)

    def run(self, plan: Plan, inline: bool = False) -> StepResult:
        self.interrupts.started(plan)
        started = time.perf_counter()
        self.interrupts.deadline = started + INLINE_RUN_MAX_S if inline else None
        result = self.executor.run(plan)
        if decode_only(plan):
            # Per decode step: a multi-step plan's run keeps the loop for a
            # few of them, still far below what a health check waits, and
            # to the thread it would pay the hand-off again. Per forward it
            # ran, not per step it might have: an inline run ends at its
            # deadline, often after one long step, which divided by the
            # plan's most would look short enough to run inline again.
            self.last_decode_s = (time.perf_counter() - started) / max(1, result.num_forwards)
        return result

    def on_thread(self, fn: Callable, *args) -> Future:
        """Queues fn behind every step already on the thread."""
        return self._thread.submit(fn, *args)

    def stream(self) -> PlanQueue:
        self.interrupts.clear()  # a former stream's unrun plans never will be
        return PlanQueue(self)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class PlanQueue:
    """One step stream's plans, in arrival order. `put` is called as each
    plan arrives, so the step thread starts it at once; `results` yields
    every result in plan order, running inline plans itself, so a result is
    ready as soon as its step ends."""

    def __init__(self, steps: StepLoop):
        self._steps = steps
        self._items: asyncio.Queue = asyncio.Queue()
        # Queued plans that `results` starts itself. While any is queued,
        # later plans queue behind it instead of reaching the thread first.
        self._held = 0

    def put(self, plan: Plan) -> None:
        self._steps.interrupts.received(plan)
        if self._held or self._steps.runs_inline(plan):
            self._held += 1
            self._items.put_nowait((plan, None))
        else:
            self._items.put_nowait((plan, asyncio.wrap_future(self._steps.on_thread(self._steps.run, plan))))

    def end(self) -> None:
        """No more plans: `results` stops after the last one."""
        self._items.put_nowait(None)

    async def results(self) -> AsyncIterator[StepResult]:
        while (item := await self._items.get()) is not None:
            plan, started = item
            if started is not None:
                yield await started
                continue
            self._held -= 1
            if self._steps.runs_inline(plan):  # every earlier step has ended
                yield self._steps.run(plan, inline=True)
            else:
                yield await asyncio.wrap_future(self._steps.on_thread(self._steps.run, plan))
