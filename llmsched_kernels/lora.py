"""Triton kernels: multi-LoRA shrink and expand over tokens of mixed adapters
(``lora_shrink``, ``lora_expand``), after Punica's and S-LoRA's segmented
GEMMs: each token names a slot of stacked, zero-padded adapter weights (or -1,
the base model), and one launch serves every slot and rank at once.

The tokens are first ordered by slot (``sort_by_slot``, plain torch ops, no host
sync): ``order`` lists the token indices slot by slot, base-model tokens first,
and slot s's tokens are ``order[starts[s]:starts[s + 1]]``. The grid's first axis
is the slot, its second a BLOCK_M tile of that slot's tokens: every tile holds
the tokens of one adapter, so its weight tile is shared and the product is a
``tl.dot``. The grid is sized for the worst case (one slot holding every token),
known from shapes alone; tiles past a slot's tokens exit at once, and base-model
tokens are in no slot's run, so they cost nothing. Ranks are mixed: a slot's
rank is read at run time, shrink tiles past it exit, and expand's rank loop
stops at it, so a rank-8 adapter in rank-64 buffers reads 8 rows.

The order of operations is PEFT's, rounded where the torch path rounds:
s = x A^T is stored in the activations' dtype; y + scale * (s B^T) is summed in
float32 and rounded once. Fused projections (q/k/v, gate/up) are one launch
each way: shrink's grid has an axis over parts, and expand's tiles each lie in
one part's columns.

Shapes (see ``llmsched_kernels.reference.lora_shrink`` / ``lora_expand`` for the semantics):

* x:            [num_tokens, K] float16, bfloat16 or float32 (unit column stride)
* a:            [num_slots, num_parts, max_rank, K]  A of each slot and part, zero past its rank
* b:            [num_slots, max_rank, N]             B^T of each slot, the parts' columns side by side,
                zero past its rank (N contiguous: expand's weight tiles load whole rows)
* s:            [num_tokens, num_parts, max_rank]    shrink's output; rows of base tokens and
                columns past their slot's rank are left unwritten, and never read
* y:            [num_tokens, N]                      the base output, added to in place
* token_slots:  [num_tokens] int, -1 = no adapter
* ranks:        [num_slots] int32 (0: an empty slot); scales: [num_slots] float32
* part_rows:    the N columns per part (at most three), in order
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmsched_kernels.triton_bits import interpreting, round_to_bf16

__all__ = ["sort_by_slot", "lora_shrink", "lora_expand", "MAX_PARTS"]

MAX_PARTS = 3  # q/k/v: the most parts a fused projection has


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [num_tokens, K]
    a_ptr,  # [num_slots, num_parts, max_rank, K]
    s_ptr,  # [num_tokens, num_parts, max_rank]
    order_ptr,  # [num_tokens] int32: token indices, slot by slot
    starts_ptr,  # [num_slots + 1] int32: where each slot's tokens start in order
    rank_ptr,  # [num_slots] int32
    K,
    R_TILES,  # cdiv(max_rank, BLOCK_R)
    stride_xm,
    stride_as,
    stride_ap,
    stride_ar,
    stride_sm,
    stride_sp,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 so it is not rounded to tf32
    DOT_UPCAST: tl.constexpr,  # interpreter + 16-bit x: multiply as fp32 (exact upcast), as a GPU's MMA does
    ROUND_BY_HAND: tl.constexpr,  # interpreter + bf16: its float32 -> bfloat16 casts truncate
):
    slot = tl.program_id(0)
    pid_m = tl.program_id(1)
    part = tl.program_id(2) // R_TILES
    r0 = (tl.program_id(2) % R_TILES) * BLOCK_R
    end = tl.load(starts_ptr + slot + 1)
    m0 = tl.load(starts_ptr + slot) + pid_m * BLOCK_M
    if m0 >= end:
        return  # past this slot's tokens
    rank = tl.load(rank_ptr + slot)
    if r0 >= rank:
        return  # past this slot's rank
    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_ok = offs_m < end
    tok = tl.load(order_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)  # [BLOCK_M]
    offs_r = r0 + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    r_ok = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    x_rows = x_ptr + tok[:, None] * stride_xm  # [BLOCK_M, 1]
    a_cols = a_ptr + slot.to(tl.int64) * stride_as + part * stride_ap + offs_r[None, :] * stride_ar  # [1, BLOCK_R]
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        xt = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        at = tl.load(a_cols + k[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
        if DOT_UPCAST:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, at, acc, input_precision=DOT_PRECISION)
    if ROUND_BY_HAND:
        acc = round_to_bf16(acc)
    tl.store(s_ptr + tok[:, None] * stride_sm + part * stride_sp + offs_r[None, :],
             acc.to(s_ptr.dtype.element_ty), mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    s_ptr,  # [num_tokens, num_parts, max_rank]
    b_ptr,  # [num_slots, max_rank, N]
    y_ptr,  # [num_tokens, N], read and written
    order_ptr,  # [num_tokens] int32: token indices, slot by slot
    starts_ptr,  # [num_slots + 1] int32
    rank_ptr,  # [num_slots] int32
    scale_ptr,  # [num_slots] float32
    N,
    END0,  # part 0's columns are [0, END0), part 1's [END0, END1), part 2's [END1, N)
    END1,
    N_TILES,  # cdiv(widest part, BLOCK_N): tiles per part
    stride_sm,
    stride_sp,
    stride_bs,
    stride_br,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    ROUND_BY_HAND: tl.constexpr,
):
    slot = tl.program_id(0)
    pid_m = tl.program_id(1)
    part = tl.program_id(2) // N_TILES
    end = tl.load(starts_ptr + slot + 1)
    m0 = tl.load(starts_ptr + slot) + pid_m * BLOCK_M
    if m0 >= end:
        return  # past this slot's tokens
    rank = tl.load(rank_ptr + slot)
    col_start = tl.where(part == 0, 0, tl.where(part == 1, END0, END1))
    col_end = tl.where(part == 0, END0, tl.where(part == 1, END1, N))
    n0 = col_start + (tl.program_id(2) % N_TILES) * BLOCK_N
    if n0 >= col_end:
        return  # past this part's columns (a narrower part than the widest)
    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_ok = offs_m < end
    tok = tl.load(order_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)  # [BLOCK_M]
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < col_end
    offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    s_rows = s_ptr + tok[:, None] * stride_sm + part * stride_sp  # [BLOCK_M, 1]
    b_cols = b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :]  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + offs_r
        r_ok = r < rank
        st = tl.load(s_rows + r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
        bt = tl.load(b_cols + r[:, None] * stride_br, mask=r_ok[:, None] & n_ok[None, :],
                     other=0.0)  # [BLOCK_R, BLOCK_N]
        if DOT_UPCAST:
            st = st.to(tl.float32)
            bt = bt.to(tl.float32)
        acc = tl.dot(st, bt, acc, input_precision=DOT_PRECISION)
    y_tile = y_ptr + tok[:, None] * stride_ym + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
    mask = m_ok[:, None] & n_ok[None, :]
    out = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32) + acc * tl.load(scale_ptr + slot)
    if ROUND_BY_HAND:
        out = round_to_bf16(out)
    tl.store(y_tile, out.to(y_ptr.dtype.element_ty), mask=mask)


def sort_by_slot(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token_slots [num_tokens] (-1: no adapter) -> order [num_tokens] int32,
    the token indices slot by slot (base tokens first, in no slot's run), and
    starts [num_slots + 1] int32, slot s's run being order[starts[s]:starts[s + 1]].
    Torch ops on token_slots' device, no host sync (a graph can capture them)."""
    sorted_slots, order = torch.sort(token_slots.to(torch.int64), stable=True)
    starts = torch.searchsorted(sorted_slots, torch.arange(num_slots + 1, device=token_slots.device),
                                out_int32=True)
    return order.to(torch.int32), starts


