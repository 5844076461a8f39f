"""The executor's step policy without gRPC or a model
(executor_svc/step/step_loop.py): which plans run inline and which on the
step thread, that results keep plan order either way, and what a failed
step does to the plans of its epoch."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from executor_svc.step import step_loop
from executor_svc.step.runner import NewRequestData, StepPlan, StepResult
from executor_svc.step.sampler import SamplingSettings
from executor_svc.step.step_loop import StepExecutor, StepLoop, UndecodablePlan, load_on_step_thread

# The routing compares a decode step's wall time with INLINE_DECODE_MAX_S
# (20 ms). A fake step that returns at once can take longer than that on a
# saturated CI machine, which sent a short decode to the thread in one full
# run. These tests raise the bound so that only their deliberately slow
# steps (SLOW_S) cross it.
INLINE_MAX_S = 0.25
SLOW_S = 2 * INLINE_MAX_S


@pytest.fixture(autouse=True)
def roomy_inline_bound(monkeypatch):
    monkeypatch.setattr(step_loop, "INLINE_DECODE_MAX_S", INLINE_MAX_S)


def prefill(step_id: int, epoch: int = 1) -> StepPlan:
    new = NewRequestData(handle=step_id, token_ids=[1, 2, 3], block_ids=[0], num_computed_tokens=0,
                         num_scheduled_tokens=3, sampling=SamplingSettings(0.0, 1.0, 0, None, 0), num_output_tokens=0)
    return StepPlan(step_id=step_id, new_requests=[new], epoch=epoch)


def decode(step_id: int, epoch: int = 1) -> StepPlan:
    return StepPlan(step_id=step_id, cached_handles=[0], cached_num_scheduled_tokens=[1], epoch=epoch)


class FakeExecutor:
    """Records the thread each step ran on; a step takes `seconds[step_id]`."""

    def __init__(self, seconds: dict[int, float] | None = None):
        self.seconds = seconds or {}
        self.threads: dict[int, str] = {}

    def run(self, plan) -> StepResult:
        self.threads[plan.step_id] = threading.current_thread().name
        time.sleep(self.seconds.get(plan.step_id, 0.0))
        return StepResult(plan.step_id, [], [], None, 0, 0, 0)


def run_all(loop: StepLoop, plans: list) -> list[int]:
    async def main():
        queue = loop.stream()
        for plan in plans:
            queue.put(plan)
        queue.end()
        return [r.step_id async for r in queue.results()]

    return asyncio.run(main())


def test_decode_steps_run_inline_and_plans_with_prefill_on_the_step_thread_in_plan_order():
    fake = FakeExecutor()
    loop = StepLoop(fake, inline_decode=True)
    try:
        order = run_all(loop, [prefill(0), decode(1), decode(2), prefill(3), decode(4)])
    finally:
        loop.close()
    assert order == [0, 1, 2, 3, 4], "results out of plan order"
    on_thread = sorted(s for s, name in fake.threads.items() if name.startswith("step"))
    # Plan 3 arrives while 1 and 2 are held for the loop, so it queues
    # behind them and the loop hands it over in its turn.
    assert on_thread == [0, 3], f"steps on the step thread: {on_thread}; expected only the prefills, 0 and 3"


def test_without_inline_decode_every_step_runs_on_the_step_thread():
    fake = FakeExecutor()
    loop = StepLoop(fake, inline_decode=False)
    try:
        assert run_all(loop, [prefill(0), decode(1), decode(2)]) == [0, 1, 2]
    finally:
        loop.close()
    assert all(name.startswith("step") for name in fake.threads.values()), fake.threads


def test_a_slow_decode_step_sends_the_decode_steps_after_it_to_the_thread():
    fake = FakeExecutor(seconds={1: SLOW_S})
    loop = StepLoop(fake, inline_decode=True)
    try:
        # One at a time, as in lockstep.
        run_all(loop, [prefill(0)])
        run_all(loop, [decode(1)])
        assert loop.last_decode_s >= SLOW_S, "the slow decode step was not timed"
        run_all(loop, [decode(2)])
        run_all(loop, [decode(3)])
    finally:
        loop.close()
    assert not fake.threads[1].startswith("step"), "decode step 1 followed a short one: inline"
    assert fake.threads[2].startswith("step"), "decode step 2 followed a slow one: the thread"
    assert not fake.threads[3].startswith("step"), "decode step 3 followed a short one again: inline"


def test_a_multi_step_plan_that_ran_one_slow_forward_sends_the_next_decode_to_the_thread():
    # A multi-step plan may run up to 1 + 8 forwards, but an inline run ends
    # at its deadline: here after its first. Its time is per forward run;
    # divided by the nine it might have run, a 40 ms step would look like
    # 4 ms, and every plan of a large model would run on the event loop.
    fake = FakeExecutor(seconds={1: SLOW_S})
    loop = StepLoop(fake, inline_decode=True)
    multi = StepPlan(step_id=1, cached_handles=[0], cached_num_scheduled_tokens=[9], draft_handles=[0],
                     draft_counts=[8], multi_step=True)
    try:
        run_all(loop, [prefill(0)])
        run_all(loop, [multi])
        assert loop.last_decode_s >= SLOW_S, (
            f"one forward of {SLOW_S} s was timed as {loop.last_decode_s:.4f} s a step")
        run_all(loop, [decode(2)])
    finally:
        loop.close()
    assert fake.threads[2].startswith("step"), "the decode after a slow one-forward run ran inline"


def test_the_model_loads_on_the_thread_that_then_runs_every_step():
    """serve() loads through load_on_step_thread and hands the thread to the
    StepLoop: with more than one torch thread, a second thread starting
    OpenMP regions (loading or warming up on the event loop) would cut
    every thread's spin to libgomp's throttled 1,000 turns."""
    class Recording(FakeExecutor):
        def run(self, plan) -> StepResult:
            self.threads[plan.step_id] = threading.get_ident()
            return StepResult(plan.step_id, [], [], None, 0, 0, 0)

    loaded, thread = asyncio.run(load_on_step_thread(threading.get_ident))
    fake = Recording()
    loop = StepLoop(fake, inline_decode=False, thread=thread)
    try:
        run_all(loop, [prefill(0), decode(1)])
    finally:
        loop.close()
    assert loaded != threading.get_ident(), "the model loaded on the event loop's thread"
    assert set(fake.threads.values()) == {loaded}, "steps ran on a thread other than the one that loaded"


class FakeRunner:
    def __init__(self, fail_step: int):
        self.fail_step, self.resets, self.ran = fail_step, 0, []

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.step_id == self.fail_step:
            raise RuntimeError("boom")
        self.ran.append(plan.step_id)
        return StepResult(plan.step_id, [], [], None, 0, 0, 0)

    def reset(self) -> None:
        self.resets += 1


class QuietTelemetry:
    def __init__(self):
        self.errors = []

    def record(self, *args) -> None:
        self.errors.append(args[10])


def test_a_failed_step_resets_the_runner_and_discards_the_rest_of_its_epoch():
    runner, telemetry = FakeRunner(fail_step=1), QuietTelemetry()
    executor = StepExecutor(runner, telemetry)
    failed = executor.run(decode(1, epoch=7))
    assert failed.error == "RuntimeError: boom" and runner.resets == 1
    later = executor.run(decode(2, epoch=7))
    assert later.was_discarded and runner.ran == [], "a plan of the failed epoch must not run"
    assert not executor.run(decode(3, epoch=8)).error and runner.ran == [3], "the next epoch runs"
    assert telemetry.errors == ["RuntimeError: boom", None], "discarded plans are not steps"


def test_a_plan_that_does_not_decode_is_answered_as_that_steps_failure():
    runner = FakeRunner(fail_step=-1)
    executor = StepExecutor(runner, QuietTelemetry())
    bad = UndecodablePlan(step_id=4, epoch=2, traceparent="", after_idle=False, wire=b"",
                          error=ValueError("handle 3: 9 computed tokens out of 5"))
    result = executor.run(bad)
    assert result.step_id == 4 and result.error == "ValueError: handle 3: 9 computed tokens out of 5"
    assert runner.resets == 1 and executor.failed_epoch == 2
