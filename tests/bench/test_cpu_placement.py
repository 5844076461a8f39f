"""bench.cpu_placement's arithmetic and configurations (the bench itself
launches the services four times a round: it is run by hand)."""

from __future__ import annotations

from bench.cpu_placement import CONFIGS, round_ratios


def test_ratios_are_to_the_first_configuration_of_the_same_round():
    rounds = [{"before": 4.0, "after": 1.0}, {"before": 2.0, "after": 1.5}]
    assert round_ratios(rounds, "before") == {"before": [1.0, 1.0], "after": [0.25, 0.75]}


def test_the_first_configuration_is_the_executor_before_and_the_last_todays_defaults():
    first, *_, last = CONFIGS.values()
    assert first["LLMSCHED_PIN_CPUS"] == "off" and first["EXECUTOR_TORCH_COMPILE"] == "off"
    assert first["OMP_WAIT_POLICY"] == "", "an empty value keeps libgomp's own default"
    assert last == {"EXECUTOR_NUM_THREADS": "0", "LLMSCHED_PIN_CPUS": "auto", "EXECUTOR_TORCH_COMPILE": "auto"}
