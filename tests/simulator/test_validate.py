"""P19's verdicts (simulator/validate.py): errors against the mean of the
real runs, with issue 26's bounds, and the real spread for p99s only."""

from __future__ import annotations

import pytest

from simulator.validate import compare


def report(throughput, ttft_p50, tpot_p50, ttft_p99, tpot_p99):
    return {"summary": {"output_throughput": throughput, "ttft_ms": {"p50": ttft_p50, "p99": ttft_p99},
                        "tpot_ms": {"p50": tpot_p50, "p99": tpot_p99}}}


def test_errors_are_against_the_real_mean_and_p99_may_use_the_real_spread():
    reals = [report(100, 10, 5, 100, 20), report(100, 10, 5, 150, 20), report(100, 10, 5, 50, 20)]
    rows = {r["figure"]: r for r in compare(report(104, 10.9, 5.6, 140, 25), reals)}
    assert rows["output_throughput"]["error_pct"] == pytest.approx(4.0) and rows["output_throughput"]["met"]
    assert rows["ttft_ms.p50"]["met"] and rows["ttft_ms.p50"]["bound_pct"] == 10
    assert rows["tpot_ms.p50"]["error_pct"] == pytest.approx(12.0) and not rows["tpot_ms.p50"]["met"]
    # Real p99s of 50, 100 and 150: a spread of 100%, wider than 20%.
    assert rows["ttft_ms.p99"]["spread_pct"] == pytest.approx(100.0) and rows["ttft_ms.p99"]["met"]
    assert rows["tpot_ms.p99"]["bound_pct"] == 20 and not rows["tpot_ms.p99"]["met"]  # +25%, no spread
