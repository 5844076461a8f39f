"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2).

Each token's keys and values for every head are decompressed from one
latent vector: c = norm(W_dkv x) (kv_lora_rank values), plus one RoPE'd key
part k_pe (qk_rope_head_dim values) that every head shares. The paged
cache holds only [c, k_pe] per token and layer, which is MLA's whole point:
kv_lora_rank + qk_rope_head_dim values instead of 2 x heads x head_dim.

Attention runs on the latent with the decompression absorbed into the
query and the output (as vLLM's and FlashMLA's MLA do): for head h with
kv_b_proj's parts W_uk[h] (keys) and W_uv[h] (values),

  q_nope[h] . (W_uk[h] c) = (W_uk[h]^T q_nope[h]) . c
  sum_j p_j W_uv[h] c_j   = W_uv[h] (sum_j p_j c_j)

so each head attends over the latents as one multi-query attention with
head dim kv_lora_rank + qk_rope_head_dim, and its output is projected by
W_uv[h] afterwards. Prefill and decode take the same path (a prefill could
decompress instead; the product is the same).

Under tensor parallelism the heads split over ranks (q_b, kv_b by their
heads' rows, o by columns); the latent projection and its norm are
replicated, and so is the cache: every rank's heads read all of it.
"""

from __future__ import annotations

import torch
from torch import nn

from executor_svc.attention import AttentionBackend, AttentionMetadata
from executor_svc.model.invariant_ops import pad_rows
from executor_svc.model.layers import ColumnLinear, RowLinear
from executor_svc.model.model import RMSNorm, apply_rope
from executor_svc.model.model_config import ModelConfig
from executor_svc.model.sharding import Shard

# HF builds the q_a and kv_a norms without passing rms_norm_eps: their eps is the default.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    row_unit = 1  # the absorbed projections' rows are padded to a multiple of it (batch_invariant.py)

    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard, comm):
        super().__init__()
        m = cfg.mla
        self.num_heads = shard.num_heads(cfg)
        self.nope, self.rope = m.qk_nope_head_dim, m.qk_rope_head_dim
        self.v_dim, self.kv_lora = m.v_head_dim, m.kv_lora_rank
        self.scale, self.interleave, self.comm = m.softmax_scale, m.rope_interleave, comm
        # An FP8 latent cache stores latent / k_scale (attention/kv_quant.py), as
        # vLLM's MLA does: the checkpoint's self_attn.k_scale, else 1.0. v_scale
        # is never read (the values are the latent's first kv_lora_rank dims).
        self.k_scale = self.v_scale = 1.0
        h, rank, size = cfg.hidden_size, shard.rank, shard.size
        q_rows = cfg.num_heads * m.qk_head_dim
        if m.q_lora_rank:
            # Replicated: one part holding every row (an FP8 checkpoint's
            # layer like any other).
            self.q_a_proj = ColumnLinear.split(h, m.q_lora_rank, 0, 1)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnLinear.split(m.q_lora_rank, q_rows, rank, size)
        else:
            self.q_proj = ColumnLinear.split(h, q_rows, rank, size)
        self.kv_a_proj_with_mqa = ColumnLinear.split(h, m.kv_lora_rank + m.qk_rope_head_dim, 0, 1)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnLinear.split(m.kv_lora_rank, cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), rank,
                                            size)
        # Its weight is read whole every step (dense_weight below), so it
        # keeps a layout that dequantizes cheaply (cpu_int_linear.py).
        self.kv_b_proj.cpu_kernel_ok = False
        self.o_proj = RowLinear.split(cfg.num_heads * m.v_head_dim, h, rank, size)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleave:
            # RoPE over (even, odd) pairs = the halves' RoPE with the even dims moved first,
            # which is also HF's output layout (q and k alike, so q.k is unchanged).
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        return apply_rope(x, cos, sin)

    def forward(self, x, cos, sin, cache: tuple[torch.Tensor, ...], meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        # x: [num_tokens, hidden]; cache: (latent,), [num_blocks, block_size, 1, kv_lora + rope]
        (latent_cache,) = cache
        n, heads = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q = q.view(n, heads, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]  # [n, heads, nope], [n, heads, rope]
        kv = self.kv_a_proj_with_mqa(x)  # [n, kv_lora + rope]
        c = self.kv_a_layernorm(kv[:, : self.kv_lora])  # [n, kv_lora]
        k_pe = self._rope(kv[:, None, self.kv_lora :], cos, sin)  # [n, 1, rope]
        latent = torch.cat([c[:, None], k_pe], dim=-1)  # [n, 1, kv_lora + rope]
        backend.write_latent(latent, latent_cache, meta, k_scale=self.k_scale)

        w = self.kv_b_proj.dense_weight(x.dtype).view(heads, self.nope + self.v_dim, self.kv_lora)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # [heads, nope, kv_lora], [heads, v, kv_lora]
        # Tokens are the GEMMs' rows: padded as every linear's are in batch-invariant mode.
        unit = self.row_unit
        q_latent = torch.bmm(pad_rows(q_nope, unit).transpose(0, 1), w_uk).transpose(0, 1)[:n]  # [n, heads, kv_lora]
        query = torch.cat([q_latent, self._rope(q_pe, cos, sin)], dim=-1)  # [n, heads, kv_lora + rope]
        o_latent = backend.attend_latent(query, latent_cache, meta, self.scale, self.kv_lora,
                                         k_scale=self.k_scale)  # [n, heads, kv_lora]
        o = torch.bmm(pad_rows(o_latent, unit).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)[:n]  # [n, heads, v]
        out = self.o_proj(o.reshape(n, heads * self.v_dim))  # this rank's heads' share
        return out if self.comm is None else self.comm.all_reduce(out)
