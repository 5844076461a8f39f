"""DeepSeek-V3's multi-token-prediction (MTP) module, loaded from the
checkpoint that ships it (`num_nextn_predict_layers`: the layers past
`num_hidden_layers`), for speculative decoding (executor_svc/step/head_drafts.py).

One MTP layer at position i reads the target's final (normed) hidden state
at i and the embedding of token i + 1, each RMS-normed (hnorm, enorm),
concatenated [embedding, hidden] and projected back to the hidden size
(eh_proj), then runs one decoder layer of the target's own kind (MLA
attention with its own latent KV, experts or a dense MLP as the layer index
says), and predicts token i + 2 through its shared_head's norm and the
target's lm_head. The checkpoint's copies of the embedding and the head
(`embed_tokens`, `shared_head.head`) are not loaded: the DeepSeek-V3 report
has the module share both with the main model, so the target's serve.
transformers' forward never runs these layers, and the target's loader
skips them (families/deepseek_v3.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import torch
from torch import nn

from executor_svc.model.checkpoint import LazyTensor
from executor_svc.model.layers import ColumnLinear
from executor_svc.model.model import CausalLM, make_norm
from executor_svc.model.model_config import FULL, ModelConfig
from executor_svc.model.sharding import Shard

# The MTP layer's tensors the target's own serve instead.
SHARED_WITH_TARGET = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The target's config extended by one layer, the first MTP layer's
    index (num_layers): its layer type and whether it has experts follow
    the target's rule for a layer that deep."""
    moe = cfg.moe
    if moe is not None:
        moe = dataclasses.replace(moe, sparse_layers=moe.sparse_layers + (moe.sparse_layers[-1],))
    return dataclasses.replace(cfg, num_layers=cfg.num_layers + 1, layer_types=cfg.layer_types + (FULL,), moe=moe)


def mtp_model_class(target_cls: type[CausalLM]) -> type[CausalLM]:
    """A model class holding only the first MTP layer, under its checkpoint
    names (model.layers.<num_hidden_layers>.*), so the target's loader
    (build_model) fills it, quantized linears included."""

    class MultiTokenPredictor(target_cls):
        def __init__(self, cfg: ModelConfig, max_len: int, shard: Shard = Shard(), comm=None):
            nn.Module.__init__(self)
            self.cfg, self.max_len, self.shard, self.comm = cfg, max_len, shard, comm
            index = cfg.num_layers - 1
            layer = self.make_layer(cfg, index, shard, comm)
            layer.enorm = make_norm(cfg, cfg.hidden_size)
            layer.hnorm = make_norm(cfg, cfg.hidden_size)
            layer.eh_proj = ColumnLinear.split(2 * cfg.hidden_size, cfg.hidden_size, 0, 1)
            layer.shared_head = nn.Module()
            layer.shared_head.norm = make_norm(cfg, cfg.hidden_size)
            self.model = nn.Module()
            self.model.layers = nn.ModuleDict({str(index): layer})
            self.lm_head = None
            self.rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            self.embed_scale = None

        @property
        def layer(self) -> nn.Module:
            return self.model.layers[str(self.cfg.num_layers - 1)]

        def predict(self, target: CausalLM, next_ids: torch.Tensor, positions: torch.Tensor,
                    previous: torch.Tensor, cache: tuple[torch.Tensor, ...], meta, backend) -> torch.Tensor:
            """next_ids[t]: the token after position positions[t]; previous[t]:
            the hidden state there (the target's, normed, or this layer's own
            output one position earlier when drafting ahead). Returns this
            layer's output [num_tokens, hidden], before shared_head.norm."""
            layer = self.layer
            x = torch.cat([layer.enorm(target._embed(next_ids)), layer.hnorm(previous)], dim=-1)
            x = layer.eh_proj(x)
            cos, sin = self.rope[FULL]
            return layer(x, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1), cache, meta, backend)

        def compute_logits(self, target: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
            return target.compute_logits(self.layer.shared_head.norm(hidden))

    return MultiTokenPredictor


LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def mtp_tensors(tensors: Iterator[tuple[str, LazyTensor]], index: int) -> Iterator[tuple[str, LazyTensor]]:
    """The checkpoint's tensors of MTP layer `index`, less those shared
    with the target."""
    for name, t in tensors:
        m = LAYER.match(name)
        if m and int(m.group(1)) == index and m.group(2) not in SHARED_WITH_TARGET:
            yield name, t


class MTPHead:
    """The MTP layer as a draft head (step/head_drafts.py), bound to the
    target whose embedding and lm_head it uses."""

    def __init__(self, mtp: CausalLM, target: CausalLM):
        self.mtp, self.target = mtp, target

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # the target's final, normed hidden states

    def predict(self, next_ids, positions, previous, cache, meta, backend) -> torch.Tensor:
        return self.mtp.predict(self.target, next_ids, positions, previous, cache, meta, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.mtp.compute_logits(self.target, hidden)
