"""LoRA adapter slots on the executor's device, owned by the scheduler as
KV blocks are.

The executor has `num_slots` device slots (EXECUTOR_MAX_LORAS); each holds
one adapter's weights or none. It decides nothing: each plan carries the
slots to evict and the (slot, adapter) pairs to load (StepPlan.lora_*),
which the executor applies, evictions first, before the plan's forward.
A load replaces everything in its slot, so an adapter never serves with a
weight of the slot's previous adapter.

Invariants:
- a running request's adapter is in a slot: a request is admitted only
  when it is, or when this plan's load puts it there;
- a slot is evicted only when no running request uses its adapter and the
  result of every plan that named it (a load, or a request using it) has
  been applied. Plans run in order on the executor, so this is stricter
  than needed; it keeps "no plan in flight reads an evicted slot" a fact
  the scheduler alone can check.

Admission (Scheduler._next_to_admit): waiting requests are taken in policy
order; one whose adapter has no slot, when none can be freed, is skipped,
so the loaded adapters keep batching, and its adapter waits. Each waiting
adapter drains one loaded adapter (the one with the fewest running
requests, least recently used on ties), at most one per slot: a draining
adapter admits only the requests that arrived before its drain began (so
an adapter that just got a slot still takes every request that waited for
it, in one batch), and its slot frees once they end; the first waiting
adapter in policy order takes it. An adapter therefore waits at most for
one drain (a finite set of requests) per waiting adapter ahead of it in
policy order: none starves, and priority and fair share decide who is
ahead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from scheduler_svc.core.request import Request


class LoraSlots:
    def __init__(self, num_slots: int, adapters: Iterable[str]):
        if num_slots < 1:
            raise ValueError(f"LoRA slots: {num_slots} slots; at least 1 is needed to serve adapters")
        self.num_slots = num_slots
        self.adapters = frozenset(adapters)
        self.names: list[str | None] = [None] * num_slots  # [slot] -> adapter
        self.slot_of: dict[str, int] = {}
        # [slot] -> step id of the last plan naming its adapter; evictable
        # once that plan's result is applied (step id <= applied_step).
        self.last_step: list[int] = [-1] * num_slots
        self.applied_step = -1
        # Running requests per adapter, as of this step's admissions.
        self.users: Counter[str] = Counter()
        # Loaded adapters that admit no request that arrived after their
        # drain began (Request.arrival_seq >= the value), so their slots
        # free up for adapters waiting for one; in the order chosen.
        self.draining: dict[str, int] = {}
        # Adapters skipped this step for want of a slot (policy order).
        self.blocked: list[str] = []
        # The plan being built: slots evicted, then (slot, adapter) loaded.
        self.evicts: list[int] = []
        self.loads: list[tuple[int, str]] = []
        self.num_loads = 0
        self.num_evictions = 0

    # ----- the step --------------------------------------------------------

    def begin_step(self, running: Iterable[Request]) -> None:
        self.users = Counter(r.adapter for r in running if r.adapter)
        self.blocked = []

    def is_loaded(self, adapter: str) -> bool:
        return not adapter or adapter in self.slot_of

    def can_admit(self, adapter: str, arrival_seq: int) -> bool:
        """Whether a request with this adapter (that arrived arrival_seq-th)
        may run this step: the base model, an adapter in a slot that is not
        draining or whose drain began after it arrived, or one a free or
        evictable slot can take."""
        if not adapter:
            return True
        if adapter in self.slot_of:
            return arrival_seq < self.draining.get(adapter, arrival_seq + 1)
        return self._slot_for_load() is not None

    def admit(self, adapter: str) -> None:
        """A request with this adapter runs from this plan on (after
        can_admit said yes): its adapter is loaded if it is not."""
        if not adapter:
            return
        if adapter not in self.slot_of:
            slot = self._slot_for_load()
            if slot is None:
                raise RuntimeError(f"LoRA slots: admitting adapter {adapter!r} with no slot free or evictable")
            old = self.names[slot]
            if old is not None:
                del self.slot_of[old]
                self.draining.pop(old, None)
                self.evicts.append(slot)
                self.num_evictions += 1
            self.names[slot] = adapter
            self.slot_of[adapter] = slot
            self.loads.append((slot, adapter))
            self.num_loads += 1
            if adapter in self.blocked:
                self.blocked.remove(adapter)
        self.users[adapter] += 1

    def block(self, adapter: str, next_arrival: int) -> None:
        """A waiting request with this adapter cannot run this step for
        want of a slot: its adapter waits, and drains a slot when fewer
        slots drain than adapters wait. next_arrival: the arrival_seq the
        next request to arrive will get (where a drain begins)."""
        if adapter in self.blocked:
            return
        self.blocked.append(adapter)
        if adapter in self.slot_of or len(self.draining) >= min(len(self.blocked), self.num_slots):
            return
        candidates = [a for a in self.slot_of if a not in self.draining]
        if candidates:
            drained = min(candidates, key=lambda a: (self.users[a], self.last_step[self.slot_of[a]]))
            self.draining[drained] = next_arrival

    def end_pass(self) -> None:
        """Every waiting request was looked at this step: drains beyond the
        adapters that still wait are lifted (their waiters ended, or got a
        slot another way)."""
        waiting = sum(a not in self.slot_of for a in self.blocked)
        for lifted in list(self.draining)[waiting:]:
            del self.draining[lifted]

    def end_plan(self, step_id: int, adapters: Iterable[str]) -> tuple[list[int], list[tuple[int, str]]]:
        """The plan's evictions and loads; `adapters`: those its requests
        use, whose slots it now reads."""
        for a in adapters:
            if a:
                slot = self.slot_of.get(a)
                if slot is None:
                    raise RuntimeError(f"LoRA slots: step {step_id} runs a request with adapter {a!r}, which is in "
                                       "no slot (a running request's adapter must be loaded)")
                self.last_step[slot] = step_id
        for slot, _ in self.loads:
            self.last_step[slot] = step_id
        ops = self.evicts, self.loads
        self.evicts, self.loads = [], []
        return ops

    def complete(self, step_id: int) -> None:
        """The result of plan step_id has been applied (plans complete in order)."""
        self.applied_step = max(self.applied_step, step_id)

    def reset(self) -> None:
        """The executor's state was reset, and plans in flight will not run:
        what the slots hold is taken as unknown, every slot as empty (a
        load replaces a slot's content whatever it was)."""
        self.names = [None] * self.num_slots
        self.slot_of.clear()
        self.last_step = [-1] * self.num_slots
        self.draining.clear()
        self.users.clear()
        self.evicts, self.loads = [], []

    # ----- helpers ---------------------------------------------------------

    def evictable(self, slot: int) -> bool:
        name = self.names[slot]
        return name is None or (not self.users[name] and self.last_step[slot] <= self.applied_step)

    def _slot_for_load(self) -> int | None:
        """An empty slot, else an evictable one: a draining adapter's
        first, then the least recently used."""
        if None in self.names:
            return self.names.index(None)
        free = [s for s in range(self.num_slots) if self.evictable(s)]
        if not free:
            return None
        return min(free, key=lambda s: (self.names[s] not in self.draining, self.last_step[s]))

    @property
    def num_in_use(self) -> int:
        """Slots holding an adapter."""
        return len(self.slot_of)

    def num_waiting_for_slot(self, waiting: Iterable[Request]) -> int:
        """Waiting requests whose adapter is not in a slot."""
        return sum(1 for r in waiting if r.adapter and r.adapter not in self.slot_of)
