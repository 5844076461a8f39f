"""Gemma 3: Gemma 2 without soft-capping, plus (1+w) q/k norms, a 5:1
pattern of sliding and global layers, and a RoPE base per layer type. Its
multimodal checkpoints (Gemma3ForConditionalGeneration) serve their text
model only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from executor_svc.model.checkpoint import LazyTensor
from executor_svc.model.families.base import Family, layer_types
from executor_svc.model.families.gemma2 import GEMMA_IGNORED, Gemma2ForCausalLM, gemma_common
from executor_svc.model.model import QKNormAttention
from executor_svc.model.model_config import (
    COMMON_IGNORED, FULL, SLIDING, ConfigReader, ModelConfig, UnsupportedConfig, eos_ids, rope_spec,
)

MULTIMODAL = ("Gemma3ForConditionalGeneration",)


def read_gemma3(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    out = gemma_common(r)
    pattern = r.get("sliding_window_pattern", 6)
    # Two RoPE bases: rope_parameters nested by layer type (transformers 5),
    # or rope_theta + rope_scaling for global layers and
    # rope_local_base_freq for sliding ones (transformers 4).
    nested, scaling = r.get("rope_parameters") or {}, r.get("rope_scaling")
    if FULL in nested or SLIDING in nested:
        unknown = set(nested) - {FULL, SLIDING}
        if unknown:
            raise UnsupportedConfig(f"gemma3: rope_parameters for layer types {sorted(unknown)} are not supported")
        full, local = dict(nested.get(FULL) or {}) | (scaling or {}), dict(nested.get(SLIDING) or {})
    else:
        full, local = dict(scaling or nested), {}
    kw = dict(head_dim=c["head_dim"], max_position_embeddings=c["max_position_embeddings"])
    rope = {
        FULL: rope_spec(full, "gemma3 full_attention", theta=r.get("rope_theta", 1_000_000.0), **kw),
        SLIDING: rope_spec(local, "gemma3 sliding_attention", theta=r.get("rope_local_base_freq", 10_000.0), **kw),
    }
    return out | dict(
        layer_types=layer_types(r, c["num_layers"], lambda i: SLIDING if (i + 1) % pattern else FULL),
        sliding_window=r.get("sliding_window", 4096),
        rope=rope,
        attn_softcap=r.get("attn_logit_softcapping"),
        final_softcap=r.get("final_logit_softcapping"),
    )


def text_model_config(cfg: dict[str, Any], arch: str, model_type: str) -> dict[str, Any]:
    """A multimodal config.json -> its text model's, as a text-only config.
    Keys of the outer config are vision-only (ignored: text prompts never
    reach the vision tower), merged in, or refused."""
    merged = {"text_config", "eos_token_id", "bos_token_id", "tie_word_embeddings", "is_encoder_decoder"}
    outer = set(cfg) - set(COMMON_IGNORED) - set(VISION_IGNORED) - merged
    if outer:
        raise UnsupportedConfig(f"{arch} config.json has keys the executor does not implement: {sorted(outer)}")
    text = dict(cfg.get("text_config") or {})
    text.update(architectures=[arch], model_type=text.get("model_type", model_type))
    if "tie_word_embeddings" in cfg:  # HF ties the head by the outer config's flag
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    text["eos_token_id"] = list(eos_ids(text.get("eos_token_id"), cfg.get("eos_token_id")))
    for key in ("bos_token_id", "is_encoder_decoder"):
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    return text


def text_weights_only(name: str, t: LazyTensor, cfg: ModelConfig) -> Iterator[tuple[str, LazyTensor]]:
    """Multimodal checkpoints keep the text model under language_model
    (transformers 5: model.language_model.*, 4: language_model.model.*);
    the vision tower and projector are not loaded."""
    if cfg.architecture not in MULTIMODAL:
        yield name, t
        return
    for prefix, to in (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.lm_head.", "lm_head.")):
        if name.startswith(prefix):
            yield to + name.removeprefix(prefix), t
            return
    if name.startswith("lm_head."):
        yield name, t
        return
    if not name.startswith(VISION_PREFIXES):
        yield name, t  # unknown: build_model reports it as unexpected


VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")
VISION_IGNORED = {
    "vision_config": "vision tower: served text-only",
    "mm_tokens_per_image": "vision tower: served text-only",
    "boi_token_index": "vision tower: served text-only",
    "eoi_token_index": "vision tower: served text-only",
    "image_token_index": "vision tower: served text-only",
}

class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's layers with q/k norms."""

    attention_cls = QKNormAttention


FAMILY = Family("gemma3", ("Gemma3ForCausalLM", *MULTIMODAL), ("gemma3_text",), read_gemma3,
                defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "head_dim": 256,
                          "tie_word_embeddings": True},
                ignored=GEMMA_IGNORED | {"_sliding_window_pattern": "transformers 5's copy of sliding_window_pattern"},
                rename=text_weights_only, multimodal=MULTIMODAL, model_cls=Gemma3ForCausalLM)
