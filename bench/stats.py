"""Pure-Python statistics for the bench client: percentiles, per-request
latency figures and seeded Poisson arrivals.

Kept free of numpy and torch so the client side of the benchmark runs on a
scheduler-only install.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between the two
    nearest ranks, the same rule as numpy's default, so figures agree with
    whatever a reader recomputes from the JSON. NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(slots=True)
class Distribution:
    """Summary of one latency figure, in the unit it was measured in."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Distribution":
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(len(values), sum(values) / len(values), p50, p90, p99, max(values))

    def scaled(self, factor: float) -> "Distribution":
        """Same figures in another unit (seconds -> ms)."""
        return Distribution(self.count, self.mean * factor, self.p50 * factor, self.p90 * factor,
                            self.p99 * factor, self.max * factor)


# ----- per-request latency figures -------------------------------------------
#
# A request's stream is a list of responses ("chunks"), each with its arrival
# time and how many tokens it carries. The server merges tokens into one
# response when the reader falls behind, so a chunk may carry several tokens.


def ttft(send_s: float, chunk_times: Sequence[float]) -> float | None:
    """Time to first token: send to the first response that carries one."""
    return chunk_times[0] - send_s if chunk_times else None


def tpot(send_s: float, chunk_times: Sequence[float], num_tokens: int) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (n - 1).
    Undefined for fewer than two tokens, since nothing follows the first."""
    if num_tokens < 2 or not chunk_times:
        return None
    return (chunk_times[-1] - chunk_times[0]) / (num_tokens - 1)


def inter_token_latencies(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """One gap per token after the first.

    A chunk of k tokens that arrives g seconds after the previous chunk
    contributes k gaps of g/k: those tokens were produced during g, and
    spreading keeps sum(ITL) == e2e - ttft, so mean ITL equals TPOT instead
    of overstating per-token latency whenever responses were merged. Extra
    tokens in the first chunk have no earlier chunk to measure from and
    count as zero gaps, for the same sum.
    """
    if len(chunk_times) != len(chunk_tokens):
        raise ValueError("chunk_times and chunk_tokens differ in length")
    gaps: list[float] = []
    prev: float | None = None
    for t, k in zip(chunk_times, chunk_tokens):
        if k <= 0:  # a response with no tokens (e.g. usage only) is no gap
            continue
        if prev is None:
            gaps.extend([0.0] * (k - 1))
        else:
            gaps.extend([(t - prev) / k] * k)
        prev = t
    return gaps


# ----- arrivals --------------------------------------------------------------


def poisson_arrivals(rate: float, seed: int, *, num: int | None = None, duration_s: float | None = None) -> list[float]:
    """Arrival offsets (seconds from start) of a Poisson process with `rate`
    requests/s: exponential gaps from a private seeded RNG, so the same seed
    gives the same schedule whatever else uses `random`. Stops after `num`
    arrivals, or at the last arrival before `duration_s`, whichever comes
    first; at least one of the two must be given. The first request arrives
    after one gap, not at t=0, as a Poisson stream would."""
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError(f"request rate must be a positive finite number, got {rate}")
    if num is None and duration_s is None:
        raise ValueError("give num or duration_s, or the stream never ends")
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while num is None or len(out) < num:
        t += rng.expovariate(rate)
        if duration_s is not None and t >= duration_s:
            break
        out.append(t)
    return out


def throughput_timeline(token_events: Sequence[tuple[float, int]], duration_s: float,
                        bucket_s: float | None = None) -> tuple[float, list[float]]:
    """Output tokens/s per time bucket from (time, tokens) events. The bucket
    is 1 s for runs of 20 s or more, else a twentieth of the run, so short
    smoke runs still draw a curve. Returns (bucket_s, rates)."""
    if duration_s <= 0:
        return (bucket_s or 1.0), []
    if bucket_s is None:
        bucket_s = 1.0 if duration_s >= 20 else max(duration_s / 20, 1e-3)
    n = max(1, math.ceil(duration_s / bucket_s))
    counts = [0] * n
    for t, k in token_events:
        counts[min(n - 1, max(0, int(t / bucket_s)))] += k
    return bucket_s, [c / bucket_s for c in counts]
