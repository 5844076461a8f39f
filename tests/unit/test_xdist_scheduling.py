"""tests/xdist_scheduling.py, which `make test` relies on, checked on a
small suite run under `pytest -n 2 --dist loadgroup` in a subprocess, with
make test's own flags: tests sharing a module-scoped fixture run on one
worker, which sets it up once; each parameter of a parametrized module
fixture is a group of its own; the other tests spread over both workers;
the group holding a `slow` test starts first; and an `alone` test overlaps
no other test. A pytest or xdist release that ignored the groups (as
pytest 9.2 made xdist's own loadgroup do) fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

CONFTEST = '''
import json, os, time
import pytest
from tests.xdist_scheduling import pytest_runtest_protocol, pytest_xdist_make_scheduler, schedule_for_xdist

def pytest_configure(config):
    config.addinivalue_line("markers", "alone: runs with no other test beside it")
    config.addinivalue_line("markers", "slow: long")

def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        schedule_for_xdist(config, items)

def log(**record):
    with open(os.environ["SCHED_LOG"], "a") as f:
        f.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER"), **record}) + "\\n")

@pytest.fixture
def run(request):
    start = time.time()
    yield lambda seconds: time.sleep(seconds)
    log(test=request.node.name, start=start, end=time.time())
'''

SHARED = '''
import pytest
from conftest import log

@pytest.fixture(scope="module")
def stack():
    log(setup="stack")
    yield

@pytest.mark.parametrize("i", range(4))
def test_shared(stack, run, i):
    run(0.1)
'''

FAMILY = '''
import pytest
from conftest import log

@pytest.fixture(scope="module", params=["a", "b"])
def family(request):
    log(setup="family-" + request.param)
    yield request.param

def test_first(family, run):
    run(0.1)

def test_second(family, run):
    run(0.1)
'''

SPREAD = '''
import pytest

@pytest.mark.parametrize("i", range(8))
def test_spread(run, i):
    run(0.2)

@pytest.mark.alone
def test_alone(run):
    run(0.5)
'''

SLOW = '''
import pytest

@pytest.mark.slow
def test_slow(run):
    run(0.3)
'''


def test_groups_share_fixtures_spread_the_rest_start_slow_first_and_keep_alone_tests_alone(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    for name, text in {"conftest.py": CONFTEST, "test_a_shared.py": SHARED, "test_b_family.py": FAMILY,
                       "test_c_spread.py": SPREAD, "test_z_slow.py": SLOW}.items():
        (suite / name).write_text(text)
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "SCHED_LOG": str(log)}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_TESTRUNUID", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         "--no-loadscope-reorder", "--basetemp", str(tmp_path / "basetemp"), str(suite)],
        cwd=suite, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    records = [json.loads(line) for line in log.read_text().splitlines()]
    setups = [r["setup"] for r in records if "setup" in r]
    tests = [r for r in records if "test" in r]
    assert len(tests) == 18, tests
    assert sorted(setups) == ["family-a", "family-b", "stack"], f"each module fixture set up once: {setups}"

    def workers(select) -> set[str]:
        return {r["worker"] for r in tests if select(r["test"])}

    assert len(workers(lambda t: t.startswith("test_shared"))) == 1, "test_shared's tests ran on two workers"
    for param in ("a", "b"):
        assert len(workers(lambda t: t.endswith(f"[{param}]"))) == 1, f"family {param}'s tests ran on two workers"
    assert workers(lambda t: t.startswith("test_spread")) == {"gw0", "gw1"}, "ungrouped tests must spread"

    slow = next(r for r in tests if r["test"] == "test_slow")
    first_on_its_worker = min((r for r in tests if r["worker"] == slow["worker"]), key=lambda r: r["start"])
    assert first_on_its_worker is slow, f"the slow group must start first, not {first_on_its_worker['test']}"

    alone = next(r for r in tests if r["test"] == "test_alone")
    overlapping = [r["test"] for r in tests
                   if r is not alone and r["start"] < alone["end"] and r["end"] > alone["start"]]
    assert not overlapping, f"tests ran beside the alone test: {overlapping}"
