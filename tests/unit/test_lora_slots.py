"""The scheduler's LoRA adapter slots (scheduler_svc/core/lora_slots.py):
scenarios, then a hypothesis state machine with an executor mirror that
applies each plan's evictions and loads in plan order and checks that
every request runs on its own adapter's weights, that no slot a running
request or a plan in flight uses is evicted, and that no request starves."""

from __future__ import annotations

from collections import deque

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from scheduler_svc.core.request import RequestStatus
from tests.factories import FakeExecutor, make_request, make_scheduler

ADAPTERS = ("a", "b", "c", "d")


def lora_scheduler(max_loras=2, **overrides):
    return make_scheduler(lora_adapters=ADAPTERS, max_loras=max_loras, **overrides)


class Mirror:
    """The executor's slots, as the plans leave them: evictions, then loads."""

    def __init__(self, num_slots: int):
        self.slots: list[str | None] = [None] * num_slots

    def apply(self, out) -> None:
        for s in out.lora_evicts:
            assert self.slots[s] is not None, f"step {out.step_id} evicts slot {s}, which is empty"
            self.slots[s] = None
        for s, name in out.lora_loads:
            assert self.slots[s] is None, f"step {out.step_id} loads {name!r} over {self.slots[s]!r} in slot {s}"
            self.slots[s] = name
        for e in out.entries.values():
            if e.request.adapter:
                assert e.request.adapter in self.slots, \
                    f"step {out.step_id} runs {e.request.request_id} on {e.request.adapter!r}, in no slot {self.slots}"


def run(sched, mirror, steps=1, in_flight: deque | None = None, depth=1):
    """Plans `steps` steps with up to `depth` plans in flight; returns the plans."""
    in_flight = deque() if in_flight is None else in_flight
    plans = []
    for _ in range(steps):
        out = sched.schedule()
        mirror.apply(out)
        plans.append(out)
        if not out.is_empty:
            in_flight.append(out)
        while len(in_flight) >= depth or (in_flight and not sched.has_work):
            done = in_flight.popleft()
            sched.update_from_output(done, FakeExecutor().run(done))
    return plans


def test_adapters_load_into_free_slots_and_waiting_adapters_skip_to_loaded_ones():
    sched, mirror = lora_scheduler(), Mirror(2)
    reqs = {a: make_request(max_tokens=6, adapter=a) for a in ("a", "b", "c")}
    later = {a: make_request(max_tokens=2, adapter=a) for a in ("a", "b")}
    base = make_request(max_tokens=2)
    for r in [*reqs.values(), *later.values(), base]:
        sched.add_request(r)
    (out,) = run(sched, mirror)
    # c has no slot and none frees this step: it waits, and drains a slot
    # (a's: as few running requests as b's, loaded first). Later requests
    # on a, b and the base model go past it: a's drain admits the requests
    # that arrived before it began, none after.
    assert out.lora_loads == [(0, "a"), (1, "b")] and not out.lora_evicts
    assert sched.lora.blocked == ["c"] and list(sched.lora.draining) == ["a"]
    assert {e.request.request_id for e in out.entries.values()} == {
        reqs["a"].request_id, reqs["b"].request_id, later["a"].request_id, later["b"].request_id, base.request_id}
    too_late = make_request(max_tokens=2, adapter="a")
    sched.add_request(too_late)
    assert sched.lora.num_waiting_for_slot(sched.waiting) == 1
    # Once a's requests end (their results applied), c takes a's slot, and
    # the request on a that came too late, waiting again, the idle b's.
    plans = run(sched, mirror, 12)
    loads = [(p.lora_evicts, p.lora_loads) for p in plans if p.lora_loads]
    assert loads[0] == ([0, 1], [(0, "c"), (1, "a")])
    assert all(r.status.is_finished for r in [*reqs.values(), *later.values(), base, too_late])


