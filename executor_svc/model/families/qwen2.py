"""Qwen2 / Qwen2.5: Llama with q/k/v biases and an optional window on the
layers from max_window_layers on."""

from __future__ import annotations

from typing import Any

from executor_svc.model.families.base import Family, qwen_window, silu_only, single_rope
from executor_svc.model.model_config import FULL, SLIDING, ConfigReader


def read_qwen2(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    silu_only(r)
    r.refuse_unless("use_mrope", False, "multimodal RoPE (Qwen2-VL) is not implemented")
    types, window = qwen_window(r, c["num_layers"])
    rope = single_rope(r, c)
    return dict(layer_types=types, sliding_window=window, qkv_bias=True, rope={FULL: rope, SLIDING: rope})


FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), read_qwen2,
                defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768})
