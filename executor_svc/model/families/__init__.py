"""The model families the executor serves, one module each, written as its
difference from Llama (llama.py): which config.json keys it reads (with
HF's defaults for absent ones), which it ignores and why, how its
checkpoint names map onto the decoder's, and which decoder it builds.

A family is chosen from `architectures` (falling back to `model_type`);
anything else is refused with the list of what is served. This package
sits on top: it imports the model code, never the other way round.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from executor_svc.model.checkpoint import LazyTensor
from executor_svc.model.families import (
    deepseek_v3, gemma2, gemma3, gpt_oss, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe,
)
from executor_svc.model.families.base import Family
from executor_svc.model.model import CausalLM
from executor_svc.model.model import build_model as _build_model
from executor_svc.model.model_config import COMMON_IGNORED, ConfigReader, ModelConfig, UnsupportedConfig, eos_ids
from executor_svc.model.quantization import read_quantization
from executor_svc.model.sharding import Shard

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma2.FAMILY, gemma3.FAMILY, phi3.FAMILY,
    mixtral.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY, gpt_oss.FAMILY, deepseek_v3.FAMILY,
)

REFUSED_ARCHITECTURES = {
    "Phi3SmallForCausalLM": "Phi-3-small uses block-sparse attention, which is not implemented",
}


def supported() -> str:
    return ", ".join(a for f in FAMILIES for a in f.architectures)


def family_for(cfg: dict[str, Any]) -> tuple[Family, str]:
    """The family serving this config.json, and the architecture name."""
    archs = cfg.get("architectures") or []
    if len(archs) > 1:
        raise UnsupportedConfig(f"config.json names several architectures {archs}; expected one of {supported()}")
    for arch in archs:
        if arch in REFUSED_ARCHITECTURES:
            raise UnsupportedConfig(f"architecture {arch} is not supported: {REFUSED_ARCHITECTURES[arch]}")
        for fam in FAMILIES:
            if arch in fam.architectures:
                return fam, arch
        raise UnsupportedConfig(f"architecture {arch} is not supported; supported: {supported()}")
    model_type = cfg.get("model_type")
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam, fam.architectures[0]
    raise UnsupportedConfig(
        f"config.json names no architecture and model_type {model_type!r} is not supported; supported: {supported()}"
    )


def read_config(cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """Reads config.json (and generation_config.json for EOS ids); raises
    UnsupportedConfig naming what it cannot serve."""
    fam, arch = family_for(cfg)
    if arch in fam.multimodal:
        cfg = gemma3.text_model_config(cfg, arch, fam.model_types[0])
    r = ConfigReader(cfg, fam.name)
    d = fam.defaults
    r.refuse_unless("is_encoder_decoder", False, "the served families are decoder-only")
    hidden, heads = r.require("hidden_size"), r.require("num_attention_heads")
    common: dict[str, Any] = dict(
        vocab_size=r.require("vocab_size"),
        hidden_size=hidden,
        intermediate_size=r.require("intermediate_size"),
        num_layers=r.require("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=r.get("num_key_value_heads", heads),
        head_dim=r.get("head_dim", d.get("head_dim", hidden // heads)),
        max_position_embeddings=r.get("max_position_embeddings", d.get("max_position_embeddings", 2048)),
        rms_norm_eps=r.get("rms_norm_eps", d["rms_norm_eps"]),
        tie_word_embeddings=r.get("tie_word_embeddings", d.get("tie_word_embeddings", False)),
        bos_token_id=r.get("bos_token_id"),
        # generation_config.json is where instruct models list their
        # turn-end tokens; HF generate() stops on those.
        eos_token_ids=eos_ids(r.get("eos_token_id"), (generation_config or {}).get("eos_token_id")),
    )
    specific = fam.read(r, common)
    if "quantization_config" not in r.used:  # gpt-oss reads its own (MXFP4)
        specific["quantization"] = read_quantization(r.get("quantization_config"), fam.name)
    common.update({k: specific.pop(k) for k in list(specific) if k in common})  # a family may override a common value
    ignored = COMMON_IGNORED | fam.ignored
    leftover = r.leftover(ignored)
    if leftover:
        raise UnsupportedConfig(
            f"{fam.name} config.json has keys the executor does not implement and that may change the forward "
            f"pass: {leftover}; it reads {sorted(r.used)} and ignores {sorted(ignored)}"
        )
    window = specific.get("sliding_window")
    if window is not None and window < 1:
        raise UnsupportedConfig(f"{fam.name}: sliding_window={window} must be at least 1")
    return ModelConfig(architecture=arch, family=fam.name, **common, **specific, read_keys=frozenset(r.used),
                       ignored={k: ignored[k] for k in cfg if k in ignored})


def family_of(cfg: ModelConfig) -> Family:
    return next(f for f in FAMILIES if f.name == cfg.family)


def build_model(cfg: ModelConfig,
                tensors: Iterable[tuple[str, torch.Tensor | LazyTensor]] | dict[str, torch.Tensor],
                max_len: int, device: torch.device, dtype: torch.dtype, shard: Shard = Shard(),
                comm=None, headless_ok: bool = False) -> CausalLM:
    """The family's decoder, filled from checkpoint tensors (see model.build_model)."""
    fam = family_of(cfg)
    return _build_model(cfg, tensors, max_len, device, dtype, shard, comm, model_cls=fam.model_cls, rename=fam.rename,
                        headless_ok=headless_ok)
