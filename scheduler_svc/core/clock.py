"""The one place scheduler_svc reads the clock.

Everything else takes a Clock (or, in the synchronous core, the time as an
argument), so the simulator can run the same code in virtual time, where
host time spent computing the simulation never counts. A test scans the
package's source for clock reads outside this module.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (timeouts, request timelines)."""

    def perf_counter(self) -> float:
        """Seconds, finest resolution (step durations)."""

    def time_ns(self) -> int:
        """Nanoseconds since the Unix epoch (span start times)."""


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def perf_counter(self) -> float:
        return time.perf_counter()

    def time_ns(self) -> int:
        return time.time_ns()


SYSTEM_CLOCK = SystemClock()
