"""LoRA adapter slots on the executor's device, owned by the scheduler as
KV blocks are.

The executor has `num_slots` device slots (EXECUTOR_MAX_LORAS); each holds
one adapter's weights or none. It decides nothing: each plan carries the
slots to evict and the (slot, adapter) pairs to load (StepPlan.lora_*),
which the executor applies, evictions first, before the plan's forward.
A load replaces everything in its slot, so an adapter never serves with a
weight of the slot's previous adapter; a request row keeps its adapter's
name, not its slot, so an adapter may come back in another slot.

Slots are time-sliced among the adapters that want one, in policy order:
- An adapter wants a slot when a request that uses it waits for one: a
  waiting request, or a running one whose adapter was evicted (it is
  *parked*: it keeps its KV blocks and its row on the executor, and is
  not scheduled until its adapter is back).
- At each step, the adapters that want a slot, ordered by their most
  urgent request (Scheduler.order_key), each reserve one: an empty slot,
  else one whose adapter no running request uses (least recently used
  first), else one whose adapter has held it for `quantum` steps (loaded
  longest ago first). A slot reserved away takes no new request, and its
  running requests are parked.
- The reserved slot is evicted and loaded when a request of the adapter
  runs and the slot is free: no plan in flight names its old adapter (the
  result of the last plan that did has been applied; plans run in order,
  so this is stricter than the executor needs, and it keeps "no plan in
  flight reads an evicted slot" a fact the scheduler alone can check).
- A plan in which the slot was free but no request of the adapter could
  run (no KV blocks or budget left for it: parked requests hold theirs)
  gives the reservation up: the slot's adapter gets a new quantum, and
  the adapter that could not use it goes behind the others that want a
  slot for as long, so requests that hold KV run on and free it, and
  neither side waits on the other forever. Parked requests do not count
  against max_num_seqs (they do not run).
So the slots never idle while an adapter waits, a loaded adapter keeps
admitting requests in between (batching by adapter), and the first
adapter in policy order to want a slot gets one within `quantum` steps
plus the plans in flight: none starves, and priority and fair share
decide who is first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from itertools import chain

from scheduler_svc.core.request import Request


class LoraSlots:
    def __init__(self, num_slots: int, adapters: Iterable[str], quantum: int = 4):
        if num_slots < 1:
            raise ValueError(f"LoRA slots: {num_slots} slots; at least 1 is needed to serve adapters")
        self.num_slots = num_slots
        # The adapters' keys (lora_registry.py): start-up ones, and runtime
        # ones from register() to forget().
        self.adapters = set(adapters)
        self.quantum = quantum
        self.names: list[str | None] = [None] * num_slots  # [slot] -> adapter
        self.slot_of: dict[str, int] = {}
        # [slot] -> step id of the last plan naming its adapter, and of the
        # plan that loaded it.
        self.last_step: list[int] = [-1] * num_slots
        self.loaded_step: list[int] = [-1] * num_slots
        self.applied_step = -1
        self.step_id = 0
        # Running requests per adapter, parked ones included.
        self.users: Counter[str] = Counter()
        # slot -> the adapter it is reserved for (its own adapter is on its
        # way out); kept across steps until the load or until nobody wants it.
        self.reserved: dict[int, str] = {}
        # Adapters whose requests cannot run this step (none of the base model).
        self.blocked: frozenset[str] = frozenset()
        # The plan being built: adapters its requests use; slots evicted,
        # then (slot, adapter) loaded.
        self.in_plan: set[str] = set()
        self.evicts: list[int] = []
        self.loads: list[tuple[int, str]] = []
        self.num_loads = 0
        self.num_evictions = 0
        self.num_waiting_for_slot = 0
        # Running requests whose adapter is blocked this step.
        self.num_parked = 0
        # Reserved slots that are free this step: given up at end_plan if
        # their adapter did not take them.
        self._ready_reserved: list[int] = []
        # adapter -> the step until which it wants a slot behind the others
        # (it could not use the last one it was given).
        self.backoff: dict[str, int] = {}

    # ----- the step --------------------------------------------------------

    def begin_step(self, step_id: int, running: list[Request], waiting: Iterable[Request],
                   order_key: Callable[[Request], tuple]) -> None:
        """Reserves slots for the adapters that want one, in the order of
        their most urgent request, and decides which adapters are blocked."""
        self.step_id = step_id
        self.users = Counter(r.adapter for r in running if r.adapter)
        self.in_plan = set()
        first: dict[str, tuple] = {}
        num_waiting = 0
        for r in chain(running, waiting):
            if r.adapter and r.adapter not in self.slot_of:
                num_waiting += 1
                key = order_key(r)
                if r.adapter not in first or key < first[r.adapter]:
                    first[r.adapter] = key
        self.num_waiting_for_slot = num_waiting
        self.reserved = {s: a for s, a in self.reserved.items() if a in first}
        self.backoff = {a: until for a, until in self.backoff.items() if until > step_id}
        for adapter in sorted(first, key=lambda a: (a in self.backoff, first[a])):
            if adapter in self.reserved.values():
                continue
            slot = self._slot_to_reserve()
            if slot is None:
                break
            self.reserved[slot] = adapter
        self.blocked = frozenset(a for a in self.adapters if not self._runnable(a))
        self.num_parked = sum(1 for r in running if r.adapter in self.blocked)
        self._ready_reserved = [s for s in self.reserved if self._ready(s)]

    def can_admit(self, adapter: str) -> bool:
        """Whether a request with this adapter may run this step."""
        return adapter not in self.blocked

    def admit(self, adapter: str) -> None:
        """A request with this adapter runs in this plan (can_admit said
        yes): its adapter is loaded into its reserved slot if it is not in
        one."""
        if not adapter:
            return
        if adapter not in self.slot_of:
            slot = next((s for s, a in self.reserved.items() if a == adapter), None)
            if slot is None or not self._ready(slot):
                raise RuntimeError(f"LoRA slots: running adapter {adapter!r} with no slot reserved and free for it")
            old = self.names[slot]
            if old is not None:
                if old in self.in_plan:
                    raise RuntimeError(f"LoRA slots: evicting {old!r} from slot {slot}, which this plan uses")
                del self.slot_of[old]
                self.evicts.append(slot)
                self.num_evictions += 1
            del self.reserved[slot]
            self.names[slot] = adapter
            self.slot_of[adapter] = slot
            self.loaded_step[slot] = self.step_id
            self.loads.append((slot, adapter))
            self.num_loads += 1
        self.in_plan.add(adapter)

    def end_plan(self, step_id: int) -> tuple[list[int], list[tuple[int, str]]]:
        """The plan's evictions and loads; the slots of the adapters it uses
        are read by it from now on."""
        for a in self.in_plan:
            self.last_step[self.slot_of[a]] = step_id
        for slot in self._ready_reserved:
            if slot in self.reserved:  # free, and not taken
                self.backoff[self.reserved.pop(slot)] = step_id + 1 + self.quantum
                self.loaded_step[slot] = step_id + 1
        self._ready_reserved = []
        ops = self.evicts, self.loads
        self.evicts, self.loads, self.in_plan = [], [], set()
        return ops

    def register(self, adapter: str) -> None:
        """A runtime adapter the executor now serves (lora_registry.py)."""
        self.adapters.add(adapter)

    def forget(self, adapter: str) -> bool:
        """An unloaded adapter that no live request uses leaves the slots;
        returns False while a plan in flight names it (try again after the
        next result). Its slot counts as empty from then on: the executor
        evicts it when told to forget the adapter, and a load into the slot
        replaces it whatever it holds."""
        slot = self.slot_of.get(adapter)
        if slot is not None:
            if not self._ready(slot):
                return False
            del self.slot_of[adapter]
            self.names[slot] = None
        self.reserved = {s: a for s, a in self.reserved.items() if a != adapter}
        self.backoff.pop(adapter, None)
        self.adapters.discard(adapter)
        return True

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
        self.loaded_step = [-1] * self.num_slots
        self.reserved.clear()
        self._ready_reserved = []
        self.backoff.clear()
        self.num_parked = 0
        self.blocked = frozenset()
        self.users.clear()
        self.in_plan, self.evicts, self.loads = set(), [], []

    # ----- helpers ---------------------------------------------------------

    def _ready(self, slot: int) -> bool:
        """Empty, or no plan in flight (or being built) names its adapter."""
        name = self.names[slot]
        return name is None or (self.last_step[slot] <= self.applied_step and name not in self.in_plan)

    def _runnable(self, adapter: str) -> bool:
        if not adapter:
            return True
        slot = self.slot_of.get(adapter)
        if slot is not None:
            return slot not in self.reserved
        return any(a == adapter and self._ready(s) for s, a in self.reserved.items())

    def _slot_to_reserve(self) -> int | None:
        """An empty slot, else one no running request uses (least recently
        used first), else one held for `quantum` steps (longest first)."""
        free = [s for s in range(self.num_slots) if s not in self.reserved]
        empty = [s for s in free if self.names[s] is None]
        if empty:
            return empty[0]
        idle = [s for s in free if not self.users[self.names[s]]]
        if idle:
            return min(idle, key=lambda s: self.last_step[s])
        expired = [s for s in free if self.step_id - self.loaded_step[s] >= self.quantum]
        if expired:
            return min(expired, key=lambda s: self.loaded_step[s])
        return None

    @property
    def num_in_use(self) -> int:
        """Slots holding an adapter."""
        return len(self.slot_of)
