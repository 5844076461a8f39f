"""Triton kernel: scatter this step's K/V into the paged cache (``write_kv_cache``).

An FP8 cache gets value / scale, saturated to its finite range and encoded
from the float32 bits (llmsched_kernels/fp8_kv.py), as ``llmsched_kernels.reference.write_kv_cache``
casts it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmsched_kernels.fp8_kv import as_kernel_cache, encode_fp8, fp8_kind, max_finite

__all__ = ["write_kv_cache"]


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; int8 bits when KV_FP8
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; int8 bits when KV_FP8
    slot_mapping_ptr,  # [num_tokens] int64 (or int32)
    k_scale,  # fp32: the FP8 cache holds key / k_scale                  (KV_FP8)
    v_scale,  # fp32                                                      (KV_FP8)
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next pow2 of NUM_KV_HEADS
    HEAD_DIM_PAD: tl.constexpr,  # next pow2 of HEAD_DIM
    KV_FP8: tl.constexpr,  # 0: the cache is in the values' dtype; 1: e4m3fn, 2: e5m2 (fp8_kv.fp8_kind)
    FP8_MAX: tl.constexpr,  # the FP8 format's largest finite value   (KV_FP8)
):
    # One program per token: all of its heads form one [HEADS_PAD, HEAD_DIM_PAD] tile,
    # a few KB at most, so a single load/store pair moves the whole token.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token (e.g. CUDA-graph padding): nothing to write
        return
    # int64 before multiplying by the block stride: block_id * stride can pass 2^31.
    block_id = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE

    offs_h = tl.arange(0, HEADS_PAD)  # [HEADS_PAD]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [HEADS_PAD, HEAD_DIM_PAD]

    key = tl.load(
        key_ptr + token * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :], mask=mask
    )  # [HEADS_PAD, HEAD_DIM_PAD]
    value = tl.load(
        value_ptr + token * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :], mask=mask
    )  # [HEADS_PAD, HEAD_DIM_PAD]

    if KV_FP8:
        # div_rn: IEEE division on GPUs too, so the codes match torch's (x / scale).to(fp8).
        key = encode_fp8(tl.clamp(tl.div_rn(key.to(tl.float32), k_scale), -FP8_MAX, FP8_MAX), KV_FP8)
        value = encode_fp8(tl.clamp(tl.div_rn(value.to(tl.float32), v_scale), -FP8_MAX, FP8_MAX), KV_FP8)

    k_dst = k_cache_ptr + block_id * stride_kc_b + in_block * stride_kc_s
    v_dst = v_cache_ptr + block_id * stride_vc_b + in_block * stride_vc_s
    tl.store(
        k_dst + offs_h[:, None] * stride_kc_h + offs_d[None, :],
        key.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dst + offs_h[:, None] * stride_vc_h + offs_d[None, :],
        value.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton version of ``llmsched_kernels.reference.write_kv_cache`` (in place); an FP8
    cache (float8_e4m3fn or float8_e5m2) stores key / k_scale and value / v_scale."""
    assert key.dim() == 3 and value.shape == key.shape, f"key {tuple(key.shape)} value {tuple(value.shape)}"
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, (
        f"k_cache {tuple(k_cache.shape)} v_cache {tuple(v_cache.shape)}"
    )
    num_tokens, num_kv_heads, head_dim = key.shape
    _, block_size, cache_kv_heads, cache_head_dim = k_cache.shape
    assert (cache_kv_heads, cache_head_dim) == (num_kv_heads, head_dim), "key and cache head shapes differ"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)}"
    assert slot_mapping.dtype in (torch.int64, torch.int32), f"slot_mapping dtype {slot_mapping.dtype}"
    assert key.dtype == value.dtype and k_cache.dtype == v_cache.dtype
    kv_fp8 = fp8_kind(k_cache.dtype)
    assert kv_fp8 or k_cache.dtype == key.dtype, f"cache {k_cache.dtype} for {key.dtype} values"
    assert k_scale > 0 and v_scale > 0, f"k_scale {k_scale} v_scale {v_scale}"
    # The head_dim axis is read/written as one contiguous vector.
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.stride(-1) == 1, f"{name} must be contiguous along head_dim, strides {t.stride()}"
    assert slot_mapping.is_contiguous()
    for name, t in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        assert t.device == key.device, f"{name} on {t.device}, key on {key.device}"
    if num_tokens == 0:
        return

    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        as_kernel_cache(k_cache),
        as_kernel_cache(v_cache),
        slot_mapping,
        float(k_scale),
        float(v_scale),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        KV_FP8=kv_fp8,
        FP8_MAX=max_finite(k_cache.dtype),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
