"""One decoder for every family, over a flattened, unpadded token batch with
a paged KV cache. Llama is the base. Numbers and small switches come from
the family's ModelConfig (biases, norms' unit offset, windows, soft-caps,
RoPE). A family whose layer differs subclasses that layer and names it on
its CausalLM subclass (attention_cls, layer_cls; experts_cls for MoE), as
transformers' modular files do: QKNormAttention (Qwen3, Gemma 3),
SandwichDecoderLayer (Gemma 2 and 3), gpt-oss's SinkAttention, DeepSeek-V3's
latent attention (executor_svc/model/mla.py), and the mixture-of-experts
MLP (executor_svc/model/moe.py).

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

Under tensor parallelism each rank builds the same modules at its shard's
sizes (executor_svc/model/sharding.py), each layer loads its own part of the
checkpoint (executor_svc/model/layers.py), and `comm` (a tensor_parallel.TPGroup)
sums the row-split outputs and gathers the logits; with comm None the
model is whole and runs no collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.attention import AttentionBackend, AttentionMetadata
from executor_svc.model.invariant_ops import rows_in_fixed_calls
from executor_svc.model.checkpoint import LazyTensor
from executor_svc.model.layers import (
    ColumnLinear, RowLinear, RowPart, VocabEmbedding, VocabHead, load_replicated, quantize_linears, replicated_shapes,
)
from executor_svc.model.model_config import ModelConfig
from executor_svc.model.sharding import Shard

# A family's map from one checkpoint tensor to the decoder parameters it fills.
Rename = Callable[[str, LazyTensor, ModelConfig], Iterator[tuple[str, LazyTensor]]]

# Batch-invariant mode: rows per call of a final softcap's tanh over the logits.
LOGIT_CALL_ROWS = 4

# A checkpoint's FP8 KV-cache scales: one float32 scalar per layer for K and for V.
KV_SCALE_SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale")
# ModelOpt's names for the same scalars, on the projections that make K and V.
MODELOPT_KV_SCALES = {".self_attn.k_proj.k_scale": ".self_attn.k_scale",
                      ".self_attn.v_proj.v_scale": ".self_attn.v_scale"}


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
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op instead of six; in fp32 it is bitwise the same.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * self._normed(x).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Scales by (1 + w), in fp32 before the cast back (zero-initialised w)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self._normed(x) * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return (GemmaRMSNorm if cfg.norm_unit_offset else RMSNorm)(dim, cfg.rms_norm_eps)


def rope_cache(inv_freq: torch.Tensor, max_len: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, rotary_dim] in fp32, in the rotate-half layout,
    times `scale` (YaRN's attention factor; HF scales cos and sin alike)."""
    t = torch.arange(max_len, device=inv_freq.device).float()
    freqs = torch.outer(t, inv_freq)  # [max_len, rotary_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, rotary_dim]
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


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
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard, comm):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads(cfg), shard.num_kv_heads(cfg), cfg.head_dim
        self.scale = cfg.attn_scale
        self.sliding_window = cfg.layer_window(layer)
        self.softcap = cfg.attn_softcap
        # An FP8 KV cache stores k / k_scale and v / v_scale (attention/kv_quant.py):
        # the checkpoint's self_attn.k_scale / v_scale (set_kv_scales), else 1.0.
        self.k_scale = self.v_scale = 1.0
        self.comm = comm
        d, hq, kvh = cfg.head_dim, self.num_heads, self.num_kv_heads
        first_kv = shard.first_kv_head(cfg)
        # q/k/v run as one matmul over this rank's heads (its KV heads may
        # be replicated on other ranks: see Shard.first_kv_head).
        self.qkv_proj = ColumnLinear(cfg.hidden_size, [
            RowPart("q_proj", cfg.num_heads * d, shard.rank * hq * d, hq * d),
            RowPart("k_proj", cfg.num_kv_heads * d, first_kv * d, kvh * d),
            RowPart("v_proj", cfg.num_kv_heads * d, first_kv * d, kvh * d),
        ], bias=cfg.qkv_bias)
        self.o_proj = RowLinear.split(cfg.num_heads * d, cfg.hidden_size, shard.rank, shard.size, bias=cfg.o_bias)

    def forward(self, x, cos, sin, cache: tuple[torch.Tensor, ...], meta: AttentionMetadata,
                backend: AttentionBackend):
        # x: [num_tokens, hidden]; cache: (k_cache, v_cache), each [num_blocks, block_size, kvh, head_dim]
        k_cache, v_cache = cache
        n, h, kvh = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(n, h + 2 * kvh, self.head_dim)
        v = qkv[:, h + kvh:]
        q, k = self.rotate(qkv, cos, sin)
        backend.write_kv(k, v, k_cache, v_cache, meta, k_scale=self.k_scale, v_scale=self.v_scale)
        o = self.attend(q, k_cache, v_cache, meta, backend)  # [num_tokens, heads, head_dim]
        out = self.o_proj(o.reshape(n, self.num_heads * self.head_dim))  # this rank's heads' share
        return out if self.comm is None else self.comm.all_reduce(out)

    def rotate(self, qkv, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, heads, d] and k [n, kv_heads, d] with RoPE, from qkv [n,
        heads + 2 * kv_heads, d]: q's and k's heads in one pass."""
        h = self.num_heads
        qk = apply_rope(qkv[:, : h + self.num_kv_heads], cos, sin)
        return qk[:, :h], qk[:, h:]

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        return backend.attend(q, k_cache, v_cache, meta, self.scale, sliding_window=self.sliding_window,
                              softcap=self.softcap, k_scale=self.k_scale, v_scale=self.v_scale)


class QKNormAttention(Attention):
    """Qwen3, Gemma 3: a per-head RMSNorm of q and of k before RoPE."""

    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard, comm):
        super().__init__(cfg, layer, shard, comm)
        self.q_norm = make_norm(cfg, cfg.head_dim)
        self.k_norm = make_norm(cfg, cfg.head_dim)

    def rotate(self, qkv, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        h, kvh = self.num_heads, self.num_kv_heads
        return apply_rope(self.q_norm(qkv[:, :h]), cos, sin), apply_rope(self.k_norm(qkv[:, h : h + kvh]), cos, sin)


class MLP(nn.Module):
    """The gated MLP, split by intermediate units. reduce=False leaves the
    rank's partial sum to a parent that adds more before one all-reduce
    (a MoE layer's shared expert)."""

    def __init__(self, cfg: ModelConfig, shard: Shard, comm, intermediate_size: int | None = None,
                 reduce: bool = True):
        super().__init__()
        whole = intermediate_size or cfg.intermediate_size
        inter = whole // shard.size
        start = shard.rank * inter
        self.gate_up_proj = ColumnLinear(cfg.hidden_size, [
            RowPart("gate_proj", whole, start, inter), RowPart("up_proj", whole, start, inter),
        ], bias=False)
        self.down_proj = RowLinear.split(whole, cfg.hidden_size, shard.rank, shard.size)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.comm = comm if reduce else None

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.down_proj(self.act(gate) * up)  # this rank's units' share
        return out if self.comm is None else self.comm.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP, each added to the residual. A family
    whose attention or MLP differs passes its own (CausalLM.make_layer)."""

    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard, comm, attention: nn.Module | None = None,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = attention or Attention(cfg, layer, shard, comm)
        self.mlp = mlp or MLP(cfg, shard, comm)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)

    def forward(self, x, cos, sin, cache, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2/3: each sublayer's output is normed again before the residual
    add, so post_attention_layernorm normalises the attention output rather
    than the MLP input, and the MLP gets its own pre/post pair."""

    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard, comm, **parts):
        super().__init__(cfg, layer, shard, comm, **parts)
        self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
        self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)

    def forward(self, x, cos, sin, cache, meta, backend):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cache, meta, backend)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, comm, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, *shard.vocab_range(cfg))
        self.layers = nn.ModuleList(layers)
        self.norm = make_norm(cfg, cfg.hidden_size)