def _dot_switches(dtype: torch.dtype) -> dict:
    under_interpreter = interpreting()
    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                DOT_UPCAST=dtype != torch.float32 and under_interpreter,
                ROUND_BY_HAND=dtype == torch.bfloat16 and under_interpreter)


def _block_m(num_tokens: int) -> int:
    return min(64, max(16, triton.next_power_of_2(num_tokens)))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, order: torch.Tensor, starts: torch.Tensor,
                ranks: torch.Tensor) -> torch.Tensor:
    """s [num_tokens, num_parts, max_rank] in x's dtype: s[t, p, :r] = x[t] A[slot(t), p, :r]^T
    for the tokens of each slot (r its rank); other entries are left unwritten."""
    num_tokens, k = x.shape
    num_slots, num_parts, max_rank, a_k = a.shape
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"x {x.dtype}"
    assert a.dtype == x.dtype and a_k == k and a.stride(3) == 1, f"a {tuple(a.shape)} {a.dtype} for x [.., {k}]"
    assert order.shape == (num_tokens,) and order.dtype == torch.int32, "order: [num_tokens] int32"
    assert starts.shape == (num_slots + 1,) and starts.dtype == torch.int32, "starts: [num_slots + 1] int32"
    assert ranks.shape == (num_slots,) and ranks.dtype == torch.int32, "ranks: [num_slots] int32"
    x = x if x.stride(1) == 1 else x.contiguous()
    s = torch.empty((num_tokens, num_parts, max_rank), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return s
    block_m, block_r = _block_m(num_tokens), 16
    block_k = 32 if x.dtype == torch.float32 else 64
    r_tiles = triton.cdiv(max_rank, block_r)
    grid = (num_slots, triton.cdiv(num_tokens, block_m), num_parts * r_tiles)
    _lora_shrink_kernel[grid](
        x, a, s, order, starts, ranks, k, r_tiles, x.stride(0), a.stride(0), a.stride(1), a.stride(2),
        s.stride(0), s.stride(1), BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, **_dot_switches(x.dtype),
        num_warps=4,
    )
    return s


def lora_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, order: torch.Tensor, starts: torch.Tensor,
                ranks: torch.Tensor, scales: torch.Tensor, part_rows: tuple[int, ...]) -> torch.Tensor:
    """y[t, part p's columns] += scale * (s[t, p, :r] b[slot(t), :r, part p's columns]) for the tokens
    of each slot, in place (float32 sum, rounded once); returns y."""
    num_tokens, n = y.shape
    num_slots, max_rank, b_n = b.shape
    num_parts = len(part_rows)
    assert 1 <= num_parts <= MAX_PARTS and sum(part_rows) == n == b_n, f"parts {part_rows} of y [.., {n}], b {b_n}"
    assert s.shape == (num_tokens, num_parts, max_rank) and s.dtype == y.dtype == b.dtype, (
        f"s {tuple(s.shape)} {s.dtype}, y {y.dtype}, b {b.dtype}")
    assert y.stride(1) == 1 and s.stride(2) == 1 and b.stride(2) == 1, "unit column strides"
    assert order.shape == (num_tokens,) and starts.shape == (num_slots + 1,) and ranks.shape == (num_slots,)
    assert scales.shape == (num_slots,) and scales.dtype == torch.float32, "scales: [num_slots] float32"
    if num_tokens == 0:
        return y
    ends = [sum(part_rows[:i + 1]) for i in range(num_parts)] + [n] * (MAX_PARTS - num_parts)
    block_m = _block_m(num_tokens)
    block_n = 32 if y.dtype == torch.float32 else 64
    n_tiles = triton.cdiv(max(part_rows), block_n)
    grid = (num_slots, triton.cdiv(num_tokens, block_m), num_parts * n_tiles)
    _lora_expand_kernel[grid](
        s, b, y, order, starts, ranks, scales, n, ends[0], ends[1], n_tiles, s.stride(0), s.stride(1),
        b.stride(0), b.stride(1), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=16,
        **_dot_switches(y.dtype), num_warps=4,
    )
    return y
