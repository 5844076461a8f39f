"""Block tables: which KV blocks hold each request's tokens, and prefix
caching on top of the block pool.

Invariant: block tables are append-only while a request holds them, so the
executor can mirror them from diffs (new block ids per step). A prefix-cache
hit only ever supplies the first blocks of a table, at admission.

Every full block is named by a hash chained from its parent's hash and its
own token ids, so equal hashes mean equal prefixes, not just equal blocks.

With a host KV tier (host_tier.py), a cached device block that is evicted
is copied out to it, a prefix lookup that misses on the device goes on in
the host tier, and a preempted request can be swapped out whole. A block
found in the host tier is copied into a fresh device block by the plan
that admits the request, before its forward.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from scheduler_svc.core.block_pool import BlockHash, BlockPool
from scheduler_svc.core.host_tier import HostTier, SwapPlan, SwappedOut
from scheduler_svc.core.request import Request

ROOT_HASH = b"llmsched-root"


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def hash_block(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    return hashlib.blake2b(parent + array("I", token_ids).tobytes(), digest_size=16).digest()


def prefix_root(request: Request) -> BlockHash:
    """The hash a request's block chain starts from: its salt's and its
    LoRA adapter's, each a link of its own so neither can be spelled as
    the other. Requests share cached blocks only under the same root."""
    root = hash_block(ROOT_HASH + request.prefix_salt, []) if request.prefix_salt else ROOT_HASH
    if request.adapter:
        root = hash_block(root + b"adapter:" + request.adapter.encode(), [])
    return root


@dataclass(slots=True)
class CacheHit:
    """The first blocks of a request's table, found before admission."""

    # One per leading block: a device block (shared at once), or, where
    # on_host is set, a host block copied into a fresh device block.
    blocks: list[int]
    num_tokens: int
    num_queried_blocks: int  # full blocks looked up, for hit-rate counters
    on_host: list[bool] | None = None  # None: all on the device
    # The request's own KV, swapped out at its preemption (not a lookup).
    resumed: SwappedOut | None = None
    # The chain stops at a block whose spill to the host tier is in flight:
    # a step or two from now it continues from the host tier.
    stops_at_pending_spill: bool = False

    @classmethod
    def make_empty(cls) -> "CacheHit":
        return cls([], 0, 0)

    @property
    def num_host_blocks(self) -> int:
        return sum(self.on_host) if self.on_host else 0

    def device_blocks(self) -> list[int]:
        on_host = self.on_host or [False] * len(self.blocks)
        return [b for b, h in zip(self.blocks, on_host) if not h]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        # The host KV tier; None when the executor has none.
        self.host = HostTier(num_host_blocks) if num_host_blocks > 0 else None
        self.block_tables: dict[str, list[int]] = {}
        # Hashes of each request's full blocks, computed once per block.
        self._block_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of each table are already registered.
        self._num_cached: dict[str, int] = {}
        self.num_queried_blocks = 0  # prefix-cache lookups, in blocks
        self.num_hit_blocks = 0  # of which were found on the device
        self.num_host_hit_blocks = 0  # and in the host tier

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def _hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """The hashes of the request's first num_full_blocks blocks, and no
        more: the list kept may run further (blocks are named through the
        last known token once its KV is computed, or copied out), and a
        lookup that walked it all could cover that token too, leaving the
        step nothing to compute."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        if len(hashes) < num_full_blocks:
            tokens = request.all_token_ids
            bs = self.block_size
            root = prefix_root(request)
            for i in range(len(hashes), num_full_blocks):
                parent = hashes[-1] if hashes else root
                hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes[:num_full_blocks] if len(hashes) > num_full_blocks else hashes

    def find_cached_prefix(self, request: Request) -> CacheHit:
        """The longest chain of cached full blocks that starts the request's
        tokens, each from the device or else the host tier. At least one
        token is always left to compute: the step that computes it is the
        one that samples. A request swapped out at its preemption gets its
        own blocks back instead."""
        if self.host is not None and (record := self.host.resumable(request)) is not None:
            # Its last token is recomputed only if the swap holds it (never
            # after a step in flight sampled it, see Scheduler._preempt).
            num_tokens = min(record.num_tokens, request.num_tokens - 1)
            return CacheHit(list(record.host_blocks), num_tokens, 0, [True] * len(record.host_blocks), record)
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return CacheHit.make_empty()
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        on_host: list[bool] = []
        pending = False
        for h in self._hashes(request, max_blocks):
            b = self.pool.lookup(h)
            if b is None and self.host is not None and (b := self.host.lookup(h)) is not None:
                on_host.append(True)
            elif b is not None:
                on_host.append(False)
            else:
                pending = self.host is not None and self.host.is_spilling(h)
                break
            blocks.append(b)
        return CacheHit(blocks, len(blocks) * self.block_size, max_blocks, on_host if any(on_host) else None,
                        stops_at_pending_spill=pending)

    def record_hit(self, hit: CacheHit) -> None:
        """Counts a lookup that led to an admission."""
        self.num_queried_blocks += hit.num_queried_blocks
        if hit.resumed is None:
            self.num_host_hit_blocks += hit.num_host_blocks
            self.num_hit_blocks += len(hit.blocks) - hit.num_host_blocks

    def num_blocks_to_take(self, request: Request, num_new_tokens: int, hit: CacheHit | None = None) -> int:
        """Free-pool blocks a call to allocate_slots would consume."""
        held = len(self.block_tables.get(request.request_id, ()))
        if hit is None:
            return max(0, blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size) - held)
        # A hit on a cached-free block takes it out of the free pool too, and
        # a block from the host tier needs a fresh device block.
        reused_free = sum(1 for b in hit.device_blocks() if self.pool.ref_counts[b] == 0)
        fresh = blocks_needed(hit.num_tokens + num_new_tokens, self.block_size) - len(hit.blocks)
        return reused_free + hit.num_host_blocks + max(0, fresh)

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: CacheHit | None = None) -> list[int] | None:
        """Grows the request's table to hold num_new_tokens more tokens after
        its computed ones. `hit` (admission only) supplies its first blocks;
        those from the host tier go into fresh device blocks by this plan's
        swap_in.

        Returns the block ids appended, or None when the pool is short: the
        caller preempts or waits, and nothing has changed.
        """
        if hit is None:
            # The steady decode step: its table already covers the token (15
            # steps in 16 at block size 16). A fast path: P1's per-request cost.
            table = self.block_tables.get(request.request_id)
            if table is not None and blocks_needed(request.num_computed_tokens + num_new_tokens,
                                                   self.block_size) <= len(table):
                return []
        if not self.pool.can_allocate(self.num_blocks_to_take(request, num_new_tokens, hit)):
            return None
        table = self.block_tables.setdefault(request.request_id, [])
        if hit is not None and hit.blocks:
            if table:
                raise RuntimeError(f"prefix hit for {request.request_id}, which already holds blocks")
            # Out of the free pools before anything is evicted below.
            self.pool.touch(hit.device_blocks())
            if hit.resumed is None and hit.num_host_blocks:
                self.host.reserve([b for b, on_host in zip(hit.blocks, hit.on_host) if on_host])
            fresh = self.pool.allocate(hit.num_host_blocks, self._spill)
            if hit.resumed is not None:
                table.extend(fresh)
                self.host.swap_in_resumed(hit.resumed, fresh)
            else:
                fresh_iter = iter(fresh)
                for b, on_host in zip(hit.blocks, hit.on_host or [False] * len(hit.blocks)):
                    if on_host:
                        d = next(fresh_iter)
                        self.host.swap_in_hit(request, b, d)
                        b = d
                    table.append(b)
        computed = hit.num_tokens if hit is not None else request.num_computed_tokens
        n = max(0, blocks_needed(computed + num_new_tokens, self.block_size) - len(table))
        new_blocks = self.pool.allocate(n, self._spill)
        table.extend(new_blocks)
        return new_blocks

    def _spill(self, block: int, h: BlockHash) -> None:
        if self.host is not None:
            self.host.spill(block, h)

    def swap_out(self, request: Request, num_tokens: int) -> bool:
        """Copies the KV of the request's first num_tokens tokens to the host
        tier (this plan's swap_out), if it has room; the caller frees the
        device blocks after. False, and nothing changed, when it cannot."""
        table = self.block_tables.get(request.request_id, [])
        n = blocks_needed(num_tokens, self.block_size)
        if self.host is None or n == 0 or n > len(table) or not self.host.can_swap_out(n):
            return False
        # Its full blocks of known tokens keep their prefix-cache names.
        num_named = min(num_tokens, request.num_tokens) // self.block_size if self.enable_prefix_caching else 0
        hashes = self._hashes(request, num_named)
        self.host.swap_out(request, table[:n], num_tokens, hashes + [None] * (n - num_named))
        return True

    def can_resume(self, request: Request) -> bool:
        """False while a swapped-out request's copy is not confirmed."""
        return self.host is None or not self.host.is_waiting_for_copy(request)

    def end_plan(self) -> SwapPlan | None:
        return self.host.end_plan() if self.host is not None else None

    def complete_swaps(self, plan: SwapPlan, failed_outs: set[int], failed_ins: set[int]
                       ) -> tuple[list[SwappedOut], list[Request]]:
        return self.host.complete(plan, failed_outs, failed_ins)

    def cache_computed_blocks(self, request: Request, num_computed: int) -> None:
        """Makes the request's full blocks within its first num_computed
        tokens findable by later requests with the same prefix. The caller
        vouches that those tokens are known and their KV written: a block
        must never be named by tokens still in flight."""
        if not self.enable_prefix_caching:
            return
        done = self._num_cached.get(request.request_id, 0)
        num_full = num_computed // self.block_size
        if num_full <= done:
            return  # no block filled since (most steps)
        table = self.block_tables.get(request.request_id, [])
        num_full = min(num_full, len(table), request.num_tokens // self.block_size)
        if num_full <= done:
            return
        hashes = self._hashes(request, num_full)
        for i in range(done, num_full):
            self.pool.cache(table[i], hashes[i])
        self._num_cached[request.request_id] = num_full

    def reset_executor(self, host_lost: bool) -> list[SwappedOut]:
        """The executor dropped its requests (and what was in flight); only
        valid when no request holds a device block. Forgets every cached
        device hash. The host tier keeps what was confirmed, unless the
        executor process (and its host memory) is gone. Returns the
        swapped-out requests whose KV is lost."""
        self.pool.reset_cache()
        self._num_cached.clear()
        if self.host is None:
            return []
        return self.host.reset() if host_lost else self.host.void_in_flight()

    def replace_host_tier(self, num_host_blocks: int) -> None:
        """A restarted executor brought a host tier of another size (or none).
        Only after reset_executor(host_lost=True), which emptied the old one:
        nothing it held is referred to any more."""
        if self.host is not None and (self.host.swapped or self.host.num_free_blocks != self.host.num_blocks):
            raise RuntimeError("the host tier is replaced while it still holds blocks")
        self.host = HostTier(num_host_blocks) if num_host_blocks > 0 else None

    def get_block_table(self, request: Request) -> list[int]:
        return self.block_tables.get(request.request_id, [])

    def free(self, request: Request) -> None:
        """Releases the request's device blocks (not its swapped-out KV)."""
        # Tail first: a shared prefix's earliest blocks stay cached longest.
        self.pool.free(list(reversed(self.block_tables.pop(request.request_id, []))))
        self._num_cached.pop(request.request_id, None)

    def forget(self, request: Request) -> None:
        """Drops per-request state once the request is gone for good."""
        self._block_hashes.pop(request.request_id, None)
        if self.host is not None:
            self.host.drop(request)
