"""Block tables: which KV blocks hold each request's tokens.

Invariant: block tables are append-only while a request holds them, so the
executor can mirror them from diffs (new block ids per step).
"""

from __future__ import annotations

from scheduler_svc.block_pool import BlockPool
from scheduler_svc.request import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        held = len(self.block_tables.get(request.request_id, ()))
        return max(0, blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size) - held)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grows the request's table to hold num_new_tokens more tokens.

        Returns the block ids appended (possibly none), or None when the pool
        is short: the caller preempts or waits.
        """
        n = self.num_new_blocks(request, num_new_tokens)
        if not self.pool.can_allocate(n):
            return None
        new_blocks = self.pool.allocate(n)
        self.block_tables.setdefault(request.request_id, []).extend(new_blocks)
        return new_blocks

    def get_block_table(self, request: Request) -> list[int]:
        return self.block_tables.get(request.request_id, [])

    def free(self, request: Request) -> None:
        self.pool.free(self.block_tables.pop(request.request_id, []))
