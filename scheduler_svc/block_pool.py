"""The pool of KV-cache block ids, with reference counts so that blocks can
be shared between requests."""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Takes n free blocks, each with reference count 1."""
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with {len(self._free)} free: callers must check can_allocate")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drops one reference per block; a block returns to the pool when
        no one holds it."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than it was allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)
