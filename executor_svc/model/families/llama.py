"""Llama (2, 3, 3.1, 3.2): the base every other family is written against."""

from __future__ import annotations

from typing import Any

from executor_svc.model.families.base import Family, no_bias, silu_only, single_rope
from executor_svc.model.model_config import FULL, ConfigReader


def read_llama(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    silu_only(r)
    no_bias(r)
    r.refuse_unless("mlp_bias", False, "MLP biases are not implemented")
    return dict(layer_types=(FULL,) * c["num_layers"], rope={FULL: single_rope(r, c)})


FAMILY = Family("llama", ("LlamaForCausalLM",), ("llama",), read_llama, defaults={"rms_norm_eps": 1e-6})
