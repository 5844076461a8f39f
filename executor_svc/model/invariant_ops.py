"""The primitives batch-invariant mode puts inside layers (model.py,
moe.py, mla.py, the torch attention backend): row padding, tail-free
elementwise calls, fixed-size calls. A leaf module, importing only torch,
so the layers can use them without importing batch_invariant.py, which
walks the model's layers (and so imports them).
"""

from __future__ import annotations

import math

import torch

# Rows per GEMM are padded to a multiple of this. 4 is the smallest row
# count of MKL's wide fp32 kernel on the development machine; a multiple of
# it also keeps every thread's share of rows wide (shares are cut in units
# of the kernel's rows).
ROW_UNIT = 4


def pad_rows(x: torch.Tensor, unit: int) -> torch.Tensor:
    """x ([m, ...]) with zero rows appended up to a multiple of unit (x itself when it is one)."""
    m = x.shape[0]
    if unit == 1:
        return x
    padded = max(unit, -(-m // unit) * unit)
    if padded == m:
        return x
    return torch.cat([x, x.new_zeros(padded - m, *x.shape[1:])])


# ATen runs an elementwise op over a contiguous tensor as one flat loop of
# vectors (32 fp32 values a step on AVX-512) whose last, partial step takes
# a scalar path that rounds transcendental functions (exp, sigmoid, tanh)
# differently: an element's result then depends on where the tensor ends,
# hence on the batch. A row count that makes the element count a multiple
# of this leaves no partial step.
VECTOR_ELEMENTS = 64
# The MoE router's rows are padded to a multiple of this: its scores
# ([rows, experts], a sigmoid for DeepSeek) are then whole vectors too.
ROUTER_ROW_UNIT = 32


def tail_free(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn over x ([rows, ...], contiguous), computed
    on x padded with zero rows up to a whole number of VECTOR_ELEMENTS, so
    no element of x falls in the loop's partial last step. For tensors
    small enough for one thread (the loop is split over threads from 32768
    elements; see rows_in_fixed_calls for larger ones)."""
    per_row = max(1, x[0].numel()) if x.shape[0] else 1
    unit = VECTOR_ELEMENTS // math.gcd(VECTOR_ELEMENTS, per_row)
    return fn(pad_rows(x, unit))[: x.shape[0]]


def rows_in_fixed_calls(fn, x: torch.Tensor, rows: int) -> torch.Tensor:
    """fn(x) for an elementwise fn, over x's rows in calls of exactly `rows`
    rows (the last padded with zero rows): every call has one size, so the
    loop's vectors and its split over threads put each row's elements in
    the same places whatever the batch."""
    n = x.shape[0]
    return torch.cat([fn(pad_rows(x[a : a + rows], rows)) for a in range(0, n, rows)])[:n] if n else fn(x)
