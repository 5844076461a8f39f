"""Integer-quantized linears on the CPU through torch's own weight-only
kernels, so an int8 or int4 checkpoint decodes faster than its bf16
original instead of several times slower.

Without them a quantized layer dequantizes its whole weight for every
matmul (layers.py), and that pass costs several times the matrix-vector
product it feeds (docs/performance.md P20). torch ships two CPU kernels
that read the quantized bytes directly, vectorised for bfloat16
activations (torchao and gpt-fast run on them):

  _weight_int8pack_mm           int8 [N, K] with one scale per row
  _weight_int4pack_mm_for_cpu   int4 in torch's packed layout, with a
                                scale and an offset per group of 32, 64,
                                128 or 256 columns

Measured on this project's 2-core AMD EPYC development machine (bf16, a
[6144, 1024] layer, 28 of them so the weights come from memory): one row
takes 0.43 ms in int8 and 0.18 ms in int4 against 0.74 ms in bf16 and
6.5 ms dequantizing int4 first. The kernels work a few rows at a time,
so past CPU_INT8_KERNEL_MAX_ROWS rows an int8 layer dequantizes (one
multiply: 0.9 ms) and runs the bf16 GEMM, which is faster there. int4
always runs its kernel: torch's packed layout replaces the checkpoint's
(one copy is held) and depends on the CPU's vector width, so no layout of
ours is left to dequantize from. Up to about 128 rows the kernel is as
fast as dequantizing and the GEMM or faster; at 512 rows (a long prefill
chunk) it takes 37 ms against 5.8 + 15.6 ms.

Only bfloat16 activations: both kernels fall back to scalar loops for
float32 and float16 (6 and 10 ms a row here), slower than dequantizing.
A layer that does not fit a kernel keeps the dequantizing path: act-order
(g_idx), 8-bit groups narrower than the row, values q - zero outside int8
(asymmetric int8), int4 groups the kernel does not take, or an int4 layer
whose output rows are not a multiple of 16.

Numerics. The kernels multiply the integer weight by its scale in
float32 inside the dot product, where transformers rounds each
dequantized weight to bf16 first; the scales are held in bf16 (the
kernels take them in the activations' dtype), and int4's zero point
enters as an offset (8 - zero) * scale, also in bf16. Both differ from the dequantized GEMM by
bf16 rounding, as any two bf16 GEMMs of different blocking do; greedy
tokens can part on near-ties. Batch-invariant mode does not use them
(the path depends on the row count).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.model.quant_formats import groups_in_order
from llmsched_kernels.reference import unpack_int

log = logging.getLogger(__name__)

INT4_GROUPS = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu takes, largest first
INT4_ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu's rule on N
# Rows up to which the int8 kernel beats dequantize + GEMM (16 rows: 1.33
# against 1.6 ms; 32 rows: 2.7 against 2.1 ms, on the layer above).
CPU_INT8_KERNEL_MAX_ROWS = 16
PACK_ROWS = 256  # rows converted at a time: a multiple of every row block torch packs (32, 64)


@dataclass(slots=True)
class Int8Rows:
    """W = weight * scales[:, None]: int8 [N, K], bf16 [N]."""

    weight: torch.Tensor
    scales: torch.Tensor

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # the kernels take [M, K]
        # In a compiled graph the operator chooses by row count when the graph runs.
        step = torch.ops.llmsched.cpu_int8_linear if torch.compiler.is_compiling() else int8_rows_linear
        return step(rows, self.weight, self.scales).view(*x.shape[:-1], -1)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return _dequantize_int8_rows(self.weight, self.scales, dtype)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.weight, self.scales


def _dequantize_int8_rows(weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight.to(scales.dtype) * scales[:, None]).to(dtype)


def int8_rows_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] times Int8Rows' weight: the kernel up to
    CPU_INT8_KERNEL_MAX_ROWS rows, else dequantize and bf16 GEMM."""
    if x.shape[0] > CPU_INT8_KERNEL_MAX_ROWS:
        return F.linear(x, _dequantize_int8_rows(weight, scales, x.dtype))
    return torch._weight_int8pack_mm(x, weight, scales)


