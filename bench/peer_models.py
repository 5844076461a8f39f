"""Checkpoints `python -m bench.peer` builds for itself: a random model of
Qwen3-0.6B's shape in bf16, and an int8 weight-only copy of a checkpoint
(compressed-tensors' int-quantized W8A16, which the executor serves
quantized: executor_svc/model/quantization.py), the match for llama.cpp's
Q8_0."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from llmsched.assets import STORIES260K

QWEN3_SHAPE = "qwen3-0.6b-shape"
# Qwen3-0.6B's published sizes; the weights are random (seed 0).
QWEN3_06B = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "max_position_embeddings": 40960,
             "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_qwen3_shape(directory: Path, seed: int = 0) -> Path:
    """Qwen3ForCausalLM of Qwen3-0.6B's shape with random weights, saved by
    transformers in bf16, with stories260K's SentencePiece tokenizer: the
    requests send token ids, so any tokenizer serves, and llama.cpp's
    converter reads this one as it is (padding its 512 pieces to the
    model's vocabulary). Reused when already there."""
    if (directory / "config.json").exists():
        return directory
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**QWEN3_06B, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    with torch.device("cpu"):
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="2GB")
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(STORIES260K / name, tmp / name)
    tmp.rename(directory)
    return directory


def quantize_int8_rows(weight):
    """Symmetric int8 per output row: scale = amax / 127, in bf16.
    Returns (int8 [N, K], scale [N, 1])."""
    import torch

    w = weight.float()  # [N, K]
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-8).to(torch.bfloat16)  # [N, 1]
    q = (w / scale.float()).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def write_int8(plain: Path, out: Path) -> Path:
    """`plain` with every decoder linear as compressed-tensors int-quantized
    int8 per channel (weights only: activations stay bf16), the rest as it
    was. Reused when already there."""
    if (out / "config.json").exists():
        return out
    from safetensors.torch import load_file, save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in plain.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, tmp / f.name)
    index = {}
    for f in sorted(plain.glob("*.safetensors")):
        tensors = {}
        for name, t in load_file(f).items():
            if any(f".{p}.weight" in name for p in LINEARS):
                module = name[: -len(".weight")]
                tensors[name], tensors[f"{module}.weight_scale"] = quantize_int8_rows(t)
            else:
                tensors[name] = t
        save_file(tensors, tmp / f.name, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, f.name))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    cfg = json.loads((tmp / "config.json").read_text())
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "int-quantized",
                                  "quantization_status": "compressed", "ignore": ["lm_head"],
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp.rename(out)
    return out
