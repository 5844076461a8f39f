"""Hypothesis drives the scheduler with random arrivals, shared prefixes,
cancels, stop-string finishes, executor resets, tiny KV pools and tiny
budgets, and checks the block invariants after every step."""

from __future__ import annotations

from collections import Counter, defaultdict

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_svc.request import RequestStatus
from tests.factories import EOS, make_request, make_scheduler

PREFIXES = [[], [101, 102, 103, 104, 105, 106], [101, 102, 103, 104, 201, 202, 203]]


# Tiny pools, block sizes and budgets, both policies, caching on and off.
SCHEDULER_SHAPES = dict(
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 24),
    chunk=st.integers(1, 16),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
)


def shaped_scheduler(num_blocks, block_size, max_num_seqs, budget, chunk, policy, caching):
    return make_scheduler(
        num_kv_blocks=num_blocks, block_size=block_size, max_model_len=64, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, max_prefill_chunk=chunk, policy=policy, enable_prefix_caching=caching,
    )


def assert_drained(sched, admitted) -> None:
    """After teardown ran the scheduler dry: everyone finished, nothing leaked."""
    assert not sched.has_work, "every admitted request finishes"
    assert all(r.status.is_finished for r in admitted)
    assert sched.num_free_blocks == sched.config.num_kv_blocks, "nothing leaks"
    assert not sched.kv.block_tables


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(**SCHEDULER_SHAPES)
    def setup(self, **shape):
        self.sched = shaped_scheduler(**shape)
        self.admitted = []

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(300, 310), max_size=8),
          max_tokens=st.integers(1, 10), priority=st.integers(0, 3))
    def arrive(self, prefix, suffix, max_tokens, priority):
        prompt = prefix + suffix or [999]
        if self.sched.fits(len(prompt), max_tokens) is not None:
            return
        req = make_request(prompt=prompt, max_tokens=max_tokens, priority=priority)
        self.sched.add_request(req)
        self.admitted.append(req)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def cancel(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.sched.requests)))
        req = self.sched.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        assert req is not None and req.request_id not in self.sched.kv.block_tables
        assert self.sched.finish_request(request_id, RequestStatus.FINISHED_ABORTED) is None, "cancel is idempotent"

    @rule(tokens=st.lists(st.sampled_from([EOS, 7, 8, 9]), min_size=8, max_size=8), stop_one=st.booleans())
    def step(self, tokens, stop_one):
        sched = self.sched
        was_idle = not sched.running and bool(sched.waiting)
        out = sched.schedule()
        if was_idle:
            assert not out.is_empty, "a lone request always fits the pool, so an idle scheduler admits one"
        # No overtaking: whoever was admitted precedes, in policy order,
        # everyone still waiting, so no request waits while later ones run.
        admitted_keys = [sched.order_key(n.request) for n in out.new_requests]
        if admitted_keys and sched.waiting:
            assert max(admitted_keys) < sched.order_key(sched.waiting.peek())
        for e in out.entries.values():
            assert e.start + e.num_tokens <= e.request.num_tokens_with_placeholders
            table = sched.kv.get_block_table(e.request)
            assert len(table) * sched.config.block_size >= e.start + e.num_tokens, "table must cover the step"
        sampled = [(h, tokens[i % len(tokens)], None) for i, h in enumerate(out.sampling_handles())]
        sched.update_from_output(out, sampled)
        if stop_one and sched.running:  # a stop string matched in the output processor
            sched.finish_request(sched.running[0].request_id, RequestStatus.FINISHED_STOPPED)

    @rule()
    def executor_restart(self):
        self.sched.reset_executor_state()
        assert not self.sched.running and self.sched.num_free_blocks == self.sched.config.num_kv_blocks

    @precondition(lambda self: not self.sched.has_work)
    @rule()
    def go_idle(self):
        """The engine, about to wait for requests, sends what is left to
        forget in a plan of its own."""
        out = self.sched.flush_forgets()
        if out is not None:
            live = {r.handle for r in self.sched.requests.values()}
            assert out.is_empty and out.finished_handles and not set(out.finished_handles) & live
            assert self.sched.update_from_output(out, []) == []
        assert self.sched.flush_forgets() is None, "everything was forgotten"

    @invariant()
    def live_handles_are_distinct_and_never_free(self):
        live = [r.handle for r in self.sched.requests.values()]
        assert len(set(live)) == len(live), f"two live requests share a handle: {sorted(live)}"
        assert not set(live) & set(self.sched._free_handles), "a live request's handle is free for reuse"

    @invariant()
    def blocks_are_owned_consistently(self):
        kv = self.sched.kv
        pool = kv.pool
        holders = Counter(b for table in kv.block_tables.values() for b in table)
        for b in range(pool.num_blocks):
            assert pool.ref_counts[b] == holders[b], f"block {b}: ref_count {pool.ref_counts[b]} but {holders[b]} holders"
        num_held = sum(1 for c in pool.ref_counts if c > 0)
        assert pool.num_free_blocks + num_held == pool.num_blocks, "free + held = total"
        for h, b in pool.cached.items():
            assert pool.block_hashes[b] == h
        positions = {}
        for table in kv.block_tables.values():
            for i, b in enumerate(table):
                if holders[b] > 1:
                    assert pool.block_hashes[b] is not None, f"block {b} shared but not through the prefix cache"
                    assert positions.setdefault(b, i) == i, f"shared block {b} at different table positions"
                    assert len(set(table)) == len(table), "a table holds a block twice"

    @invariant()
    def only_live_requests_hold_blocks(self):
        sched = self.sched
        running = {r.request_id for r in sched.running}
        assert set(sched.kv.block_tables) <= running
        for r in sched.running:
            assert len(sched.kv.get_block_table(r)) * sched.config.block_size >= r.num_computed_tokens
        for r in sched.waiting:
            assert r.num_computed_tokens == 0 and not sched.kv.get_block_table(r)
        assert len(sched.running) <= sched.config.max_num_seqs

    def teardown(self):
        sched = getattr(self, "sched", None)
        if sched is None:
            return
        for _ in range(2000):
            if not sched.has_work:
                break
            out = sched.schedule()
            sampled = [(h, 7, None) for h in out.sampling_handles()]
            sched.update_from_output(out, sampled)
        assert_drained(sched, self.admitted)


SchedulerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_scheduler_state_machine = SchedulerMachine.TestCase


class ExecutorMirror:
    """What the executor holds per handle (known tokens, computed tokens),
    updated by plans in the order it runs them, as executor_svc does. It
    checks that each plan is consistent with what came before it and that it
    samples exactly where the scheduler placed placeholders."""

    def __init__(self):
        self.requests: dict[int, list[int]] = {}  # handle -> [num_tokens, num_computed]

    def run(self, out) -> list[int]:
        for h in out.finished_handles:
            self.requests.pop(h, None)
        for new in out.new_requests:
            assert new.handle not in self.requests, f"handle {new.handle} added while the executor still holds it"
            self.requests[new.handle] = [len(new.token_ids), new.num_computed_tokens]
        sampled = []
        for h, e in out.entries.items():
            state = self.requests.get(h)
            assert state is not None, f"step {out.step_id} names handle {h}, which the executor does not hold"
            assert state[1] == e.start, f"handle {h}: executor computed {state[1]}, plan starts at {e.start}"
            state[1] += e.num_tokens
            assert state[1] <= state[0], f"handle {h}: plan computes past the tokens the executor knows"
            if state[1] == state[0]:
                state[0] += 1
                sampled.append(h)
        assert sorted(sampled) == sorted(out.sampling_handles()), "executor and scheduler disagree on who samples"
        return sampled


