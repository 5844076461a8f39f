"""Triton kernel: y = x W^T with W stored as FP8 (e4m3) and one float32 scale
per block of rows x columns (``fp8_block_linear``), the layout of DeepSeek-V3's
and Qwen3-FP8's checkpoints (executor_svc/model/quantization.py).

The weight is read as int8 and decoded in the load loop, with integer ops
only, so the kernel runs where Triton has no FP8 type (sm_80, the A100): e4m3
/ 256 is exactly the float16 whose bits are e4m3's sign, a zero, then its
exponent and mantissa bits (quantization.fp8_as_half), and the scales carry
the factor 256. Each tile of the weight is scaled in float32 and cast to
the activations' dtype before the dot, as the torch path dequantizes it, so
both compute with the same weights (W8A16; accumulation in float32).

Shapes (see ``llmsched_kernels.reference.fp8_block_linear`` for the semantics):

* x:         [M, K] float16, bfloat16 or float32
* weight:    [N, K] float8_e4m3fn
* scales:    [grid rows, cdiv(K, block_k)] float32
* grid_rows: [N] int64, the scale row of each weight row (a layer that
  stacks several checkpoint tensors, q/k/v or gate/up, stacks their grids)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmsched_kernels.triton_bits import e4m3_over_256, interpreting, round_to_bf16

__all__ = ["fp8_block_linear"]

@triton.jit
def _fp8_block_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] int8: e4m3 bits
    s_ptr,  # [grid rows, KB] float32, times 256
    g_ptr,  # [N] int64: grid row of each weight row
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sg,
    stride_ym,
    SCALE_K: tl.constexpr,  # columns per scale block
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 so it is not rounded to tf32
    DOT_UPCAST: tl.constexpr,  # interpreter + bf16: multiply as fp32 (exact upcast)
    ROUND_BY_HAND: tl.constexpr,  # interpreter + bf16: its float32 -> bfloat16 casts truncate; round to nearest even
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    m_ok = offs_m < M
    n_ok = offs_n < N
    grid_row = tl.load(g_ptr + offs_n, mask=n_ok, other=0)  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k  # [BLOCK_K]
        k_ok = k < K
        a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_ok = k_ok[:, None] & n_ok[None, :]
        bits = tl.load(w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + k[:, None], mask=w_ok,
                       other=0)  # [BLOCK_K, BLOCK_N] int8
        scale = tl.load(s_ptr + grid_row[None, :] * stride_sg + (k // SCALE_K)[:, None], mask=w_ok,
                        other=0.0)  # [BLOCK_K, BLOCK_N]
        w = e4m3_over_256(bits) * scale  # the dequantized weight, as the torch path has it, then in x's dtype
        if ROUND_BY_HAND:
            w = round_to_bf16(w)
        else:
            w = w.to(a.dtype)
        if DOT_UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if ROUND_BY_HAND:
        acc = round_to_bf16(acc)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, grid_rows: torch.Tensor,
                     block_k: int) -> torch.Tensor:
    """Triton version of ``llmsched_kernels.reference.fp8_block_linear``: [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.dtype == torch.float8_e4m3fn, f"weight {tuple(weight.shape)} {weight.dtype}"
    assert scales.shape[1] == triton.cdiv(k, block_k) and grid_rows.shape == (n,), (
        f"scales {tuple(scales.shape)} grid_rows {tuple(grid_rows.shape)} for weight {tuple(weight.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    scales = (scales * 256.0).contiguous()  # the factor fp8_as_half leaves out
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    # fp32 tiles hold twice the bytes: smaller ones keep them in registers (no spills on sm_80/sm_90).
    block_n, block_k_tile = (32, 32) if x.dtype == torch.float32 else (64, 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_linear_kernel[grid](
        x, weight.view(torch.int8), scales, grid_rows, y, m, n, k,
        x.stride(0), weight.stride(0), scales.stride(0), y.stride(0),
        SCALE_K=block_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k_tile,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_UPCAST=x.dtype == torch.bfloat16 and interpreting(),
        ROUND_BY_HAND=x.dtype == torch.bfloat16 and interpreting(),
        num_warps=4,
    )
    return y
