"""FP8 KV-cache values encoded and decoded with integer ops, for the kernels
that read and write the paged cache (kv_write, paged_attention, mla_decode).

An FP8 cache (float8_e4m3fn or float8_e5m2) is passed to the kernels as
int8 and converted by hand, so the kernels run where Triton has no FP8
type (sm_80, the A100) and under the interpreter alike:

* decode: e5m2 is the high byte of a float16; e4m3 / 256 is exactly the
  float16 whose bits are e4m3's sign, a zero, then its exponent and
  mantissa bits (the trick llmsched_kernels/fp8_linear.py uses for weights).
* encode: round to nearest even from the float32 bits, as torch's cast
  does; values below the smallest normal go through a float add that
  rounds them to the subnormal grid. Callers saturate first (clamp to
  ``max_finite``), as vLLM does.

Formats, as the launchers' ``KV_FP8`` constexpr: 0 = not FP8, 1 = e4m3fn,
2 = e5m2 (``fp8_kind``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmsched_kernels.triton_bits import e4m3_over_256

__all__ = ["fp8_kind", "as_kernel_cache", "max_finite", "encode_fp8", "decode_fp8"]

_KINDS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}

def fp8_kind(dtype: torch.dtype) -> int:
    """The KV_FP8 constexpr for a cache of this dtype: 0 when it is not FP8."""
    return _KINDS.get(dtype, 0)


def as_kernel_cache(cache: torch.Tensor) -> torch.Tensor:
    """The cache as a kernel takes it: an FP8 cache as its int8 bits."""
    return cache.view(torch.int8) if fp8_kind(cache.dtype) else cache


def max_finite(dtype: torch.dtype) -> float:
    """The saturation bound of an FP8 cache (1.0 for other dtypes: unused)."""
    return float(torch.finfo(dtype).max) if fp8_kind(dtype) else 1.0


@triton.jit
def decode_fp8(bits, KIND: tl.constexpr):
    """int8 bits -> their FP8 value (KIND 1: e4m3fn, 2: e5m2) in float32, exactly."""
    if KIND == 1:
        return e4m3_over_256(bits) * 256.0
    else:
        return (bits.to(tl.int16) << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def encode_fp8(x, KIND: tl.constexpr):
    """float32 x, already within the format's finite range -> its FP8 bits
    (KIND 1: e4m3fn, 2: e5m2) as int8, rounded to nearest even."""
    if KIND == 1:
        SHIFT: tl.constexpr = 20  # 23 - 3 mantissa bits
        REBIAS: tl.constexpr = (7 - 127) << 23
        MIN_NORMAL: tl.constexpr = 121 << 23  # 2^-6
        SUBNORMAL_ADD: tl.constexpr = 16384.0  # 2^14: its float32 ulp, 2^-9, is e4m3's smallest subnormal
        SUBNORMAL_BITS: tl.constexpr = 141 << 23  # the bits of 2^14
    else:
        SHIFT: tl.constexpr = 21  # 23 - 2 mantissa bits
        REBIAS: tl.constexpr = (15 - 127) << 23
        MIN_NORMAL: tl.constexpr = 113 << 23  # 2^-14
        SUBNORMAL_ADD: tl.constexpr = 128.0  # 2^7: its float32 ulp, 2^-16, is e5m2's smallest subnormal
        SUBNORMAL_BITS: tl.constexpr = 134 << 23
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal: rebias the exponent, then round the dropped mantissa bits to nearest even.
    normal = (mag + REBIAS + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT
    # Subnormal (or zero): the float add rounds |x| to a multiple of the smallest subnormal.
    subnormal = (mag.to(tl.float32, bitcast=True) + SUBNORMAL_ADD).to(tl.int32, bitcast=True) - SUBNORMAL_BITS
    return (tl.where(mag < MIN_NORMAL, subnormal, normal) | sign).to(tl.int8)
