"""llmsched/cpus.py: CPU lists, how launch splits the cores between the
services, and LLMSCHED_PIN_CPUS's values."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from llmsched import cpus
from llmsched.errors import StartupError
from llmsched.launch import Services


@pytest.mark.parametrize("text, expected", [("0", {0}), ("0-2,5", {0, 1, 2, 5}), (" 3 , 1-2 ", {1, 2, 3}),
                                            ("7-7", {7})])
def test_cpu_lists_parse_and_format_back(text, expected):
    assert cpus.parse_cpu_list(text) == expected
    assert cpus.parse_cpu_list(cpus.format_cpu_list(expected)) == expected


def test_cpu_lists_format_runs_compactly():
    assert cpus.format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "1,,2", "-1"])
def test_a_malformed_cpu_list_is_refused(text):
    with pytest.raises(ValueError):
        cpus.parse_cpu_list(text)


def test_the_scheduler_takes_the_lowest_core_and_the_executor_the_rest_or_both_of_two():
    assert cpus.split_for_services({2, 3, 4, 5}) == ({3, 4, 5}, {2})
    assert cpus.split_for_services({0, 1, 2}) == ({1, 2}, {0})
    assert cpus.split_for_services({0, 1}) == ({0, 1}, {0}), "on two cores the executor keeps both"
    assert cpus.split_for_services({3}) is None, "one core is not split"


def test_launch_gives_each_child_its_cores_unless_told_otherwise():
    with mock.patch.object(cpus, "usable_cpus", return_value={0, 1, 2, 3}):
        with mock.patch.dict(os.environ, {cpus.PIN_SETTING: "auto"}):
            os.environ.pop(cpus.CPUS_ENV, None)
            assert Services._cpus_env("executor") == {cpus.CPUS_ENV: "1-3"}
            assert Services._cpus_env("scheduler") == Services._cpus_env("gateway") == {cpus.CPUS_ENV: "0"}
        with mock.patch.dict(os.environ, {cpus.PIN_SETTING: "off"}):
            assert Services._cpus_env("executor") == {}
        with mock.patch.dict(os.environ, {cpus.PIN_SETTING: "auto", cpus.CPUS_ENV: "2"}):
            assert Services._cpus_env("executor") == {}, "the caller's own LLMSCHED_CPUS is left to every child"
    with mock.patch.object(cpus, "usable_cpus", return_value={5}), \
            mock.patch.dict(os.environ, {cpus.PIN_SETTING: "auto"}):
        assert Services._cpus_env("executor") == {}


def test_an_unknown_pin_mode_is_refused_by_name():
    with pytest.raises(StartupError, match="LLMSCHED_PIN_CPUS='always' is not supported; use auto or off"):
        cpus.pin_mode({cpus.PIN_SETTING: "always"})
