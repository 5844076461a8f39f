"""Engine.stop ends the engine's loop even when the loop misses its
cancellation: Python 3.11's asyncio.wait_for drops one when the awaited
result arrives at the same moment, and the loop used to go on, reconnect
and hold the scheduler's shutdown for its close timeout."""

from __future__ import annotations

import asyncio

from opentelemetry import trace

from llmsched.tracing import Tracing
from scheduler_svc.config import SchedulerSettings
from scheduler_svc.engine import Engine


class ClosedClient:
    """An executor client with nothing behind it; stop() only closes it."""

    closed = False

    async def close(self) -> None:
        self.closed = True


def test_stop_ends_the_loop_even_when_a_turn_swallows_its_cancellation():
    async def scenario() -> tuple[bool, int, bool]:
        client = ClosedClient()
        engine = Engine(SchedulerSettings(), Tracing(trace.get_tracer("test"), enabled=False), client)
        turns = 0

        async def turn_that_misses_its_cancellation() -> None:
            nonlocal turns
            turns += 1
            try:
                await asyncio.Event().wait()  # waiting for a step's result
            except asyncio.CancelledError:
                pass  # the result won the race: wait_for returned it instead

        engine._turn = turn_that_misses_its_cancellation
        engine._task = asyncio.create_task(engine._run(), name="engine-loop")
        await asyncio.sleep(0)  # the loop is in its first turn
        stopping = asyncio.create_task(engine.stop())
        # asyncio.wait, which never cancels: a stop that hangs is reported, not waited out.
        done, _ = await asyncio.wait({stopping}, timeout=5)
        return bool(done) and engine._task.done(), turns, client.closed

    loop = asyncio.new_event_loop()
    try:
        stopped, turns, closed = loop.run_until_complete(scenario())
    finally:
        loop.close()  # without waiting for what a failed stop left running
    assert stopped, f"stop() did not end the engine's loop within 5 s ({turns} turns)"
    assert turns == 1 and closed
