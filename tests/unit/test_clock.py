"""scheduler_svc reads the clock only through scheduler_svc/core/clock.py, so the
simulator can run its code in virtual time (issue 26)."""

from __future__ import annotations

import ast
from pathlib import Path

import scheduler_svc

PACKAGE = Path(scheduler_svc.__file__).parent
CLOCK_MODULE = PACKAGE / "core" / "clock.py"
# (module, attribute) pairs that read a wall or monotonic clock.
CLOCK_READS = {("time", name) for name in ("time", "time_ns", "monotonic", "monotonic_ns", "perf_counter",
                                           "perf_counter_ns", "process_time", "thread_time", "clock_gettime")}
CLOCK_READS |= {("datetime", "now"), ("datetime", "utcnow"), ("datetime", "today"), ("date", "today")}


def clock_reads(source: str) -> list[tuple[int, str]]:
    """Every reference to a clock-reading function: `time.monotonic` called
    or passed along, `from time import monotonic`, `datetime.now()`, also
    under another name (`import time as t`, `from datetime import datetime
    as dt`)."""
    tree = ast.parse(source)
    # A local name -> the module or class it stands for.
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in ("time", "datetime")})
        elif isinstance(node, ast.ImportFrom) and node.module == "datetime":
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in ("datetime", "date")})
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
            owner = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
            owner = aliases.get(owner, owner)
            if (owner, node.attr) in CLOCK_READS:
                found.append((node.lineno, f"{owner}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "datetime"):
            for alias in node.names:
                if (node.module, alias.name) in CLOCK_READS:
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
    return found


def test_the_scan_finds_every_way_of_reading_the_clock():
    source = ("import time, datetime\nfrom time import perf_counter\nx = time.monotonic()\n"
              "f = field(default_factory=time.time)\ny = datetime.datetime.now()\n")
    assert sorted(what for _, what in clock_reads(source)) == sorted(
        ["from time import perf_counter", "time.monotonic", "time.time", "datetime.now"])
    renamed = ("import time as t\nfrom datetime import datetime as dt\nfrom time import monotonic as m\n"
               "a = t.perf_counter()\nb = dt.now()\n")
    assert sorted(what for _, what in clock_reads(renamed)) == sorted(
        ["time.perf_counter", "datetime.now", "from time import monotonic"])


def test_scheduler_svc_reads_the_clock_only_through_clock_py():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == CLOCK_MODULE:
            continue
        for lineno, what in clock_reads(path.read_text()):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{lineno}: {what}")
    assert not offenders, "read the clock through scheduler_svc.core.clock instead:\n" + "\n".join(offenders)
    assert clock_reads(CLOCK_MODULE.read_text()), "clock.py is where the clock is read"
