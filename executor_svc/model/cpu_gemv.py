"""One-row linears on the CPU through an inductor-generated GEMV
(EXECUTOR_CPU_GEMV).

A single stream's decode step multiplies one row by every weight: a
matrix-vector product, bound by how fast the weights stream from memory.
torch's own GEMM (oneDNN/MKL) reads them at about 17-19 GB/s on this
project's 2-core AMD EPYC development machine in bf16 and float32, where
llama.cpp's dot products read about 27 GB/s on the same cores. The same
product written as a reduction, `(x * W).sum(-1)` in float32, and compiled
by inductor into a vectorised C++ loop over W's rows, reads 26-30 GB/s
(28 rotating [6144, 1024] bf16 weights: 0.41 against 0.68 ms; the
151,936 x 1,024 head of a Qwen3-0.6B shape: 9.4 against 15.9 ms). With two
rows or more, the GEMM is as fast or faster (it reads W once for all of
them), so only one-row products take this path.

Where: CPU layers without quantization whose weight holds at least
GEMV_MIN_ELEMENTS values over at least GEMV_MIN_COLUMNS columns, in
bfloat16 or float32 (smaller weights sit in cache, where the call's
overhead, about 20 us through dynamo, outweighs the gain; the GEMV is
called without dynamo once compiled, direct_call.py). One compile
with dynamic shapes serves every layer (about 2 s at start-up, then
inductor's on-disk cache). Not in batch-invariant mode (a row's result
would depend on whether it shares the step). The product accumulates in
float32 as the GEMM does, in another order: outputs differ from it by the
dtype's rounding.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable

import torch
from torch import nn

from executor_svc.direct_call import DirectCall

log = logging.getLogger(__name__)

GEMV_MIN_ELEMENTS = 1 << 20
GEMV_MIN_COLUMNS = 512
DTYPES = (torch.bfloat16, torch.float32)

# One compiled GEMV per dtype, each called without dynamo (direct_call.py)
# once its first call has bound it, for contiguous operands of its dtype.
_compiled: dict[torch.dtype, tuple[Callable, DirectCall]] = {}


def _gemv_body(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [1, K], weight: [N, K] -> [1, N], accumulated in float32.
    return (x[:, None, :].float() * weight[None].float()).sum(-1).to(x.dtype)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] times weight [N, K] transposed: F.linear(x, weight) for one row."""
    if isinstance(weight, nn.Parameter):
        # Dynamo gives a parameter static sizes (its config's
        # force_parameter_static_shapes): a GEMV first traced with a layer's
        # weight would serve that layer's shape only, and every other layer
        # would fail its size check. A detached view is a plain tensor.
        weight = weight.detach()
    entry = _compiled.get(weight.dtype)
    plain = x.dtype == weight.dtype and x.is_contiguous() and weight.is_contiguous()
    if entry is not None and entry[1].bound and plain:
        return entry[1].call((x, weight))[0]
    if entry is None:
        direct = DirectCall(f"CPU GEMV ({weight.dtype})")
        entry = _compiled[weight.dtype] = (torch.compile(_gemv_body, dynamic=True, backend=direct.backend), direct)
        out = entry[0](x, weight)
        if plain:
            direct.bind((x, weight), out)
        return out
    return entry[0](x, weight)


def calls_direct(dtype: torch.dtype) -> bool:
    """Whether the GEMV of this dtype is compiled and called without dynamo."""
    entry = _compiled.get(dtype)
    return entry is not None and entry[1].bound


def has_cxx_compiler() -> bool:
    """Whether inductor can build its C++ kernels here (CXX, c++ or g++)."""
    return bool(os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"))


def fits(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2
            and weight.shape[1] >= GEMV_MIN_COLUMNS and weight.numel() >= GEMV_MIN_ELEMENTS)


def use_cpu_gemv(model: nn.Module, setting: str = "auto", batch_invariant: bool = False) -> int:
    """EXECUTOR_CPU_GEMV: marks every linear whose weight fits (its one-row
    products then take gemv), compiling the GEMV once now so that the first
    request does not wait for it; logs what it did. Returns the layers
    marked (0 if compiling fails: they keep the GEMM)."""
    layers = [m for m in model.modules() if hasattr(m, "use_cpu_gemv") and getattr(m, "weight", None) is not None
              and isinstance(m.weight, torch.Tensor) and fits(m.weight)]
    if not layers:
        return 0
    if setting == "off" or batch_invariant:
        log.info("CPU GEMV: off (%s); %d linears keep the GEMM for one-row steps",
                 "EXECUTOR_CPU_GEMV=off" if setting == "off" else "batch-invariant mode", len(layers))
        return 0
    if not has_cxx_compiler():
        log.info("CPU GEMV: off (no C++ compiler for inductor); %d linears keep the GEMM", len(layers))
        return 0
    started = time.perf_counter()
    try:
        weight = layers[0].weight
        # Random, not zeros: the first call's output is what the direct call
        # is checked against (direct_call.py).
        x = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        with torch.inference_mode():
            gemv(x, weight)
    except Exception:  # a broken toolchain: serve on the GEMM rather than not at all
        log.exception("CPU GEMV: compiling failed; one-row steps keep the GEMM")
        return 0
    for layer in layers:
        layer.use_cpu_gemv = True
    log.info("CPU GEMV: %d linears take an inductor GEMV for one-row steps (compiled in %.1f s)", len(layers),
             time.perf_counter() - started)
    return len(layers)
