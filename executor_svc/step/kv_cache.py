"""The executor's KV-cache pool: every layer's blocks, laid out as each
layer's CacheSpec says.

A layer keeps either a K/V pair (one K and one V vector per KV head and
token) or, for multi-head latent attention (MLA, DeepSeek-V3), one latent
vector per token that every head reads as both keys and values. The
scheduler decides which block holds what, and sees only blocks; the
executor only stores, and sizes the pool by the real bytes per token:
one byte per value for an FP8 cache (EXECUTOR_KV_CACHE_DTYPE), whose
scales the layers keep (executor_svc/attention/kv_quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from executor_svc.attention.kv_quant import FP8_DTYPES
from executor_svc.model.model_config import ModelConfig
from executor_svc.model.sharding import Shard
from llmsched.errors import StartupError

MIB = 1024 * 1024
KV_CACHE_DTYPES = ("auto", *FP8_DTYPES)


def resolve_kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """EXECUTOR_KV_CACHE_DTYPE: auto = the compute dtype, else an FP8 type.
    The setting's Literal already refuses other names when read from the
    environment; this refuses them from code too."""
    if name == "auto":
        return compute_dtype
    if name not in FP8_DTYPES:
        raise ValueError(f"EXECUTOR_KV_CACHE_DTYPE={name!r} is not supported; supported: {', '.join(KV_CACHE_DTYPES)}")
    return FP8_DTYPES[name]


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """What one layer keeps per token, on one rank."""

    num_tensors: int  # 2: K and V; 1: MLA's latent, read as keys and (its first kv_lora_rank dims) values
    num_heads: int  # per tensor: this rank's KV heads, or 1 (the latent is shared by every head)
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_tensors * self.num_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


def layer_specs(cfg: ModelConfig, shard: Shard = Shard()) -> list[CacheSpec]:
    """Each layer's cache. MLA's latent (kv_lora_rank + qk_rope_head_dim per
    token) is whole on every rank: each rank's heads all read it."""
    if cfg.mla is not None:
        return [CacheSpec(1, 1, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)] * cfg.num_layers
    return [CacheSpec(2, shard.num_kv_heads(cfg), cfg.head_dim)] * cfg.num_layers


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, shard: Shard = Shard()) -> int:
    """One token's cache over every layer, on one rank."""
    return sum(spec.bytes_per_token(dtype) for spec in layer_specs(cfg, shard))


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, shard: Shard = Shard()) -> int:
    """On one rank: its KV heads only."""
    return block_size * bytes_per_token(cfg, dtype, shard)


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_mb: int,
                          shard: Shard = Shard()) -> int:
    return max(1, budget_mb * MIB // bytes_per_block(cfg, block_size, dtype, shard))


def free_memory_bytes(device: torch.device) -> int | None:
    """What the pool may still take on device: free CUDA memory, or on CPU
    the kernel's estimate of RAM available without swapping. None when
    unknown (another OS), and then the allocation itself decides."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def pool_num_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                    num_kv_blocks: int, kv_cache_memory_mb: int, shard: Shard = Shard(),
                    draft_cfg: ModelConfig | None = None) -> int:
    """The pool size the settings ask for (num_kv_blocks, else the memory
    budget, per rank), refused by setting name when the device cannot hold
    it: on CPU an oversized pool would otherwise be OOM-killed while zeroing.
    With a draft model (draft_model.py) each block also has its draft KV,
    in a pool of as many blocks, and the budget covers both."""
    per_block = bytes_per_block(cfg, block_size, dtype, shard)
    if draft_cfg is not None:
        per_block += bytes_per_block(draft_cfg, block_size, dtype)
    num_blocks = num_kv_blocks or max(1, kv_cache_memory_mb * MIB // per_block)
    free = free_memory_bytes(device)
    if free is not None and num_blocks * per_block > free:
        setting = (f"EXECUTOR_NUM_KV_BLOCKS={num_kv_blocks}" if num_kv_blocks
                   else f"EXECUTOR_KV_CACHE_MEMORY_MB={kv_cache_memory_mb}")
        raise StartupError(f"{setting}: the KV pool needs {num_blocks * per_block / MIB:.0f} MiB but only "
                           f"{free / MIB:.0f} MiB is free on {device}")
    return num_blocks


class KVCachePool:
    """dtype: the cache's element type (resolve_kv_cache_dtype), which may
    be FP8 while the model computes in another."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 shard: Shard = Shard()):
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.specs = layer_specs(cfg, shard)
        self.bytes_per_token = sum(spec.bytes_per_token(dtype) for spec in self.specs)
        spec = self.specs[0]
        if any(s != spec for s in self.specs):
            # Not needed by any family yet: every layer of a model keeps the same shape.
            raise NotImplementedError(f"layers with different cache shapes: {sorted(set(self.specs))}")
        # [num_layers, num_tensors (k, v or the latent), num_blocks, block_size, heads, head_dim]
        self.storage = torch.zeros(cfg.num_layers, spec.num_tensors, num_blocks, block_size, spec.num_heads,
                                   spec.head_dim, device=device, dtype=dtype)

    @property
    def holds_kv_pairs(self) -> bool:
        return self.specs[0].num_tensors == 2

    def describe(self) -> str:
        spec = self.specs[0]
        per_layer = (f"K and V, {spec.num_heads} heads x {spec.head_dim}" if self.holds_kv_pairs
                     else f"one latent of {spec.head_dim}")
        return (f"{self.num_blocks} blocks of {self.block_size} tokens in {self.dtype}, {self.bytes_per_token} bytes "
                f"per token "
                f"({len(self.specs)} layers, each {per_layer})")

    def layer_caches(self) -> list[tuple[torch.Tensor, ...]]:
        """Per layer its tensors, each [num_blocks, block_size, heads, head_dim]:
        (k_cache, v_cache), or (latent,) for MLA."""
        return [tuple(layer) for layer in self.storage]
