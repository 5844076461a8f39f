"""The host KV tier as the scheduler keeps it: which host block holds what.

The executor keeps a second pool of blocks in host memory
(EXECUTOR_HOST_KV_CACHE_MEMORY_MB) and copies blocks between it and the
device pool when a plan says so (StepPlan.swap_out / swap_in); it decides
nothing. The scheduler owns the host blocks as it owns the device ones, in
a second BlockPool, and uses them two ways:

- spill: a cached device block about to be evicted is copied out, so the
  prefix cache still finds it, in the host tier, and copies it back in
  instead of recomputing it;
- swap: a request preempted by swap has its computed KV copied out into
  host blocks it holds while it waits, and back in when it resumes.

Every host block is in exactly one place:
- free, with or without a hash (a cached prefix block, evicted in LRU
  order as on the device);
- pending: the destination of a swap_out whose plan's result has not come
  back (reference 1, no hash yet);
- held by a swapped-out request (reference 1).
A cached block being swapped in also holds a reference while its plan is
built, so that the same plan's swap_outs, which the executor runs first,
cannot overwrite it.

A copy counts only once the step result of its plan has come back without
failing it: only then is a spilled block named by its hash, and only then
can a swapped-out request resume. The executor runs plans in order, so a
host block released here may be written by the very next plan: any plan
that still reads it runs before.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from scheduler_svc.core.block_pool import BlockHash, BlockPool
from scheduler_svc.core.request import Request


@dataclass(slots=True, eq=False)
class SwappedOut:
    """A request preempted by swap: the KV of its first num_tokens tokens,
    in host blocks it holds until it resumes or ends."""

    request: Request
    host_blocks: list[int]
    num_tokens: int
    # Per host block, the prefix-cache hash of its content when it is a full
    # block of known tokens: once the request resumes or ends, the block
    # stays cached under it, and meanwhile the device's copy is not
    # spilled a second time.
    hashes: list[BlockHash | None] = field(default_factory=list)
    # The result of the plan that copies it out has come back: it may
    # resume (its swap_in then runs after that copy, in any case).
    confirmed: bool = False


@dataclass(slots=True)
class SwapPlan:
    """One plan's block copies between the device pool and the host tier
    (StepPlan.swap_out / swap_in), with what each copy is for, so that the
    step's result can confirm or fail each one."""

    out_device: list[int] = field(default_factory=list)
    out_host: list[int] = field(default_factory=list)
    # Per swap_out pair: the hash of a spilled prefix block, or the
    # swapped-out request the host block now holds KV of.
    out_for: list[BlockHash | SwappedOut] = field(default_factory=list)
    in_host: list[int] = field(default_factory=list)
    in_device: list[int] = field(default_factory=list)
    # Per swap_in pair: the request whose table it fills, and the host
    # block's hash for a prefix hit (None for a request resumed from swap).
    in_for: list[tuple[Request, BlockHash | None]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.out_host or self.in_host)


