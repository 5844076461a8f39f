"""A Llama decoder over a flattened, unpadded token batch with a paged KV
cache. Parameter names match Hugging Face's LlamaForCausalLM, so a
checkpoint's state dict loads as is."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.attention import AttentionBackend, AttentionMetadata
from executor_svc.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the weights' dtype, as HF does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cache(cfg: ModelConfig, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, head_dim] in fp32, in the rotate-half layout."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    t = torch.arange(max_len, device=device).float()
    freqs = torch.outer(t, inv_freq)  # [max_len, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, 1, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=False)

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
        # x: [num_tokens, hidden]
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        backend.write_kv(k, v, k_cache, v_cache, meta)
        o = backend.attend(q, k_cache, v_cache, meta, self.scale)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_cache(cfg, max_len, torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: [num_blocks, block_size, kvh, d] x2
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Returns the final normed hidden states, [num_tokens, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos = self.rope_cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.rope_sin[positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, k_cache, v_cache, meta, backend)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_sampled, hidden] -> [num_sampled, vocab] in fp32
        return self.lm_head(hidden).float()


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], max_len: int,
                device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_len)
    state = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the Llama layout: missing={missing} unexpected={unexpected}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype).eval()
    # RoPE tables are computed in fp32 and then cast to the activation dtype,
    # as HF does, so fp32 runs match it bit for bit.
    cos, sin = rope_cache(cfg, max_len, device)
    model.rope_cos, model.rope_sin = cos.to(dtype), sin.to(dtype)
    return model
