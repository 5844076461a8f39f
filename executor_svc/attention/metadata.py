"""What every attention backend is given and must do: the per-step
metadata the runner builds once and every layer reads, and the backend
interface the model calls (write_kv, then attend, for every layer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one flattened, unpadded step batch (requests back to back)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    cu_query_lens: torch.Tensor  # [num_reqs + 1] int32: query offsets per request
    seq_lens: torch.Tensor  # [num_reqs] int32: context length incl. this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32; columns past a request's blocks are padding
    # Host-side copies, so the torch backend can split the batch without
    # device syncs.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # False where only the device tensors hold this step's values (verify
    # steps in CUDA graphs: cuda_graphs.py): the host lists then give the
    # number of requests, not their lengths.
    host_lists: bool = True
    # What a backend derives from the fields above on its first layer call and
    # reuses on every later layer of the same step (the metadata is built once
    # per step and shared by all layers). Keys belong to the backend.
    cache: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_host)


class AttentionBackend(Protocol):
    """A cache in an FP8 dtype holds value / scale (kv_quant.py): k_scale and
    v_scale are the layer's, and a cache in the compute dtype ignores them."""

    name: str

    def write_latent(self, latent: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                     k_scale: float = 1.0) -> None:
        """MLA: latent [num_tokens, 1, latent_dim] into cache [num_blocks, block_size, 1, latent_dim]."""
        ...

    def attend_latent(self, query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      value_dim: int, k_scale: float = 1.0) -> torch.Tensor:
        """MLA: causal multi-query attention of query [num_tokens, num_heads, latent_dim]
        over the latent cache, each latent serving as the key and its first
        value_dim values as the value. Returns [num_tokens, num_heads, value_dim]."""
        ...

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata, k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Causal attention of each new query token over its request's cached context.

        As in HF transformers: with sliding_window W, the query at position i
        sees key position j iff i - W < j <= i; with softcap s the scaled
        scores become s * tanh(scores / s) before masking and softmax; with
        sinks ([num_heads] logits, gpt-oss) head h's softmax has one more
        term, exp(sinks[h]), which weighs no value.
        """
        ...
