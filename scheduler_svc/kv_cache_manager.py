"""Block tables: which KV blocks hold each request's tokens, and prefix
caching on top of the block pool.

Invariant: block tables are append-only while a request holds them, so the
executor can mirror them from diffs (new block ids per step). A prefix-cache
hit only ever supplies the first blocks of a table, at admission.

Every full block is named by a hash chained from its parent's hash and its
own token ids, so equal hashes mean equal prefixes, not just equal blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from scheduler_svc.block_pool import BlockHash, BlockPool
from scheduler_svc.request import Request

ROOT_HASH = b"llmsched-root"


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def hash_block(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    return hashlib.blake2b(parent + array("I", token_ids).tobytes(), digest_size=16).digest()


@dataclass(slots=True)
class CacheHit:
    blocks: list[int]
    num_tokens: int
    num_queried_blocks: int  # full blocks looked up, for hit-rate counters

    @classmethod
    def make_empty(cls) -> "CacheHit":
        return cls([], 0, 0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        # Hashes of each request's full blocks, computed once per block.
        self._block_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of each table are already registered.
        self._num_cached: dict[str, int] = {}
        self.num_queried_blocks = 0  # prefix-cache lookups, in blocks
        self.num_hit_blocks = 0  # of which were found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def _hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        hashes = self._block_hashes.setdefault(request.request_id, [])
        if len(hashes) < num_full_blocks:
            tokens = request.all_token_ids
            bs = self.block_size
            root = hash_block(ROOT_HASH + request.prefix_salt, []) if request.prefix_salt else ROOT_HASH
            for i in range(len(hashes), num_full_blocks):
                parent = hashes[-1] if hashes else root
                hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, request: Request) -> CacheHit:
        """The longest chain of cached full blocks that starts the request's
        tokens. At least one token is always left to compute: the step that
        computes it is the one that samples."""
        if not self.enable_prefix_caching:
            return CacheHit.make_empty()
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for h in self._hashes(request, max_blocks):
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return CacheHit(blocks, len(blocks) * self.block_size, max_blocks)

    def record_hit(self, hit: CacheHit) -> None:
        """Counts a lookup that led to an admission."""
        self.num_queried_blocks += hit.num_queried_blocks
        self.num_hit_blocks += len(hit.blocks)

    def num_blocks_to_take(self, request: Request, num_new_tokens: int, hit: CacheHit | None = None) -> int:
        """Free-pool blocks a call to allocate_slots would consume."""
        held = len(self.block_tables.get(request.request_id, ()))
        if hit is None:
            return max(0, blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size) - held)
        # A hit on a cached-free block takes it out of the free pool too.
        reused_free = sum(1 for b in hit.blocks if self.pool.ref_counts[b] == 0)
        fresh = blocks_needed(hit.num_tokens + num_new_tokens, self.block_size) - len(hit.blocks)
        return reused_free + max(0, fresh)

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: CacheHit | None = None) -> list[int] | None:
        """Grows the request's table to hold num_new_tokens more tokens after
        its computed ones. `hit` (admission only) supplies its first blocks.

        Returns the block ids appended, or None when the pool is short: the
        caller preempts or waits, and nothing has changed.
        """
        if not self.pool.can_allocate(self.num_blocks_to_take(request, num_new_tokens, hit)):
            return None
        table = self.block_tables.setdefault(request.request_id, [])
        if hit is not None and hit.blocks:
            if table:
                raise RuntimeError(f"prefix hit for {request.request_id}, which already holds blocks")
            self.pool.touch(hit.blocks)
            table.extend(hit.blocks)
        computed = hit.num_tokens if hit is not None else request.num_computed_tokens
        n = max(0, blocks_needed(computed + num_new_tokens, self.block_size) - len(table))
        new_blocks = self.pool.allocate(n)
        table.extend(new_blocks)
        return new_blocks

    def cache_computed_blocks(self, request: Request, num_computed: int) -> None:
        """Makes the request's full blocks within its first num_computed
        tokens findable by later requests with the same prefix. The caller
        vouches that those tokens are known and their KV written: a block
        must never be named by tokens still in flight."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request.request_id, [])
        num_full = min(num_computed // self.block_size, len(table), request.num_tokens // self.block_size)
        done = self._num_cached.get(request.request_id, 0)
        if num_full <= done:
            return
        hashes = self._hashes(request, num_full)
        for i in range(done, num_full):
            self.pool.cache(table[i], hashes[i])
        self._num_cached[request.request_id] = num_full

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash; only valid when no request holds a block."""
        self.pool.reset_cache()
        self._num_cached.clear()

    def get_block_table(self, request: Request) -> list[int]:
        return self.block_tables.get(request.request_id, [])

    def free(self, request: Request) -> None:
        # Tail first: a shared prefix's earliest blocks stay cached longest.
        self.pool.free(list(reversed(self.block_tables.pop(request.request_id, []))))
        self._num_cached.pop(request.request_id, None)

    def forget(self, request: Request) -> None:
        """Drops per-request hash state once the request is gone for good."""
        self._block_hashes.pop(request.request_id, None)
