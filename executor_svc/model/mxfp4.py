"""MXFP4 (OCP microscaling FP4) weights.

gpt-oss's released checkpoints store each expert projection as 4-bit E2M1
values, two per byte (`*_blocks`, [..., groups, 16] uint8), with one power
of two per group of 32 values (`*_scales`, [..., groups] uint8, biased by
127). The executor keeps them packed and dequantizes one expert when a
token is routed to it (families/gpt_oss.py), into the serving dtype, as
transformers does when it runs without its MXFP4 kernels: exact for fp32
and bf16 (every MXFP4 value is representable in both).
"""

from __future__ import annotations

import torch

# The 16 E2M1 values, by their 4-bit code (sign bit high).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., groups, 16] uint8 + scales [..., groups] uint8 ->
    [..., groups * 32] in dtype: low nibble first, each value times
    2^(scale - 127), as transformers' convert_moe_packed_tensors (before its
    final transpose)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    out = torch.empty(*blocks.shape[:-1], 32, dtype=dtype, device=blocks.device)  # [..., groups, 32]
    out[..., 0::2] = lut[(blocks & 0x0F).int()]
    out[..., 1::2] = lut[(blocks >> 4).int()]
    exponents = scales.to(torch.int32) - 127  # [..., groups]
    out = torch.ldexp(out, exponents[..., None].expand_as(out))
    return out.reshape(*blocks.shape[:-2], -1)
