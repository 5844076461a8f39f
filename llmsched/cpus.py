"""The CPU cores each co-located service runs on.

A scheduler and an executor on the same cores fight over them: every step
the scheduler must build the next plan while the executor computes, and an
executor whose OpenMP threads spin on every core delays it. So where
`llmsched.launch` starts the services on a machine with two or more cores
it splits them: the scheduler and the gateway share the lowest, the
executor gets the rest, or on two cores both (`LLMSCHED_PIN_CPUS=auto`, the
default; `off` leaves placement to the operating system). It tells each child through `LLMSCHED_CPUS`, a
Linux CPU list such as `1-3,6`, which the child applies to itself first
thing, before torch starts any thread, so that every thread inherits it.
A service started by hand (a container, a unit file) honours
`LLMSCHED_CPUS` the same way.

Nothing here imports torch.
"""

from __future__ import annotations

import os

from llmsched.errors import StartupError

PIN_SETTING = "LLMSCHED_PIN_CPUS"
CPUS_ENV = "LLMSCHED_CPUS"


def parse_cpu_list(text: str) -> set[int]:
    """'0-2,5' -> {0, 1, 2, 5}; raises ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{part!r} is not a CPU number or range")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{part!r} is a backward range")
        cpus.update(range(first, last + 1))
    return cpus


def format_cpu_list(cpus: set[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def usable_cpus() -> set[int]:
    """The cores this process may run on."""
    return set(os.sched_getaffinity(0))


def split_for_services(cpus: set[int]) -> tuple[set[int], set[int]] | None:
    """(the executor's cores, the scheduler's and gateway's core), or None
    with fewer than two cores: one core cannot be split. The scheduler takes
    the lowest; the executor the rest, a contiguous run, where that leaves
    it two or more. On two cores it keeps both: a core of its own would
    halve a compute-bound model's threads (a Qwen3-0.6B-shaped model served
    0.53x llama-server's 16-stream throughput pinned to one core, 0.71x on
    both), while a tiny model's one thread gains little from it (1.60x
    against 1.52x; docs/performance.md, P24)."""
    if len(cpus) < 2:
        return None
    first = min(cpus)
    return (cpus - {first} if len(cpus) > 2 else set(cpus)), {first}


def pin_mode(env: dict[str, str] | os._Environ) -> str:
    mode = env.get(PIN_SETTING, "auto").strip().lower()
    if mode not in ("auto", "off"):
        raise StartupError(f"{PIN_SETTING}={mode!r} is not supported; use auto or off")
    return mode


def apply_from_env(service: str) -> set[int] | None:
    """Pins this process to LLMSCHED_CPUS when set; returns the cores, or
    None when unset. Call before anything starts a thread."""
    text = os.environ.get(CPUS_ENV, "").strip()
    if not text:
        return None
    try:
        cpus = parse_cpu_list(text)
    except ValueError as exc:
        raise StartupError(f"{CPUS_ENV}={text!r}: {exc}; expected a CPU list such as 0-2,5") from None
    allowed = usable_cpus()
    if not cpus <= allowed:
        raise StartupError(f"{CPUS_ENV}={text!r} names cores the {service} may not run on; "
                           f"it may run on {format_cpu_list(allowed)}")
    os.sched_setaffinity(0, cpus)
    return cpus
