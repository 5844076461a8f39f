"""Suite-wide pytest set-up: the gpu marker skips without CUDA, and the
Triton interpreter is used on machines without a GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
STORIES = REPO_ROOT.parent / "shared" / "models" / "stories260K"


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
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def stories_path() -> Path:
    if not (STORIES / "model.safetensors").exists():
        pytest.fail(f"stories260K checkpoint missing at {STORIES}: it is read in place from ../shared")
    return STORIES
