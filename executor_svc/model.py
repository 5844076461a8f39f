"""One decoder for every family, over a flattened, unpadded token batch with
a paged KV cache. Llama is the base; the other families switch on small
pieces from their ModelConfig (see executor_svc/families.py):

  Qwen2     q/k/v biases
  Qwen3     per-head q/k RMSNorm before RoPE
  Mistral   a sliding window on every layer
  Gemma 2   (1+w) RMSNorm, sandwich norms, sqrt(hidden) embedding scale,
            GeGLU, query_pre_attn_scalar, score and logit soft-capping,
            sliding and global layers alternating
  Gemma 3   Gemma 2 without soft-capping, plus (1+w) q/k norms and a RoPE
            base per layer type
  Phi-3     partial rotary dims (its fused weights are split at load)

Parameter names match Hugging Face's, so a checkpoint's tensors load by name.
"""

from __future__ import annotations

from collections.abc import Iterable

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

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the weights' dtype, as HF does.
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self._normed(x).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Scales by (1 + w), in fp32 before the cast back (zero-initialised w)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self._normed(x) * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return (GemmaRMSNorm if cfg.norm_unit_offset else RMSNorm)(dim, cfg.rms_norm_eps)


def rope_cache(inv_freq: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, rotary_dim] in fp32, in the rotate-half layout."""
    t = torch.arange(max_len, device=inv_freq.device).float()
    freqs = torch.outer(t, inv_freq)  # [max_len, rotary_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, rotary_dim]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, 1, rotary_dim].
    # Dims past rotary_dim (Phi-3's partial rotary factor) pass through.
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    rotated = torch.cat((-rot[..., d // 2:], rot[..., : d // 2]), dim=-1)
    out = rot * cos + rotated * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.attn_scale
        self.sliding_window = cfg.layer_window(layer)
        self.softcap = cfg.attn_softcap
        h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, q, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg, cfg.head_dim)
            self.k_norm = make_norm(cfg, cfg.head_dim)

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
        # x: [num_tokens, hidden]
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        backend.write_kv(k, v, k_cache, v_cache, meta)
        o = backend.attend(q, k_cache, v_cache, meta, self.scale,
                           sliding_window=self.sliding_window, softcap=self.softcap)  # [num_tokens, heads, head_dim]
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)

    def forward(self, x, cos, sin, k_cache, v_cache, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2/3: each sublayer's output is normed again before the residual
    add, so post_attention_layernorm normalises the attention output rather
    than the MLP input, and the MLP gets its own pre/post pair."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
        self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)

    def forward(self, x, cos, sin, k_cache, v_cache, meta, backend):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta, backend)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        layer_cls = SandwichDecoderLayer if cfg.sandwich_norms else DecoderLayer
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int):
        super().__init__()
        self.cfg, self.max_len = cfg, max_len
        self.model = DecoderBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # layer type -> cos, sin; set by init_rope
        self.embed_scale: torch.Tensor | None = None

    def init_rope(self, device: torch.device, dtype: torch.dtype) -> None:
        """RoPE tables are computed in fp32 and then cast to the activation
        dtype, as HF does, so fp32 runs match it bit for bit. Gemma's
        embedding scale is likewise rounded to the activation dtype first."""
        self.rope = {}
        for layer_type in set(self.cfg.layer_types):
            cos, sin = rope_cache(self.cfg.rope[layer_type].inv_freq(device), self.max_len)
            self.rope[layer_type] = (cos.to(dtype), sin.to(dtype))
        if self.cfg.embed_scale:
            self.embed_scale = torch.tensor(self.cfg.hidden_size**0.5, device=device).to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: [num_blocks, block_size, kvh, d] x2
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Returns the final normed hidden states, [num_tokens, hidden]."""
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        # per layer type: [num_tokens, 1, rotary_dim] each
        rope = {t: (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)) for t, (cos, sin) in self.rope.items()}
        for layer, layer_type, (k_cache, v_cache) in zip(self.model.layers, self.cfg.layer_types, kv_caches):
            x = layer(x, *rope[layer_type], k_cache, v_cache, meta, backend)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_sampled, hidden] -> [num_sampled, vocab] in fp32
        logits = self.lm_head(hidden)
        if self.cfg.final_softcap is not None:
            c = self.cfg.final_softcap
            logits = torch.tanh(logits / c) * c
        return logits.float()


def build_model(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
                max_len: int, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Fills a meta-device model one checkpoint tensor at a time, each moved
    to device and dtype as it arrives, so the host never holds more than one
    copy of the weights. Every parameter must come from the checkpoint, and
    every checkpoint tensor must land somewhere."""
    from executor_svc.families import family_of

    with torch.device("meta"):
        model = CausalLM(cfg, max_len)
    expected = {name for name, _ in model.named_parameters()}
    rename = family_of(cfg).rename
    loaded: set[str] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in (tensors.items() if isinstance(tensors, dict) else tensors):
        if ckpt_name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the config
        if cfg.tie_word_embeddings and ckpt_name == "lm_head.weight":
            continue  # HF ignores it too: the head is the embedding matrix
        for name, t in (rename(ckpt_name, tensor, cfg) if rename else [(ckpt_name, tensor)]):
            if name not in expected:
                unexpected.append(name)
                continue
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name)
            if tuple(t.shape) != tuple(getattr(module, leaf).shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)}, config implies "
                                 f"{tuple(getattr(module, leaf).shape)}")
            # Always a copy: safetensors hands out views of the mmapped file,
            # which would keep the served weights tied to files on disk.
            setattr(module, leaf, nn.Parameter(t.to(device=device, dtype=dtype, copy=True), requires_grad=False))
            loaded.add(name)
    missing = sorted(expected - loaded)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the {cfg.architecture} layout: "
                         f"missing={missing} unexpected={sorted(unexpected)}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_rope(device, dtype)
    return model.eval()
