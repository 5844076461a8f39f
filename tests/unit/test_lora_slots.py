"""The scheduler's LoRA adapter slots (scheduler_svc/core/lora_slots.py):
scenarios, then a hypothesis state machine with an executor mirror that
applies each plan's evictions and loads in plan order and checks that
every request a plan runs finds its adapter in a slot, that no slot a
plan in flight uses is evicted, that no request starves, and that
everything drains (parked requests and tiny KV pools included)."""

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
        while len(in_flight) >= depth or (in_flight and (out.is_empty or not sched.has_work)):
            done = in_flight.popleft()
            sched.update_from_output(done, FakeExecutor().run(done))
    return plans


def test_adapters_load_into_free_slots_and_waiting_adapters_skip_to_loaded_ones():
    sched, mirror = lora_scheduler(lora_quantum_steps=100), Mirror(2)  # no slot passes on by quantum here
    reqs = {a: make_request(max_tokens=6, adapter=a) for a in ("a", "b", "c")}
    later = {a: make_request(max_tokens=2, adapter=a) for a in ("a", "b")}
    base = make_request(max_tokens=2)
    for r in [*reqs.values(), *later.values(), base]:
        sched.add_request(r)
    (out,) = run(sched, mirror)
    # c has no slot and none frees this step: it waits, and later requests
    # on a, b and the base model go past it.
    assert out.lora_loads == [(0, "a"), (1, "b")] and not out.lora_evicts
    assert "c" in sched.lora.blocked and not {"", "a", "b"} & sched.lora.blocked
    assert {e.request.request_id for e in out.entries.values()} == {
        reqs["a"].request_id, reqs["b"].request_id, later["a"].request_id, later["b"].request_id, base.request_id}
    run(sched, mirror)
    assert sched.lora.num_waiting_for_slot == 1
    # Once a's and b's shorter requests end... c takes the slot whose
    # adapter no running request uses first.
    plans = run(sched, mirror, 12)
    loads = [(p.lora_evicts, p.lora_loads) for p in plans if p.lora_loads]
    assert len(loads) == 1 and loads[0][1][0][1] == "c" and loads[0][0] == [loads[0][1][0][0]]
    assert all(r.status.is_finished for r in [*reqs.values(), *later.values(), base])


def test_a_waiting_adapter_gets_a_slot_within_the_quantum_despite_a_stream_of_loaded_requests():
    """a and b get a new request every step, forever: c still gets a slot
    once the one held longest has had its quantum, and that adapter's
    running requests are parked (their KV kept, not sent again) until it
    comes back."""
    sched, mirror = lora_scheduler(num_kv_blocks=512, max_num_seqs=64, lora_quantum_steps=4), Mirror(2)
    in_flight: deque = deque()
    first = {a: make_request(max_tokens=30, adapter=a) for a in ("a", "b")}
    for r in first.values():
        sched.add_request(r)
    run(sched, mirror, 1, in_flight, depth=2)
    c = make_request(max_tokens=3, adapter="c")
    sched.add_request(c)
    parked_seen = False
    for step in range(40):
        for a in ("a", "b"):
            sched.add_request(make_request(max_tokens=8, adapter=a))
        (out,) = run(sched, mirror, 1, in_flight, depth=2)
        parked = [r for r in sched.running if r.adapter not in sched.lora.slot_of]
        if parked:
            parked_seen = True
            assert all(r.on_executor and sched.kv.block_tables[r.request_id] for r in parked)
            assert not any(n.request in parked for n in out.new_requests), "a parked request is never re-sent"
        if c.status != RequestStatus.WAITING:
            break
    assert c.status != RequestStatus.WAITING, "c starved"
    assert step <= 4 + 3, f"c waited {step} steps for a slot"
    assert parked_seen and sched.lora.num_evictions == 1
    run(sched, mirror, 80, in_flight, depth=2)
    assert all(r.status.is_finished for r in [*first.values(), c])


def test_a_parked_request_resumes_when_its_adapter_is_back():
    """One slot, quantum 2: a long request on a, then one on b. b takes
    the slot after a's quantum, a waits parked, then a comes back (into
    the same slot) and finishes; nobody is recomputed."""
    sched, mirror = lora_scheduler(max_loras=1, lora_quantum_steps=2), Mirror(1)
    a, b = make_request(max_tokens=12, adapter="a"), make_request(max_tokens=2, adapter="b")
    sched.add_request(a)
    run(sched, mirror, 1)
    sched.add_request(b)
    plans = run(sched, mirror, 40)
    loads = [p.lora_loads for p in plans if p.lora_loads]
    assert loads == [[(0, "b")], [(0, "a")]]
    assert a.status.is_finished and b.status.is_finished and len(a.output_token_ids) == 12
    assert not sched.num_recomputed_tokens and a.num_preemptions == 0


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
              depth=st.integers(1, 3), policy=st.sampled_from(["fcfs", "priority", "fair"]),
              quantum=st.integers(1, 6), num_kv_blocks=st.sampled_from([12, 256]))
MAX_TOKENS = 6
PROMPT_LEN = 5


class LoraSlotMachine(RuleBasedStateMachine):
    @initialize(shape=st.fixed_dictionaries(SHAPES))
    def setup(self, shape):
        self.depth = shape.pop("depth")
        self.sched = lora_scheduler(max_loras=shape["max_loras"], max_num_seqs=shape["max_num_seqs"],
                                    max_num_batched_tokens=shape["budget"], max_prefill_chunk=shape["budget"],
                                    policy=shape["policy"], num_kv_blocks=shape["num_kv_blocks"],
                                    lora_quantum_steps=shape["quantum"])
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
        self.mirror = Mirror(self.sched.lora.num_slots)  # the executor empties its slots too

    def _check_evictions(self, out):
        for s in out.lora_evicts:
            gone = self.mirror.slots[s]
            assert all(e.request.adapter != gone for p in self.in_flight for e in p.entries.values()), \
                f"slot {s} ({gone!r}) evicted while a plan in flight uses it"
        # (The mirror checks that each request the plan runs finds its
        # adapter in a slot.)

    @invariant()
    def slots_match_the_mirror(self):
        """What the scheduler believes each slot holds is what the plans
        sent so far put there."""
        if not hasattr(self, "sched"):
            return
        lora = self.sched.lora
        assert lora.names == self.mirror.slots
        assert all(lora.names[s] == a for a, s in lora.slot_of.items())
        assert len(lora.reserved) <= lora.num_slots

    @invariant()
    def nobody_starves(self):
        """A request that arrived waits a bounded number of steps: each
        adapter ahead of it drains one slot at most, which takes its
        running requests' remaining steps, plus plans in flight."""
        if not hasattr(self, "sched"):
            return
        lora = self.sched.lora
        per_turn = self.sched.config.lora_quantum_steps + PROMPT_LEN + MAX_TOKENS + 2 * self.depth + 2
        bound = (len(ADAPTERS) + 1) * per_turn * max(1, 6 // self.sched.config.max_num_seqs) * 4
        for rid, n in self.waited.items():
            assert n <= bound, f"{rid} waited {n} steps (bound {bound}); slots {lora.names}, reserved {lora.reserved}"

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
