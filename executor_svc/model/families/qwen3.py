"""Qwen3: Qwen2's window rule, without biases, with a per-head RMSNorm of q
and k before RoPE."""

from __future__ import annotations

from typing import Any

from executor_svc.model.families.base import Family, no_bias, qwen_window, silu_only, single_rope
from executor_svc.model.model import CausalLM, QKNormAttention
from executor_svc.model.model_config import FULL, SLIDING, ConfigReader


def read_qwen3(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    silu_only(r)
    no_bias(r)
    types, window = qwen_window(r, c["num_layers"])
    rope = single_rope(r, c)
    return dict(layer_types=types, sliding_window=window, rope={FULL: rope, SLIDING: rope})


class Qwen3ForCausalLM(CausalLM):
    attention_cls = QKNormAttention


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), read_qwen3,
                defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 128},
                model_cls=Qwen3ForCausalLM)
