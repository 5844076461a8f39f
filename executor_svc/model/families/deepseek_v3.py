"""DeepSeek-V3 (and Kimi K2, its architecture): Llama with

- multi-head latent attention (executor_svc/model/mla.py): q through a low-rank
  q_a/q_b pair (q_lora_rank), keys and values decompressed from one latent
  per token (kv_lora_rank) plus a shared RoPE'd key part
  (qk_rope_head_dim), RoPE over interleaved pairs (rope_interleave); with
  YaRN, the softmax scale times mscale(factor, mscale_all_dim)^2;
- experts from layer first_k_dense_replace on: sigmoid scores, chosen on
  scores + e_score_correction_bias within the topk_group best of n_group
  groups, renormalised, times routed_scaling_factor, plus shared experts.

Multi-token-prediction layers (num_nextn_predict_layers) are not part of
the decoder: transformers' forward does not run them. Speculative decoding
loads the first on its own (executor_svc/model/mtp.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from executor_svc.model.checkpoint import LazyTensor
from executor_svc.model.families.base import DROPOUT, ROUTER_TRAINING, Family, silu_only, single_rope
from executor_svc.model.families.moe_common import MOE_IGNORED, num_experts
from executor_svc.model.mla import MLAttention
from executor_svc.model.model_config import FULL, ConfigReader, MLASpec, ModelConfig, MoESpec, UnsupportedConfig, yarn_mscale
from executor_svc.model.moe import MoECausalLM


class DeepseekV3ForCausalLM(MoECausalLM):
    attention_cls = MLAttention


def read_deepseek_v3(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    silu_only(r)
    r.refuse_unless("attention_bias", False, "DeepSeek-V3's projection biases are not implemented")
    # Keys of DeepSeek's own config.json (remote code) that transformers does
    # not read: accepted only with the values transformers' modeling assumes.
    r.refuse_unless("scoring_func", "sigmoid", "transformers' DeepSeek-V3 router scores with a sigmoid")
    r.refuse_unless("topk_method", "noaux_tc", "transformers' DeepSeek-V3 router is noaux_tc (correction bias, "
                                               "group-limited top-k)")
    r.refuse_unless("moe_layer_freq", 1, "transformers' DeepSeek-V3 has experts on every layer from "
                                         "first_k_dense_replace on")
    rope_dim, nope, v_dim = r.require("qk_rope_head_dim"), r.require("qk_nope_head_dim"), r.require("v_head_dim")
    for key, want in (("head_dim", rope_dim), ("qk_head_dim", nope + rope_dim)):  # transformers 5 saves these derived
        if r.get(key, want) != want:
            raise UnsupportedConfig(f"deepseek_v3 config.json: {key}={r.get(key)} but the MLA dims give {want}")
    c = c | {"head_dim": rope_dim}  # RoPE runs over the rope part only
    rope = single_rope(r, c)
    scale = (nope + rope_dim) ** -0.5
    params = r.get("rope_scaling") or r.get("rope_parameters") or {}
    if rope.rope_type != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(rope.factor, params["mscale_all_dim"]) ** 2
    mla = MLASpec(q_lora_rank=r.get("q_lora_rank"), kv_lora_rank=r.require("kv_lora_rank"), qk_nope_head_dim=nope,
                  qk_rope_head_dim=rope_dim, v_head_dim=v_dim, rope_interleave=r.get("rope_interleave", True),
                  softmax_scale=scale)
    n, first_dense = c["num_layers"], r.get("first_k_dense_replace", 3)
    experts = num_experts(r, "n_routed_experts", "num_local_experts")
    moe_inter = r.get("moe_intermediate_size", 2048)
    n_group, topk_group = r.get("n_group", 8), r.get("topk_group", 4)
    if experts % n_group or not 0 < topk_group <= n_group:
        raise UnsupportedConfig(f"deepseek_v3: {experts} experts in n_group={n_group} groups with "
                                f"topk_group={topk_group} do not form a group-limited routing")
    moe = MoESpec(num_experts=experts, top_k=r.get("num_experts_per_tok", 8), intermediate_size=moe_inter,
                  sparse_layers=tuple(i >= first_dense for i in range(n)), scoring="sigmoid",
                  norm_topk_prob=r.get("norm_topk_prob", True),
                  routed_scaling_factor=float(r.get("routed_scaling_factor", 2.5)), n_group=n_group,
                  topk_group=topk_group, correction_bias=True, router_fp32=True,
                  shared_intermediate_size=moe_inter * r.get("n_shared_experts", 1))
    return dict(head_dim=rope_dim, layer_types=(FULL,) * n, rope={FULL: rope}, moe=moe, mla=mla)


LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def rename_deepseek_v3(name: str, t: LazyTensor, cfg: ModelConfig) -> Iterator[tuple[str, LazyTensor]]:
    """shared_experts -> shared_expert (the shared MoE layer's name); the
    multi-token-prediction layers past num_hidden_layers are skipped."""
    layer = LAYER.match(name)
    if layer and int(layer.group(1)) >= cfg.num_layers:
        return
    yield name.replace(".mlp.shared_experts.", ".mlp.shared_expert."), t


FAMILY = Family("deepseek_v3", ("DeepseekV3ForCausalLM",), ("deepseek_v3", "kimi_k2"), read_deepseek_v3,
                defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 4096},
                ignored=MOE_IGNORED | {
                    "num_nextn_predict_layers": "multi-token-prediction layers: not run by transformers' forward "
                                                "(their weights are skipped, unless EXECUTOR_SPECULATIVE_METHOD=mtp "
                                                "loads the first)",
                    "num_mtp_layers": "multi-token-prediction layers: not run by transformers' forward",
                    "aux_loss_alpha": ROUTER_TRAINING,
                    "seq_aux": ROUTER_TRAINING,
                    "ep_size": "the original inference code's expert-parallel size; the executor splits experts "
                               "by EXECUTOR_TENSOR_PARALLEL_SIZE",
                    "attention_dropout": DROPOUT,
                },
                rename=rename_deepseek_v3, model_cls=DeepseekV3ForCausalLM)
