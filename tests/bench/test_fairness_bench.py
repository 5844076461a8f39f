"""P18's arithmetic (bench/fairness.py), without services: which polling
intervals count as both tenants backlogged, and the TTFT ratio an exact
slot split would give."""

from bench.fairness import Sample, ideal_wave_ratio, share_while_both_backlogged


def test_share_counts_only_intervals_that_begin_and_end_with_both_tenants_waiting():
    samples = [
        Sample(0.0, {"A": 0, "B": 0}, {"A": 5, "B": 0}),     # B not yet waiting
        Sample(0.1, {"A": 100, "B": 0}, {"A": 5, "B": 3}),
        Sample(0.2, {"A": 160, "B": 40}, {"A": 4, "B": 2}),  # counted: A +60, B +40
        Sample(0.3, {"A": 200, "B": 100}, {"A": 3, "B": 1}),  # counted: A +40, B +60
        Sample(0.4, {"A": 300, "B": 150}, {"A": 2, "B": 0}),  # B drained: not counted
    ]
    ratio, got = share_while_both_backlogged(samples)
    assert got == {"A": 100, "B": 100}
    assert ratio == 1.0


def test_share_is_none_when_the_tenants_never_both_wait():
    samples = [Sample(0.0, {"A": 0, "B": 0}, {"A": 1, "B": 0}), Sample(0.1, {"A": 9, "B": 0}, {"A": 1, "B": 0})]
    assert share_while_both_backlogged(samples)[0] is None


def test_ideal_ratio_counts_the_waves_before_bs_last_request():
    # 32 slots: alone, B's 50 run in 2 waves (its last starts after 1);
    # with 16 slots under the flood, in 4 (its last starts after 3).
    assert ideal_wave_ratio(50, 32, 1 / 2) == 3.0
    # 16 slots: 4 waves alone, 7 with 8 slots.
    assert ideal_wave_ratio(50, 16, 1 / 2) == 2.0
    # A weighing 2: B holds 5 of 16 slots, 10 waves.
    assert ideal_wave_ratio(50, 16, 1 / 3) == 3.0
    # B fits one wave alone: its TTFT alone is a prefill, no wave to compare.
    assert ideal_wave_ratio(50, 64, 1 / 2) is None