@torch.library.custom_op("llmsched::cpu_int8_linear", mutates_args=())
def int8_linear_op(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8_rows_linear as an operator of a compiled decode graph, choosing
    by row count when the graph runs, as eager steps choose. Traced instead,
    past CPU_INT8_KERNEL_MAX_ROWS the dequantize and the GEMM compiled into
    a product slower than eager's oneDNN one: W8A16 decoded 64 streams 12%
    slower compiled than eager (P20)."""
    return int8_rows_linear(x, weight, scales)


@int8_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@dataclass(slots=True)
class Int4Groups:
    """W[n, k] = (q[n, k] - 8) * scale + offset, per group of `group`
    columns: q in torch's packed int4 layout, scale_offsets [K / group, N,
    2] in bf16."""

    packed: torch.Tensor
    group: int
    scale_offsets: torch.Tensor
    in_cols: int

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # the kernel takes [M, K]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scale_offsets)
        return y.view(*x.shape[:-1], -1)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """W itself, read back through the kernel (x = I): as costly as a
        GEMM of in_cols rows, for the rare caller that needs the matrix."""
        eye = torch.eye(self.in_cols, dtype=self.scale_offsets.dtype, device=self.packed.device)
        return self.linear(eye).t().contiguous().to(dtype)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.packed, self.scale_offsets


CpuIntWeights = Int8Rows | Int4Groups


def why_not(layer: nn.Module, dtype: torch.dtype) -> str | None:
    """Why this quantized linear cannot run a CPU kernel, or None."""
    scheme = layer.scheme
    if scheme is None or scheme.kind != "int":
        return "not integer-quantized"
    if dtype != torch.bfloat16:
        return f"compute dtype {dtype} (the kernels are vectorised for bfloat16 only)"
    if not getattr(layer, "cpu_kernel_ok", True):
        return "its weight is read whole each step"
    rows, cols = layer.scales.shape[0], layer.in_cols
    group = scheme.group_size or cols
    if not groups_in_order(layer.g_idx, cols, group):
        return "act-order (g_idx)"
    if scheme.bits == 8:
        if group < cols:
            return f"8-bit groups of {group} columns (the int8 kernel takes one scale per row)"
        if not bool((layer.zeros == 128).all()):
            return "asymmetric int8 zero points (q - zero can leave int8)"
        return None
    if rows % INT4_ROW_MULTIPLE:
        return f"{rows} output rows, not a multiple of {INT4_ROW_MULTIPLE}"
    if _int4_group(group, cols) is None:
        return f"groups of {group} columns (the int4 kernel takes {list(INT4_GROUPS)} dividing {cols})"
    return None


def _int4_group(group: int, cols: int) -> int | None:
    """The kernel's group for this layer: its own, or for one scale per
    row, the largest the kernel takes that divides the row (the scale
    repeated: the same weights)."""
    if group in INT4_GROUPS and cols % group == 0:
        return group
    if group == cols:
        return next((g for g in INT4_GROUPS if cols % g == 0), None)
    return None


def pack(layer: nn.Module, dtype: torch.dtype) -> CpuIntWeights:
    """The layer's weight in the kernel's form (why_not(layer) is None),
    written over its qweight: both take the same bytes, and converting in
    place leaves no freed copy for the allocator to keep resident."""
    scheme, cols = layer.scheme, layer.in_cols
    qweight = layer.qweight.data  # [N, K] (8 bits) or [N, K / 2] (4 bits) uint8
    scales = layer.scales.to(torch.float32)  # [N, groups]
    if scheme.bits == 8:
        # why_not checked every zero point is 128, so q - 128, which is
        # q with its top bit flipped read as int8, is the signed value.
        return Int8Rows(qweight.bitwise_xor_(0x80).view(torch.int8), scales[:, 0].to(dtype).contiguous())
    group = scheme.group_size or cols
    kernel_group = _int4_group(group, cols)
    repeat = group // kernel_group
    zeros = layer.zeros.to(torch.float32)
    if repeat > 1:
        scales, zeros = scales.repeat_interleave(repeat, 1), zeros.repeat_interleave(repeat, 1)
    # (q - z) * s = (q - 8) * s + (8 - z) * s: the kernel's form.
    scale_offsets = torch.stack([scales, (8 - zeros) * scales], dim=-1).to(dtype)  # [N, groups, 2]
    # torch's layout packs blocks of 32 or 64 rows (the CPU's vector width)
    # independently, each into its own rows' bytes: converted a few blocks
    # at a time, each piece lands where its rows were.
    for start in range(0, qweight.shape[0], PACK_ROWS):
        piece = qweight[start:start + PACK_ROWS]
        q = unpack_int(piece, 4, cols).to(torch.int32)  # [rows, K], 0 .. 15
        piece.copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
    return Int4Groups(qweight, kernel_group, scale_offsets.transpose(0, 1).contiguous(), cols)


def use_cpu_int_kernels(model: nn.Module, dtype: torch.dtype, setting: str = "auto",
                        batch_invariant: bool = False) -> int:
    """EXECUTOR_CPU_INT_KERNELS: moves every integer-quantized linear that
    fits a kernel onto it, dropping its dequantizing form (the memory stays
    the quantized size), and logs what it did. Returns the layers moved."""
    # Integer-quantized layers.py linears (not imported: layers.py imports this module).
    layers = [m for m in model.modules() if hasattr(m, "hold_cpu_int") and m.scheme is not None
              and m.scheme.kind == "int"]
    if not layers:
        return 0
    if setting == "off" or batch_invariant:
        log.info("CPU int kernels: off (%s); %d integer layers dequantize per matmul",
                 "EXECUTOR_CPU_INT_KERNELS=off" if setting == "off" else "batch-invariant mode", len(layers))
        return 0
    moved, left = 0, {}
    for layer in layers:
        reason = why_not(layer, dtype)
        if reason is None:
            layer.hold_cpu_int(pack(layer, dtype))
            moved += 1
        else:
            left[reason] = left.get(reason, 0) + 1
    log.info("CPU int kernels: %d of %d integer layers on torch's int8/int4 kernels%s", moved, len(layers),
             "".join(f"; {n} not: {why}" for why, n in left.items()))
    return moved
