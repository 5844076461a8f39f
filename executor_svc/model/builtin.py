"""Built-in models that need no files: random Llama (or, for bench-moe,
Qwen3-MoE) weights from a fixed seed plus a byte-level tokenizer.

They come out in Hugging Face form (config dict, HF-named state dict,
tokenizer.json text), so they go through the same loading path as a real
checkpoint (checkpoint.load_checkpoint wraps them), and tests can hand the
very same weights to HF transformers. This module imports nothing of the
executor's: checkpoint.py imports it, not the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

NUM_SPECIAL = 3  # <unk>, <s>, </s>
BOS_ID, EOS_ID = 1, 2


@dataclass(frozen=True, slots=True)
class BuiltinSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    seed: int
    # A mixture of experts (Qwen3-MoE) in place of every MLP when num_experts > 0.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0


BUILTIN_MODELS: dict[str, BuiltinSpec] = {
    # Default for `make serve`: small enough to start in a second on a laptop.
    "tiny-random": BuiltinSpec(512, 64, 128, 2, 4, 2, 2048, tie_word_embeddings=False, seed=0),
    # docs/performance.md: compute per step big enough that overhead and
    # batching both show.
    "bench-small": BuiltinSpec(8192, 256, 704, 4, 8, 4, 2048, tie_word_embeddings=False, seed=0),
    # bench-small's scale with Qwen3-MoE layers: 8 experts, 2 active per
    # token, each half bench-small's MLP width, so a token's active MLP
    # FLOPs equal bench-small's (P15).
    "bench-moe": BuiltinSpec(8192, 256, 704, 4, 8, 4, 2048, tie_word_embeddings=False, seed=0, num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=352),
}


def hf_config(name: str, spec: BuiltinSpec) -> dict:
    if spec.num_experts:
        return _llama_config(name, spec) | {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.num_experts_per_tok, "moe_intermediate_size": spec.moe_intermediate_size,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
        }
    return _llama_config(name, spec)


def _llama_config(name: str, spec: BuiltinSpec) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "_name_or_path": name,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }


def random_state_dict(spec: BuiltinSpec) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights. Scaled like a trained model (unit-variance
    activations), so logits are well spread and greedy decoding is not
    decided by rounding noise."""
    g = torch.Generator().manual_seed(spec.seed)
    head_dim = spec.hidden_size // spec.num_heads
    h, kv = spec.hidden_size, spec.num_kv_heads * head_dim

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=g) / in_features**0.5

    sd = {"model.embed_tokens.weight": torch.randn(spec.vocab_size, h, generator=g)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = linear(h, h)
        sd[p + "self_attn.k_proj.weight"] = linear(kv, h)
        sd[p + "self_attn.v_proj.weight"] = linear(kv, h)
        sd[p + "self_attn.o_proj.weight"] = linear(h, h)
        if spec.num_experts:
            sd[p + "self_attn.q_norm.weight"] = torch.ones(head_dim)
            sd[p + "self_attn.k_norm.weight"] = torch.ones(head_dim)
            sd[p + "mlp.gate.weight"] = linear(spec.num_experts, h)
            for e in range(spec.num_experts):
                sd[p + f"mlp.experts.{e}.gate_proj.weight"] = linear(spec.moe_intermediate_size, h)
                sd[p + f"mlp.experts.{e}.up_proj.weight"] = linear(spec.moe_intermediate_size, h)
                sd[p + f"mlp.experts.{e}.down_proj.weight"] = linear(h, spec.moe_intermediate_size)
        else:
            sd[p + "mlp.gate_proj.weight"] = linear(spec.intermediate_size, h)
            sd[p + "mlp.up_proj.weight"] = linear(spec.intermediate_size, h)
            sd[p + "mlp.down_proj.weight"] = linear(h, spec.intermediate_size)
        sd[p + "input_layernorm.weight"] = torch.ones(h)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h)
    sd["model.norm.weight"] = torch.ones(h)
    if not spec.tie_word_embeddings:
        sd["lm_head.weight"] = linear(spec.vocab_size, h)
    return sd


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes map to themselves, the
    rest to unused code points, so every byte is one visible character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_level_tokenizer_json(vocab_size: int) -> str:
    """Token id = 3 + byte value; ids past 258 are filler tokens the random
    model may still emit, which decode to their literal name."""
    alphabet = _bytes_to_unicode()
    vocab = {"<unk>": 0, "<s>": BOS_ID, "</s>": EOS_ID}
    for b in range(256):
        vocab[alphabet[b]] = NUM_SPECIAL + b
    for i in range(NUM_SPECIAL + 256, vocab_size):
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    return tok.to_str()


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    name: str
    hf_config: dict
    tokenizer_json: str
    state_dict: dict[str, torch.Tensor]  # HF names


def load_builtin(name: str) -> BuiltinModel:
    spec = BUILTIN_MODELS[name]
    tokenizer_json = byte_level_tokenizer_json(spec.vocab_size)
    return BuiltinModel(name, hf_config(name, spec), tokenizer_json, random_state_dict(spec))
