"""EAGLE-3 draft heads in the `speculators` checkpoint format, for
EXECUTOR_SPECULATIVE_METHOD=eagle3 (EXECUTOR_SPECULATIVE_DRAFT_MODEL names
the head's directory; the proposer: executor_svc/step/head_drafts.py).

The format: config.json with `speculators_model_type: eagle3`, the draft
layer's Llama config (`transformer_layer_config`), `draft_vocab_size`,
`norm_before_residual`, `target_hidden_size` and
`eagle_aux_hidden_state_layer_ids` (the target layers whose input it
reads; by default 2, L // 2 and L - 3 of the target's L); safetensors with
`fc` (those states, concatenated, projected to the head's size),
`layers.0` (a Llama decoder layer whose q/k/v read twice the hidden size),
`norm`, `lm_head` over the draft vocabulary, `d2t` (each draft id's offset
to its target id), `t2d`, and optionally `embed_tokens`.

At position i, with e the embedding of token i + 1 and g the features
there (fc of the target's states at i, or the head's own output at i - 1
when it drafts ahead of what the target has computed):

    residual = g, or hidden_norm(g) with norm_before_residual
    x = residual + attention(concat[input_layernorm(e), hidden_norm(g)])
    out = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(out)), placed at their target ids (the others -inf)

Variants the format has grown that this does not compute are refused by
name: several decoder layers, norm_before_fc, fc_norm, norm_output, a
layer config other than Llama's, and quantized heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from executor_svc.model.layers import RowLinear, VocabEmbedding
from executor_svc.model.model import MLP, Attention, CausalLM, make_norm
from executor_svc.model.model_config import FULL, ModelConfig
from executor_svc.model.sharding import Shard
from llmsched.errors import StartupError

SETTING = "EXECUTOR_SPECULATIVE_DRAFT_MODEL"
# Keys that select a computation this module does not implement.
REFUSED_FLAGS = {
    "norm_before_fc": "an RMSNorm over the concatenated target states before fc",
    "fc_norm": "an RMSNorm over each target state before fc",
    "norm_output": "normed outputs fed back between drafts (EAGLE 3.1)",
}
# Tensors of the checkpoint that inference does not read.
UNUSED = ("t2d", "verifier_norm.weight")


@dataclass(frozen=True, slots=True)
class Eagle3Spec:
    layer: ModelConfig  # the draft layer's, one layer
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # the target layers whose input (the residual stream there) it reads
    norm_before_residual: bool


def read_eagle3(config: dict[str, Any], target: ModelConfig, name: str) -> Eagle3Spec:
    """The head's config.json, checked against the target; StartupError
    naming what does not fit."""
    from executor_svc.model.families import read_config

    where = f"{SETTING}={name!r}"
    kind = config.get("speculators_model_type")
    if kind != "eagle3":
        raise StartupError(f"{where}: not an EAGLE-3 head in the speculators format (config.json's "
                           f"speculators_model_type is {kind!r}, not 'eagle3')")
    for key, what in REFUSED_FLAGS.items():
        if config.get(key):
            raise StartupError(f"{where}: {key}=true ({what}) is not implemented")
    layer = dict(config.get("transformer_layer_config") or {})
    if layer.get("model_type", "llama") != "llama":
        raise StartupError(f"{where}: transformer_layer_config model_type {layer.get('model_type')!r} is not "
                           "implemented (implemented: llama)")
    if layer.get("num_hidden_layers", 1) != 1:
        raise StartupError(f"{where}: {layer['num_hidden_layers']} decoder layers; one is implemented")
    if layer.get("quantization_config") or config.get("quantization_config"):
        raise StartupError(f"{where}: quantized EAGLE-3 heads are not implemented")
    try:
        cfg = read_config({**layer, "model_type": "llama", "num_hidden_layers": 1,
                           "architectures": ["LlamaForCausalLM"]})
    except Exception as exc:  # UnsupportedConfig and the reader's own errors
        raise StartupError(f"{where}: transformer_layer_config: {exc}") from None
    cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    if cfg.vocab_size != target.vocab_size:
        raise StartupError(f"{where}: its target vocabulary has {cfg.vocab_size} tokens, the target model's "
                           f"{target.vocab_size}")
    target_hidden = config.get("target_hidden_size") or cfg.hidden_size
    if target_hidden != target.hidden_size:
        raise StartupError(f"{where}: made for a target of hidden size {target_hidden}; this target's is "
                           f"{target.hidden_size}")
    n = target.num_layers
    ids = tuple(config.get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3))
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > n:
        raise StartupError(f"{where}: eagle_aux_hidden_state_layer_ids {list(ids)} are not distinct layers of the "
                           f"target's {n} (0 to {n})")
    if len(ids) * target_hidden == cfg.hidden_size:
        raise StartupError(f"{where}: {len(ids)} target states of {target_hidden} are as wide as the head's own "
                           f"output ({cfg.hidden_size}), so the two cannot be told apart")
    return Eagle3Spec(cfg, int(config.get("draft_vocab_size") or cfg.vocab_size), ids,
                      bool(config.get("norm_before_residual", False)))


class Eagle3Layer(nn.Module):
    """The decoder layer: attention over [embedding, features], each normed."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__()
        # q, k and v read twice the hidden size; o writes it once.
        self.self_attn = Attention(dataclasses.replace(cfg, hidden_size=2 * cfg.hidden_size), 0, Shard(), None)
        self.self_attn.o_proj = RowLinear.split(cfg.num_heads * cfg.head_dim, cfg.hidden_size, 0, 1, bias=cfg.o_bias)
        self.mlp = MLP(cfg, Shard(), None)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.hidden_norm = make_norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds, features, cos, sin, cache, meta, backend):
        hidden = self.hidden_norm(features)
        residual = hidden if self.norm_before_residual else features
        x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        x = residual + self.self_attn(x, cos, sin, cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


def eagle3_model_class(spec: Eagle3Spec, target_hidden: int, fc_bias: bool, own_embedding: bool) -> type[CausalLM]:
    """The head as a module the target's loader (build_model) fills, its
    parameters under the checkpoint's names (layers.0 lands in
    model.layers.0, as a bare decoder's do)."""

    class Eagle3Module(CausalLM):
        def __init__(self, cfg: ModelConfig, max_len: int, shard: Shard = Shard(), comm=None):
            nn.Module.__init__(self)
            self.cfg, self.max_len, self.shard, self.comm = cfg, max_len, shard, comm
            h = cfg.hidden_size
            self.fc = nn.Linear(len(spec.aux_layer_ids) * target_hidden, h, bias=fc_bias)
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([Eagle3Layer(cfg, spec.norm_before_residual)])
            self.norm = make_norm(cfg, h)
            self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
            self.embed_tokens = VocabEmbedding(cfg.vocab_size, h, 0, cfg.vocab_size) if own_embedding else None
            self.rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            self.embed_scale = None

    return Eagle3Module


class Eagle3Head:
    """The head as the proposer sees it (step/head_drafts.py), bound to the
    target it reads: its captured layer inputs, and its embedding when the
    checkpoint ships none."""

    def __init__(self, module: CausalLM, target: CausalLM, draft_to_target: torch.Tensor):
        self.module, self.target = module, target
        self.draft_to_target = draft_to_target  # [draft vocab] int64: each draft id's target id
        self.vocab_size = target.cfg.vocab_size

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.target.aux_hidden, dim=-1)  # [num_tokens, 3 x target hidden]

    def predict(self, next_ids, positions, previous, cache, meta, backend) -> torch.Tensor:
        m = self.module
        if previous.shape[-1] == m.fc.in_features:  # the target's states, not the head's own output
            previous = m.fc(previous)
        embeds = m.embed_tokens(next_ids) if m.embed_tokens is not None else self.target._embed(next_ids)
        cos, sin = m.rope[FULL]
        return m.model.layers[0](embeds, previous, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1), cache,
                                 meta, backend)

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        m = self.module
        draft = m.lm_head(m.norm(out)).float()  # [n, draft vocab]
        logits = draft.new_full((len(out), self.vocab_size), float("-inf"))
        logits[:, self.draft_to_target] = draft
        return logits
