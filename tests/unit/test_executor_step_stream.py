"""The executor's Step stream in process (executor_svc/service.py over
executor_svc/step/step_loop.py), driven
with raw plans as a scheduler with plans in flight sends them: which steps run
on the event loop and which on the step thread, and that either way the
results come back in plan order with HF's greedy tokens."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from executor_svc.config import ExecutorSettings
from executor_svc.loading import load
from executor_svc.service import ExecutorService
from executor_svc.step.step_loop import INLINE_DECODE_MAX_S
from llmsched.tracing import setup_tracing
from llmsched.v1 import executor_pb2 as pb
from tests.oracle import hf_greedy

PROMPTS = {1: [1, 403, 407, 261, 378], 2: [1, 263, 403, 418, 395, 261, 378, 310, 412, 280, 33, 71, 99, 12]}
BLOCK = 16


class FakeContext:
    async def send_initial_metadata(self, metadata):
        pass

    async def abort(self, code, details):
        raise AssertionError(f"stream aborted: {code} {details}")


def plans() -> list[pb.StepPlan]:
    """Request 1 prefills at step 0 and decodes; request 2 joins at step 4;
    both decode to step 24, each crossing into a second block."""
    greedy = pb.StepSampling(temperature=0, top_p=1)
    out, blocks = [], {1: 1, 2: 1}
    for step_id in range(25):
        plan = pb.StepPlan(step_id=step_id, epoch=1)
        if step_id == 0:
            plan.new_requests.add(handle=1, token_ids=PROMPTS[1], block_ids=[0], num_scheduled_tokens=len(PROMPTS[1]),
                                  sampling=greedy)
        else:
            plan.cached_handles.append(1)
            plan.cached_num_scheduled_tokens.append(1)
        if step_id == 4:
            plan.new_requests.add(handle=2, token_ids=PROMPTS[2], block_ids=[5], num_scheduled_tokens=len(PROMPTS[2]),
                                  sampling=greedy)
        elif step_id > 4:
            plan.cached_handles.append(2)
            plan.cached_num_scheduled_tokens.append(1)
        for handle, first_step, first_block in ((1, 1, 1), (2, 5, 6)):
            # This step computes the token sampled the step before, at len(prompt) + step_id - first_step.
            position = len(PROMPTS[handle]) + step_id - first_step
            if step_id >= first_step and position // BLOCK >= blocks[handle]:
                plan.new_block_handles.append(handle)
                plan.new_block_ids.append(first_block + blocks[handle])
                blocks[handle] += 1
        out.append(plan)
    return out


@pytest.fixture(scope="module")
def service(stories_path):
    settings = ExecutorSettings(model=str(stories_path), num_kv_blocks=64, num_threads=1)
    service = ExecutorService(settings, setup_tracing("executor-test"), load(settings))
    yield service
    service.close()


def run_stream(service: ExecutorService, lockstep: bool = False) -> tuple[list[pb.StepResult], dict[int, str]]:
    """Sends every plan at once (or, in lockstep, each after the previous
    result) and collects the results; returns them and the thread each step
    ran on."""
    threads: dict[int, str] = {}
    steps = service.steps
    run_step = steps.run

    def recording(plan, inline=False):
        threads[plan.step_id] = threading.current_thread().name
        return run_step(plan, inline)

    answered: asyncio.Queue = asyncio.Queue()

    async def requests():
        for plan in plans():
            yield plan
            if lockstep:
                await answered.get()

    async def collect():
        results = []
        async for r in service.Step(requests(), FakeContext()):
            results.append(r)
            answered.put_nowait(r.step_id)
        return results

    steps.run = recording
    try:
        return asyncio.run(collect()), threads
    finally:
        del steps.run


def tokens_by_request(results: list[pb.StepResult]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {1: [], 2: []}
    for r in results:
        assert not r.error, f"step {r.step_id} failed: {r.error}"
        for h, t in zip(r.sampled_handles, r.sampled_token_ids):
            out[h].append(t)
    return out


# Alone: which thread a decode step runs on depends on it taking under 20 ms.
@pytest.mark.alone
def test_cpu_decode_steps_run_on_the_event_loop_and_steps_with_prefill_on_the_step_thread(service, stories_path):
    results, threads = run_stream(service)
    assert [r.step_id for r in results] == list(range(25)), "results out of plan order"
    loop_thread = threading.main_thread().name  # asyncio.run's loop runs here
    on_thread = sorted(s for s, name in threads.items() if name != loop_thread)
    assert on_thread == [0, 4], f"steps run on the step thread: {on_thread}; expected only the prefills, 0 and 4"
    assert all(threads[s].startswith("step") for s in on_thread), threads
    got = tokens_by_request(results)
    assert got[1] == hf_greedy(str(stories_path), PROMPTS[1], 25, ignore_eos=True)
    assert got[2] == hf_greedy(str(stories_path), PROMPTS[2], 21, ignore_eos=True)


def test_with_every_step_on_the_step_thread_the_tokens_are_the_same(service):
    inline, _ = run_stream(service)
    service.steps.inline_decode = False  # as on CUDA and under tensor parallelism
    try:
        threaded, threads = run_stream(service)
    finally:
        service.steps.inline_decode = True
    assert all(name.startswith("step") for name in threads.values()), threads
    assert tokens_by_request(threaded) == tokens_by_request(inline)


# Alone: which thread a decode step runs on depends on it taking under 20 ms.
@pytest.mark.alone
def test_after_a_long_decode_step_decode_steps_use_the_thread_until_one_is_short_again(service):
    # As after a decode step of a large model on CPU: the loop must stay
    # free for health checks while such steps run.
    service.steps.last_decode_s = 1.0
    results, threads = run_stream(service, lockstep=True)
    loop_thread = threading.main_thread().name
    on_thread = sorted(s for s, name in threads.items() if name != loop_thread)
    # Step 1, the first decode, goes to the thread and measures short
    # (stories260K), so the decode steps after it run inline again.
    assert on_thread == [0, 1, 4], f"steps run on the step thread: {on_thread}; expected 0, 1 and 4"
    assert service.steps.last_decode_s < INLINE_DECODE_MAX_S
    assert [r.step_id for r in results] == list(range(25))


def test_with_more_than_one_torch_thread_every_step_runs_on_the_step_thread(stories_path):
    # On the event loop, a decode step would make a second thread start
    # OpenMP regions, and libgomp would cut every thread's spin (StepLoop).
    threads = torch.get_num_threads()
    settings = ExecutorSettings(model=str(stories_path), num_kv_blocks=16, num_threads=2)
    try:
        loaded = load(settings)
        assert loaded.torch_threads == 2
        service = ExecutorService(settings, setup_tracing("executor-test"), loaded)
        assert not service.steps.inline_decode, "decode steps of a two-thread executor run on the event loop"
        service.close()
    finally:
        torch.set_num_threads(threads)  # load() set this process's
