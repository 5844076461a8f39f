"""Quantized checkpoints: reading quantization_config into a QuantSpec, and
turning the decoder's linear layers into ones that keep the checkpoint's
quantized weights as they are.

FP8 with block scales (quant_method "fp8" and weight_block_size: DeepSeek-V3
and R1, Kimi K2, the Qwen3 -FP8 releases): each linear weight is
float8_e4m3fn, and `weight_scale_inv` holds one float32 scale per block of
block_n rows by block_k columns, blocks at the edges included. The weights
stay FP8 in memory. On CUDA a linear layer runs kernels/fp8_linear.py,
which decodes FP8 in its load loop; elsewhere (and for experts) a layer
dequantizes its own weight for each matmul (`dequantize_fp8_blocks`) and
drops it after, so at most one layer's weight is ever held at the compute
dtype. Activations stay in the compute dtype (W8A16), which is what
transformers computes on the CPU for the same checkpoint (it dequantizes on
load), and what GPUs without FP8 tensor cores run. activation_scheme "dynamic" describes how FP8 GPUs quantize
activations per token group; it does not change the stored weights.

Every key that changes the math is read or refused by name, as with the
rest of config.json; keys that only record how the checkpoint was made are
accepted. The layers themselves are in layers.py (ColumnLinear.use_fp8,
RowLinear.use_fp8, convert_to_fp8).
"""

from __future__ import annotations

from typing import Any

import torch

from executor_svc.model.model_config import QuantSpec, UnsupportedConfig

FP8 = torch.float8_e4m3fn
# The keys of quant_method fp8 that are read; `dequantize` is transformers'
# load-time switch and changes nothing here.
FP8_KEYS = {"quant_method", "weight_block_size", "activation_scheme", "fmt", "modules_to_not_convert",
            "ignored_layers", "scale_fmt", "dequantize"}
# Methods served, and where (the refusal names them).
SUPPORTED = "'fp8' with weight_block_size, and 'mxfp4' (gpt-oss)"


def read_quantization(config: dict[str, Any] | None, family: str) -> QuantSpec | None:
    """quantization_config of a family that has none of its own (gpt-oss
    reads its MXFP4 in families/gpt_oss.py)."""
    if config is None:
        return None
    method = config.get("quant_method")
    if method != "fp8":
        raise UnsupportedConfig(f"{family} config.json: quantization_config quant_method={method!r} is not "
                                f"supported; supported: {SUPPORTED}")
    unknown = sorted(set(config) - FP8_KEYS)
    if unknown:
        raise UnsupportedConfig(f"{family} config.json: quantization_config keys {unknown} are not implemented for "
                                f"quant_method 'fp8'; it reads {sorted(FP8_KEYS)}")
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedConfig(f"{family} config.json: quantization_config fmt={fmt!r} is not supported; "
                                "FP8 weights are read as e4m3 (float8_e4m3fn)")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UnsupportedConfig(f"{family} config.json: quantization_config activation_scheme={scheme!r} is not "
                                "supported; only 'dynamic' (no activation scales in the checkpoint)")
    # ue8m0: the scales are powers of two (DeepSeek-V3.1); stored as float32
    # or as float8_e8m0fnu, both read exactly as float32.
    scale_fmt = config.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise UnsupportedConfig(f"{family} config.json: quantization_config scale_fmt={scale_fmt!r} is not "
                                "supported; supported: absent (float32 scales) or 'ue8m0'")
    block = config.get("weight_block_size")
    if block is None:
        raise UnsupportedConfig(f"{family} config.json: quantization_config for quant_method 'fp8' without "
                                "weight_block_size (per-tensor FP8) is not supported yet; FP8 with block scales is")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise UnsupportedConfig(f"{family} config.json: quantization_config weight_block_size={block!r} must be "
                                "two positive integers [block_n, block_k]")
    not_converted = tuple(config.get("modules_to_not_convert") or ()) + tuple(config.get("ignored_layers") or ())
    return QuantSpec("fp8", weight_block=(block[0], block[1]), not_converted=not_converted)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# e4m3 values times 2^-8 are exactly the half-precision numbers whose bits
# are e4m3's sign, then a zero, then its 7 exponent and mantissa bits: both
# formats put the exponent before the mantissa, and e4m3's bias (7) is 8 less
# than half precision's (15); subnormals map onto subnormals alike. Shifting
# the bits this way is several times faster on the CPU than torch's
# float8 -> float32 conversion, which goes one element at a time.
FP8_AS_HALF_SCALE = 256.0
_HALF_SIGN_AND_LOW_BITS = -16512  # 0xBF80 as int16: the sign bit and bits 13..7


def fp8_as_half(weight: torch.Tensor) -> torch.Tensor:
    """weight (float8_e4m3fn) / 256 in float16, exactly, for every finite value."""
    return ((weight.view(torch.int8).to(torch.int16) << 7) & _HALF_SIGN_AND_LOW_BITS).view(torch.float16)


def dequantize_fp8_blocks(weight: torch.Tensor, scales: torch.Tensor, grid_rows: torch.Tensor, block_k: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """weight [rows, cols] in FP8 times its block scales, in dtype.

    scales: [grid rows, cdiv(cols, block_k)] float32; grid_rows: [rows], the
    grid row of each weight row (a layer standing for several checkpoint
    tensors stacks their grids). The product is taken in float32 and then
    cast, as transformers does, so that a bf16 model gets the same weights.
    On the CPU the FP8 values come through fp8_as_half, and the scales take
    its factor of 256: the same products, bit for bit."""
    rows, cols = weight.shape
    s = scales.index_select(0, grid_rows)  # [rows, cdiv(cols, block_k)]
    if weight.device.type == "cpu":
        w = fp8_as_half(weight).to(torch.float32)
        s = s * FP8_AS_HALF_SCALE
    else:
        w = weight.to(torch.float32)
    full = cols // block_k * block_k
    if full:
        w[:, :full].unflatten(1, (full // block_k, block_k)).mul_(s[:, : full // block_k, None])
    if full < cols:
        w[:, full:].mul_(s[:, -1:])
    return w if dtype == torch.float32 else w.to(dtype)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout's definition, for writing FP8 checkpoints (bench/quantized.py):
    per block of block_n x block_k (edge blocks cropped), scale = amax / 448,
    the largest e4m3 value, and the weight divided by it in e4m3. Returns
    (weight in FP8, scales [cdiv(rows, block_n), cdiv(cols, block_k)])."""
    bn, bk = block
    rows, cols = weight.shape
    grid = (cdiv(rows, bn), cdiv(cols, bk))
    padded = weight.new_zeros(grid[0] * bn, grid[1] * bk, dtype=torch.float32)
    padded[:rows, :cols] = weight
    blocks = padded.view(grid[0], bn, grid[1], bk)
    scales = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(FP8).max
    quantized = (blocks / scales[:, None, :, None]).view(grid[0] * bn, grid[1] * bk)[:rows, :cols]
    return quantized.to(FP8).contiguous(), scales


class BlockSplitError(UnsupportedConfig):
    """A tensor-parallel size that cuts a quantization block."""
