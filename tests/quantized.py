"""Quantized checkpoints written by hand in their documented layouts, from
the tiny random checkpoints of tests/families.py.

FP8 with block scales (quant_method "fp8", weight_block_size; DeepSeek-V3's
and Qwen3-FP8's layout): each decoder linear weight in float8_e4m3fn, with
one float32 `weight_scale_inv` per block of rows x columns, blocks at the
edges included.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
# Decoder linears (experts and shared experts included; latent attention's
# too); routers, norms, embeddings and the head stay as they are.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
           "kv_a_proj_with_mqa", "kv_b_proj", "w1", "w2", "w3")


def quantize(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout's definition: per block, scale = amax / 448 and q = w / scale in e4m3."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=FP8)
    scale = torch.empty(-(-rows // bn), -(-cols // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = block.abs().max().clamp(min=1e-12) / 448.0
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (block / s).to(FP8)
            scale[i, j] = s
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """The layout's definition the other way: each block times its scale (edge blocks cropped)."""
    rows, cols = q.shape
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:rows, :cols]
    return q.to(torch.float32) * full


def write_fp8(plain: Path, out: Path, block: tuple[int, int], **config) -> Path:
    """`plain` (a bf16/fp32 checkpoint) with every decoder linear in FP8 blocks."""
    shutil.copytree(plain, out)
    tensors = {}
    for f in plain.glob("*.safetensors"):
        tensors.update(load_file(f))
        (out / f.name).unlink()
    quantized = {}
    for name, t in tensors.items():
        if any(f".{p}.weight" in name for p in LINEARS):
            q, s = quantize(t.float(), *block)
            quantized[name], quantized[name.replace(".weight", ".weight_scale_inv")] = q, s
        else:
            quantized[name] = t
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)} | config
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def write_dequantized(fp8: Path, out: Path, block: tuple[int, int]) -> Path:
    """The FP8 checkpoint's weights dequantized to fp32 by the definition, as a plain checkpoint."""
    shutil.copytree(fp8, out)
    tensors = load_file(fp8 / "model.safetensors")
    plain = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = tensors.get(name.replace(".weight", ".weight_scale_inv"))
        plain[name] = dequantize(t, scale, *block) if scale is not None else t
    save_file(plain, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
