"""The executor's KV-cache pool: one tensor holding every layer's blocks.

The scheduler decides which block holds what; the executor only stores.
"""

from __future__ import annotations

import torch

from executor_svc.model_config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_mb: int) -> int:
    return max(1, budget_mb * 1024 * 1024 // bytes_per_block(cfg, block_size, dtype))


class KVCachePool:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
        self.num_blocks, self.block_size = num_blocks, block_size
        # [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]
        self.storage = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, device=device, dtype=dtype
        )

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_cache, v_cache), each [num_blocks, block_size, kvh, d]."""
        return [(layer[0], layer[1]) for layer in self.storage]
