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

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.model.invariant_ops import ROUTER_ROW_UNIT, ROW_UNIT, pad_rows


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
    from llmsched_kernels.invariant_linear import invariant_linear

    return lambda x: invariant_linear(x, module.weight, module.bias)


def make_batch_invariant(model: nn.Module, unit: int = ROW_UNIT, triton_gemm: bool | None = None) -> int:
    """Makes every GEMM of model sum each row in one order whatever the
    batch; returns how many modules were changed. Idempotent.

    On the CPU every GEMM's rows are padded to a multiple of unit. On CUDA
    (triton_gemm; None: whether the model's weights are on CUDA) padding
    does not do it, since cuBLAS picks its algorithm and split-K from the
    whole shape: unquantized linear layers run llmsched_kernels/invariant_linear.py,
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
