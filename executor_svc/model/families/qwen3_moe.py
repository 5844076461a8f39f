"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with experts on every
decoder_sparse_step-th layer (except mlp_only_layers), softmax routing,
renormalised with norm_topk_prob; no shared expert."""

from __future__ import annotations

from typing import Any

from executor_svc.model.families.base import Family, no_bias, silu_only, single_rope
from executor_svc.model.families.moe_common import MOE_IGNORED, num_experts, sparse_layers
from executor_svc.model.model import QKNormAttention
from executor_svc.model.model_config import FULL, SLIDING, ConfigReader, MoESpec
from executor_svc.model.moe import MoECausalLM


def read_qwen3_moe(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    silu_only(r)
    no_bias(r)
    # Unlike dense Qwen3, the window (with use_sliding_window) is on every layer.
    window = r.get("sliding_window", 4096)
    window = window if r.get("use_sliding_window", False) else None
    kind = FULL if window is None else SLIDING
    experts = num_experts(r, "num_experts", "num_local_experts")
    moe = MoESpec(num_experts=experts, top_k=r.get("num_experts_per_tok", 8),
                  intermediate_size=r.get("moe_intermediate_size", 768), sparse_layers=sparse_layers(r, c, experts),
                  scoring="softmax", norm_topk_prob=r.get("norm_topk_prob", False))
    return dict(layer_types=(kind,) * c["num_layers"], sliding_window=window,
                rope={kind: single_rope(r, c)}, moe=moe)


class Qwen3MoeForCausalLM(MoECausalLM):
    attention_cls = QKNormAttention


FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), read_qwen3_moe,
                defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
                ignored=MOE_IGNORED | {"max_window_layers": "not read by transformers' Qwen3-MoE (the window, "
                                                            "when on, covers every layer)"},
                model_cls=Qwen3MoeForCausalLM)