def test_a_waiting_adapter_drains_a_slot_and_gets_it_despite_a_stream_of_loaded_requests():
    """a and b get a new request every step, forever; c still runs: b (the
    one chosen to drain) admits nothing new, its slot frees, c takes it."""
    sched, mirror = lora_scheduler(num_kv_blocks=256, max_num_seqs=64), Mirror(2)
    in_flight: deque = deque()
    for a in ("a", "b"):
        sched.add_request(make_request(max_tokens=8, adapter=a))
    run(sched, mirror, 1, in_flight, depth=2)
    c = make_request(max_tokens=3, adapter="c")
    sched.add_request(c)
    for step in range(40):
        for a in ("a", "b"):
            sched.add_request(make_request(max_tokens=8, adapter=a))
        run(sched, mirror, 1, in_flight, depth=2)
        if c.status != RequestStatus.WAITING:
            break
    assert c.status != RequestStatus.WAITING, "c starved"
    assert step <= 10, f"c waited {step} steps for a slot"
    assert sched.lora.num_evictions == 1 and sched.lora.num_loads == 3


def test_a_slot_is_never_evicted_while_a_plan_in_flight_uses_it():
    sched, mirror = lora_scheduler(max_loras=1), Mirror(1)
    in_flight: deque = deque()
    a, b = make_request(max_tokens=1, adapter="a"), make_request(max_tokens=1, adapter="b")
    sched.add_request(a)
    sched.add_request(b)
    (first,) = run(sched, mirror, 1, in_flight, depth=3)
    assert first.lora_loads == [(0, "a")] and list(first.entries) == [a.handle]
    # a's only step is in flight: a is still running, and b waits.
    (second,) = run(sched, mirror, 1, in_flight, depth=3)
    assert second.is_empty and not second.lora_loads
    sched.update_from_output(first, FakeExecutor().run(first))
    in_flight.clear()
    assert a.status.is_finished
    (third,) = run(sched, mirror, 1, in_flight, depth=3)
    assert third.lora_evicts == [0] and third.lora_loads == [(0, "b")] and list(third.entries) == [b.handle]


def test_eviction_waits_for_the_result_of_the_last_plan_naming_the_slot():
    """a finished (aborted) while its plan is in flight: its slot is not
    reused until that plan's result is applied."""
    sched, mirror = lora_scheduler(max_loras=1), Mirror(1)
    a, b = make_request(max_tokens=4, adapter="a"), make_request(max_tokens=1, adapter="b")
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()
    mirror.apply(first)
    sched.finish_request(a.request_id, RequestStatus.FINISHED_ABORTED)
    second = sched.schedule()
    assert not second.lora_loads and not second.entries
    sched.update_from_output(first, FakeExecutor().run(first))
    third = sched.schedule()
    mirror.apply(third)
    assert third.lora_evicts == [0] and third.lora_loads == [(0, "b")]


def test_an_executor_reset_empties_every_slot():
    sched, mirror = lora_scheduler(), Mirror(2)
    sched.add_request(make_request(max_tokens=4, adapter="a"))
    run(sched, mirror)
    sched.reset_executor_state(host_lost=False)
    assert sched.lora.slot_of == {}
    out = sched.schedule()
    assert out.lora_loads == [(0, "a")] and not out.lora_evicts


def test_an_adapter_that_is_not_served_is_refused():
    sched = lora_scheduler()
    try:
        sched.add_request(make_request(adapter="zz"))
    except ValueError as e:
        assert "'zz'" in str(e)
    else:
        raise AssertionError("accepted an adapter that is not served")


def test_fair_share_still_orders_the_adapters_waiting_for_a_slot():
    """Under fair share the tenant with the lower counter goes first, also
    among requests skipped past a waiting adapter."""
    sched, mirror = lora_scheduler(max_loras=1, policy="fair", max_num_seqs=1), Mirror(1)
    heavy = make_request(max_tokens=30, adapter="a")
    heavy.tenant = "heavy"
    sched.add_request(heavy)
    run(sched, mirror, 5, depth=1)
    light = make_request(max_tokens=1, adapter="b")
    light.tenant = "light"
    more = make_request(max_tokens=1, adapter="a")
    more.tenant = "heavy"
    sched.add_request(more)
    sched.add_request(light)
    run(sched, mirror, 40, depth=1)
    assert light.status.is_finished and more.status.is_finished


# ----- the state machine ----------------------------------------------------

SHAPES = dict(max_loras=st.integers(1, 3), max_num_seqs=st.integers(1, 6), budget=st.integers(2, 24),
              depth=st.integers(1, 3), policy=st.sampled_from(["fcfs", "priority", "fair"]))
