"""The pool of KV-cache block ids: reference counts for sharing, and the
prefix cache of full blocks.

A block is in exactly one of three states:
- held: ref_count > 0, in some request's block table;
- cached-free: ref_count == 0 but it still has a hash, so a new request
  with the same prefix can take it back; evicted in LRU order;
- free: ref_count == 0 and no hash.
Free and cached-free blocks share one LRU queue; a block is only evicted
(its hash dropped) when it is handed out again.

The scheduler keeps one pool for the device's blocks and, with a host KV
tier, a second one for the host's (host_tier.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

BlockHash = bytes


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        # Every block with ref_count 0, least recently freed first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Lifetime counters, for per-step telemetry.
        self.num_allocated = 0
        self.num_released = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached-free included."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, on_evict: Callable[[int, BlockHash], None] | None = None) -> list[int]:
        """Takes n blocks from the LRU end, evicting their cached hashes;
        on_evict(block, hash) hears of each eviction while the block still
        holds that content (the host tier copies it out then)."""
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with {len(self._free)} free: callers must check can_allocate")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self.block_hashes[b]
            if h is not None:
                del self.cached[h]
                self.block_hashes[b] = None
                if on_evict is not None:
                    on_evict(b, h)
            self.ref_counts[b] = 1
            blocks.append(b)
        self.num_allocated += n
        return blocks

    def lookup(self, h: BlockHash) -> int | None:
        return self.cached.get(h)

    def touch(self, blocks: list[int]) -> None:
        """Takes one more reference on cached blocks (a prefix-cache hit)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1

    def cache(self, block: int, h: BlockHash) -> None:
        """Registers a held, full block under its hash. A block with the
        same content already cached stays the canonical one."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"caching block {block}, which no request holds")
        if self.block_hashes[block] is None and h not in self.cached:
            self.block_hashes[block] = h
            self.cached[h] = block

    def uncache(self, block: int) -> None:
        """Drops a block's hash (its content can no longer be trusted)."""
        h = self.block_hashes[block]
        if h is not None:
            del self.cached[h]
            self.block_hashes[block] = None

    def reset_cache(self) -> None:
        """Drops every cached hash (the KV content is gone)."""
        if any(self.ref_counts):
            raise RuntimeError("prefix cache reset while requests still hold blocks")
        self.cached.clear()
        self.block_hashes = [None] * self.num_blocks

    def free(self, blocks: list[int]) -> None:
        """Drops one reference per block. Callers pass a table tail first,
        so a prefix's later blocks are evicted before its earlier ones."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than it was allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None
                self.num_released += 1
