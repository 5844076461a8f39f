"""EXECUTOR_BATCH_INVARIANT=on: a token's numerics do not depend on the rows
that share its matrix multiplies.

A BLAS GEMM picks its kernel, and with it the order in which each output
row's dot products are summed, from the shape of the whole call. On the
development machine's CPU (MKL, AVX-512) an fp32 GEMM gives a row one
result when it is alone, another in a batch of 2 or 3 and a third in a
batch of 4 or more; with several threads, a thread's share of fewer than 4
rows takes the small kernel again. With every GEMM's row count a multiple
of ROW_UNIT (rows of zeros added, their outputs dropped), every row takes
the wide kernel, which sums each row in the same order whatever its
neighbours: measured by hand on 1 to 8 threads, batches of 1 to 700 rows,
weights from [192, 64] to [32000, 512] and [512, 4096]; the unit test
checks one shape (tests/unit/test_batch_invariant.py) and the start-up
self-test the model's own.

Modules whose forward maps rows to rows through a GEMM (every linear layer,
the lm_head, the MoE router) get a forward that pads the input's rows and
trims the output's; the few GEMMs inside other modules (the MoE
experts' per-expert matmuls, MLA's absorbed projections) pad through
pad_rows themselves, keyed by the row_unit attribute set here.

That this holds on the host, with the model's own shapes, is checked at
start-up (self_test): a BLAS or a CPU that behaves otherwise refuses
start-up rather than serving results that depend on the batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

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


def _padded(forward, unit: int):
    """forward with its first argument's rows padded to a multiple of unit
    and its output (a tensor or a tuple of them) trimmed back. Set as the
    module's own forward: a hook pair would cost every call torch's slow
    path, about as much again as a small model's GEMM."""

    def run(x: torch.Tensor, *args, **kwargs):
        m = x.shape[0]
        if m and m % unit == 0:
            return forward(x, *args, **kwargs)
        out = forward(pad_rows(x, unit), *args, **kwargs)
        return tuple(t[:m] for t in out) if isinstance(out, tuple) else out[:m]

    return run


def _row_gemm_modules(model: nn.Module) -> list[nn.Module]:
    """Modules whose forward takes [rows, features] as its first argument and
    returns rows (or a tuple of them) through a GEMM: linear layers of any
    kind (layers._Linear, nn.Linear and its VocabHead) and MoE routers."""
    from executor_svc.model.layers import _Linear
    from executor_svc.model.moe import Router

    return [m for m in model.modules() if isinstance(m, (_Linear, nn.Linear, Router))]


def _plain_linear(module: nn.Module) -> bool:
    """A linear layer whose forward is F.linear(x, weight, bias) on an unquantized weight."""
    from executor_svc.model.layers import _Linear

    return isinstance(module, nn.Linear) or (isinstance(module, _Linear) and module.scheme is None)


def _triton_forward(module: nn.Module):
    from kernels.invariant_linear import invariant_linear

    return lambda x: invariant_linear(x, module.weight, module.bias)


def make_batch_invariant(model: nn.Module, unit: int = ROW_UNIT, triton_gemm: bool | None = None) -> int:
    """Makes every GEMM of model sum each row in one order whatever the
    batch; returns how many modules were changed. Idempotent.

    On the CPU every GEMM's rows are padded to a multiple of unit. On CUDA
    (triton_gemm; None: whether the model's weights are on CUDA) padding
    does not do it, since cuBLAS picks its algorithm and split-K from the
    whole shape: unquantized linear layers run kernels/invariant_linear.py,
    whose tiles never depend on the rows; the others (quantized layers'
    kernels, the router, MLA's batched products) keep the padding and are
    left to the start-up self-test.
    """
    from executor_svc.model.moe import Router

    if triton_gemm is None:
        triton_gemm = any(p.is_cuda for p in model.parameters())
    padded = 0
    for module in _row_gemm_modules(model):
        if getattr(module, "row_unit", 1) == unit:
            continue
        module.row_unit = unit
        if triton_gemm and _plain_linear(module):
            module.forward = _triton_forward(module)
        else:
            module.forward = _padded(module.forward, ROUTER_ROW_UNIT if isinstance(module, Router) else unit)
        padded += 1
    # The GEMMs that are not a module's whole forward read row_unit
    # themselves; so do the elementwise ops that must be tail_free (the
    # shared expert's gate, a final softcap).
    from executor_svc.model.mla import MLAttention
    from executor_svc.model.model import CausalLM
    from executor_svc.model.moe import FusedExperts, SparseMoE

    for module in model.modules():
        if isinstance(module, (FusedExperts, MLAttention, SparseMoE, CausalLM)):
            module.row_unit = unit
    return padded


def linear_rows_invariant(weight: torch.Tensor, rows: int = 64, unit: int = ROW_UNIT) -> str | None:
    """None if every row of x @ weight^T, computed with row padding to unit,
    is bitwise the same in batches of 1 to `rows` rows at any position; else
    what differed. weight: [out, in], the model's own shape and dtype."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
    alone = torch.cat([F.linear(pad_rows(x[i:i + 1], unit), weight)[:1] for i in range(rows)])
    for m in range(2, rows + 1):
        y = F.linear(pad_rows(x[:m], unit), weight)[:m]
        differs = (y != alone[:m]).any(dim=-1)
        if differs.any():
            row = int(differs.nonzero()[0])
            return f"row {row} of a {m}-row batch differs from the same row alone ({tuple(weight.shape)} weight)"
    return None
