"""Triton kernel: causal attention over a paged KV cache (``paged_attention``).

One launch serves a mixed batch: decode tokens, whole prefills, prefill chunks and
prefix-cache hits are all "q_len new tokens at the end of a seq_len context".

Work decomposition
------------------
A program owns one *query tile* of one KV head: up to BLOCK_Q consecutive query tokens
of one request times the GROUP query heads that share the KV head. The tile's rows are
(token, head-in-group) pairs, so a decode step of a GQA-8 model still fills 8 rows of
the QK^T matrix multiply, and each K/V tile loaded from the cache is reused by every
row. The program walks the request's context in TILE_N-position tiles (a tile may span
several cache blocks; each position looks its block up in the block table), with an
online softmax in fp32.

Query tiles are numbered without a host sync: request r owns tiles starting at
``(cu_query_lens[r] + r * (BLOCK_Q - 1)) // BLOCK_Q``, which leaves room for
``ceil(q_len / BLOCK_Q)`` tiles per request; a program finds its request by binary
search over cu_query_lens (after an O(1) check for the one-token-per-request decode
layout), and the few surplus programs exit at once.

Split-KV (flash-decoding): when a decode batch has too few (request, KV head) pairs to
fill the GPU, each program takes only one of NUM_SPLITS slices of the context and
writes an unnormalised partial result; a second small kernel merges the slices.

Optional per-call features, each behind a constexpr switch so the plain kernel is
compiled without them:

* Sliding window W (USE_WINDOW): a query at position i sees positions j with
  ``i - W < j <= i``. A query tile starts its KV loop at the tile holding the first
  position its earliest query sees, so tiles wholly outside the window are never
  loaded; split-KV divides only that visible range.
* Score soft-capping s (USE_SOFTCAP): ``s * tanh(q.k * scale / s)`` before masking and
  softmax (Gemma 2).
* Attention sinks (USE_SINKS): one learned logit per head joins the softmax's
  denominator and weighs no value (gpt-oss); added once, after the KV loop (or in the
  split-KV merge).
* An FP8 cache (KV_FP8): K and V tiles are loaded as int8 bits, decoded with integer
  ops (llmsched_kernels/fp8_kv.py: no Triton FP8 type, so sm_80 too), times k_scale / v_scale,
  and cast to the query's dtype before the dots.

tl.dot needs every dimension >= 16, so rows are padded to BLOCK_M >= 16, the head dim
to HEAD_DIM_PAD >= 16 (next power of two, masked) and TILE_N >= 16.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from llmsched_kernels.fp8_kv import as_kernel_cache, decode_fp8, fp8_kind
from llmsched_kernels.triton_bits import interpreting

__all__ = ["paged_attention"]

_LOG2E = 1.4426950408889634
# Running max of a row that has seen nothing yet. Finite on purpose: with -inf, a row
# whose first tile is fully masked would compute exp2(-inf - -inf) = NaN.
_NO_MAX = tl.constexpr(-1.0e30)


@triton.jit
def _request_of_tile(
    cu_query_lens_ptr,  # [num_reqs + 1] int32
    num_reqs,
    tile,
    BLOCK_Q: tl.constexpr,
):
    """Largest request r whose first query tile is <= ``tile`` (first tiles never decrease)."""
    # Decode fast path: with one query per request, tile i is request i. Checking that
    # costs two independent loads instead of log2(num_reqs) dependent ones.
    guess = tl.minimum(tile, num_reqs - 1)
    guess_first = (tl.load(cu_query_lens_ptr + guess) + guess * (BLOCK_Q - 1)) // BLOCK_Q
    next_first = (tl.load(cu_query_lens_ptr + guess + 1) + (guess + 1) * (BLOCK_Q - 1)) // BLOCK_Q
    hit = (guess_first <= tile) & (next_first > tile)
    lo = tl.where(hit, guess, 0)
    hi = tl.where(hit, guess + 1, num_reqs)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = (tl.load(cu_query_lens_ptr + mid) + mid * (BLOCK_Q - 1)) // BLOCK_Q
        go_right = first_tile <= tile
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b, with fp32 accumulation."""
    if UPCAST:
        # Triton's CPU interpreter multiplies bf16 operands as their raw uint16 bits;
        # bf16 -> fp32 is exact, so upcasting gives the same numbers the GPU MMA does.
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _tanh(x):
    """tanh from exp2; libdevice's tanh has no Triton-interpreter (CPU) implementation."""
    # exp2 of a non-positive argument: never overflows. Absolute error ~1e-7.
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]                     (NUM_SPLITS == 1)
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32 (NUM_SPLITS > 1)
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, log2 domain (NUM_SPLITS > 1)
    part_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32           (NUM_SPLITS > 1)
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; int8 bits when KV_FP8
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; int8 bits when KV_FP8
    cu_query_lens_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    block_tables_ptr,  # [num_reqs, max_blocks_per_req] int32
    sinks_ptr,  # [num_heads] fp32                                      (USE_SINKS)
    num_reqs,
    num_heads,
    qk_scale,  # softmax scale * log2(e): scores live in the log2 domain (exp2 is cheaper);
    #            with USE_SOFTCAP: softmax scale / softcap, the argument of tanh
    softcap_log2,  # softcap * log2(e)                                   (USE_SOFTCAP)
    window,  # sliding window W: positions i - W < j <= i are visible   (USE_WINDOW)
    k_scale,  # fp32: a cached K is stored * k_scale                    (KV_FP8)
    v_scale,  # fp32                                                    (KV_FP8)
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_bt_r,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next pow2 of GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # rows per tile, >= BLOCK_Q * GROUP_PAD and >= 16
    TILE_N: tl.constexpr,  # context positions per inner iteration, >= 16
    BLOCK_SIZE: tl.constexpr,  # cache block size
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next pow2 of HEAD_DIM, >= 16
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs so they are not rounded to tf32
    DOT_UPCAST: tl.constexpr,  # interpreter + bf16 only, see _mma
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,  # 0: the cache is in the query's dtype; 1: e4m3fn, 2: e5m2 (fp8_kv.fp8_kind)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = _request_of_tile(cu_query_lens_ptr, num_reqs, tile, BLOCK_Q)
    q_start = tl.load(cu_query_lens_ptr + req)
    q_len = tl.load(cu_query_lens_ptr + req + 1) - q_start
    q_tile = tile - (q_start + req * (BLOCK_Q - 1)) // BLOCK_Q  # tile index within the request
    if q_tile * BLOCK_Q >= q_len:  # surplus program of the tile numbering
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # positions cached before this step's tokens

    # Rows are (query token, head within the KV head's group) pairs.
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_q = offs_m // GROUP_PAD  # [BLOCK_M] token within the tile
    row_g = offs_m % GROUP_PAD  # [BLOCK_M] head within the group
    q_idx = q_tile * BLOCK_Q + row_q  # [BLOCK_M] token within the request
    row_ok = (row_q < BLOCK_Q) & (row_g < GROUP) & (q_idx < q_len)  # [BLOCK_M]
    q_pos = context_len + q_idx  # [BLOCK_M] absolute position: sees positions <= q_pos
    token = (q_start + q_idx).to(tl.int64)  # [BLOCK_M]
    head = kv_head * GROUP + row_g  # [BLOCK_M]

    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    if HEAD_DIM_PAD == HEAD_DIM:
        d_ok = offs_d >= 0  # all true; kept trivially so loads stay fully vectorised
    else:
        d_ok = offs_d < HEAD_DIM

    q = tl.load(
        query_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]

    # The last query of the tile bounds the context the whole tile can see.
    last_q_idx = tl.minimum(q_len, (q_tile + 1) * BLOCK_Q) - 1
    kv_len = context_len + last_q_idx + 1
    num_kv_tiles = tl.cdiv(kv_len, TILE_N)
    if USE_WINDOW:
        # The first query of the tile sees the earliest positions; tiles before the one
        # holding its first visible position are skipped, not loaded and masked.
        first_visible = tl.maximum(context_len + q_tile * BLOCK_Q - window + 1, 0)
        first_kv_tile = first_visible // TILE_N
    else:
        first_kv_tile = 0
    # Split-KV slices only the tiles the query tile can see.
    tiles_per_split = tl.cdiv(num_kv_tiles - first_kv_tile, NUM_SPLITS)
    kv_tile_begin = first_kv_tile + split * tiles_per_split
    kv_tile_end = tl.minimum(kv_tile_begin + tiles_per_split, num_kv_tiles)

    block_table_row = block_tables_ptr + req.to(tl.int64) * stride_bt_r
    k_head_ptr = k_cache_ptr + kv_head * stride_kc_h
    v_head_ptr = v_cache_ptr + kv_head * stride_vc_h

    row_max = tl.full([BLOCK_M], _NO_MAX, dtype=tl.float32)  # [BLOCK_M] running max (log2 domain)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M] running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)  # [BLOCK_M, HEAD_DIM_PAD]

    for kv_tile in range(kv_tile_begin, kv_tile_end):
        offs_n = kv_tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] context positions
        n_ok = offs_n < kv_len  # [TILE_N]
        # Never dereference table entries past the request's need: they are padding.
        block_id = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0)  # [TILE_N]
        # int64 before scaling by the block stride: block_id * stride can pass 2^31.
        block_id = block_id.to(tl.int64)
        in_block = offs_n % BLOCK_SIZE  # [TILE_N]
        kv_mask = n_ok[:, None] & d_ok[None, :]  # [TILE_N, HEAD_DIM_PAD]

        k = tl.load(
            k_head_ptr + (block_id * stride_kc_b + in_block * stride_kc_s)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0,
        )  # [TILE_N, HEAD_DIM_PAD]
        if KV_FP8:
            k = (decode_fp8(k, KV_FP8) * k_scale).to(q.dtype)
        scores = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32), DOT_PRECISION, DOT_UPCAST)
        if USE_SOFTCAP:
            scores = _tanh(scores * qk_scale) * softcap_log2  # [BLOCK_M, TILE_N]
        else:
            scores = scores * qk_scale  # [BLOCK_M, TILE_N]
        # Causal inside the chunk; also hides positions past kv_len (they are > q_pos).
        visible = offs_n[None, :] <= q_pos[:, None]  # [BLOCK_M, TILE_N]
        if USE_WINDOW:
            # The first tile of the loop may still hold positions some rows must not see.
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))  # [BLOCK_M]
        rescale = tl.exp2(row_max - new_max)  # [BLOCK_M]
        probs = tl.exp2(scores - new_max[:, None])  # [BLOCK_M, TILE_N]
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        row_max = new_max

        v = tl.load(
            v_head_ptr + (block_id * stride_vc_b + in_block * stride_vc_s)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0,
        )  # [TILE_N, HEAD_DIM_PAD]
        if KV_FP8:
            v = (decode_fp8(v, KV_FP8) * v_scale).to(q.dtype)
        acc = acc * rescale[:, None]
        # Probabilities go through the MMA in the cache dtype (fp16/bf16 tensor cores).
        acc = _mma(probs.to(v.dtype), v, acc, DOT_PRECISION, DOT_UPCAST)

    if NUM_SPLITS == 1:
        if USE_SINKS:
            # The sink's exp joins the denominator, on the running max's scale.
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634  # [BLOCK_M], log2 domain
            new_max = tl.maximum(row_max, sink)
            rescale = tl.exp2(row_max - new_max)
            acc = acc * rescale[:, None]
            row_sum = row_sum * rescale + tl.exp2(sink - new_max)
        # Rows that saw nothing are masked out of the store; guard the division anyway.
        out = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]  # [BLOCK_M, HEAD_DIM_PAD]
        tl.store(
            out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # An empty slice still writes (max=_NO_MAX, sum=0) so the merge can weight it 0.
        part_row = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M] int64
        tl.store(part_max_ptr + part_row, row_max, mask=row_ok)
        tl.store(part_sum_ptr + part_row, row_sum, mask=row_ok)
        tl.store(
            part_acc_ptr + part_row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            acc,
            mask=row_ok[:, None],
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, log2 domain
    part_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    sinks_ptr,  # [num_heads] fp32 (USE_SINKS)
    num_heads,
    stride_o_t,
    stride_o_h,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next pow2 of NUM_SPLITS
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    first_part = (token * num_heads + head) * NUM_SPLITS

    offs_s = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    s_ok = offs_s < NUM_SPLITS  # [SPLITS_PAD]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]

    part_max = tl.load(part_max_ptr + first_part + offs_s, mask=s_ok, other=_NO_MAX)  # [SPLITS_PAD]
    part_sum = tl.load(part_sum_ptr + first_part + offs_s, mask=s_ok, other=0.0)  # [SPLITS_PAD]
    part_acc = tl.load(
        part_acc_ptr + (first_part + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
        mask=s_ok[:, None],
        other=0.0,
    )  # [SPLITS_PAD, HEAD_DIM_PAD]

    # Every query sees at least its own position, held by some slice, so the max is real.
    global_max = tl.max(part_max, axis=0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # log2 domain
        global_max = tl.maximum(global_max, sink)
    weight = tl.exp2(part_max - global_max)  # [SPLITS_PAD]; empty slices -> 0
    denom = tl.sum(part_sum * weight, axis=0)
    if USE_SINKS:
        denom += tl.exp2(sink - global_max)
    out = tl.sum(part_acc * weight[:, None], axis=0) / denom  # [HEAD_DIM_PAD]
    tl.store(
        out_ptr + token * stride_o_t + head * stride_o_h + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@dataclasses.dataclass(frozen=True)
class _Config:
    block_q: int  # query tokens per tile
    block_m: int  # rows per tile
    tile_n: int  # context positions per inner iteration
    num_splits: int  # context slices per query tile (1 = no split-KV)
    num_warps: int
    num_stages: int


# Upper bound on split-KV slices: more only adds merge traffic.
_MAX_SPLITS = 16
# Positions per split below which splitting stops paying for the merge.
_MIN_POSITIONS_PER_SPLIT = 128


def _compute_capability(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)
    return (9, 0)  # interpreter runs: pick tiles as for the H100/H200 target


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # Interpreter runs (CPU tensors): a small stand-in so tests exercise split-KV.
    return 4


# (block_m, tile_n, num_warps) before GQA widening, keyed by (is_fp32, is_decode, wide_head).
# Picked from compiled register/shared-memory usage on sm_90 (tests/kernels/aot_compile.py):
# every entry compiles without spills. fp32 runs its dots on FMA units ("ieee"), which need
# many more registers per tile, hence its smaller tiles; it is a correctness path.
_TILES = {
    # fp16 / bf16
    (False, True, False): (16, 64, 4),  # decode, head_dim <= 128: 116 regs, 38 KB smem
    (False, True, True): (16, 32, 4),  # decode, head_dim 256
    (False, False, False): (64, 64, 4),  # prefill/mixed, head_dim <= 128: 185 regs, 80 KB smem (sm_90)
    (False, False, True): (64, 32, 8),  # prefill/mixed, head_dim 256
    # fp32
    (True, True, False): (16, 32, 8),
    (True, True, True): (16, 32, 8),
    (True, False, False): (32, 32, 8),
    (True, False, True): (16, 32, 8),
}


def _pick_config(
    num_tokens: int,
    num_reqs: int,
    num_kv_heads: int,
    group: int,
    head_dim_pad: int,
    max_context: int,  # block_tables width * block_size: an upper bound, known without a sync
    dtype: torch.dtype,
    device: torch.device,
    sliding_window: int | None = None,
    kv_fp8: bool = False,
    fixed_split: bool = False,
) -> _Config:
    """Tile shapes from host-known sizes only (no device sync, CUDA-graph friendly).

    fixed_split (batch-invariant mode): one shape whatever the batch, the
    mixed batches' tiles and no split-KV, so a query's context is walked in
    the same TILE_N tiles in the same order in every launch. Each query is
    one row of its tile: the other rows (its request's neighbouring
    queries) do not enter its dots, and the tiles past its own position are
    fully masked, which leaves its running max, sum and accumulator
    bitwise unchanged (a weight of exactly 0, a rescale of exactly 1)."""
    # Only shapes are known on the host. num_tokens == num_reqs is the decode signature;
    # any other batch is treated as containing prefill chunks (still correct either way).
    is_decode = num_tokens == num_reqs and not fixed_split
    block_m, tile_n, num_warps = _TILES[(dtype == torch.float32, is_decode, head_dim_pad > 128)]
    group_pad = triton.next_power_of_2(group)
    # A tile holds whole groups: at least one token's worth of heads.
    block_m = max(block_m, group_pad)
    block_q = 1 if is_decode else block_m // group_pad
    if dtype != torch.float32 and not is_decode and _compute_capability(device) < (9, 0):
        # Without Hopper's wgmma the 64x64 tile spills on sm_80 (255 regs + 52 B of
        # spills, 128 regs + 20 B at 8 warps); 64x32 at 4 warps fits in 190 regs.
        tile_n = 32
        if kv_fp8:
            # Decoding FP8 tiles in fp32 spills at 4 warps (255 regs + 76 B); 8 warps fit.
            num_warps = 8

    num_splits = 1
    if is_decode and not fixed_split:
        programs = num_reqs * num_kv_heads
        sms = _num_sms(device)
        if programs < sms:
            by_occupancy = triton.cdiv(2 * sms, programs)
            # A decode query sees at most `sliding_window` positions: only those are split.
            visible = max_context if sliding_window is None else min(max_context, sliding_window)
            by_length = max(1, visible // _MIN_POSITIONS_PER_SPLIT)
            num_splits = max(1, min(_MAX_SPLITS, by_occupancy, by_length))

    return _Config(
        block_q=block_q, block_m=block_m, tile_n=tile_n, num_splits=num_splits, num_warps=num_warps, num_stages=2
    )


def _check_inputs(query, k_cache, v_cache, cu_query_lens, seq_lens, block_tables) -> None:
    assert query.dim() == 3, f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}"
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, (
        f"k_cache {tuple(k_cache.shape)} v_cache {tuple(v_cache.shape)}"
    )
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim, f"head_dim {head_dim} vs cache {cache_head_dim}"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of {num_kv_heads}"
    assert 8 <= head_dim <= 256, f"head_dim {head_dim} outside 8..256"
    assert query.dtype in (torch.float32, torch.float16, torch.bfloat16), f"query dtype {query.dtype}"
    assert k_cache.dtype == v_cache.dtype and (k_cache.dtype == query.dtype or fp8_kind(k_cache.dtype)), (
        f"{query.dtype} / {k_cache.dtype} / {v_cache.dtype}")
    num_reqs = seq_lens.shape[0]
    assert seq_lens.shape == (num_reqs,) and seq_lens.dtype == torch.int32, (
        f"seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype}"
    )
    assert cu_query_lens.shape == (num_reqs + 1,) and cu_query_lens.dtype == torch.int32, (
        f"cu_query_lens {tuple(cu_query_lens.shape)} {cu_query_lens.dtype}"
    )
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_reqs, f"block_tables {tuple(block_tables.shape)}"
    assert block_tables.dtype == torch.int32, f"block_tables dtype {block_tables.dtype}"
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {t.stride()}"
    assert cu_query_lens.is_contiguous() and seq_lens.is_contiguous()
    others = (("cache", k_cache), ("cu_query_lens", cu_query_lens), ("seq_lens", seq_lens), ("block_tables", block_tables))
    for name, t in others:
        assert t.device == query.device, f"{name} on {t.device}, query on {query.device}"


def _check_features(sliding_window, softcap) -> None:
    # bool is an int subclass: True as a window or cap is a caller bug, not 1.
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0.0 < softcap < float("inf"):
            raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_query_lens: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] fp32
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fixed_split: bool = False,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Triton version of ``llmsched_kernels.reference.paged_attention`` (same arguments); the
    caches may be float8_e4m3fn or float8_e5m2, read as stored * k_scale / v_scale.
    fixed_split: one tile shape and no split-KV for every batch (batch-invariant
    mode, see _pick_config)."""
    _check_inputs(query, k_cache, v_cache, cu_query_lens, seq_lens, block_tables)
    _check_features(sliding_window, softcap)
    if sinks is not None:
        assert sinks.shape == (query.shape[1],) and sinks.dtype == torch.float32 and sinks.is_contiguous(), (
            f"sinks must be [num_heads] contiguous fp32, got {tuple(sinks.shape)} {sinks.dtype}")
        assert sinks.device == query.device
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_reqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))

    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_reqs == 0:
        return out

    cfg = _pick_config(
        num_tokens,
        num_reqs,
        num_kv_heads,
        group,
        head_dim_pad,
        block_tables.shape[1] * block_size,
        query.dtype,
        query.device,
        sliding_window,
        kv_fp8=bool(fp8_kind(k_cache.dtype)),
        fixed_split=fixed_split,
    )
    # Enough tiles for ceil(q_len / block_q) per request (see the module docstring).
    num_q_tiles = (num_tokens + num_reqs * (cfg.block_q - 1)) // cfg.block_q

    if cfg.num_splits > 1:
        part_acc = torch.empty(
            (num_tokens, num_heads, cfg.num_splits, head_dim_pad), dtype=torch.float32, device=query.device
        )  # [num_tokens, num_heads, num_splits, head_dim_pad]
        part_max = torch.empty(
            (num_tokens, num_heads, cfg.num_splits), dtype=torch.float32, device=query.device
        )  # [num_tokens, num_heads, num_splits]
        part_sum = torch.empty_like(part_max)  # [num_tokens, num_heads, num_splits]
    else:
        part_acc = part_max = part_sum = out  # unused placeholders

    _paged_attention_kernel[(num_q_tiles, num_kv_heads, cfg.num_splits)](
        out,
        part_acc,
        part_max,
        part_sum,
        query,
        as_kernel_cache(k_cache),
        as_kernel_cache(v_cache),
        cu_query_lens,
        seq_lens,
        block_tables,
        sinks if sinks is not None else seq_lens,
        num_reqs,
        num_heads,
        scale * _LOG2E if softcap is None else scale / softcap,
        0.0 if softcap is None else softcap * _LOG2E,
        0 if sliding_window is None else sliding_window,
        float(k_scale),
        float(v_scale),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        TILE_N=cfg.tile_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        NUM_SPLITS=cfg.num_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_UPCAST=query.dtype == torch.bfloat16 and interpreting(),
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        USE_SINKS=sinks is not None,
        KV_FP8=fp8_kind(k_cache.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            sinks if sinks is not None else part_max,
            num_heads,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=cfg.num_splits,
            SPLITS_PAD=triton.next_power_of_2(cfg.num_splits),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            USE_SINKS=sinks is not None,
            num_warps=1 if head_dim_pad <= 64 else 2,
        )
    return out