class CausalLM(nn.Module):
    """Llama's decoder. A family whose layers differ subclasses this and
    names its own layer parts, as transformers' modular files do."""

    attention_cls: type[nn.Module] = Attention
    layer_cls: type[DecoderLayer] = DecoderLayer
    # Layers whose input forward keeps in aux_hidden (an EAGLE-3 head reads
    # them; model/eagle3.py); len(layers) = the last layer's output.
    aux_layer_ids: tuple[int, ...] = ()
    row_unit = 1  # above 1: batch-invariant mode (batch_invariant.py)

    def __init__(self, cfg: ModelConfig, max_len: int, shard: Shard = Shard(), comm=None):
        super().__init__()
        self.cfg, self.max_len, self.shard, self.comm = cfg, max_len, shard, comm
        layers = [self.make_layer(cfg, i, shard, comm) for i in range(cfg.num_layers)]
        self.model = DecoderBody(cfg, shard, comm, layers)
        self.lm_head = VocabHead(cfg.vocab_size, cfg.hidden_size, *shard.vocab_range(cfg))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # layer type -> cos, sin; set by init_rope
        self.embed_scale: torch.Tensor | None = None

    @classmethod
    def make_layer(cls, cfg: ModelConfig, layer: int, shard: Shard, comm) -> nn.Module:
        return cls.layer_cls(cfg, layer, shard, comm, attention=cls.attention_cls(cfg, layer, shard, comm))

    def init_rope(self, device: torch.device, dtype: torch.dtype) -> None:
        """RoPE tables are computed in fp32 and then cast to the activation
        dtype, as HF does, so fp32 runs match it bit for bit. Gemma's
        embedding scale is likewise rounded to the activation dtype first."""
        self.rope = {}
        for layer_type in set(self.cfg.layer_types):
            spec = self.cfg.rope[layer_type]
            cos, sin = rope_cache(spec.inv_freq(device), self.max_len, spec.attention_factor)
            self.rope[layer_type] = (cos.to(dtype), sin.to(dtype))
        if self.cfg.embed_scale:
            self.embed_scale = torch.tensor(self.cfg.hidden_size**0.5, device=device).to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, ...]],  # per layer, as its CacheSpec says (kv_cache.py)
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Returns the final normed hidden states, [num_tokens, hidden]."""
        x, rope = self.embed_and_rope(input_ids, positions)
        if self.aux_layer_ids:
            return self._forward_keeping(x, rope, kv_caches, meta, backend)
        for layer, layer_type, cache in zip(self.model.layers, self.cfg.layer_types, kv_caches):
            x = layer(x, *rope[layer_type], cache, meta, backend)
        return self.model.norm(x)

    def embed_and_rope(self, input_ids: torch.Tensor, positions: torch.Tensor
                       ) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """What every layer starts from: the embedded tokens [num_tokens,
        hidden] and, per layer type, RoPE's cos and sin at their positions
        ([num_tokens, 1, rotary_dim] each)."""
        x = self._embed(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = {t: (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)) for t, (cos, sin) in self.rope.items()}
        return x, rope

    def _forward_keeping(self, x, rope, kv_caches, meta, backend) -> torch.Tensor:
        """forward, keeping the residual stream where aux_layer_ids say."""
        self.aux_hidden = []
        for i, (layer, layer_type, cache) in enumerate(zip(self.model.layers, self.cfg.layer_types, kv_caches)):
            if i in self.aux_layer_ids:
                self.aux_hidden.append(x)
            x = layer(x, *rope[layer_type], cache, meta, backend)
        if len(self.model.layers) in self.aux_layer_ids:
            self.aux_hidden.append(x)
        return self.model.norm(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return self.model.embed_tokens(input_ids)
        # This rank holds rows [first, end) of the vocabulary: the others'
        # ids embed to zero here, and the sum over ranks fills them in.
        first, end = self.shard.vocab_range(self.cfg)
        local = input_ids - first
        outside = (local < 0) | (local >= end - first)
        x = self.model.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(1), 0)
        return self.comm.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [num_sampled, hidden] -> [num_sampled, vocab] in fp32. Under
        tensor parallelism only rank 0 gets them (it samples): None elsewhere."""
        if self.lm_head is None:
            raise RuntimeError("this checkpoint ships no lm_head: it serves embeddings only")
        logits = self.lm_head(hidden)  # [num_sampled, padded vocab / size]
        if self.comm is not None:
            logits = self.comm.gather_logits(logits)
            if logits is None:
                return None
            logits = logits[:, : self.cfg.vocab_size]  # padding rows are never sampled
        if self.cfg.final_softcap is not None:
            c = self.cfg.final_softcap
            if self.row_unit > 1:
                # Batch-invariant mode: a tanh over [num_sampled, vocab] is one flat
                # loop split over threads, both following the batch's size.
                logits = rows_in_fixed_calls(lambda x: torch.tanh(x / c) * c, logits, LOGIT_CALL_ROWS)
            else:
                logits = torch.tanh(logits / c) * c
        return logits.float()


