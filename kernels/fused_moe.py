"""Triton kernel: a mixture-of-experts MLP as two grouped GEMMs (``fused_moe``).

As vLLM's and SGLang's fused MoE: the (token, expert) pairs the router chose are sorted
by expert and each expert's run is padded to a multiple of BLOCK_M
(``align_by_expert``, plain torch ops, no host sync), so every BLOCK_M-row tile of the
sorted list belongs to one expert. One launch per projection then multiplies every tile
by its expert's weight: gate/up (``x W13[e]^T``), the activation in torch, then down
(``h W2[e]^T``) times the routing weight. Each (token, slot) row is written to its own
output row, and the k slots of a token are summed at the end.

Shapes (see ``kernels.reference.fused_moe`` for the semantics):

* x:        [num_tokens, hidden]
* w13:      [num_experts, 2 * inter, hidden]  gate rows, then up rows
* w2:       [num_experts, hidden, inter]
* b13, b2:  [num_experts, 2 * inter], [num_experts, hidden] or None
* weights:  [num_tokens, top_k] routing weights; ids: [num_tokens, top_k] expert ids

The grid is sized by the worst case (every expert's run padded by BLOCK_M - 1), known
from shapes alone, so no launch needs the routing on the host; tiles past the padded
total exit at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

__all__ = ["fused_moe", "align_by_expert", "grouped_gemm"]


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [num_a_rows, K]: per token (A_ROWS_PER == top_k) or per (token, slot) (A_ROWS_PER == 1)
    w_ptr,  # [num_experts, N, K]
    bias_ptr,  # [num_experts, N]                    (HAS_BIAS)
    c_ptr,  # [num_pairs, N], one row per (token, slot) pair
    weights_ptr,  # [num_pairs] routing weights       (MUL_WEIGHT)
    sorted_pairs_ptr,  # [max_padded] int32: pair index, or num_pairs for padding
    block_expert_ptr,  # [max_padded // BLOCK_M] int32: the expert of each tile
    num_padded_ptr,  # [1] int32: rows of sorted_pairs in use (the rest is never read)
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_be,
    stride_cm,
    A_ROWS_PER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 so it is not rounded to tf32
    DOT_UPCAST: tl.constexpr,  # interpreter + bf16: multiply as fp32 (exact upcast)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past every expert's padded run
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    pair = tl.load(sorted_pairs_ptr + offs_m)  # [BLOCK_M]
    row_ok = pair < num_pairs  # [BLOCK_M]; padding rows hold num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    a_row = (pair // A_ROWS_PER).to(tl.int64)  # [BLOCK_M]

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # [BLOCK_M, BLOCK_N]
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K  # [BLOCK_K]
        a = tl.load(a_ptr + a_row[:, None] * stride_am + (k0 + offs_k)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_base + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0)  # [BLOCK_N]
        acc = acc + bias.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)  # [BLOCK_M]
        acc = acc * weight.to(tl.float32)[:, None]
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def align_by_expert(ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert, each expert's run padded to a
    multiple of block_m, with torch ops only (no host sync).

    ids: [num_tokens, top_k]. Returns sorted_pairs [max_padded] int32 (pair
    index token * top_k + slot, or num_pairs for padding), block_expert
    [max_padded // block_m] int32, and num_padded [1] int32 (rows in use).
    """
    num_pairs = ids.numel()
    max_padded = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    flat = ids.reshape(-1).to(torch.int64)  # [num_pairs]
    # scatter_add, not bincount: bincount sizes its output from the data, a host sync on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # [num_experts]
    padded = (counts + block_m - 1) // block_m * block_m  # [num_experts]
    run_end = torch.cumsum(padded, 0)  # [num_experts]
    order = torch.argsort(flat, stable=True)  # [num_pairs]: pairs grouped by expert
    expert_of = flat[order]  # [num_pairs]
    first_of_expert = torch.cumsum(counts, 0) - counts  # [num_experts]: first sorted index of each expert
    rank = torch.arange(num_pairs, device=ids.device) - first_of_expert[expert_of]  # [num_pairs]
    position = (run_end - padded)[expert_of] + rank  # [num_pairs]
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[position] = order.to(torch.int32)
    tile_start = torch.arange(0, max_padded, block_m, device=ids.device)  # [max_padded // block_m]
    block_expert = torch.searchsorted(run_end, tile_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pairs, block_expert, run_end[-1:].to(torch.int32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, sorted_pairs: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, num_pairs: int, a_rows_per: int,
                 weights: torch.Tensor | None, block_m: int) -> torch.Tensor:
    """c[pair] = a[pair // a_rows_per] W[expert(pair)]^T (+ b) (* weights[pair]): [num_pairs, N]."""
    num_experts, n, k = w.shape
    assert a.dim() == 2 and a.shape[1] == k and a.stride(1) == 1, f"a {tuple(a.shape)} strides {a.stride()}"
    assert w.stride(2) == 1 and (bias is None or bias.stride(1) == 1)
    assert a.dtype == w.dtype, f"{a.dtype} vs {w.dtype}"
    c = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return c
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (sorted_pairs.shape[0] // block_m, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, bias if bias is not None else w, c, weights if weights is not None else c,
        sorted_pairs, block_expert, num_padded, num_pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), 0 if bias is None else bias.stride(0), c.stride(0),
        A_ROWS_PER=a_rows_per, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        DOT_UPCAST=a.dtype == torch.bfloat16 and _interpreting(),
        num_warps=4,
    )
    return c


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    weights: torch.Tensor,  # [num_tokens, top_k]
    ids: torch.Tensor,  # [num_tokens, top_k]
    activation: Callable[[torch.Tensor], torch.Tensor],  # [rows, 2 * inter] -> [rows, inter]
    b13: torch.Tensor | None = None,  # [num_experts, 2 * inter]
    b2: torch.Tensor | None = None,  # [num_experts, hidden]
    block_m: int = 16,
) -> torch.Tensor:  # [num_tokens, hidden]
    """Triton version of ``kernels.reference.fused_moe``."""
    num_tokens, top_k = ids.shape
    num_experts = w13.shape[0]
    assert x.dim() == 2 and w13.shape[2] == x.shape[1] and w2.shape[1] == x.shape[1], (
        f"x {tuple(x.shape)} w13 {tuple(w13.shape)} w2 {tuple(w2.shape)}")
    assert w2.shape[2] * 2 == w13.shape[1], f"w13 {tuple(w13.shape)} w2 {tuple(w2.shape)}"
    x = x if x.stride(1) == 1 else x.contiguous()
    sorted_pairs, block_expert, num_padded = align_by_expert(ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    gate_up = grouped_gemm(x, w13, b13, sorted_pairs, block_expert, num_padded, num_pairs, top_k, None, block_m)
    h = activation(gate_up).contiguous()  # [num_pairs, inter]
    flat_weights = weights.reshape(-1).contiguous()  # [num_pairs]
    down = grouped_gemm(h, w2, b2, sorted_pairs, block_expert, num_padded, num_pairs, 1, flat_weights, block_m)
    return down.view(num_tokens, top_k, -1).sum(dim=1)
