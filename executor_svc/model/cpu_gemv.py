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
rows or more, torch's float32 GEMM is as fast or faster (it reads W once
for all of them), so only one-row products take this path.

Not so in bfloat16 on a CPU without native bf16 instructions (AVX2, no
AVX512-BF16 or AMX: oneDNN refuses bf16 there): torch's bf16 GEMM costs a
one-row product's time once per row (4,096 x 1,024: 0.42 ms for one row,
6.5 ms for 16). There steps of 2 to ROWS_MAX rows take gemm_rows: a
register-tiled C kernel (cpu_bf16_gemm.py: 1.65 ms for 16 rows, 2.55 for
32 on the same weight) where it can be built, else passes of 8 rows over
W, each one loop inductor fuses from eight reductions of the same W, so
that each stretch of W is converted once and multiplied into eight float32
accumulators (the rows come in float32, converted once per step): 0.77 ms
for 8 rows, 2.0-2.3 for 16, 3.1-4.4 for 32, against torch's 3.3, 6.6 and
14.1. Past ROWS_MAX rows (large
batches, prefill chunks) converting W to float32 for MKL's GEMM is faster
still (5.3 against 5.6 ms at 64 rows, 8.1 against 12.0 at 128; torch's
bf16 GEMM 27 and 55): gemm_f32 does so a block of W's rows at a time, so
that no more than F32_BLOCK_ELEMENTS of it is ever held in float32.

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
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from executor_svc.direct_call import DirectCall
from executor_svc.model import cpu_bf16_gemm, cpu_prepack

log = logging.getLogger(__name__)

GEMV_MIN_ELEMENTS = 1 << 20
GEMV_MIN_COLUMNS = 512
DTYPES = (torch.bfloat16, torch.float32)

# One compiled GEMV per dtype, each called without dynamo (direct_call.py)
# once its first call has bound it, for contiguous operands of its dtype.
_compiled: dict[torch.dtype, tuple[Callable, DirectCall]] = {}
# Steps of 2 to ROWS_MAX rows in bfloat16 where the CPU has no native bf16
# GEMM (gemm_rows): one compiled pass per (dtype, rows of a pass).
ROWS_PER_PASS = (4, 8)
ROWS_MAX = 64
# Past ROWS_MAX rows (gemm_f32), the most of W converted to float32 at once: 16 MiB.
F32_BLOCK_ELEMENTS = 1 << 22
_compiled_rows: dict[tuple[torch.dtype, int], tuple[Callable, DirectCall]] = {}


