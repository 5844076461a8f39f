"""Suite-wide pytest set-up: the gpu marker skips without CUDA, the Triton
interpreter is used on machines without a GPU, compiler caches live in the
test session's temp directory, and under pytest-xdist tests are grouped,
ordered and kept apart as tests/xdist_scheduling.py describes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmsched import cpus
from llmsched.assets import STORIES260K
from tests.xdist_scheduling import (  # noqa: F401 (pytest hooks, registered by name)
    pytest_runtest_protocol,
    pytest_xdist_make_scheduler,
    schedule_for_xdist,
    session_root,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
STORIES = STORIES260K

# Before torch loads below: the test processes' OpenMP threads (the HF
# oracles', and those of the services they start, which inherit it) sleep
# as soon as they are idle. The suite runs many processes on few cores,
# where threads spinning for libgomp's default few milliseconds would take
# cores the others need.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The suite runs many stacks at once on few cores, where pinning every
# executor to all cores but one would leave that one to the schedulers
# alone; tests/unit/test_cpus.py starts a stack with pinning on.
os.environ.setdefault(cpus.PIN_SETTING, "off")
# EXECUTOR_TORCH_COMPILE=auto compiles every dense model's decode step at
# start-up, seconds per stack even from a warm cache, over the suite's
# hundred-odd stacks; the compiled step is tested on its own
# (tests/unit/test_compiled_decode.py, test_oracle's compiled stack).
os.environ.setdefault("EXECUTOR_TORCH_COMPILE", "off")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


HAS_CUDA = _has_cuda()
if not HAS_CUDA:
    # Must be set before triton is imported anywhere in the run.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if not HAS_CUDA:
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        schedule_for_xdist(config, items)


@pytest.fixture(scope="session")
def stories_path() -> Path:
    if not (STORIES / "model.safetensors").exists():
        pytest.fail(f"stories260K checkpoint missing at {STORIES}: the repository carries it in assets/")
    return STORIES


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Inductor's and Triton's on-disk caches go under the session's temp
    root, shared by every xdist worker and inherited by the services the
    tests start: a graph compiled once (EXECUTOR_TORCH_COMPILE) is loaded
    from the cache by the next test that compiles it, while each session,
    like a clean clone in CI, starts cold."""
    root = session_root(session.config)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor-cache")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton-cache")
    _share_cores_between_workers()


def _share_cores_between_workers() -> None:
    """Under xdist, each worker's torch gets its share of the cores, as the
    executor gives each tensor-parallel rank (loading._set_threads): N
    workers each running torch's default of one thread per core
    oversubscribe the machine, and torch's thread pool then spends whole
    milliseconds per tiny op waiting for threads that are not scheduled
    (a 2-layer MoE test model ran 10-100x slower on 2 cores with 2 workers)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


