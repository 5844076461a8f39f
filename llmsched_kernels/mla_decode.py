"""Triton kernel: multi-head latent attention decode over a paged latent cache (``mla_decode``).

DeepSeek-V3's MLA with the decompression absorbed (see executor_svc/model/mla.py): every head
of a decode token attends over the request's cached latents ``[c, k_pe]`` as one
multi-query attention, each latent serving as the key and its first ``value_dim``
values (c) as the value. As in FlashMLA, one program owns one request and a block of
BLOCK_H heads, so each latent tile loaded from the cache feeds every head of the block;
the score is split into its two parts (c with the absorbed query, k_pe with the RoPE'd
query), each a power-of-two wide tl.dot, with an online softmax in fp32.

Shapes (see ``llmsched_kernels.reference.mla_decode``):

* query:        [num_reqs, num_heads, latent_dim]  one decode token per request
* cache:        [num_blocks, block_size, 1, latent_dim]
* seq_lens:     [num_reqs] int32, context length including the decode token
* block_tables: [num_reqs, max_blocks_per_req] int32
* output:       [num_reqs, num_heads, value_dim]

An FP8 latent cache (float8_e4m3fn or float8_e5m2) is loaded as int8 bits and decoded
with integer ops (llmsched_kernels/fp8_kv.py), times k_scale, in the query's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmsched_kernels.fp8_kv import as_kernel_cache, decode_fp8, fp8_kind
from llmsched_kernels.triton_bits import interpreting

__all__ = ["mla_decode"]

_LOG2E = 1.4426950408889634
_NO_MAX = tl.constexpr(-1.0e30)  # finite: a fully masked first tile must not give NaN


@triton.jit
def _mla_decode_kernel(
    out_ptr,  # [num_reqs, num_heads, VALUE_DIM]
    query_ptr,  # [num_reqs, num_heads, VALUE_DIM + ROPE_DIM]
    cache_ptr,  # [num_blocks, block_size, 1, VALUE_DIM + ROPE_DIM]; int8 bits when KV_FP8
    seq_lens_ptr,  # [num_reqs] int32
    block_tables_ptr,  # [num_reqs, max_blocks_per_req] int32
    num_heads,
    qk_scale,  # softmax scale * log2(e)
    k_scale,  # fp32: a cached latent is stored * k_scale (KV_FP8)
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_c_b,
    stride_c_s,
    stride_bt_r,
    VALUE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    V_PAD: tl.constexpr,  # next pow2 of VALUE_DIM, >= 16
    R_PAD: tl.constexpr,  # next pow2 of ROPE_DIM, >= 16
    BLOCK_H: tl.constexpr,  # heads per program, >= 16
    TILE_N: tl.constexpr,  # context positions per iteration, >= 16
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,  # 0: the cache is in the query's dtype; 1: e4m3fn, 2: e5m2 (fp8_kv.fp8_kind)
):
    req = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    h_ok = heads < num_heads
    seq_len = tl.load(seq_lens_ptr + req)
    offs_v = tl.arange(0, V_PAD)  # [V_PAD]
    v_ok = offs_v < VALUE_DIM
    offs_r = tl.arange(0, R_PAD)  # [R_PAD]
    r_ok = offs_r < ROPE_DIM

    q_row = query_ptr + req.to(tl.int64) * stride_q_t + heads[:, None] * stride_q_h  # [BLOCK_H, 1]
    q_c = tl.load(q_row + offs_v[None, :], mask=h_ok[:, None] & v_ok[None, :], other=0.0)  # [BLOCK_H, V_PAD]
    q_pe = tl.load(q_row + VALUE_DIM + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :],
                   other=0.0)  # [BLOCK_H, R_PAD]
    if DOT_UPCAST:
        q_c = q_c.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt_r
    row_max = tl.full([BLOCK_H], _NO_MAX, dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, V_PAD], dtype=tl.float32)
    for start in range(0, seq_len, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)  # [TILE_N]
        n_ok = offs_n < seq_len
        # int64 before scaling by the block stride: block_id * stride can pass 2^31.
        block_id = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)  # [TILE_N]
        slot = cache_ptr + block_id * stride_c_b + (offs_n % BLOCK_SIZE) * stride_c_s  # [TILE_N]
        c = tl.load(slot[:, None] + offs_v[None, :], mask=n_ok[:, None] & v_ok[None, :], other=0)  # [TILE_N, V_PAD]
        pe = tl.load(slot[:, None] + VALUE_DIM + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                     other=0)  # [TILE_N, R_PAD]
        if KV_FP8:
            c = (decode_fp8(c, KV_FP8) * k_scale).to(query_ptr.dtype.element_ty)
            pe = (decode_fp8(pe, KV_FP8) * k_scale).to(query_ptr.dtype.element_ty)
        if DOT_UPCAST:
            c = c.to(tl.float32)
            pe = pe.to(tl.float32)
        scores = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)  # [BLOCK_H, TILE_N]
        scores = tl.dot(q_pe, tl.trans(pe), scores, input_precision=DOT_PRECISION)
        scores = tl.where(n_ok[None, :], scores * qk_scale, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))  # [BLOCK_H]
        rescale = tl.exp2(row_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])  # [BLOCK_H, TILE_N]
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        row_max = new_max
        acc = tl.dot(probs.to(c.dtype), c, acc * rescale[:, None], input_precision=DOT_PRECISION)
    out = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]  # [BLOCK_H, V_PAD]
    tl.store(out_ptr + req.to(tl.int64) * stride_o_t + heads[:, None] * stride_o_h + offs_v[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & v_ok[None, :])


def mla_decode(
    query: torch.Tensor,  # [num_reqs, num_heads, latent_dim]
    cache: torch.Tensor,  # [num_blocks, block_size, 1, latent_dim]
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    scale: float,
    value_dim: int,
    k_scale: float = 1.0,
) -> torch.Tensor:  # [num_reqs, num_heads, value_dim]
    """Triton version of ``llmsched_kernels.reference.mla_decode``; the cache may be
    float8_e4m3fn or float8_e5m2, read as stored * k_scale."""
    num_reqs, num_heads, latent_dim = query.shape
    assert cache.dim() == 4 and cache.shape[2] == 1 and cache.shape[3] == latent_dim, (
        f"cache {tuple(cache.shape)} for query {tuple(query.shape)}")
    assert 0 < value_dim < latent_dim, f"value_dim {value_dim} of latent_dim {latent_dim}"
    assert seq_lens.shape == (num_reqs,) and seq_lens.dtype == torch.int32
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_reqs and block_tables.dtype == torch.int32
    assert query.dtype == cache.dtype or fp8_kind(cache.dtype), f"{query.dtype} / {cache.dtype}"
    for name, t in (("query", query), ("cache", cache), ("block_tables", block_tables)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {t.stride()}"
        assert t.device == query.device
    out = torch.empty((num_reqs, num_heads, value_dim), dtype=query.dtype, device=query.device)
    if num_reqs == 0:
        return out
    rope_dim = latent_dim - value_dim
    # 32 heads a program decoding an FP8 latent in fp32 spills on sm_80 (432 B); 16 do not.
    block_h = 16 if num_heads <= 16 or fp8_kind(cache.dtype) else 32
    v_pad = max(16, triton.next_power_of_2(value_dim))
    tile_n = 16 if v_pad > 256 else 32
    _mla_decode_kernel[(num_reqs, triton.cdiv(num_heads, block_h))](
        out, query, as_kernel_cache(cache), seq_lens, block_tables, num_heads, scale * _LOG2E, float(k_scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1),
        block_tables.stride(0),
        VALUE_DIM=value_dim, ROPE_DIM=rope_dim, V_PAD=v_pad, R_PAD=max(16, triton.next_power_of_2(rope_dim)),
        BLOCK_H=block_h, TILE_N=tile_n, BLOCK_SIZE=cache.shape[1],
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_UPCAST=query.dtype == torch.bfloat16 and interpreting(),
        KV_FP8=fp8_kind(cache.dtype),
        num_warps=4 if v_pad <= 128 else 8,
    )
    return out
