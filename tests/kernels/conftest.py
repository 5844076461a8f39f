"""Pytest setup for the kernel tests.

Without CUDA the Triton kernels run under Triton's CPU interpreter. TRITON_INTERPRET is
read when ``triton`` is first imported, so it is set here, before any test module (or
``llmsched_kernels.*``) imports triton.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The repository root (for ``import kernels``) and this folder (for the shared test
# helpers in kernel_cases.py), whatever pytest's import mode.
_HERE = Path(__file__).resolve().parent
for _path in (str(_HERE.parents[1]), str(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> torch.device:
    """Where the kernels run: the GPU when there is one, else CPU (Triton interpreter)."""
    return torch.device("cuda") if _HAS_CUDA else torch.device("cpu")
