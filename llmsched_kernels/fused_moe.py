"""Triton kernel: a mixture-of-experts MLP as two grouped GEMMs (``fused_moe``).

As vLLM's and SGLang's fused MoE: the (token, expert) pairs the router chose are sorted
by expert and each expert's run is padded to a multiple of BLOCK_M
(``align_by_expert``, plain torch ops, no host sync), so every BLOCK_M-row tile of the
sorted list belongs to one expert. One launch per projection then multiplies every tile
by its expert's weight: gate/up (``x W13[e]^T``), the activation in torch, then down
(``h W2[e]^T``) times the routing weight. Each (token, slot) row is written to its own
output row, and the k slots of a token are summed at the end.

Shapes (see ``llmsched_kernels.reference.fused_moe`` for the semantics):

* x:        [num_tokens, hidden]
* w13:      [num_experts, 2 * inter, hidden]  gate rows, then up rows
* w2:       [num_experts, hidden, inter]
* b13, b2:  [num_experts, 2 * inter], [num_experts, hidden] or None
* weights:  [num_tokens, top_k] routing weights; ids: [num_tokens, top_k] expert ids

w13 and w2 may instead be held quantized (``QuantizedExperts``), and are then
decoded tile by tile in the load loop, never written out dequantized. Each tile
is dequantized in float32 as the torch path does it, then cast to the
activations' dtype before the dot (W8A16 / W4A16; accumulation in float32):

* fp8:   [num_experts, N, K] float8_e4m3fn, read as int8 and decoded with integer
         ops only (llmsched_kernels/fp8_linear.py: it runs on sm_80, where Triton has no
         FP8 type), times float32 block scales [num_experts, grid rows,
         cdiv(K, block_k)], one grid row per weight row (DeepSeek-V3, Qwen3-FP8)
* mxfp4: E2M1 nibbles [num_experts, N, K / 32, 16] uint8 (value 2j in byte j's
         low nibble within a group of 32) times 2^(scale - 127), one E8M0 scale
         byte per group [num_experts, N, K / 32] (gpt-oss); exact in bf16 and fp32
* nvfp4: E2M1 nibbles in groups of 16 [num_experts, N, K / 16, 8] uint8 times one
         float8_e4m3fn scale per group [num_experts, N, K / 16] over its row's
         float32 global scale [num_experts, N] (gate's and up's may differ),
         rounded to bfloat16 as compressed-tensors decompresses
* int:   W4A16 / W8A16 (GPTQ, AWQ, compressed-tensors): unsigned values
         [num_experts, N, cdiv(K, 2)] uint8 (column 2j in byte j's low nibble)
         or [num_experts, N, K], minus a uint8 zero point, times a scale, one
         each per row and group [num_experts, N, groups]; the product rounded
         to the scales' dtype (llmsched_kernels/int_linear.py's definition)

A tensor-parallel rank whose down-projection units start mid-group keeps the
groups that cover them; ``col0`` is where its K columns start in them.

The grid is sized by the worst case (every expert's run padded by BLOCK_M - 1), known
from shapes alone, so no launch needs the routing on the host; tiles past the padded
total exit at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmsched_kernels.triton_bits import e2m1, e4m3_over_256, e8m0_scale, interpreting, nvfp4_scale, round_to_bf16

__all__ = ["fused_moe", "align_by_expert", "grouped_gemm", "QuantizedExperts"]

@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [num_a_rows, K]: per token (A_ROWS_PER == top_k) or per (token, slot) (A_ROWS_PER == 1)
    w_ptr,  # [num_experts, N, K]; fp8: int8 bits; fp4: [num_experts, N, groups, bytes per group] uint8
    ws_ptr,  # quantized: [num_experts, scale rows, scale columns] (fp8 float32, mxfp4 uint8, nvfp4 int8 e4m3 bits,
    #          int the checkpoint's dtype)
    wr_ptr,  # fp8: [N] int64 grid row of each weight row; nvfp4: [num_experts, N] float32 global scales;
    #          int: [num_experts, N, groups] uint8 zero points, strided as the scales
    bias_ptr,  # [num_experts, N]                    (HAS_BIAS)
    c_ptr,  # [num_pairs, N], one row per (token, slot) pair
    weights_ptr,  # [num_pairs] routing weights       (MUL_WEIGHT)
    sorted_pairs_ptr,  # [max_padded] int32: pair index, or num_pairs for padding
    block_expert_ptr,  # [max_padded // BLOCK_M] int32: the expert of each tile
    num_padded_ptr,  # [1] int32: rows of sorted_pairs in use (the rest is never read)
    num_pairs,
    N,
    K,
    col0,  # fp4: the stored column of this weight's column 0 (a rank whose units start mid-group)
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sr,
    stride_be,
    stride_cm,
    A_ROWS_PER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    FORMAT: tl.constexpr,  # "plain", "fp8", "mxfp4", "nvfp4" or "int"
    BITS: tl.constexpr,  # int: 4 or 8
    SCALE_K: tl.constexpr,  # quantized: columns per scale
    SCALE_PER_TILE: tl.constexpr,  # fp8, int: every BLOCK_K tile lies in one scale column
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 so it is not rounded to tf32
    DOT_UPCAST: tl.constexpr,  # interpreter + bf16: multiply as fp32 (exact upcast)
    ROUND_BY_HAND: tl.constexpr,  # interpreter + bf16: its float32 -> bfloat16 casts truncate; round to nearest even
    ROUND_S_BY_HAND: tl.constexpr,  # interpreter + int's bf16 scales: likewise
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
    if FORMAT != "plain":
        if FORMAT == "fp8":
            scale_row = tl.load(wr_ptr + offs_n, mask=n_ok, other=0)  # [BLOCK_N] grid row
        else:
            scale_row = offs_n  # one scale row per weight row
        s_base = ws_ptr + expert * stride_se + scale_row[None, :] * stride_sr  # [1, BLOCK_N]
        if FORMAT == "int":
            z_base = wr_ptr + expert * stride_se + scale_row[None, :] * stride_sr  # [1, BLOCK_N]
    if FORMAT == "nvfp4":
        global_scale = tl.load(wr_ptr + expert * N + offs_n, mask=n_ok, other=1.0)[None, :]  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # [BLOCK_M, BLOCK_N]
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K  # [BLOCK_K]
        a = tl.load(a_ptr + a_row[:, None] * stride_am + (k0 + offs_k)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_ok = k_ok[:, None] & n_ok[None, :]  # [BLOCK_K, BLOCK_N]
        if FORMAT == "plain":
            w = tl.load(w_base + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                        mask=w_ok, other=0.0)  # [BLOCK_K, BLOCK_N]
        else:
            if FORMAT == "fp8":
                bits = tl.load(w_base + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None], mask=w_ok,
                               other=0)  # [BLOCK_K, BLOCK_N] int8
                if SCALE_PER_TILE:
                    scale = tl.load(s_base + k0 // SCALE_K, mask=n_ok[None, :], other=0.0)  # [1, BLOCK_N]
                else:
                    scale = tl.load(s_base + ((k0 + offs_k) // SCALE_K)[:, None], mask=w_ok,
                                    other=0.0)  # [BLOCK_K, BLOCK_N]
                # The product in float32, as dequantize_fp8_blocks has it (times 256: exact).
                w = e4m3_over_256(bits) * 256.0 * scale
            elif FORMAT == "int":
                col = k0 + offs_k  # [BLOCK_K]
                if BITS == 4:
                    byte = tl.load(w_base + offs_n[None, :] * stride_wn + (col >> 1)[:, None], mask=w_ok,
                                   other=0).to(tl.int32)  # [BLOCK_K, BLOCK_N]; column 2j: byte j's low nibble
                    q = (byte >> ((col & 1) * 4)[:, None]) & 0xF
                else:
                    q = tl.load(w_base + offs_n[None, :] * stride_wn + col[:, None], mask=w_ok, other=0).to(tl.int32)
                if SCALE_PER_TILE:
                    scale = tl.load(s_base + k0 // SCALE_K, mask=n_ok[None, :], other=0.0)  # [1, BLOCK_N]
                    zero = tl.load(z_base + k0 // SCALE_K, mask=n_ok[None, :], other=0).to(tl.int32)
                else:
                    group = (col // SCALE_K)[:, None]  # [BLOCK_K, 1]
                    scale = tl.load(s_base + group, mask=w_ok, other=0.0)  # [BLOCK_K, BLOCK_N]
                    zero = tl.load(z_base + group, mask=w_ok, other=0).to(tl.int32)
                # (q - zero) is exact; the product is rounded once, to the scales' dtype.
                w = (q - zero).to(tl.float32) * scale.to(tl.float32)
                if ROUND_S_BY_HAND:
                    w = round_to_bf16(w)
                else:
                    w = w.to(scale.dtype).to(tl.float32)
            else:
                col = col0 + k0 + offs_k  # [BLOCK_K] stored column
                byte = tl.load(w_base + offs_n[None, :] * stride_wn + (col >> 1)[:, None], mask=w_ok,
                               other=0).to(tl.int32)  # [BLOCK_K, BLOCK_N]; column 2j: byte j's low nibble
                value = e2m1(byte >> ((col & 1) * 4)[:, None])  # [BLOCK_K, BLOCK_N] float32
                if FORMAT == "mxfp4":
                    e8m0 = tl.load(s_base + (col // SCALE_K)[:, None], mask=w_ok, other=127).to(tl.int32)
                    w = value * e8m0_scale(e8m0)
                else:
                    e4m3 = tl.load(s_base + (col // SCALE_K)[:, None], mask=w_ok, other=0)  # int8 bits
                    # As dequantize_fp4: then rounded to bfloat16 whatever the activations' dtype.
                    w = round_to_bf16(value * nvfp4_scale(e4m3, global_scale))
            if ROUND_BY_HAND:
                w = round_to_bf16(w)
            else:
                w = w.to(a.dtype)
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
    if ROUND_BY_HAND:
        acc = round_to_bf16(acc)
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# Rows [num_pairs, K] and each row's expert [num_pairs] -> the rows a projection multiplies.
InputQuantizer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class QuantizedExperts:
    """One projection of every expert, held quantized: stands for a
    [num_experts, N, K] weight that the kernel decodes tile by tile. Build
    one with fp8_blocks, mxfp4, nvfp4 or int_groups."""

    format: str  # "fp8", "mxfp4", "nvfp4" or "int"
    data: torch.Tensor  # fp8: [E, N, K] float8_e4m3fn; fp4: [E, N, groups, 16 | 8] uint8; int: [E, N, packed] uint8
    scales: torch.Tensor  # fp8: [E, grid rows, cdiv(K, block_k)] float32; fp4, int: [E, N, groups]
    shape: tuple[int, int, int]  # (num_experts, N, K) of the weight it stands for
    scale_k: int  # columns per scale: block_k, 32 or 16, int's group size
    rows: torch.Tensor | None = None  # fp8: [N] int64, the grid row of each weight row
    global_scale: torch.Tensor | None = None  # nvfp4: [E, N] float32, each row's
    col0: int = 0  # fp4: the stored column where the K columns start
    zeros: torch.Tensor | None = None  # int: [E, N, groups] uint8
    bits: int = 4  # int: 4 or 8

    @classmethod
    def fp8_blocks(cls, weight: torch.Tensor, scales: torch.Tensor, grid_rows: torch.Tensor,
                   block_k: int) -> QuantizedExperts:
        """FusedExperts' FP8 tensors: W[e, n, k] = weight[e, n, k] * scales[e, grid_rows[n], k // block_k]."""
        e, n, k = weight.shape
        assert weight.dtype == torch.float8_e4m3fn, f"weight {weight.dtype}"
        assert scales.dtype == torch.float32 and scales.shape[0] == e and scales.shape[2] == triton.cdiv(k, block_k), (
            f"scales {tuple(scales.shape)} {scales.dtype} for weight {tuple(weight.shape)}, block_k {block_k}")
        assert grid_rows.shape == (n,) and grid_rows.stride(0) == 1, f"grid_rows {tuple(grid_rows.shape)} for {n} rows"
        return cls("fp8", weight, scales, (e, n, k), block_k, rows=grid_rows)

    @classmethod
    def mxfp4(cls, blocks: torch.Tensor, scales: torch.Tensor, col0: int = 0, k: int | None = None) -> QuantizedExperts:
        """gpt-oss's MXFP4 tensors; columns [col0, col0 + k) of the stored groups (all of them by default)."""
        return cls._fp4("mxfp4", blocks, scales, 32, col0, k, None)

    @classmethod
    def nvfp4(cls, blocks: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> QuantizedExperts:
        """W[e, n, k] = bf16(e2m1 * (scales[e, n, k // 16] / global_scale[e, n])), the
        arithmetic in float32; global_scale [E] (one per expert) or [E, N] (one per row)."""
        e, n = blocks.shape[:2]
        assert scales.dtype == torch.float8_e4m3fn, f"NVFP4 scales {scales.dtype}: float8_e4m3fn"
        assert global_scale.shape in ((e,), (e, n)) and global_scale.dtype == torch.float32, (
            f"global_scale {tuple(global_scale.shape)} {global_scale.dtype}: float32, one per expert or per row")
        rows = global_scale if global_scale.dim() == 2 else global_scale[:, None].expand(e, n)
        return cls._fp4("nvfp4", blocks, scales, 16, 0, None, rows.contiguous())

    @classmethod
    def int_groups(cls, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                   group_size: int, k: int) -> QuantizedExperts:
        """W[e, n, c] = (q[e, n, c] - zeros[e, n, c // group_size]) * scales[e, n, c // group_size], the
        product rounded to the scales' dtype: layers.py's held int layout, stacked over the experts."""
        e, n, packed = qweight.shape
        groups = triton.cdiv(k, group_size)
        assert bits in (4, 8) and qweight.dtype == torch.uint8 and packed == (triton.cdiv(k, 2) if bits == 4 else k), (
            f"qweight {tuple(qweight.shape)} {qweight.dtype} for {bits}-bit weights of {k} columns")
        assert scales.shape == zeros.shape == (e, n, groups) and zeros.dtype == torch.uint8, (
            f"scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)} {zeros.dtype}: want [{e}, {n}, {groups}], "
            "uint8 zeros")
        assert scales.dtype in (torch.float16, torch.bfloat16, torch.float32), f"scales {scales.dtype}"
        assert scales.stride() == zeros.stride(), f"scales {scales.stride()} and zeros {zeros.stride()} strides"
        return cls("int", qweight, scales, (e, n, k), group_size, zeros=zeros, bits=bits)

    @classmethod
    def _fp4(cls, fmt, blocks, scales, group, col0, k, global_scale) -> QuantizedExperts:
        e, n, groups, nbytes = blocks.shape
        assert blocks.dtype == torch.uint8 and nbytes == group // 2 and scales.shape == (e, n, groups), (
            f"{fmt} blocks {tuple(blocks.shape)} {blocks.dtype}, scales {tuple(scales.shape)}: want [E, N, groups, "
            f"{group // 2}] uint8 and [E, N, groups]")
        # A row's groups back to back, so stored column c is byte c // 2 of the row.
        assert blocks.stride(3) == 1 and blocks.stride(2) == nbytes, f"{fmt} blocks strides {blocks.stride()}"
        k = groups * group - col0 if k is None else k
        assert 0 <= col0 and col0 + k <= groups * group, f"columns [{col0}, {col0 + k}) of {groups} groups"
        return cls(fmt, blocks, scales, (e, n, k), group, global_scale=global_scale, col0=col0)


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


