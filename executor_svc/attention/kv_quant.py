"""An FP8 KV cache (EXECUTOR_KV_CACHE_DTYPE=fp8_e4m3 | fp8_e5m2): how a
value is stored and read back, shared by every backend.

Each layer has one scale for K and one for V (the checkpoint's
`self_attn.k_scale` / `v_scale`, else 1.0): the cache holds value / scale
in FP8, saturated to the format's finite range as vLLM does (e4m3fn has
no infinity, and an out-of-range cast gives NaN), and a read multiplies
the stored value, cast to the compute dtype, by the scale. A cache in the
compute dtype ignores the scales.
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor viewed as its bytes (same shape), else t itself: FP8
    blocks are moved (gathered, scattered, swapped) as uint8, which every
    device's indexing ops support, whatever they know of the FP8 types."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def quantize(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: itself in a plain cache; in FP8, x / scale
    (in fp32) saturated to the finite range, rounded to nearest even."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(cache_dtype)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What the cache holds, in the compute dtype: stored * scale for FP8
    (every FP8 value is exact in float16, bfloat16 and float32)."""
    if not is_fp8(stored.dtype):
        return stored
    out = stored.to(dtype)
    return out if scale == 1.0 else out.mul_(scale)