class HostTier:
    def __init__(self, num_blocks: int):
        self.pool = BlockPool(num_blocks)
        self.swapped: dict[str, SwappedOut] = {}
        # Plans sent with swaps, oldest first, until their results confirm them.
        self._in_flight: list[SwapPlan] = []
        # Hash -> host block of each spill copy in flight, so that a prefix
        # evicted again meanwhile is not copied twice.
        self._pending_spills: dict[BlockHash, int] = {}
        # Hashes of the full blocks that swapped-out requests hold.
        self._held_hashes: Counter[BlockHash] = Counter()
        self._plan = SwapPlan()
        # Host blocks read by this plan's swap_ins, released when it is built
        # (cached under the hash given, if any).
        self._release_after_plan: list[tuple[int, BlockHash | None]] = []
        # Lifetime counters, in blocks, for metrics.
        self.num_spilled = 0
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def lookup(self, h: BlockHash) -> int | None:
        """A host block holding this prefix block, confirmed."""
        return self.pool.lookup(h)

    def is_spilling(self, h: BlockHash) -> bool:
        """This prefix block is being copied out by a plan (built or in
        flight) whose result has not confirmed it yet."""
        return h in self._pending_spills

    # ----- building a plan ---------------------------------------------------

    def spill(self, device_block: int, h: BlockHash) -> None:
        """The device evicts a cached block: copy it out while there is a
        free (or an older cached) host block, unless the host has it."""
        if (h in self.pool.cached or h in self._pending_spills or h in self._held_hashes
                or not self.pool.can_allocate(1)):
            return
        (hb,) = self.pool.allocate(1)
        self._plan.out_device.append(device_block)
        self._plan.out_host.append(hb)
        self._plan.out_for.append(h)
        self._pending_spills[h] = hb
        self.num_spilled += 1

    def can_swap_out(self, num_blocks: int) -> bool:
        return self.pool.can_allocate(num_blocks)

    def swap_out(self, request: Request, device_blocks: list[int], num_tokens: int,
                 hashes: list[BlockHash | None]) -> None:
        """Copies a preempted request's first blocks out; the caller checked
        can_swap_out and frees the device blocks after."""
        if request.request_id in self.swapped:
            raise RuntimeError(f"request {request.request_id} swapped out twice")
        record = SwappedOut(request, self.pool.allocate(len(device_blocks)), num_tokens, hashes)
        self.swapped[request.request_id] = record
        self._held_hashes.update(h for h in hashes if h is not None)
        self._plan.out_device.extend(device_blocks)
        self._plan.out_host.extend(record.host_blocks)
        self._plan.out_for.extend([record] * len(device_blocks))
        self.num_swapped_out += len(device_blocks)

    def resumable(self, request: Request) -> SwappedOut | None:
        """The request's confirmed swapped-out KV; None when it has none yet."""
        record = self.swapped.get(request.request_id)
        return record if record is not None and record.confirmed else None

    def is_waiting_for_copy(self, request: Request) -> bool:
        record = self.swapped.get(request.request_id)
        return record is not None and not record.confirmed

    def swap_in_resumed(self, record: SwappedOut, device_blocks: list[int]) -> None:
        """Copies a resuming request's blocks back in; its host blocks are
        free once this plan is built."""
        self._forget(record)
        self._plan.in_host.extend(record.host_blocks)
        self._plan.in_device.extend(device_blocks)
        self._plan.in_for.extend([(record.request, None)] * len(device_blocks))
        self._release_after_plan.extend(zip(record.host_blocks, record.hashes))
        self.num_swapped_in += len(device_blocks)

    def reserve(self, host_blocks: list[int]) -> None:
        """Holds cached blocks that this plan swaps in, so that nothing this
        plan allocates (a spill, a swap-out) evicts and overwrites them
        first; released once the plan is built."""
        self.pool.touch(host_blocks)
        self._release_after_plan.extend((b, None) for b in host_blocks)

    def swap_in_hit(self, request: Request, host_block: int, device_block: int) -> None:
        """Copies a reserved, cached prefix block in for a prefix hit; it
        stays cached in the host tier as well."""
        self._plan.in_host.append(host_block)
        self._plan.in_device.append(device_block)
        self._plan.in_for.append((request, self.pool.block_hashes[host_block]))
        self.num_swapped_in += 1

    def drop(self, request: Request, keep_cached: bool = True) -> SwappedOut | None:
        """Forgets a request's swapped-out KV: it ended, so its confirmed
        full blocks stay cached; or the copy is lost (keep_cached=False)."""
        record = self.swapped.get(request.request_id)
        if record is not None:
            self._forget(record)
            if keep_cached and record.confirmed:
                self._release([*zip(record.host_blocks, record.hashes)])
            else:
                self.pool.free(record.host_blocks)
        return record

    def _forget(self, record: SwappedOut) -> None:
        del self.swapped[record.request.request_id]
        self._held_hashes.subtract(h for h in record.hashes if h is not None)
        self._held_hashes = +self._held_hashes

    def _release(self, blocks: list[tuple[int, BlockHash | None]]) -> None:
        for b, h in blocks:
            if h is not None:
                self.pool.cache(b, h)  # a no-op when another block holds h
            self.pool.free([b])

    def end_plan(self) -> SwapPlan | None:
        """The swaps of the plan just built, now in flight; None if none."""
        self._release(self._release_after_plan)
        self._release_after_plan = []
        plan, self._plan = self._plan, SwapPlan()
        if not plan:
            return None
        self._in_flight.append(plan)
        return plan

    # ----- step results ------------------------------------------------------

    def complete(self, plan: SwapPlan, failed_outs: set[int], failed_ins: set[int]
                 ) -> tuple[list[SwappedOut], list[Request]]:
        """Applies a plan's result: spilled blocks become findable, swapped-out
        requests resumable. Returns the swapped-out requests whose copy
        failed (their KV is lost) and the requests whose swap_in failed
        (their device blocks hold garbage)."""
        if not self._in_flight or self._in_flight[0] is not plan:
            raise RuntimeError("swap results must confirm plans in the order they were sent")
        self._in_flight.pop(0)
        lost: list[SwappedOut] = []
        for i, (hb, what) in enumerate(zip(plan.out_host, plan.out_for)):
            if isinstance(what, SwappedOut):
                if i in failed_outs and self.swapped.get(what.request.request_id) is what:
                    lost.append(what)
                    self.drop(what.request, keep_cached=False)
                continue
            del self._pending_spills[what]
            if i not in failed_outs:
                self.pool.cache(hb, what)
            self.pool.free([hb])
        for what in plan.out_for:
            if isinstance(what, SwappedOut):
                what.confirmed = True  # a dropped record is never read again
        failed: list[Request] = []
        for i in sorted(failed_ins):
            request, h = plan.in_for[i]
            hb = plan.in_host[i]
            if h is not None and self.pool.block_hashes[hb] == h:
                self.pool.uncache(hb)  # the copy failed: trust neither side
            if request not in failed:
                failed.append(request)
        return lost, failed

    def void_in_flight(self) -> list[SwappedOut]:
        """The executor dropped every plan in flight (a failed step): their
        copies never happened. Confirmed content stays. Returns the
        swapped-out requests whose copy was among them."""
        lost = []
        for plan in self._in_flight:
            for hb, what in zip(plan.out_host, plan.out_for):
                if not isinstance(what, SwappedOut):
                    del self._pending_spills[what]
                    self.pool.free([hb])
                elif self.swapped.get(what.request.request_id) is what:
                    lost.append(what)
                    self.drop(what.request, keep_cached=False)
        self._in_flight.clear()
        return lost

    def reset(self) -> list[SwappedOut]:
        """The executor process is gone, and its host memory with it.
        Returns every swapped-out request (they recompute)."""
        lost = self.void_in_flight()
        for record in list(self.swapped.values()):
            lost.append(record)
            self.drop(record.request, keep_cached=False)
        self.pool.reset_cache()
        return lost
