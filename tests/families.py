"""Tiny random-weight checkpoints of each served family, built with
transformers' own classes and saved with save_pretrained, plus HF as the
greedy oracle on them.

Sizes: hidden 64, 2-6 layers, vocab 512 (stories260K's tokenizer.json is
copied in), windows of 8-12 tokens so short requests already slide.
Weights are re-drawn at trained-model scale (unit-variance activations,
logits spread by a factor 4) because transformers' init (std 0.02) gives
near-flat logits whose argmax is decided by rounding noise; every oracle
test also asserts the top-1/top-2 margin along HF's own greedy path.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.conftest import STORIES

BOS, EOS = 1, 2
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0,
              tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@dataclass(frozen=True)
class FamilyCase:
    name: str
    config_cls: str
    model_cls: str
    config: dict[str, Any]
    # transformers 4 layout: config.json rewritten with rope_theta +
    # rope_scaling instead of rope_parameters, as Hub checkpoints have it.
    t4_rope: dict[str, Any] | None = None
    zero_centred_norms: bool = False  # Gemma stores RMSNorm weights as w in (1 + w)
    # Multimodal: `config` is the text model's, nested under text_config
    # next to this tiny vision tower.
    vision_config: dict[str, Any] | None = None
    seed: int = 0
    # What this case exercises, for test ids and docs.
    features: tuple[str, ...] = field(default=())
    # Scale of the per-head attention sink logits (gpt-oss) and the router's
    # correction bias (DeepSeek-V3), redrawn so that they matter.
    bias_scale: float = 0.5


CASES = {
    "llama3": FamilyCase(
        "llama3", "LlamaConfig", "LlamaForCausalLM",
        dict(num_hidden_layers=2, rope_parameters={"rope_theta": 10000.0, **LLAMA3_ROPE}),
        features=("llama3 RoPE", "transformers 5 rope_parameters")),
    "llama3-t4": FamilyCase(
        "llama3-t4", "LlamaConfig", "LlamaForCausalLM",
        dict(num_hidden_layers=2, rope_parameters={"rope_theta": 10000.0, **LLAMA3_ROPE}),
        t4_rope={"rope_theta": 10000.0, "rope_scaling": LLAMA3_ROPE},
        features=("llama3 RoPE", "transformers 4 rope_theta/rope_scaling")),
    "llama-linear": FamilyCase(
        "llama-linear", "LlamaConfig", "LlamaForCausalLM",
        dict(num_hidden_layers=2, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
        features=("linear RoPE",)),
    "qwen2": FamilyCase(
        "qwen2", "Qwen2Config", "Qwen2ForCausalLM",
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1,
             rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"}),
        features=("q/k/v bias", "window on layers >= max_window_layers")),
    "qwen3": FamilyCase(
        "qwen3", "Qwen3Config", "Qwen3ForCausalLM",
        dict(num_hidden_layers=2, head_dim=32, rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"}),
        features=("q/k norm", "explicit head_dim")),
    "mistral": FamilyCase(
        "mistral", "MistralConfig", "MistralForCausalLM",
        dict(num_hidden_layers=2, sliding_window=12), seed=3, features=("window on every layer",)),
    "gemma2": FamilyCase(
        "gemma2", "Gemma2Config", "Gemma2ForCausalLM",
        dict(num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
             attn_logit_softcapping=1.5, final_logit_softcapping=20.0),
        zero_centred_norms=True, seed=3,
        features=("(1+w) norms", "sandwich norms", "embedding scale", "softcaps", "alternating window")),
    "gemma3": FamilyCase(
        "gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
        zero_centred_norms=True,
        features=("(1+w) q/k norms", "5:1 layer_types", "RoPE per layer type")),
    "gemma3-mm": FamilyCase(
        "gemma3-mm", "Gemma3Config", "Gemma3ForConditionalGeneration",
        dict(num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=24, sliding_window=8),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        zero_centred_norms=True, seed=1, features=("multimodal checkpoint served text-only",)),
    "phi3": FamilyCase(
        "phi3", "Phi3Config", "Phi3ForCausalLM",
        dict(num_hidden_layers=2, sliding_window=10, partial_rotary_factor=0.5), seed=3,
        features=("fused qkv/gate_up", "partial rotary", "window")),
    "mixtral": FamilyCase(
        "mixtral", "MixtralConfig", "MixtralForCausalLM",
        dict(num_hidden_layers=2, sliding_window=12, num_local_experts=4, num_experts_per_tok=2),
        seed=3, features=("top-2 of 4 experts, softmax then renormalised", "window")),
    "qwen2-moe": FamilyCase(
        "qwen2-moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=64, mlp_only_layers=[1], use_sliding_window=True, sliding_window=8,
             max_window_layers=2, rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"}),
        features=("shared expert with a sigmoid gate", "mlp_only_layers", "q/k/v bias", "window")),
    "qwen3-moe": FamilyCase(
        "qwen3-moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(num_hidden_layers=3, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
             rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "rope_theta": 1_000_000.0}),
        features=("norm_topk_prob", "q/k norm", "YaRN RoPE", "mlp_only_layers")),
    "gpt-oss": FamilyCase(
        "gpt-oss", "GptOssConfig", "GptOssForCausalLM",
        dict(num_hidden_layers=2, head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
             sliding_window=8, swiglu_limit=0.8,
             rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 8, "rope_theta": 150000.0}),
        bias_scale=1.0, seed=1,
        features=("attention sinks", "q/k/v/o biases", "alternating window", "YaRN RoPE", "router bias",
                  "expert biases", "clamped SwiGLU")),
    "deepseek-v3": FamilyCase(
        "deepseek-v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
        dict(num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
             norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=16, rope_interleave=True,
             rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                              "original_max_position_embeddings": 64, "rope_theta": 10000.0}),
        features=("MLA with a latent KV cache", "rope_interleave", "YaRN with mscale", "sigmoid routing with "
                  "correction bias", "group-limited top-k", "routed_scaling_factor", "shared expert",
                  "first_k_dense_replace")),
}


def _redraw(model: torch.nn.Module, case: FamilyCase) -> None:
    g = torch.Generator().manual_seed(case.seed)
    # transformers 5 keeps experts as 3-D tensors: [experts, out, in], or
    # [experts, in, out] for gpt-oss.
    transposed = case.model_cls == "GptOssForCausalLM"
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(case.bias_scale * torch.randn(b.shape, generator=g))
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                base = 0.0 if case.zero_centred_norms else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                # Gemma multiplies embeddings by sqrt(hidden): draw them that
                # much smaller, so the residual stream starts at unit scale.
                std = p.shape[1] ** -0.5 if case.zero_centred_norms else 1.0
                p.copy_(std * torch.randn(p.shape, generator=g))
            elif "vision_tower" in name or "multi_modal_projector" in name:
                continue  # the vision side, never reached by text prompts
            elif name.endswith((".bias", "_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(".sinks"):
                p.copy_(case.bias_scale * torch.randn(p.shape, generator=g))
            elif p.dim() == 3:  # experts
                fan_in = p.shape[1] if transposed else p.shape[2]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
            else:  # linear weights [out, in]
                scale = 4.0 if name == "lm_head.weight" else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def make_checkpoint(case: FamilyCase, directory: Path, max_shard_size: str | None = None) -> Path:
    """Saves `case` with save_pretrained (+ stories260K's tokenizer.json) into directory."""
    import transformers

    if case.vision_config is None:
        config = getattr(transformers, case.config_cls)(**COMMON | case.config)
    else:
        config = getattr(transformers, case.config_cls)(
            text_config=COMMON | case.config, vision_config=case.vision_config, mm_tokens_per_image=4,
            tie_word_embeddings=False, image_token_index=511, boi_token_index=509, eoi_token_index=510)
    config.architectures = [case.model_cls]
    torch.manual_seed(case.seed)
    model = getattr(transformers, case.model_cls)(config)
    _redraw(model, case)
    directory.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    shutil.copy(STORIES / "tokenizer.json", directory / "tokenizer.json")
    if case.t4_rope is not None:
        path = directory / "config.json"
        cfg = json.loads(path.read_text())
        del cfg["rope_parameters"]
        path.write_text(json.dumps(cfg | case.t4_rope, indent=2))
    return directory


@functools.lru_cache(maxsize=4)
def hf_model(directory: str):
    import transformers

    arch = json.loads((Path(directory) / "config.json").read_text())["architectures"][0]
    # Eager attention: the reference implementation of windows and soft-caps.
    model = getattr(transformers, arch).from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@dataclass(frozen=True)
class Greedy:
    tokens: list[int]
    min_margin: float  # smallest top-1 minus top-2 logit over the generated steps


# directory, prompt -> (tokens, the top-1 minus top-2 logit at each step),
# for the longest run so far: greedy decoding is prefix-stable (these runs
# never stop at EOS), so a shorter request is a slice of a longer one.
_GREEDY: dict[tuple[str, tuple[int, ...]], tuple[list[int], list[float]]] = {}


def _hf_greedy(directory: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[list[int], list[float]]:
    model = hf_model(directory)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt_ids)]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )
    logits = torch.cat(out.logits)  # [steps, vocab]
    top2 = logits.topk(2, dim=-1).values
    return out.sequences[0, len(prompt_ids):].tolist(), (top2[:, 0] - top2[:, 1]).tolist()


def hf_greedy(directory: str, prompt_ids: list[int], max_new_tokens: int) -> Greedy:
    """HF generate(do_sample=False) without stopping at EOS, and how close
    each of its choices came to a tie."""
    key = (directory, tuple(prompt_ids))
    if key not in _GREEDY or len(_GREEDY[key][0]) < max_new_tokens:
        _GREEDY[key] = _hf_greedy(directory, key[1], max_new_tokens)
    tokens, margins = _GREEDY[key]
    return Greedy(tokens[:max_new_tokens], min(margins[:max_new_tokens]))


def prompts(n: int, min_len: int = 5, max_len: int = 30, seed: int = 1) -> list[list[int]]:
    """n prompts of BOS + random ids (no specials), lengths spread over [min_len, max_len]."""
    g = torch.Generator().manual_seed(seed)
    lens = [min_len + (i * 7) % (max_len - min_len + 1) for i in range(n)]
    return [[BOS] + torch.randint(3, 512, (k - 1,), generator=g).tolist() for k in lens]