def _gemv_body(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [1, K] float32, weight: [N, K] -> [1, N] float32. The row comes in
    # float32 and the sums leave in float32 (gemv converts both): converted
    # inside, the row was converted again for every weight row, and the
    # output took a second parallel loop. The 113 GEMVs of a Qwen3-0.6B
    # shape in bf16, two threads: 45.9 against 56.9 ms (26 against 21 GB/s).
    return (x[:, None, :] * weight[None].float()).sum(-1)


def _call(cache: dict, key, name: str, body: Callable, x: torch.Tensor, weight: torch.Tensor,
          plain: bool) -> torch.Tensor:
    """body(x, weight), compiled once per key with dynamic shapes and, once
    its first plain call (operands of the bound dtypes, contiguous) has
    bound it, called without dynamo for plain operands."""
    if isinstance(weight, nn.Parameter):
        # Dynamo gives a parameter static sizes (its config's
        # force_parameter_static_shapes): a graph first traced with a layer's
        # weight would serve that layer's shape only, and every other layer
        # would fail its size check. A detached view is a plain tensor.
        weight = weight.detach()
    entry = cache.get(key)
    if entry is not None and entry[1].bound and plain:
        return entry[1].call((x, weight))[0]
    if entry is None:
        direct = DirectCall(name)
        entry = cache[key] = (torch.compile(body, dynamic=True, backend=direct.backend), direct)
        out = entry[0](x, weight)
        if plain:
            direct.bind((x, weight), out)
        return out
    return entry[0](x, weight)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] times weight [N, K] transposed: F.linear(x, weight) for one
    row; in bf16 the C GEMV where the tiled kernel's library is built and
    fits the weight (113 Qwen3-0.6B-shape GEMVs: 50.4 against 55.0 ms)."""
    if cpu_bf16_gemm.available() and cpu_bf16_gemm.fits(weight):
        return cpu_bf16_gemm.matmul(x.float(), weight).to(x.dtype)
    x32 = x.float().contiguous()
    plain = weight.is_contiguous()
    return _call(_compiled, weight.dtype, f"CPU GEMV ({weight.dtype})", _gemv_body, x32, weight, plain).to(x.dtype)


def _rows_body(rows: int) -> Callable:
    def body(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # x: [rows, K] float32, weight: [N, K] -> [rows, N] float32. One
        # reduction over K of the same weight per row: inductor fuses them
        # into one loop that converts each stretch of the weight once and
        # keeps a float32 accumulator per row (x comes in float32: converted
        # inside the loop, it would be converted again for every weight row).
        w = weight.float()
        return torch.stack([(x[i] * w).sum(-1) for i in range(rows)])
    return body


def gemm_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for x [M, K] of 2 to ROWS_MAX rows: the tiled C
    kernel (cpu_bf16_gemm.py) where it is built and fits the weight, else
    gemm_passes."""
    if cpu_bf16_gemm.available() and cpu_bf16_gemm.fits(weight):
        return cpu_bf16_gemm.matmul(x.float(), weight).to(x.dtype)
    return gemm_passes(x, weight)


