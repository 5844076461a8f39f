"""Triton kernel: y = x W^T (+ b) with every row summed in one order whatever
the number of rows (``invariant_linear``), for EXECUTOR_BATCH_INVARIANT=on
on CUDA.

cuBLAS picks its algorithm, its tiles and whether to split the reduction
over K from the whole call's shape, so a row's result changes with the
batch it is in. Here the tiles (BLOCK_M x BLOCK_N, stepping BLOCK_K along
K) are chosen from the dtype alone, never from M, and K is never split:
each output element is its row's and column's products accumulated tile
by tile along K in one fixed order, in one program, whatever rows share
the program's tile (a dot's rows do not mix). The same row therefore gets
the same bits in a batch of 1 or of 512. It costs what a plain, unsplit
tiled GEMM costs: slower than cuBLAS for shapes where split-K or larger
tiles would pay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmsched_kernels.triton_bits import interpreting

__all__ = ["invariant_linear"]

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by whether the inputs are fp32
# ("ieee" dots on FMA units need smaller tiles to fit the registers).
_TILES = {False: (64, 64, 64, 4), True: (32, 32, 32, 4)}


@triton.jit
def _invariant_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N]
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs so they are not rounded to tf32
    DOT_UPCAST: tl.constexpr,  # interpreter + bf16: dot in fp32 (its bf16 dot is not a GPU's)
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_ok[:, None] & (k[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + k[:, None],
                    mask=n_ok[None, :] & (k[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K], weight [N, K], with each row
    of the result independent, bit for bit, of the other rows of x."""
    assert weight.dim() == 2 and x.shape[-1] == weight.shape[1], f"x {tuple(x.shape)} weight {tuple(weight.shape)}"
    assert x.dtype == weight.dtype and x.dtype in (torch.float32, torch.float16, torch.bfloat16), (
        f"x {x.dtype} weight {weight.dtype}")
    assert bias is None or (bias.shape == (weight.shape[0],) and bias.stride(0) == 1), "bias must be [N], contiguous"
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*lead, n)
    block_m, block_n, block_k, num_warps = _TILES[x.dtype == torch.float32]
    _invariant_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x2, w, bias if bias is not None else w, y, m, n, k, x2.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_UPCAST=x.dtype == torch.bfloat16 and interpreting(),
        num_warps=num_warps,
    )
    return y.view(*lead, n)
