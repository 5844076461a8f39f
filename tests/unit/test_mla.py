"""DeepSeek-V3's config and its latent KV cache, without building a model:
the pool holds kv_lora_rank + qk_rope_head_dim values per token and layer
(not decompressed K and V), read from the real DeepSeek-V3 and Kimi K2
config.json key sets; their routing keys are read or refused by name."""

from __future__ import annotations

import pytest
import torch

from executor_svc.model.families import read_config
from executor_svc.step.kv_cache import bytes_per_block, bytes_per_token, layer_specs
from executor_svc.model.model_config import UnsupportedConfig
from executor_svc.model.sharding import Shard, valid_sizes

# deepseek-ai/DeepSeek-V3's config.json, without its fp8 quantization_config
# (a bf16 conversion's), and Kimi K2's differences from it.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
KIMI_K2 = DEEPSEEK_V3 | {"model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
                         "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                         "routed_scaling_factor": 2.827, "rope_theta": 50000.0, "vocab_size": 163840,
                         "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                          "type": "yarn"}}


def test_the_pool_stores_one_latent_per_token_and_layer_for_deepseek_v3():
    cfg = read_config(DEEPSEEK_V3)
    # 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes (bf16) = 70,272 bytes per token.
    assert bytes_per_token(cfg, torch.bfloat16) == 61 * (512 + 64) * 2 == 70_272
    assert bytes_per_block(cfg, 16, torch.bfloat16) == 16 * 70_272
    spec = layer_specs(cfg)[0]
    assert (spec.num_tensors, spec.num_heads, spec.head_dim) == (1, 1, 576)
    # Decompressed K and V would be 128 heads x (192 + 128) values: 71x more.
    decompressed = 61 * 128 * (128 + 64 + 128) * 2
    assert decompressed // bytes_per_token(cfg, torch.bfloat16) == 71
    # Every rank keeps the whole latent: each rank's heads read all of it.
    assert bytes_per_token(cfg, torch.bfloat16, Shard(3, 8)) == 70_272


def test_deepseek_v3_and_kimi_k2_configs_read_their_mla_and_routing():
    cfg = read_config(DEEPSEEK_V3)
    assert cfg.head_dim == 64 and cfg.rope[cfg.layer_types[0]].rope_type == "yarn"
    mla, moe = cfg.mla, cfg.moe
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim, mla.v_head_dim) == (1536, 512, 192, 128)
    assert mla.rope_interleave
    # YaRN: softmax scale times mscale(40, 1)^2 = (0.1 ln 40 + 1)^2.
    assert mla.softmax_scale == pytest.approx(192**-0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
    assert moe.sparse_layers == (False,) * 3 + (True,) * 58 and moe.shared_intermediate_size == 2048
    assert (moe.scoring, moe.n_group, moe.topk_group, moe.routed_scaling_factor) == ("sigmoid", 8, 4, 2.5)
    kimi = read_config(KIMI_K2)
    assert kimi.family == "deepseek_v3" and (kimi.moe.num_experts, kimi.moe.n_group) == (384, 1)
    assert 8 in valid_sizes(kimi) and 8 in valid_sizes(cfg)


@pytest.mark.parametrize("key,value,message", [
    ("scoring_func", "softmax", "scoring_func='softmax' is not supported"),
    ("topk_method", "greedy", "topk_method='greedy' is not supported"),
    ("moe_layer_freq", 2, "moe_layer_freq=2 is not supported"),
    ("attention_bias", True, "attention_bias=True is not supported"),
])
def test_deepseek_routing_and_attention_keys_it_does_not_implement_are_refused_by_name(key, value, message):
    with pytest.raises(UnsupportedConfig, match=message):
        read_config(DEEPSEEK_V3 | {key: value})


def test_deepseek_checkpoint_names_map_onto_the_shared_moe_layer_and_mtp_layers_are_skipped():
    from executor_svc.model.checkpoint import LazyTensor
    from executor_svc.model.families.deepseek_v3 import rename_deepseek_v3

    cfg, t = read_config(DEEPSEEK_V3), LazyTensor.of(torch.zeros(1))
    names = lambda n: [name for name, _ in rename_deepseek_v3(n, t, cfg)]  # noqa: E731
    shared, bias = "model.layers.3.mlp.shared_experts.gate_proj.weight", "model.layers.60.mlp.gate.e_score_correction_bias"
    assert names(shared) == ["model.layers.3.mlp.shared_expert.gate_proj.weight"] and names(bias) == [bias]
    # Layer 61 is the multi-token-prediction layer (num_nextn_predict_layers: 1): not loaded.
    assert names("model.layers.61.eh_proj.weight") == [] and names("model.layers.61.shared_head.head.weight") == []