def checkpoint_owners(model: CausalLM) -> dict[str, tuple[nn.Module, str, tuple[int, ...]]]:
    """Checkpoint name -> (the module that loads it, the name it knows it
    by, its whole shape). Modules with a loader declare their tensors
    (layers.py); any other module's direct parameters load whole."""
    owners = {}
    for path, module in model.named_modules():
        if getattr(module, "loaded_by_parent", False):
            continue  # a quantized expert's layer: its parent declares and routes its tensors
        if hasattr(module, "checkpoint_shapes"):
            shapes = module.checkpoint_shapes()
            base = path.rpartition(".")[0] if getattr(module, "names_from_parent", False) else path
        else:
            shapes = replicated_shapes(module)
            base = path
        for key, shape in shapes.items():
            owners[f"{base}.{key}" if base else key] = (module, key, shape)
    if model.cfg.tie_word_embeddings:
        del owners["lm_head.weight"]  # HF ignores it too: the head is the embedding matrix
    return owners


def set_kv_scales(model: CausalLM, scales: dict[str, LazyTensor]) -> list[str]:
    """Sets each layer's k_scale / v_scale from the checkpoint's
    `model.layers.N.self_attn.k_scale` / `v_scale` (float32 scalars: the
    FP8 KV cache holds value / scale); the names no layer has are returned.
    Read only by an FP8 cache (EXECUTOR_KV_CACHE_DTYPE): a cache in the
    compute dtype stores the values themselves.

    compressed-tensors' FP8 `kv_cache_scheme` by tensor writes these names
    (quantization.py accepts it); ModelOpt's k_proj.k_scale / v_proj.v_scale
    arrive renamed to them (MODELOPT_KV_SCALES). Per-head scales are not
    implemented and are refused."""
    layers = model.model.layers  # a ModuleDict by checkpoint index in a multi-token-prediction module (mtp.py)
    named = layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers)
    attention = {f"model.layers.{i}.self_attn": layer.self_attn for i, layer in named}
    unknown = []
    for name, tensor in scales.items():
        path, _, key = name.rpartition(".")
        if path not in attention:
            unknown.append(name)
            continue
        if math.prod(tensor.shape) != 1:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}; only one KV-cache scale per layer (per "
                             "tensor) is implemented")
        value = float(tensor.read().float().reshape(()))
        if not 0.0 < value < float("inf"):
            raise ValueError(f"{name}: {value} is not a usable KV-cache scale (a finite number > 0)")
        setattr(attention[path], key, value)
    return unknown


