"""The executor's KV-cache pool: one tensor holding every layer's blocks.

The scheduler decides which block holds what; the executor only stores.
"""

from __future__ import annotations

from pathlib import Path

import torch

from executor_svc.model_config import ModelConfig
from executor_svc.sharding import Shard
from llmsched.errors import StartupError

MIB = 1024 * 1024


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, shard: Shard = Shard()) -> int:
    """On one rank: its KV heads only."""
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * shard.num_kv_heads(cfg) * cfg.head_dim * elem


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
                    num_kv_blocks: int, kv_cache_memory_mb: int, shard: Shard = Shard()) -> int:
    """The pool size the settings ask for (num_kv_blocks, else the memory
    budget, per rank), refused by setting name when the device cannot hold
    it: on CPU an oversized pool would otherwise be OOM-killed while zeroing."""
    per_block = bytes_per_block(cfg, block_size, dtype, shard)
    num_blocks = num_kv_blocks or num_blocks_for_budget(cfg, block_size, dtype, kv_cache_memory_mb, shard)
    free = free_memory_bytes(device)
    if free is not None and num_blocks * per_block > free:
        setting = (f"EXECUTOR_NUM_KV_BLOCKS={num_kv_blocks}" if num_kv_blocks
                   else f"EXECUTOR_KV_CACHE_MEMORY_MB={kv_cache_memory_mb}")
        raise StartupError(f"{setting}: the KV pool needs {num_blocks * per_block / MIB:.0f} MiB but only "
                           f"{free / MIB:.0f} MiB is free on {device}")
    return num_blocks


class KVCachePool:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 shard: Shard = Shard()):
        self.num_blocks, self.block_size = num_blocks, block_size
        # [num_layers, 2 (k, v), num_blocks, block_size, this rank's kv heads, head_dim]
        self.storage = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, shard.num_kv_heads(cfg), cfg.head_dim, device=device, dtype=dtype
        )

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_cache, v_cache), each [num_blocks, block_size, kvh, d]."""
        return [(layer[0], layer[1]) for layer in self.storage]