class PipelinedSchedulerMachine(RuleBasedStateMachine):
    """The scheduler as the engine drives it with 2 plans in flight: plans
    are built before earlier results arrive, results come back in order,
    requests are cancelled, stopped and preempted with tokens in flight,
    and the executor fails steps. Besides the block invariants it checks
    that no dropped token is ever streamed and that no handle is reused
    while a plan in flight names it."""

    MAX_IN_FLIGHT = 2

    @initialize(**SCHEDULER_SHAPES)
    def setup(self, **shape):
        self.sched = shaped_scheduler(**shape)
        self.admitted = []
        self.in_flight = []
        self.executor = ExecutorMirror()
        self.streamed: dict[str, list[int]] = defaultdict(list)

    arrive = SchedulerMachine.arrive

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def cancel(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.sched.requests)))
        assert self.sched.finish_request(request_id, RequestStatus.FINISHED_ABORTED) is not None

    @precondition(lambda self: len(self.in_flight) < PipelinedSchedulerMachine.MAX_IN_FLIGHT)
    @rule()
    def plan(self):
        out = self.sched.schedule()
        if not out.is_empty:
            self.in_flight.append(out)

    @precondition(lambda self: self.in_flight)
    @rule(tokens=st.lists(st.sampled_from([EOS, 7, 8, 9]), min_size=8, max_size=8), stop_one=st.booleans())
    def complete(self, tokens, stop_one):
        sched = self.sched
        out = self.in_flight.pop(0)
        sampled = self.executor.run(out)
        finished_before = {r.request_id for r in self.admitted if r.status.is_finished}
        results = sched.update_from_output(out, [(h, tokens[i % len(tokens)], None) for i, h in enumerate(sampled)])
        for t in results:
            rid = t.request.request_id
            assert rid not in finished_before, f"token streamed for {rid} after it finished"
            self.streamed[rid].append(t.token_id)
        for req in self.admitted:
            assert self.streamed[req.request_id] == req.output_token_ids, "streamed tokens differ from the output"
        if stop_one and sched.running:  # a stop string matched in the output processor
            sched.finish_request(sched.running[0].request_id, RequestStatus.FINISHED_STOPPED)

    @precondition(lambda self: self.in_flight)
    @rule()
    def step_fails(self):
        """The oldest plan fails on the executor: it forgets everything and
        discards the rest of that epoch; the scheduler recomputes."""
        self.in_flight.clear()
        self.executor = ExecutorMirror()
        self.sched.reset_executor_state()
        assert not self.sched.running and self.sched.num_free_blocks == self.sched.config.num_kv_blocks

    @invariant()
    def placeholders_match_steps_in_flight(self):
        if not hasattr(self, "sched"):
            return
        expected = Counter()
        computed = Counter()
        for out in self.in_flight:
            for e in out.entries.values():
                if not e.is_stale:
                    expected[e.request.request_id] += e.samples
        for req in self.sched.running:
            assert req.num_output_placeholders == expected[req.request_id], (
                f"{req.request_id}: {req.num_output_placeholders} placeholders, {expected[req.request_id]} in flight")
            assert len(req.output_token_ids) + req.num_output_placeholders <= req.sampling.max_tokens, (
                "scheduled past max_tokens")
        for req in self.sched.waiting:
            assert req.num_output_placeholders == 0 and req.num_computed_tokens == 0

    @invariant()
    def no_handle_reused_while_a_plan_in_flight_names_it(self):
        if not hasattr(self, "sched"):
            return
        live = {r.handle: r for r in self.sched.requests.values()}
        for out in self.in_flight:
            for h, e in out.entries.items():
                if h in live:
                    assert live[h] is e.request, f"handle {h} reused while step {out.step_id} in flight names it"

    blocks_are_owned_consistently = SchedulerMachine.blocks_are_owned_consistently
    only_live_requests_hold_blocks = SchedulerMachine.only_live_requests_hold_blocks

    def teardown(self):
        sched = getattr(self, "sched", None)
        if sched is None:
            return
        for _ in range(2000):
            if not sched.has_work and not self.in_flight:
                break
            while len(self.in_flight) < self.MAX_IN_FLIGHT:
                out = sched.schedule()
                if out.is_empty:
                    break
                self.in_flight.append(out)
            if self.in_flight:
                out = self.in_flight.pop(0)
                sched.update_from_output(out, [(h, 7, None) for h in self.executor.run(out)])
        assert_drained(sched, self.admitted)


PipelinedSchedulerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_scheduler_with_two_plans_in_flight = PipelinedSchedulerMachine.TestCase
