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


@pytest.fixture
def row_invariant_dot(monkeypatch):
    """For tests that compare a token's bits alone and among others: under the
    interpreter, tl.dot becomes a sum over k in one order for every output
    element, as a GPU's MMA computes a row the same wherever it sits in a tile.
    The interpreter's own dot is numpy's matmul, whose OpenBLAS kernels sum a
    row in an order that depends on its position in their register tile on
    some CPUs (AMD EPYC, OpenBLAS 0.3.31's Haswell kernels: rows 6-15 of a
    16-row tile differ from row 0 in the last bits), which would fail such a
    test for a reason that is not the kernel's. Nothing on a GPU."""
    if _HAS_CUDA:
        return
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = np.einsum("...mk,...kn->...mn", a.data.astype(d.data.dtype), b.data.astype(d.data.dtype))
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
