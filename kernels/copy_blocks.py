"""Triton kernel: whole-block copies inside the paged KV cache (``copy_blocks``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["copy_blocks"]

# Elements moved per program: big enough for wide vector loads, small enough that one
# Llama block (16 * 8 * 128 = 16K elements) still spreads over several programs.
_CHUNK = 2048


@triton.jit
def _copy_blocks_kernel(
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], block-contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], block-contiguous
    block_mapping_ptr,  # [num_pairs, 2] int64 (src_block, dst_block), contiguous
    stride_kc_b,
    stride_vc_b,
    BLOCK_NUMEL: tl.constexpr,  # block_size * num_kv_heads * head_dim
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    # int64 block ids: src * stride can pass 2^31 elements on large caches.
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)

    offs = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK], within one block
    mask = offs < BLOCK_NUMEL  # [CHUNK]
    k = tl.load(k_cache_ptr + src * stride_kc_b + offs, mask=mask)  # [CHUNK]
    tl.store(k_cache_ptr + dst * stride_kc_b + offs, k, mask=mask)
    v = tl.load(v_cache_ptr + src * stride_vc_b + offs, mask=mask)  # [CHUNK]
    tl.store(v_cache_ptr + dst * stride_vc_b + offs, v, mask=mask)


def _block_is_contiguous(cache: torch.Tensor) -> bool:
    """True when each block is one dense run of memory (block stride itself is free)."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    return cache.stride()[1:] == (num_kv_heads * head_dim, head_dim, 1)


def copy_blocks(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: torch.Tensor,  # [n, 2] int64 (src_block, dst_block)
) -> None:
    """Triton version of ``kernels.reference.copy_blocks`` (in place).

    All pairs are copied in parallel, so a dst must not also be a src in the same call.
    """
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, (
        f"k_cache {tuple(k_cache.shape)} v_cache {tuple(v_cache.shape)}"
    )
    assert k_cache.dtype == v_cache.dtype, f"{k_cache.dtype} vs {v_cache.dtype}"
    assert _block_is_contiguous(k_cache) and _block_is_contiguous(v_cache), (
        f"each cache block must be dense, strides {k_cache.stride()} / {v_cache.stride()}"
    )
    assert block_mapping.dim() == 2 and block_mapping.shape[1] == 2, f"block_mapping {tuple(block_mapping.shape)}"
    assert block_mapping.dtype == torch.int64, f"block_mapping dtype {block_mapping.dtype}"
    assert block_mapping.is_contiguous()
    assert block_mapping.device == k_cache.device == v_cache.device, (
        f"block_mapping on {block_mapping.device}, caches on {k_cache.device} / {v_cache.device}"
    )
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return

    block_numel = k_cache.shape[1] * k_cache.shape[2] * k_cache.shape[3]
    grid = (num_pairs, triton.cdiv(block_numel, _CHUNK))
    _copy_blocks_kernel[grid](
        k_cache,
        v_cache,
        block_mapping,
        k_cache.stride(0),
        v_cache.stride(0),
        BLOCK_NUMEL=block_numel,
        CHUNK=_CHUNK,
        num_warps=4,
    )