def grouped_gemm(a: torch.Tensor, w: torch.Tensor | QuantizedExperts, bias: torch.Tensor | None,
                 sorted_pairs: torch.Tensor, block_expert: torch.Tensor, num_padded: torch.Tensor, num_pairs: int,
                 a_rows_per: int, weights: torch.Tensor | None, block_m: int) -> torch.Tensor:
    """c[pair] = a[pair // a_rows_per] W[expert(pair)]^T (+ b) (* weights[pair]): [num_pairs, N]."""
    num_experts, n, k = w.shape
    assert a.dim() == 2 and a.shape[1] == k and a.stride(1) == 1, f"a {tuple(a.shape)} strides {a.stride()}"
    assert bias is None or bias.stride(1) == 1
    quantized = isinstance(w, QuantizedExperts)
    if quantized:
        assert a.dtype in (torch.float16, torch.bfloat16, torch.float32), f"a {a.dtype}"
        data = w.data.view(torch.int8) if w.format == "fp8" else w.data
        scales = w.scales.view(torch.int8) if w.format == "nvfp4" else w.scales
        assert data.stride(-1) == 1 and scales.stride(-1) == 1, f"{w.format} strides {data.stride()} {scales.stride()}"
        extra = {"fp8": w.rows, "int": w.zeros}.get(w.format, w.global_scale)
    else:
        assert w.stride(2) == 1 and a.dtype == w.dtype, f"{a.dtype} vs {w.dtype}, strides {w.stride()}"
        data = scales = extra = w
    c = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return c
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    if quantized and a.dtype == torch.float32:
        # fp32 tiles beside the decode's temporaries spill at 64 x 64 (sm_80/sm_90): halve them.
        block_n, block_k = min(block_n, 32), min(block_k, 32)
    per_tile = quantized and w.format in ("fp8", "int") and (w.scale_k % block_k == 0 or w.scale_k >= k)
    if quantized and w.format == "int" and not per_tile:
        block_n = min(block_n, 32)  # a scale and a zero per element: narrower tiles keep them in registers
    under_interpreter = interpreting()
    grid = (sorted_pairs.shape[0] // block_m, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, data, scales, extra if extra is not None else data, bias if bias is not None else data, c,
        weights if weights is not None else c, sorted_pairs, block_expert, num_padded, num_pairs, n, k,
        w.col0 if quantized else 0,
        a.stride(0), data.stride(0), data.stride(1), scales.stride(0) if quantized else 0,
        scales.stride(1) if quantized else 0, 0 if bias is None else bias.stride(0), c.stride(0),
        A_ROWS_PER=a_rows_per, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None,
        FORMAT=w.format if quantized else "plain", BITS=w.bits if quantized else 4,
        SCALE_K=w.scale_k if quantized else 1,
        SCALE_PER_TILE=per_tile,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        DOT_UPCAST=a.dtype == torch.bfloat16 and under_interpreter,
        ROUND_BY_HAND=a.dtype == torch.bfloat16 and under_interpreter,
        ROUND_S_BY_HAND=quantized and w.format == "int" and w.scales.dtype == torch.bfloat16 and under_interpreter,
        num_warps=4,
    )
    return c


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor | QuantizedExperts,  # [num_experts, 2 * inter, hidden]
    w2: torch.Tensor | QuantizedExperts,  # [num_experts, hidden, inter]
    weights: torch.Tensor,  # [num_tokens, top_k]
    ids: torch.Tensor,  # [num_tokens, top_k]
    activation: Callable[[torch.Tensor], torch.Tensor],  # [rows, 2 * inter] -> [rows, inter]
    b13: torch.Tensor | None = None,  # [num_experts, 2 * inter]
    b2: torch.Tensor | None = None,  # [num_experts, hidden]
    block_m: int = 16,
    ordered_combine: bool = False,
    quantize_inputs: tuple[InputQuantizer, InputQuantizer] | None = None,
) -> torch.Tensor:  # [num_tokens, hidden]
    """Triton version of ``llmsched_kernels.reference.fused_moe``; w13 and w2 are plain
    tensors in x's dtype or QuantizedExperts (on the dequantized weights).
    ordered_combine (batch-invariant mode): each token's experts add one
    after another in top-k slot order, rather than by a reduction whose
    order the device may pick from the batch's size. The grouped GEMMs'
    tiles depend on the weights' shapes only, so each pair's row is computed
    the same whatever shares its tile.
    quantize_inputs (checkpoints that quantize activations per expert, as
    NVFP4 W4A4): gate/up's and down's, each mapping the (token, slot)
    pairs' input rows [num_pairs, K] and their experts [num_pairs] to the
    rows that projection multiplies; x is then read once per pair."""
    num_tokens, top_k = ids.shape
    num_experts = w13.shape[0]
    assert x.dim() == 2 and w13.shape[2] == x.shape[1] and w2.shape[1] == x.shape[1], (
        f"x {tuple(x.shape)} w13 {tuple(w13.shape)} w2 {tuple(w2.shape)}")
    assert w2.shape[2] * 2 == w13.shape[1], f"w13 {tuple(w13.shape)} w2 {tuple(w2.shape)}"
    x = x if x.stride(1) == 1 else x.contiguous()
    sorted_pairs, block_expert, num_padded = align_by_expert(ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    a, a_rows_per = x, top_k
    if quantize_inputs is not None:
        pair_experts = ids.reshape(-1)  # [num_pairs]
        a, a_rows_per = quantize_inputs[0](x.repeat_interleave(top_k, dim=0), pair_experts).contiguous(), 1
    gate_up = grouped_gemm(a, w13, b13, sorted_pairs, block_expert, num_padded, num_pairs, a_rows_per, None, block_m)
    h = activation(gate_up)  # [num_pairs, inter]
    h = (h if quantize_inputs is None else quantize_inputs[1](h, pair_experts)).contiguous()
    flat_weights = weights.reshape(-1).contiguous()  # [num_pairs]
    down = grouped_gemm(h, w2, b2, sorted_pairs, block_expert, num_padded, num_pairs, 1, flat_weights, block_m)
    down = down.view(num_tokens, top_k, -1)  # [num_tokens, top_k, hidden]
    if not ordered_combine:
        return down.sum(dim=1)
    out = down[:, 0].clone()
    for slot in range(1, top_k):
        out += down[:, slot]
    return out
