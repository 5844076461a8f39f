"""A service's shutdown waits a bounded time for its connections to close:
a gRPC call that never finishes cancelling must not hold the process until
a supervisor kills it (seen about 1 stop in 20 under load). The stuck
task's stack is logged so the hang can be found."""

from __future__ import annotations

import asyncio
import logging
import time

from llmsched import server as srv


async def never_closes():
    await asyncio.Event().wait()


async def closes_quickly():
    await asyncio.sleep(0)


async def fails_closing():
    raise RuntimeError("channel already gone")


def test_a_close_that_never_finishes_is_given_up_after_its_bound_with_the_stuck_stack_logged(caplog):
    async def main():
        start = time.monotonic()
        closed = await srv.finished_within(never_closes(), 0.2, "closing connections")
        return closed, time.monotonic() - start

    with caplog.at_level(logging.ERROR, logger="llmsched.server"):
        closed, waited = asyncio.run(main())
    assert closed is False
    assert waited < 2.0, f"waited {waited:.1f}s for a 0.2s bound"
    assert "closing connections did not finish within" in caplog.text
    assert "never_closes" in caplog.text, f"the stuck coroutine is not named in the log: {caplog.text}"


def test_a_close_that_finishes_reports_closed_and_one_that_raises_is_logged_not_raised(caplog):
    async def main():
        return (await srv.finished_within(closes_quickly(), 5, "closing connections"),
                await srv.finished_within(fails_closing(), 5, "closing connections"))

    with caplog.at_level(logging.ERROR, logger="llmsched.server"):
        assert asyncio.run(main()) == (True, True)
    assert "closing connections failed" in caplog.text and "channel already gone" in caplog.text
