"""Qwen2-MoE (Qwen1.5-MoE): Qwen2 with experts on every
decoder_sparse_step-th layer (except mlp_only_layers), softmax routing with
optional renormalisation, and a shared expert gated by sigmoid(x w_g)."""

from __future__ import annotations

from typing import Any

from executor_svc.model.families.base import Family, layer_types, silu_only, single_rope
from executor_svc.model.families.moe_common import MOE_IGNORED, num_experts, sparse_layers
from executor_svc.model.model_config import FULL, SLIDING, ConfigReader, MoESpec
from executor_svc.model.moe import MoECausalLM


def read_qwen2_moe(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    silu_only(r)
    n = c["num_layers"]
    # transformers 5: sliding layers are the even ones below max_window_layers
    # (and only with use_sliding_window), unless layer_types says otherwise.
    use_window, max_window_layers = r.get("use_sliding_window", False), r.get("max_window_layers", 28)
    types = layer_types(r, n, lambda i: SLIDING if use_window and (i + 1) % 2 and i < max_window_layers else FULL)
    window = r.get("sliding_window", 4096)
    window = window if use_window else None
    if window is None:
        types = (FULL,) * n
    experts = num_experts(r, "num_experts", "num_local_experts")
    moe = MoESpec(num_experts=experts, top_k=r.get("num_experts_per_tok", 4),
                  intermediate_size=r.get("moe_intermediate_size", 1408), sparse_layers=sparse_layers(r, c, experts),
                  scoring="softmax", norm_topk_prob=r.get("norm_topk_prob", False),
                  shared_intermediate_size=r.get("shared_expert_intermediate_size", 5632), shared_gate=True)
    rope = single_rope(r, c)
    return dict(layer_types=types, sliding_window=window, qkv_bias=r.get("qkv_bias", True),
                rope={FULL: rope, SLIDING: rope}, moe=moe)


FAMILY = Family("qwen2_moe", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), read_qwen2_moe,
                defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
                ignored=MOE_IGNORED, model_cls=MoECausalLM)
