"""Two stacks (executor + scheduler) serving one checkpoint, one with
speculative decoding (n-gram unless told otherwise) and one without,
started together and timed in alternating order: what `python -m bench
--speculative K` and `python -m bench.speculative` share."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from llmsched.launch import Services, launch

def names(method: str = "ngram") -> dict[bool, str]:
    """The stacks by whether they speculate, as reports and logs name them."""
    return {False: "off", True: method}


NAMES = names()


def speculative_env(tokens: int, method: str = "ngram", draft_model: str = "") -> dict[str, str]:
    env = {"EXECUTOR_SPECULATIVE_METHOD": method, "EXECUTOR_SPECULATIVE_TOKENS": str(tokens)}
    return env | ({"EXECUTOR_SPECULATIVE_DRAFT_MODEL": draft_model} if draft_model else {})


def launch_pair(executor_env: Mapping[str, str], scheduler_env: Mapping[str, str], tokens: int,
                method: str = "ngram", draft_model: str = "") -> dict[bool, Services]:
    """Both stacks, not started yet (the caller may send their logs to a
    file first), keyed by whether they speculate; everything but the
    speculation settings is the same on both."""
    spec_env = speculative_env(tokens, method, draft_model)
    return {spec: launch(executor_env={**executor_env, **(spec_env if spec else {})}, scheduler_env=scheduler_env)
            for spec in (False, True)}


def start_pair(pair: Mapping[bool, Services]) -> None:
    """Starts both at once (a start is mostly each executor loading its
    model); if either fails, both are stopped and the first error raised."""
    with ThreadPoolExecutor(len(pair)) as pool:
        starts = [pool.submit(services.start) for services in pair.values()]
    try:
        for start in starts:
            start.result()
    except BaseException:
        stop_pair(pair)
        raise


def stop_pair(pair: Mapping[bool, Services]) -> None:
    for services in pair.values():
        services.stop()


def round_order(round_index: int) -> tuple[bool, bool]:
    """Which stack runs first in a round: the plain one in even rounds, the
    speculating one in odd ones, so that neither always meets a warmer (or
    busier) machine."""
    return (False, True) if round_index % 2 == 0 else (True, False)