MAX_TOKENS = 6
PROMPT_LEN = 5


class LoraSlotMachine(RuleBasedStateMachine):
    @initialize(shape=st.fixed_dictionaries(SHAPES))
    def setup(self, shape):
        self.depth = shape.pop("depth")
        self.sched = lora_scheduler(max_loras=shape["max_loras"], max_num_seqs=shape["max_num_seqs"],
                                    max_num_batched_tokens=shape["budget"], max_prefill_chunk=shape["budget"],
                                    policy=shape["policy"], num_kv_blocks=256)
        self.mirror = Mirror(shape["max_loras"])
        self.in_flight: deque = deque()
        self.waited: dict[str, int] = {}  # waiting request id -> steps planned since it arrived
        self.requests = []

    @rule(adapter=st.sampled_from(("", *ADAPTERS)), max_tokens=st.integers(1, MAX_TOKENS),
          priority=st.integers(0, 2), tenant=st.sampled_from(["t1", "t2"]))
    def arrive(self, adapter, max_tokens, priority, tenant):
        req = make_request(PROMPT_LEN, max_tokens, adapter=adapter, priority=priority)
        req.tenant = tenant
        self.sched.add_request(req)
        self.requests.append(req)

    @rule()
    def step(self):
        out = self.sched.schedule()
        self._check_evictions(out)
        self.mirror.apply(out)
        if not out.is_empty:
            self.in_flight.append(out)
        if len(self.in_flight) >= self.depth:
            self.complete()
        for r in self.sched.waiting:
            self.waited[r.request_id] = self.waited.get(r.request_id, 0) + 1
        for r in self.sched.running:
            self.waited.pop(r.request_id, None)

    @rule()
    def complete(self):
        if self.in_flight:
            out = self.in_flight.popleft()
            self.sched.update_from_output(out, FakeExecutor().run(out))

    @rule(i=st.integers(0, 1000))
    def abort(self, i):
        live = [r for r in self.requests if not r.status.is_finished]
        if live:
            r = live[i % len(live)]
            self.sched.finish_request(r.request_id, RequestStatus.FINISHED_ABORTED)
            self.waited.pop(r.request_id, None)

    @rule()
    def reset(self):
        self.sched.reset_executor_state(host_lost=False)
        self.in_flight.clear()  # the executor discards them
        self.mirror = Mirror(self.sched.lora.num_slots)  # what it holds is unknown: all loads again

    def _check_evictions(self, out):
        running = {r.adapter for r in self.sched.running}
        for s in out.lora_evicts:
            gone = self.mirror.slots[s]
            assert all(e.request.adapter != gone for p in self.in_flight for e in p.entries.values()), \
                f"slot {s} ({gone!r}) evicted while a plan in flight uses it"
            assert gone not in running or gone in (n for _, n in out.lora_loads), \
                f"slot {s} ({gone!r}) evicted while a running request uses it"

    @invariant()
    def running_adapters_are_loaded(self):
        if not hasattr(self, "sched"):
            return
        for r in self.sched.running:
            if r.adapter:
                slot = self.sched.lora.slot_of.get(r.adapter)
                assert slot is not None and self.sched.lora.names[slot] == r.adapter, \
                    f"{r.request_id} runs on {r.adapter!r}, which is in no slot"
        assert len(self.sched.lora.draining) <= self.sched.lora.num_slots

    @invariant()
    def nobody_starves(self):
        """A request that arrived waits a bounded number of steps: each
        adapter ahead of it drains one slot at most, which takes its
        running requests' remaining steps, plus plans in flight."""
        if not hasattr(self, "sched"):
            return
        lora = self.sched.lora
        per_drain = PROMPT_LEN + MAX_TOKENS + 2 * self.depth + 2
        bound = (len(ADAPTERS) + 1) * per_drain * max(1, 6 // self.sched.config.max_num_seqs) * 4
        for rid, n in self.waited.items():
            assert n <= bound, f"{rid} waited {n} steps (bound {bound}); slots {lora.names}, draining {lora.draining}"

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_work and not self.in_flight:
                break
            self.step()
            self.complete()
        assert not self.sched.has_work, "requests left after draining"


LoraSlotMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
TestLoraSlotMachine = LoraSlotMachine.TestCase