def build_model(cfg: ModelConfig,
                tensors: Iterable[tuple[str, torch.Tensor | LazyTensor]] | dict[str, torch.Tensor],
                max_len: int, device: torch.device, dtype: torch.dtype, shard: Shard = Shard(), comm=None, *,
                model_cls: type[CausalLM] = CausalLM, rename: Rename | None = None,
                headless_ok: bool = False) -> CausalLM:
    """Fills a meta-device model one checkpoint tensor at a time, each moved
    to device and dtype as it arrives, so the host never holds more than one
    copy of the weights; given LazyTensors, a tensor-parallel rank reads only
    its part of each, as the layer that owns it decides (layers.py). Every
    parameter must come from the checkpoint, and every checkpoint tensor
    must land somewhere. headless_ok: an untied lm_head may be missing (an
    embedding checkpoint saved without it, as Qwen3-Embedding-8B is); the
    model then pools but cannot generate (lm_head is None)."""
    with torch.device("meta"):
        model = model_cls(cfg, max_len, shard, comm)
        if cfg.quantization is not None and cfg.quantization.schemes:
            quantize_linears(model, cfg.quantization, shard.size)
    owners = checkpoint_owners(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    kv_scales: dict[str, LazyTensor] = {}
    for ckpt_name, tensor in (tensors.items() if isinstance(tensors, dict) else tensors):
        if ckpt_name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the config
        for modelopt, ours in MODELOPT_KV_SCALES.items():
            if ckpt_name.endswith(modelopt):
                ckpt_name = ckpt_name[: -len(modelopt)] + ours
        if ckpt_name.endswith(KV_SCALE_SUFFIXES):
            kv_scales[ckpt_name] = tensor if isinstance(tensor, LazyTensor) else LazyTensor.of(tensor)
            continue
        if cfg.tie_word_embeddings and ckpt_name == "lm_head.weight":
            continue  # HF ignores it too: the head is the embedding matrix
        lazy = tensor if isinstance(tensor, LazyTensor) else LazyTensor.of(tensor)
        for name, whole in (rename(ckpt_name, lazy, cfg) if rename else [(ckpt_name, lazy)]):
            if name not in owners and f"model.{name}" in owners:
                # Saved from the bare decoder (AutoModel), as sentence-transformers
                # saves Qwen3-Embedding: the body's tensors lack the prefix.
                name = f"model.{name}"
            if name not in owners:
                unexpected.append(name)
                continue
            module, key, shape = owners[name]
            if shape is not None and whole.shape != shape:  # None: the layer checks (per-tensor scales)
                raise ValueError(f"{name}: checkpoint shape {whole.shape}, config implies {shape}")
            if hasattr(module, "load_weight"):
                module.load_weight(key, whole, device, dtype)
            else:
                load_replicated(module, key, whole, device, dtype)
            loaded.add(name)
    unexpected += set_kv_scales(model, kv_scales)
    missing = sorted(owners.keys() - loaded)
    if headless_ok and missing == ["lm_head.weight"]:
        model.lm_head = None
        missing = []
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the {cfg.architecture} layout: "
                         f"missing={missing} unexpected={sorted(unexpected)}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    unfilled = [n for n, p in model.named_parameters() if p.is_meta]
    if unfilled:  # a layer's loader left part of a parameter unread: a bug, not a checkpoint problem
        raise RuntimeError(f"parameters not filled by their loaders: {unfilled}")
    model.init_rope(device, dtype)
    return model.eval()
