"""Triton kernel: y = x W^T (+ bias) with W stored packed, decoded in the load loop:

* ``int_weight_linear`` (W4A16 / W8A16): 4- or 8-bit unsigned integers, one scale
  and one zero point per row and group of columns, the layout the executor converts
  GPTQ, AWQ and compressed-tensors checkpoints into at load;
* ``fp4_weight_linear``: 4-bit floats (E2M1), NVFP4 (an FP8 e4m3 scale per 16
  columns over a float32 global scale per row) or MXFP4 (an E8M0 power of two per
  32), as the executor holds compressed-tensors' and ModelOpt's FP4 checkpoints
  (executor_svc/model/quant_formats.py, kind "fp4").

The packed bytes are decoded in the load loop: a tile of BLOCK_K / 2 contiguous
bytes per row is split into its low and high nibbles, interleaved into the
BLOCK_K columns they hold (column 2j low, 2j + 1 high). Each tile is dequantized as the
torch path does it: (q - zero) is an exact integer, its product with the scale is
rounded once to the scales' dtype, then cast to the activations' dtype before the
dot (accumulation in float32). So both paths multiply the same weights. FP4 codes
are decoded the same way and dequantized as quant_formats.dequantize_fp4 does
(compressed-tensors' decompression): NVFP4 value * (scale / global scale), each
step rounded in float32; MXFP4 value * 2^(scale - 127), exact; then rounded to
bfloat16. Activations quantized at run time (NVFP4 W4A4) come in already quantized
and dequantized (layers.py), so this one GEMM serves both NVFP4 schemes.

Groups: without g_idx a column's group is k // group_size; when a group spans
whole BLOCK_K tiles (or the whole row) each tile loads one scale and zero per row
(GROUP_PER_TILE). With g_idx (GPTQ act-order) each column gathers its own.

Shapes (see ``llmsched_kernels.reference.int_weight_linear`` for the semantics):

* x:       [M, K] float16, bfloat16 or float32 (unit column stride)
* qweight: [N, cdiv(K, 2)] uint8 (bits 4) or [N, K] uint8 (bits 8)
* scales:  [N, cdiv(K, group_size)] float16, bfloat16 or float32
* zeros:   [N, cdiv(K, group_size)] uint8
* g_idx:   [K] int32 or None
* bias:    [N] or None

FP4 (see ``llmsched_kernels.reference.fp4_weight_linear``): qweight as for 4 bits
(E2M1 codes, sign bit high); scales [N, cdiv(K, group_size)] float8_e4m3fn (NVFP4)
or uint8 (MXFP4); global_scale [N] float32 (NVFP4) or None.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmsched_kernels.triton_bits import e2m1, e8m0_scale, interpreting, nvfp4_scale, round_to_bf16

__all__ = ["int_weight_linear", "fp4_weight_linear"]


@triton.jit
def _int_weight_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, cdiv(K, 2)] (BITS 4) or [N, K] (BITS 8) uint8
    s_ptr,  # [N, n_groups]; nvfp4: int8 e4m3 bits, mxfp4: uint8 E8M0
    z_ptr,  # [N, n_groups] uint8; nvfp4: [N] float32 global scales; mxfp4: a dummy
    g_ptr,  # [K] int32 (HAS_G_IDX) or a dummy
    b_ptr,  # [N] (HAS_BIAS) or a dummy
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,  # scales and zeros share it (both contiguous)
    stride_ym,
    GROUP_SIZE: tl.constexpr,
    FORMAT: tl.constexpr,  # "int", "nvfp4" or "mxfp4"
    BITS: tl.constexpr,  # 4 or 8 (fp4: 4)
    HAS_G_IDX: tl.constexpr,
    GROUP_PER_TILE: tl.constexpr,  # no g_idx and every BLOCK_K tile lies in one group
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 so it is not rounded to tf32
    DOT_UPCAST: tl.constexpr,  # interpreter + 16-bit x: multiply as fp32 (exact upcast), as a GPU's MMA does
    ROUND_S_BY_HAND: tl.constexpr,  # interpreter + bf16 scales: its float32 -> bfloat16 casts truncate
    ROUND_X_BY_HAND: tl.constexpr,  # interpreter + bf16 x: likewise
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    s_rows = offs_n * stride_sn  # [BLOCK_N]; int32: scales hold far fewer than 2**31 entries
    if FORMAT == "nvfp4":
        global_scale = tl.load(z_ptr + offs_n, mask=n_ok, other=1.0)[:, None]  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k  # [BLOCK_K]
        k_ok = k < K
        a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_ok = n_ok[:, None] & k_ok[None, :]  # [BLOCK_N, BLOCK_K]
        # The weight tile is [BLOCK_N, BLOCK_K], along its rows as stored: the loads are contiguous bytes.
        if BITS == 4:
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BLOCK_K / 2] byte columns (k0 is even)
            packed = tl.load(w_rows + kb[None, :], mask=n_ok[:, None] & (kb < (K + 1) // 2)[None, :],
                             other=0).to(tl.int32)  # [BLOCK_N, BLOCK_K / 2]
            # Column 2j is byte j's low nibble, 2j + 1 its high one (odd K: a padding nibble meets x's zero).
            q = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, BLOCK_K]
        else:
            q = tl.load(w_rows + k[None, :], mask=w_ok, other=0).to(tl.int32)  # [BLOCK_N, BLOCK_K]
        if FORMAT == "int":
            if GROUP_PER_TILE:
                sz = s_rows + k0 // GROUP_SIZE  # [BLOCK_N]
                scale = tl.load(s_ptr + sz, mask=n_ok, other=0.0).to(tl.float32)[:, None]  # [BLOCK_N, 1]
                zero = tl.load(z_ptr + sz, mask=n_ok, other=0).to(tl.int32)[:, None]  # [BLOCK_N, 1]
            else:
                if HAS_G_IDX:
                    group = tl.load(g_ptr + k, mask=k_ok, other=0)  # [BLOCK_K]
                else:
                    group = k // GROUP_SIZE  # [BLOCK_K]
                sz = s_rows[:, None] + group[None, :]  # [BLOCK_N, BLOCK_K]
                scale = tl.load(s_ptr + sz, mask=w_ok, other=0.0).to(tl.float32)
                zero = tl.load(z_ptr + sz, mask=w_ok, other=0).to(tl.int32)
            # (q - zero) is exact; the product is rounded once, to the scales' dtype, as the torch path has it.
            w = (q - zero).to(tl.float32) * scale  # [BLOCK_N, BLOCK_K]
            if ROUND_S_BY_HAND:
                w = round_to_bf16(w)
            else:
                w = w.to(s_ptr.dtype.element_ty)
        else:  # fp4: a scale per element (groups of 16 or 32 are narrower than a tile)
            value = e2m1(q)  # [BLOCK_N, BLOCK_K] float32
            sz = s_rows[:, None] + (k // GROUP_SIZE)[None, :]  # [BLOCK_N, BLOCK_K]
            if FORMAT == "nvfp4":
                e4m3 = tl.load(s_ptr + sz, mask=w_ok, other=0)  # int8 bits
                w = value * nvfp4_scale(e4m3, global_scale)
            else:
                w = value * e8m0_scale(tl.load(s_ptr + sz, mask=w_ok, other=127).to(tl.int32))
            w = round_to_bf16(w)  # as compressed-tensors decompresses, whatever x's dtype
        if ROUND_X_BY_HAND:
            w = round_to_bf16(w.to(tl.float32))
        else:
            w = w.to(a.dtype)
        if DOT_UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ROUND_X_BY_HAND:
        acc = round_to_bf16(acc)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def int_weight_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int, bits: int, g_idx: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of ``llmsched_kernels.reference.int_weight_linear``: [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    n_groups = triton.cdiv(k, group_size)
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"x {x.dtype}"
    assert bits in (4, 8), f"bits {bits}: 4 or 8"
    packed_k = triton.cdiv(k, 2) if bits == 4 else k
    assert qweight.dtype == torch.uint8 and qweight.shape == (n, packed_k), (
        f"qweight {tuple(qweight.shape)} {qweight.dtype} for {bits}-bit [{n}, {k}]")
    assert scales.shape == (n, n_groups) and zeros.shape == (n, n_groups) and zeros.dtype == torch.uint8, (
        f"scales {tuple(scales.shape)} zeros {tuple(zeros.shape)} {zeros.dtype}: want [{n}, {n_groups}], uint8 zeros")
    assert scales.dtype in (torch.float16, torch.bfloat16, torch.float32), f"scales {scales.dtype}"
    assert g_idx is None or (g_idx.shape == (k,) and g_idx.dtype == torch.int32), "g_idx: [K] int32"
    assert scales.numel() < 2**31, "scale offsets are 32-bit"
    assert bias is None or bias.shape == (n,), f"bias {tuple(bias.shape)} for {n} rows"
    x = x if x.stride(1) == 1 else x.contiguous()
    qweight = qweight if qweight.stride(1) == 1 else qweight.contiguous()
    scales, zeros = scales.contiguous(), zeros.contiguous()
    # fp32 tiles hold twice the bytes: smaller ones keep them in registers (no spills on sm_80/sm_90).
    block_n, block_k = (32, 32) if x.dtype == torch.float32 else (64, 64)
    group_per_tile = g_idx is None and (group_size % block_k == 0 or group_size >= k)
    if not group_per_tile:
        block_n = 32  # a scale and a zero per element: narrower tiles keep their addresses in registers
    return _launch(x, qweight, scales, zeros, g_idx, bias, group_size, "int", bits, group_per_tile, block_n, block_k)


def fp4_weight_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None,
                      group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of ``llmsched_kernels.reference.fp4_weight_linear``: [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    nvfp4 = global_scale is not None
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"x {x.dtype}"
    assert group_size == (16 if nvfp4 else 32), f"group_size {group_size}: NVFP4 16, MXFP4 32"
    assert qweight.dtype == torch.uint8 and qweight.shape == (n, triton.cdiv(k, 2)), (
        f"qweight {tuple(qweight.shape)} {qweight.dtype} for 4-bit [{n}, {k}]")
    assert scales.shape == (n, triton.cdiv(k, group_size)), f"scales {tuple(scales.shape)} for [{n}, {k}]"
    assert scales.dtype == (torch.float8_e4m3fn if nvfp4 else torch.uint8), f"scales {scales.dtype}"
    assert scales.numel() < 2**31, "scale offsets are 32-bit"
    assert not nvfp4 or (global_scale.shape == (n,) and global_scale.dtype == torch.float32), (
        "global_scale: [N] float32")
    assert bias is None or bias.shape == (n,), f"bias {tuple(bias.shape)} for {n} rows"
    x = x if x.stride(1) == 1 else x.contiguous()
    qweight = qweight if qweight.stride(1) == 1 else qweight.contiguous()
    scales = scales.contiguous()
    scales = scales.view(torch.int8) if nvfp4 else scales  # e4m3 read as bits: sm_80 has no FP8 type
    # A scale per element, and fp32 tiles twice the bytes: 32-wide tiles keep them in registers.
    block_k = 32 if x.dtype == torch.float32 else 64
    return _launch(x, qweight, scales, global_scale.contiguous() if nvfp4 else None, None, bias, group_size,
                   "nvfp4" if nvfp4 else "mxfp4", 4, False, 32, block_k)


def _launch(x, qweight, scales, extra, g_idx, bias, group_size, fmt, bits, group_per_tile, block_n, block_k):
    """The kernel over x's rows; extra: int's zeros or NVFP4's global scales."""
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    under_interpreter = interpreting()
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int_weight_linear_kernel[grid](
        x, qweight, scales, y if extra is None else extra, y if g_idx is None else g_idx.contiguous(),
        y if bias is None else bias.to(x.dtype).contiguous(), y, m, n, k,  # the torch path adds it in x's dtype
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        GROUP_SIZE=group_size, FORMAT=fmt, BITS=bits, HAS_G_IDX=g_idx is not None, GROUP_PER_TILE=group_per_tile,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_UPCAST=x.dtype != torch.float32 and under_interpreter,
        ROUND_S_BY_HAND=scales.dtype == torch.bfloat16 and under_interpreter,
        ROUND_X_BY_HAND=x.dtype == torch.bfloat16 and under_interpreter,
        num_warps=4,
    )
    return y
