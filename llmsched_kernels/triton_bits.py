"""What the Triton kernels share: decoding e4m3 from its int8 bits with
integer ops (so kernels run where Triton has no FP8 type: sm_80, the
A100) and E2M1 (FP4) codes, rounding to bfloat16 by hand (the interpreter's float32 -> bfloat16
cast truncates; a GPU's rounds to nearest even), and whether the
interpreter runs them. Imported by the kernel modules only, never at
package import time."""

from __future__ import annotations

import os

import triton
import triton.language as tl

# 0xBF80 as int16: keeps the sign (bit 15) and bits 13..7, e4m3's exponent
# and mantissa shifted into float16's places (quantization.fp8_as_half).
_E4M3_HALF_MASK = tl.constexpr(-16512)


@triton.jit
def e4m3_over_256(bits):
    """e4m3 bits (int8) -> the value / 256 in float32, exactly: e4m3 / 256
    is the float16 whose bits are e4m3's sign, a zero, then its exponent and
    mantissa bits (e4m3's bias is 8 below float16's)."""
    return ((bits.to(tl.int16) << 7) & _E4M3_HALF_MASK).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def round_to_bf16(x):
    """x (float32) rounded to the nearest bfloat16, ties to even, kept in
    float32 (finite values): what a GPU's cast does, and the interpreter's
    does not."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1(code):
    """The E2M1 value of a 4-bit code's low 4 bits (sign bit high), in float32:
    0 and 0.5 below magnitude code 2, else 2^(m // 2 - 1) * (1 + (m % 2) / 2),
    whose float32 bits are (m + 252) << 22."""
    magnitude = code & 7
    value = tl.where(magnitude >= 2, ((magnitude + 252) << 22).to(tl.float32, bitcast=True),
                     magnitude.to(tl.float32) * 0.5)
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def e8m0_scale(bits):
    """MXFP4's E8M0 scale bits (int32) -> 2^(bits - 127) in float32, from its
    bits (0 is the subnormal 2^-127): times an E2M1 value, the product is exact."""
    return tl.where(bits == 0, 0x400000, bits << 23).to(tl.float32, bitcast=True)


@triton.jit
def nvfp4_scale(e4m3_bits, global_scale):
    """NVFP4's group scale (e4m3 bits, int8) over its row's float32 global
    scale, rounded once in float32, as quant_formats.dequantize_fp4 (and
    compressed-tensors) computes it before multiplying the value."""
    return tl.math.div_rn(e4m3_over_256(e4m3_bits) * 256.0, global_scale)


def interpreting() -> bool:
    """The kernels run under the Triton interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