def gemm_passes(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for x [M, K] of 2 to ROWS_MAX rows: passes of 8
    rows over the weight (4 for a last pass of 4 or fewer), a short one
    padded with zero rows whose outputs are dropped. Each pass is one
    compiled _rows_body per (dtype, rows); its rows are contiguous float32."""
    m = x.shape[0]
    plain = weight.is_contiguous()
    x32 = x.float().contiguous()
    outs = []
    for start in range(0, m, ROWS_PER_PASS[-1]):
        chunk = x32[start:start + ROWS_PER_PASS[-1]]
        rows = next(r for r in ROWS_PER_PASS if r >= len(chunk))
        if len(chunk) < rows:
            chunk = torch.cat([chunk, chunk.new_zeros(rows - len(chunk), chunk.shape[1])])
        outs.append(_call(_compiled_rows, (weight.dtype, rows), f"CPU {rows}-row GEMM ({weight.dtype})",
                          _rows_body(rows), chunk, weight, plain))
    return torch.cat(outs)[:m].to(x.dtype)


def gemm_f32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) through float32: each block of W's rows is
    converted and multiplied by MKL's GEMM in turn."""
    x32 = x.float()
    block = max(1, F32_BLOCK_ELEMENTS // weight.shape[1])
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    for first in range(0, weight.shape[0], block):
        out[:, first:first + block] = torch.nn.functional.linear(x32, weight[first:first + block].float())
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for a layer use_cpu_gemv marked, x [M, K] with M
    up to the layer's cpu_gemv_rows: one row through the GEMV, up to
    ROWS_MAX through passes, more through float32 blocks."""
    if x.shape[0] == 1:
        return gemv(x, weight)
    if x.shape[0] > ROWS_MAX:
        return gemm_f32(x, weight)
    return gemm_rows(x, weight)


@torch.library.custom_op("llmsched::cpu_gemv_linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> torch.Tensor:
    """What a marked layer runs inside a compiled graph (the compiled CPU
    decode step): linear() for up to max_rows rows (the layer's
    cpu_gemv_rows), else F.linear. An operator dynamo does not look into:
    traced, the compiled GEMV would be inlined as a reduction specialised to
    the warm-up's row count, and the row count's dispatch lost; as an
    operator the graph calls it with the step's rows, as eager steps do."""
    if x.shape[0] <= max_rows:
        return linear(x, weight)
    return torch.nn.functional.linear(x, weight)


@linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def marked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> torch.Tensor:
    """F.linear(x, weight, bias) for a 2-D x through a layer use_cpu_gemv
    marked, whose cpu_gemv_rows is max_rows: linear() up to max_rows rows,
    else torch's own; inside a compiled graph, linear_op, which makes that
    choice when the graph runs."""
    if torch.compiler.is_compiling():
        y = torch.ops.llmsched.cpu_gemv_linear(x, weight, max_rows)
    elif x.shape[0] <= max_rows:
        y = linear(x, weight)
    else:
        return torch.nn.functional.linear(x, weight, bias)
    return y if bias is None else y + bias


def native_bf16_gemm() -> bool:
    """Whether torch's bfloat16 GEMM runs on native bf16 instructions here
    (oneDNN's test: AVX512-BF16 or AVX-NE-CONVERT and the like, AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


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


def use_cpu_gemv(model: nn.Module, setting: str = "auto", batch_invariant: bool = False,
                 prepack: str = "auto") -> int:
    """EXECUTOR_CPU_GEMV: marks every linear whose weight fits (its one-row
    products then take gemv), compiling the GEMV once now so that the first
    request does not wait for it; packs bf16 weights for the CPU's bf16
    kernel first (prepack: EXECUTOR_CPU_BF16_PREPACK); logs what it did.
    Returns the layers marked or packed (those packed only, if compiling
    fails: the others keep the GEMM)."""
    layers = [m for m in model.modules() if hasattr(m, "use_cpu_gemv") and getattr(m, "weight", None) is not None
              and isinstance(m.weight, torch.Tensor) and fits(m.weight)]
    if not layers:
        return 0
    if setting == "off" or batch_invariant:
        log.info("CPU GEMV: off (%s); %d linears keep the GEMM for one-row steps",
                 "EXECUTOR_CPU_GEMV=off" if setting == "off" else "batch-invariant mode", len(layers))
        return 0
    bf16 = [layer for layer in layers if layer.weight.dtype == torch.bfloat16]
    # EXECUTOR_CPU_BF16_PREPACK: those weights packed for the CPU's bf16 kernel.
    packed = prepack_bf16(model, bf16, prepack) if bf16 else []
    if packed:  # their products dispatch on prepack_handle, not use_cpu_gemv
        layers = [layer for layer in layers if layer.prepack_handle is None]
        bf16 = [layer for layer in bf16 if layer.prepack_handle is None]
        if not layers:
            return len(packed)
    if not has_cxx_compiler():
        log.info("CPU GEMV: off (no C++ compiler for inductor); %d linears keep the GEMM", len(layers))
        return len(packed)
    # Without native bf16, the C kernels (cpu_bf16_gemm) take every bf16
    # weight they fit, one row or several: inductor's GEMV is compiled (a
    # few seconds) only where a weight is left for it.
    no_native_bf16 = bool(bf16) and not native_bf16_gemm()
    c_kernels = no_native_bf16 and cpu_bf16_gemm.load()
    on_inductor = [layer for layer in layers if not (c_kernels and cpu_bf16_gemm.fits(layer.weight))]
    started = time.perf_counter()
    if on_inductor:
        try:
            weight = on_inductor[0].weight
            # Random, not zeros: the first call's output is what the direct call
            # is checked against (direct_call.py).
            x = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            with torch.inference_mode():
                gemv(x, weight)
        except Exception:  # a broken toolchain: serve on the GEMM rather than not at all
            log.exception("CPU GEMV: compiling failed; one-row steps keep the GEMM")
            return len(packed)
    for layer in layers:
        layer.use_cpu_gemv = True
    log.info("CPU GEMV: %d linears take a GEMV for one-row steps: %d inductor's (compiled in %.1f s), %d the C "
             "one (cpu_bf16_gemm.py)", len(layers), len(on_inductor), time.perf_counter() - started,
             len(layers) - len(on_inductor))
    if no_native_bf16:
        started = time.perf_counter()
        kernel = c_kernels and all(cpu_bf16_gemm.fits(layer.weight) for layer in bf16)
        if not kernel:  # the passes serve where the kernel was not built, or does not fit a weight
            try:
                weight = bf16[0].weight
                with torch.inference_mode():
                    for rows in ROWS_PER_PASS:
                        gemm_passes(torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(
                            rows)).to(weight.dtype), weight)
            except Exception:
                log.exception("CPU GEMV: compiling the several-row passes failed; steps of several rows keep the "
                              "GEMM")
                return len(layers) + len(packed)
        for layer in bf16:
            layer.cpu_gemv_rows = sys.maxsize
        how = ("a tiled bf16 GEMM kernel (cpu_bf16_gemm.py)" if kernel else
               f"{' and '.join(map(str, ROWS_PER_PASS))}-row passes")
        log.info("CPU GEMV: no native bfloat16 GEMM on this CPU, so steps of 2 to %d rows take %s over each of "
                 "those %d linears, and larger ones float32 blocks of them (built in %.1f s)", ROWS_MAX, how,
                 len(bf16), time.perf_counter() - started)
    return len(layers) + len(packed)


def prepack_bf16(model: nn.Module, bf16: list[nn.Module], setting: str) -> list[nn.Module]:
    """Each bf16 weight packed once for the kind the setting chooses on this
    CPU (cpu_prepack.py), except in latent-attention models (mla.py reads
    kv_b_proj's weight as it is stored) and a weight another module shares:
    a head tied to the embedding is packed for cpu_bf16_vnni's kernels
    only, whose layout the embedding then reads its rows from
    (VocabEmbedding.packed_rows; oneDNN's is opaque). Returns the layers
    packed, logged."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.mla is not None:
        return []
    kind = cpu_prepack.choose(setting, native_bf16_gemm())
    if kind is None:
        return []
    shared = cpu_prepack.shared_weights(model)
    started = time.perf_counter()
    packed, tied = [], []
    for layer in bf16:
        if id(layer.weight) not in shared:
            if cpu_prepack.prepack(layer, kind):
                packed.append(layer)
            continue
        embedding = tied_embedding(model, layer)
        if kind in cpu_prepack.PAIR_KINDS and embedding is not None and cpu_prepack.prepack(layer, kind):
            embedding.weight, embedding.packed_rows = layer.weight, True
            packed.append(layer)
            tied.append(layer)
    how = f"the {kind} kernel's layout (cpu_bf16_vnni.py)" if kind in cpu_prepack.PAIR_KINDS else "oneDNN's layout"
    left = [layer for layer in bf16 if id(layer.weight) in shared and layer not in tied]
    log.info("CPU GEMV: %d of %d bf16 linears packed once into %s (%.1f s), "
             "every product of theirs on it%s%s", len(packed), len(bf16), how, time.perf_counter() - started,
             "; the head tied to the embedding too, whose lookups read its rows there" if tied else "",
             "; a weight shared with another module keeps the GEMV and torch's GEMM" if left else "")
    return packed


def tied_embedding(model: nn.Module, head: nn.Module) -> nn.Module | None:
    """The embedding whose weight is the head's, where those two modules
    alone hold it: None otherwise. An embedding is a module with
    packed_rows (layers.VocabEmbedding; named by that attribute, since
    layers.py imports this module)."""
    holders = [m for m in model.modules() if m._parameters.get("weight") is head.weight]
    embeddings = [m for m in holders if hasattr(m, "packed_rows")]
    if len(holders) == 2 and head in holders and len(embeddings) == 1 and embeddings[0] is not head:
        return embeddings[0]
    return None
