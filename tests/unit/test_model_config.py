"""Reading config.json: every key is read, deliberately ignored, or refused
by name; both transformers layouts of RoPE give the same model."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from executor_svc.model.families import FAMILIES, family_of, read_config
from executor_svc.model.families.gpt_oss import SinkAttention
from executor_svc.model.model import QKNormAttention
from executor_svc.model.model_config import FULL, SLIDING, UnsupportedConfig

# Each served family's transformers config class, as the Hub's config.json files come from it.
CONFIG_CLASSES = {
    "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
    "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig", "phi3": "Phi3Config",
    "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
    "gpt_oss": "GptOssConfig", "deepseek_v3": "DeepseekV3Config",
}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def hf_dict(cls_name: str, **kwargs) -> dict:
    return getattr(transformers, cls_name)(**kwargs).to_dict()


def llama(**overrides) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY, "rope_theta": 10000.0,
            "hidden_act": "silu", **overrides}


def test_every_family_has_a_config_class_in_this_walk():
    assert set(CONFIG_CLASSES) == {f.name for f in FAMILIES}


@pytest.mark.parametrize("family", CONFIG_CLASSES)
def test_every_key_of_the_transformers_config_class_is_read_or_ignored_with_a_reason(family):
    """A key a future transformers adds lands in neither set and fails here
    (and the executor refuses such checkpoints at start until someone
    decides what the key means for the forward pass)."""
    # DeepSeek-V3's head_dim is its qk_rope_head_dim (transformers derives it).
    tiny = {k: v for k, v in TINY.items() if k != "head_dim"} if family == "deepseek_v3" else TINY
    d = hf_dict(CONFIG_CLASSES[family], **tiny)
    cfg = read_config(d)
    assert cfg.family == family
    unaccounted = sorted(k for k in d if k not in cfg.read_keys and k not in cfg.ignored)
    assert not unaccounted, f"{family}: keys neither read nor ignored: {unaccounted}"
    assert all(cfg.ignored.values()), f"{family}: an ignored key without a reason: {cfg.ignored}"


def test_unknown_architecture_is_refused_with_the_supported_list():
    with pytest.raises(UnsupportedConfig, match=r"FalconForCausalLM is not supported; supported: LlamaForCausalLM"):
        read_config(llama(architectures=["FalconForCausalLM"]))


def test_multimodal_gemma3_serves_its_text_model_and_ignores_only_vision_keys():
    d = transformers.Gemma3Config(text_config=TINY).to_dict() | {"architectures": ["Gemma3ForConditionalGeneration"],
                                                                  "eos_token_id": [1, 106]}
    cfg = read_config(d)
    assert (cfg.architecture, cfg.family, cfg.hidden_size) == ("Gemma3ForConditionalGeneration", "gemma3", 64)
    assert family_of(cfg).model_cls.attention_cls is QKNormAttention
    assert cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings
    with pytest.raises(UnsupportedConfig, match=r"\['audio_config'\]"):
        read_config(d | {"audio_config": {}})


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_unimplemented_rope_types_are_refused_by_name(rope_type):
    scaling = {"rope_type": rope_type, "factor": 2.0}
    message = f"RoPE type '{rope_type}' is not supported.*supported: default, linear, llama3, yarn"
    with pytest.raises(UnsupportedConfig, match=message):
        read_config(llama(rope_scaling=scaling))
    with pytest.raises(UnsupportedConfig, match=f"RoPE type '{rope_type}'"):
        read_config(llama(rope_parameters={"rope_theta": 1e4, **scaling}))


def test_phi35_longrope_is_refused_and_plain_phi3_is_served():
    d = hf_dict("Phi3Config", **TINY)
    d.pop("rope_parameters")
    assert read_config(d | {"rope_theta": 10000.0, "rope_scaling": None}).rope[FULL].rope_type == "default"
    longrope = {"type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}
    with pytest.raises(UnsupportedConfig, match="RoPE type 'longrope'"):
        read_config(d | {"rope_theta": 10000.0, "rope_scaling": longrope})


@pytest.mark.parametrize("key, value, message", [
    ("some_future_key", 1, r"does not implement.*\['some_future_key'\]"),
    ("sliding_window", 16, r"\['sliding_window'\]"),  # Llama has no window: an unread key
    ("attn_logit_softcapping", 50.0, r"\['attn_logit_softcapping'\]"),
    ("quantization_config", {"quant_method": "bitsandbytes"}, r"quant_method=.bitsandbytes. is not supported"),
    ("attention_bias", True, "attention_bias=True is not supported"),
    ("mlp_bias", True, "mlp_bias=True is not supported"),
    ("hidden_act", "gelu", "hidden_act='gelu' is not supported"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5 is not supported"),
])
def test_forward_changing_keys_the_llama_reader_does_not_implement_are_refused_by_name(key, value, message):
    with pytest.raises(UnsupportedConfig, match=message):
        read_config(llama(**{key: value}))


def test_unknown_rope_parameter_is_refused():
    with pytest.raises(UnsupportedConfig, match=r"RoPE parameters \['beta_fast'\]"):
        read_config(llama(rope_scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 32}))


def test_gemma_refusals():
    base = hf_dict("Gemma3TextConfig", **TINY)
    with pytest.raises(UnsupportedConfig, match="use_bidirectional_attention=True"):
        read_config(base | {"use_bidirectional_attention": True})
    with pytest.raises(UnsupportedConfig, match="hidden_activation='gelu'"):
        read_config(base | {"hidden_activation": "gelu"})
    with pytest.raises(UnsupportedConfig, match="attention_bias=True"):
        read_config(hf_dict("Gemma2Config", **TINY) | {"attention_bias": True})


def test_llama3_rope_reads_the_same_from_both_layouts_and_matches_hf_frequencies():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    t4 = read_config(llama(rope_theta=500000.0, rope_scaling=scaling))
    d5 = hf_dict("LlamaConfig", **TINY, rope_parameters={"rope_theta": 500000.0, **scaling})
    t5 = read_config(d5 | {"architectures": ["LlamaForCausalLM"]})
    assert t4.rope == t5.rope and t4.rope[FULL].theta == 500000.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    want, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**TINY, rope_parameters={"rope_theta": 500000.0,
                                                                                              **scaling}))
    assert torch.equal(t5.rope[FULL].inv_freq(), want)
    unscaled = read_config(llama(rope_theta=500000.0)).rope[FULL]
    assert not torch.equal(t5.rope[FULL].inv_freq(), unscaled.inv_freq())
    assert t5.rope_description() == "llama3(factor=8)"


YARN_CASES = {
    # gpt-oss's own: no truncation, attention factor from the factor alone.
    "gpt-oss": ({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096, "rope_theta": 150000.0}, 131072),
    # DeepSeek-V3's: mscale and mscale_all_dim set the attention factor (1 when equal).
    "deepseek-v3": ({"rope_type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
                     "beta_slow": 1, "original_max_position_embeddings": 4096, "rope_theta": 10000.0}, 163840),
    "mscales differ": ({"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                        "original_max_position_embeddings": 64, "rope_theta": 10000.0}, 256),
    # Qwen3's long-context recipe: factor 4 over 32k, truncated bounds.
    "qwen3": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
               "rope_theta": 1_000_000.0}, 131072),
    "explicit attention_factor": ({"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.9,
                                   "original_max_position_embeddings": 128, "rope_theta": 10000.0}, 256),
}


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_frequencies_and_attention_factor_match_hf(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params, max_positions = YARN_CASES[case]
    cfg = read_config(llama(rope_parameters=dict(params), max_position_embeddings=max_positions))
    hf = transformers.LlamaConfig(**TINY | {"max_position_embeddings": max_positions}, rope_parameters=dict(params))
    want, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    assert torch.equal(cfg.rope[FULL].inv_freq(), want)
    assert cfg.rope[FULL].attention_factor == attention_factor
    assert cfg.rope_description().startswith("yarn(factor=")


def test_linear_rope_matches_hf_frequencies():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    cfg = read_config(llama(rope_scaling=params))
    want, _ = ROPE_INIT_FUNCTIONS["linear"](transformers.LlamaConfig(**TINY, rope_parameters=params))
    assert torch.equal(cfg.rope[FULL].inv_freq(), want)


def test_gemma3_two_rope_bases_read_the_same_from_both_layouts():
    t5 = read_config(hf_dict("Gemma3TextConfig", **TINY | {"num_hidden_layers": 6}, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}))
    hub = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **TINY, "num_hidden_layers": 6,
           "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "hidden_activation": "gelu_pytorch_tanh",
           "query_pre_attn_scalar": 256, "sliding_window": 512}
    t4 = read_config(hub)
    assert t4.rope == t5.rope
    assert t4.rope[FULL].factor == 8.0 and t4.rope[FULL].theta == 1e6 and t4.rope[SLIDING].theta == 1e4
    assert t4.layer_types == (SLIDING,) * 5 + (FULL,)
    assert t4.attn_softcap is None and t4.final_softcap is None


def test_gemma2_defaults_are_hfs_when_keys_are_absent():
    hub = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **TINY, "num_hidden_layers": 4,
           "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
    cfg = read_config(hub)
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.sliding_window) == (50.0, 30.0, 4096)
    assert cfg.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert math.isclose(cfg.attn_scale, 256**-0.5) and cfg.tie_word_embeddings and cfg.embed_scale


@pytest.mark.parametrize("use_sliding_window, want", [
    (False, (FULL, FULL, FULL, FULL)),
    (True, (FULL, FULL, SLIDING, SLIDING)),
])
def test_qwen2_window_only_with_use_sliding_window_and_from_max_window_layers(use_sliding_window, want):
    hub = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **TINY, "num_hidden_layers": 4,
           "use_sliding_window": use_sliding_window, "sliding_window": 8, "max_window_layers": 2,
           "rope_theta": 1e6, "hidden_act": "silu"}
    cfg = read_config(hub)
    assert cfg.layer_types == want and cfg.qkv_bias
    assert cfg.sliding_window == (8 if use_sliding_window else None)


def test_generation_config_eos_ids_are_merged_with_the_configs():
    cfg = read_config(llama(eos_token_id=2), {"eos_token_id": [7, 2, 9]})
    assert cfg.eos_token_ids == (2, 7, 9)
    assert read_config(llama(eos_token_id=None), None).eos_token_ids == ()


def test_phi3_partial_rotary_factor_sets_the_rotary_dims():
    d = hf_dict("Phi3Config", **TINY, partial_rotary_factor=0.5)
    cfg = read_config(d)
    assert cfg.rope[FULL].rotary_dim == 8 and cfg.head_dim == 16


COMMON_HUB = {"attention_dropout": 0.0, "initializer_range": 0.02, "torch_dtype": "bfloat16",
              "transformers_version": "4.45.0", "use_cache": True}
# Key sets of well-known Hub config.json files (sizes shrunk), as saved by transformers 4.
HUB_CONFIGS = {
    "Llama-3.2-1B": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
                     "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 16, "hidden_act": "silu",
                     "max_position_embeddings": 131072, "mlp_bias": False, "pretraining_tp": 1, "rms_norm_eps": 1e-5,
                     "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                     "rope_theta": 500000.0, "tie_word_embeddings": True},
    "Qwen2.5-0.5B": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "bos_token_id": 151643,
                     "eos_token_id": 151643, "hidden_act": "silu", "max_position_embeddings": 32768,
                     "max_window_layers": 24, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768,
                     "tie_word_embeddings": True, "use_sliding_window": False, "use_mrope": False},
    "Qwen3-0.6B": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
                   "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
                   "max_position_embeddings": 40960, "max_window_layers": 28, "rms_norm_eps": 1e-6,
                   "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
                   "use_sliding_window": False},
    "Mistral-7B-v0.1": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1,
                        "eos_token_id": 2, "hidden_act": "silu", "max_position_embeddings": 32768,
                        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 4096,
                        "tie_word_embeddings": False},
    "gemma-2-2b": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
                   "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
                   "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 16,
                   "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                   "max_position_embeddings": 8192, "pad_token_id": 0, "query_pre_attn_scalar": 256,
                   "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 4096},
    "gemma-3-1b-it": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                      "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
                      "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 16,
                      "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768, "pad_token_id": 0,
                      "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_local_base_freq": 10000,
                      "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
                      "sliding_window_pattern": 6},
    "Phi-3-mini-4k-instruct": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                               "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config"}, "attention_bias": False,
                               "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu",
                               "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
                               "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-5, "rope_scaling": None,
                               "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False},
    "Mixtral-8x7B-v0.1": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "bos_token_id": 1,
                          "eos_token_id": 2, "hidden_act": "silu", "max_position_embeddings": 32768,
                          "num_experts_per_tok": 2, "num_local_experts": 8, "output_router_logits": False,
                          "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
                          "sliding_window": None, "tie_word_embeddings": False},
    "Qwen1.5-MoE-A2.7B": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "bos_token_id": 151643,
                          "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu",
                          "max_position_embeddings": 8192, "max_window_layers": 21, "moe_intermediate_size": 32,
                          "norm_topk_prob": False, "num_experts": 60, "num_experts_per_tok": 4,
                          "output_router_logits": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                          "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 64,
                          "sliding_window": 32768, "tie_word_embeddings": False, "use_sliding_window": False},
    "Qwen3-30B-A3B": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
                      "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 16,
                      "hidden_act": "silu", "max_position_embeddings": 40960, "max_window_layers": 48,
                      "mlp_only_layers": [], "moe_intermediate_size": 32, "norm_topk_prob": True, "num_experts": 128,
                      "num_experts_per_tok": 8, "output_router_logits": False, "rms_norm_eps": 1e-6,
                      "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
                      "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False},
    "gpt-oss-20b": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
                    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 16, "hidden_act": "silu",
                    "initial_context_length": 4096, "layer_types": ["sliding_attention", "full_attention"],
                    "max_position_embeddings": 131072, "num_experts_per_tok": 4, "num_local_experts": 32,
                    "output_router_logits": False, "pad_token_id": 199999,
                    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                                       "model.layers.*.mlp.router",
                                                                       "model.embed_tokens", "lm_head"],
                                            "quant_method": "mxfp4"},
                    "rms_norm_eps": 1e-5, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                           "original_max_position_embeddings": 4096,
                                                           "rope_type": "yarn", "truncate": False},
                    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
                    "tie_word_embeddings": False},
}


@pytest.mark.parametrize("name", HUB_CONFIGS)
def test_hub_shaped_configs_are_served(name):
    cfg = read_config(COMMON_HUB | TINY | HUB_CONFIGS[name])
    assert cfg.architecture == HUB_CONFIGS[name]["architectures"][0]


def test_hub_phi35_mini_is_refused_for_its_longrope():
    d = COMMON_HUB | TINY | HUB_CONFIGS["Phi-3-mini-4k-instruct"] | {
        "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8},
        "original_max_position_embeddings": 4096, "max_position_embeddings": 131072}
    with pytest.raises(UnsupportedConfig, match="'longrope'"):
        read_config(d)


def test_gpt_oss_reads_mxfp4_and_refuses_other_quantizations():
    hub = COMMON_HUB | TINY | HUB_CONFIGS["gpt-oss-20b"]
    cfg = read_config(hub)
    assert cfg.quantization.method == "mxfp4" and family_of(cfg).model_cls.attention_cls is SinkAttention and cfg.o_bias and cfg.rope[FULL].rope_type == "yarn"
    assert cfg.layer_types == (SLIDING, FULL) and cfg.moe.scoring == "topk_softmax" and cfg.moe.swiglu_limit == 7.0
    with pytest.raises(UnsupportedConfig, match="quantization_config .* is not supported"):
        read_config(hub | {"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(UnsupportedConfig, match="experts_per_token=2 differs"):
        read_config(hub | {"experts_per_token": 2})
