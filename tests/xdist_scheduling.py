"""pytest-xdist scheduling for this suite (hooks that tests/conftest.py
registers).

- Grouping. `--dist loadgroup` runs with FixtureGroupScheduling: tests
  that share a module-scoped fixture (a started stack, a built checkpoint)
  go to one worker, which starts it once. xdist's own loadgroup passes
  groups by appending them to node ids, which pytest >= 9.2 no longer lets
  it do (pytest-xdist#1386: the groups are then silently ignored), so each
  worker writes the groups to a file in the session's temp root and the
  controller's scheduler reads them from there.
- Order. Groups holding `slow` tests go first, so the longest work starts
  first and the run does not end waiting on one worker.
- `alone`. A test marked `alone` (timing-sensitive) runs with no other
  test beside it.

tests/unit/test_xdist_scheduling.py runs a small suite under `-n 2` and
checks all three.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

import pytest


def session_root(config) -> Path:
    """The temp directory this session's processes share: under xdist each
    worker's basetemp is <root>/popen-gwN."""
    base = config._tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


# --- grouping and order ------------------------------------------------------

def group_of(item) -> str | None:
    """An explicit xdist_group mark, else the module plus the parameter of
    any parametrized module-scoped fixture (so each family's stack is its
    own group, free to go to either worker), else None: a test with only
    function- or session-scoped fixtures spreads on its own."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    defs = item._fixtureinfo.name2fixturedefs
    module_fixtures = sorted(name for name, fds in defs.items() if fds[-1].scope in ("module", "class", "package"))
    if not module_fixtures:
        return None
    callspec = getattr(item, "callspec", None)
    params = [f"{n}={callspec.indices[n]}" for n in module_fixtures if callspec and n in callspec.indices]
    return item.module.__name__ + ("[" + ",".join(params) + "]" if params else "")


def schedule_for_xdist(config, items) -> None:
    """In a worker's collection: orders the groups (a stable sort: the order
    within and among the rest is kept) and writes each test's group for the
    controller. Every worker collects and sorts alike, as xdist requires."""
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(group_of(item) or item.nodeid, []).append(item)
    ordered = sorted(groups.values(), key=lambda g: not any(i.get_closest_marker("slow") for i in g))
    items[:] = [item for group in ordered for item in group]
    path = session_root(config) / "xdist-groups.json"
    tmp = path.with_suffix(f".{os.environ['PYTEST_XDIST_WORKER']}")
    tmp.write_text(json.dumps({item.nodeid: name for name, group in groups.items() for item in group}))
    tmp.replace(path)  # atomic: the workers write the same groups


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FixtureGroupScheduling(LoadScopeScheduling):
        """Work units are the groups the workers wrote (schedule_for_xdist)."""

        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:  # first called once every worker has collected
                self._groups = json.loads((session_root(config) / "xdist-groups.json").read_text())
            return self._groups.get(nodeid, nodeid)

    return FixtureGroupScheduling(config, log)


# --- `alone`: no other test runs beside it --------------------------------

# Under pytest-xdist every test holds a shared lock for its whole run
# (fixture set-up and teardown included), and an `alone` test holds it
# exclusively: it waits for the running tests to end, and none starts
# beside it. A writer first takes the turnstile, which each new reader
# passes through, so a stream of ordinary tests cannot starve it.

@contextlib.contextmanager
def _flock(path: Path, mode: int):
    with open(path, "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # a serial run shares the machine with no test
        yield
        return
    root = session_root(item.config)
    turnstile, room = root / "alone.turnstile", root / "alone.lock"
    if item.get_closest_marker("alone") is not None:
        with _flock(turnstile, fcntl.LOCK_EX), _flock(room, fcntl.LOCK_EX):
            yield
    else:
        with _flock(turnstile, fcntl.LOCK_EX):
            pass
        with _flock(room, fcntl.LOCK_SH):
            yield
