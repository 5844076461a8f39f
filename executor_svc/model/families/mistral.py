"""Mistral: Llama with a sliding window on every layer."""

from __future__ import annotations

from typing import Any

from executor_svc.model.families.base import Family, no_bias, silu_only, single_rope
from executor_svc.model.model_config import FULL, SLIDING, ConfigReader


def read_mistral(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    silu_only(r)
    no_bias(r)
    window = r.get("sliding_window")
    kind = FULL if window is None else SLIDING
    return dict(layer_types=(kind,) * c["num_layers"], sliding_window=window, rope={kind: single_rope(r, c)})


FAMILY = Family("mistral", ("MistralForCausalLM",), ("mistral",), read_mistral,
                defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32})
