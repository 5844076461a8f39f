"""Triton kernel: y = x W^T (+ bias) with W stored as 4-bit floats (``fp4_weight_linear``):
NVFP4 (an FP8 e4m3 scale per 16 columns over a float32 global scale per row) and
MXFP4 (an E8M0 power of two per 32), the layout the executor holds compressed-tensors'
and ModelOpt's FP4 checkpoints in (executor_svc/model/quant_formats.py, kind "fp4").

The packed bytes are decoded in the load loop, as int_linear.py decodes its nibbles:
column 2j is byte j's low nibble, 2j + 1 its high one. Each weight is dequantized as
the torch path (quant_formats.dequantize_fp4, compressed-tensors' decompression) does
it, so both paths multiply the same weights: NVFP4 value * (scale / global scale),
each step rounded in float32; MXFP4 value * 2^(scale - 127), exact; then rounded to
bfloat16, then cast to the activations' dtype before the dot (accumulation in float32).
Activations quantized at run time (NVFP4 W4A4) come in already quantized and
dequantized (layers.py), so this one GEMM serves both.

Shapes (see ``llmsched_kernels.reference.fp4_weight_linear`` for the semantics):

* x:            [M, K] float16, bfloat16 or float32 (unit column stride)
* qweight:      [N, cdiv(K, 2)] uint8, E2M1 codes (sign bit high)
* scales:       [N, cdiv(K, group_size)]: NVFP4 float8_e4m3fn, MXFP4 uint8 (E8M0)
* global_scale: [N] float32 (NVFP4) or None (MXFP4)
* bias:         [N] or None
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmsched_kernels.triton_bits import e2m1, e4m3_over_256, interpreting, round_to_bf16

__all__ = ["fp4_weight_linear"]


@triton.jit
def _fp4_weight_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, cdiv(K, 2)] uint8
    s_ptr,  # [N, n_groups]: NVFP4 int8 e4m3 bits, MXFP4 uint8 E8M0
    g_ptr,  # [N] float32 global scales (NVFP4) or a dummy
    b_ptr,  # [N] (HAS_BIAS) or a dummy
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    GROUP_SIZE: tl.constexpr,  # 16 (NVFP4) or 32 (MXFP4)
    NVFP4: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 so it is not rounded to tf32
    DOT_UPCAST: tl.constexpr,  # interpreter + 16-bit x: multiply as fp32 (exact upcast), as a GPU's MMA does
    ROUND_X_BY_HAND: tl.constexpr,  # interpreter + bf16 x: its float32 -> bfloat16 casts truncate
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
    s_rows = s_ptr + offs_n.to(tl.int64)[:, None] * stride_sn  # [BLOCK_N, 1]
    if NVFP4:
        global_scale = tl.load(g_ptr + offs_n, mask=n_ok, other=1.0)[:, None]  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k  # [BLOCK_K]
        k_ok = k < K
        a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_ok = n_ok[:, None] & k_ok[None, :]  # [BLOCK_N, BLOCK_K]
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BLOCK_K / 2] byte columns (k0 is even)
        packed = tl.load(w_rows + kb[None, :], mask=n_ok[:, None] & (kb < (K + 1) // 2)[None, :],
                         other=0).to(tl.int32)  # [BLOCK_N, BLOCK_K / 2]
        # Column 2j is byte j's low nibble, 2j + 1 its high one (odd K: a padding nibble meets x's zero).
        value = e2m1(tl.interleave(packed & 0xF, packed >> 4))  # [BLOCK_N, BLOCK_K] float32
        group = (k // GROUP_SIZE)[None, :]  # [1, BLOCK_K]
        if NVFP4:
            e4m3 = tl.load(s_rows + group, mask=w_ok, other=0)  # [BLOCK_N, BLOCK_K] int8 bits
            w = value * tl.math.div_rn(e4m3_over_256(e4m3) * 256.0, global_scale)
        else:
            e8m0 = tl.load(s_rows + group, mask=w_ok, other=127).to(tl.int32)
            # 2^(e8m0 - 127) from its bits (e8m0 0 is the subnormal 2^-127): the product is exact.
            w = value * tl.where(e8m0 == 0, 0x400000, e8m0 << 23).to(tl.float32, bitcast=True)
        w = round_to_bf16(w)  # as compressed-tensors decompresses, whatever x's dtype
        if ROUND_X_BY_HAND:
            w = round_to_bf16(w)
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
    assert not nvfp4 or (global_scale.shape == (n,) and global_scale.dtype == torch.float32), (
        "global_scale: [N] float32")
    assert bias is None or bias.shape == (n,), f"bias {tuple(bias.shape)} for {n} rows"
    x = x if x.stride(1) == 1 else x.contiguous()
    qweight = qweight if qweight.stride(1) == 1 else qweight.contiguous()
    scales = scales.contiguous()
    scales = scales.view(torch.int8) if nvfp4 else scales  # e4m3 read as bits: sm_80 has no FP8 type
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    # A scale per element, and fp32 tiles twice the bytes: 32-wide tiles keep them in registers.
    block_n, block_k = 32, (32 if x.dtype == torch.float32 else 64)
    under_interpreter = interpreting()
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp4_weight_linear_kernel[grid](
        x, qweight, scales, global_scale.contiguous() if nvfp4 else y,
        y if bias is None else bias.to(x.dtype).contiguous(), y, m, n, k,  # the torch path adds it in x's dtype
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        GROUP_SIZE=group_size, NVFP4=nvfp4, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_UPCAST=x.dtype != torch.float32 and under_interpreter,
        ROUND_X_BY_HAND=x.dtype == torch.bfloat16 and under_interpreter,
        num_warps=4,
    )
    return y
