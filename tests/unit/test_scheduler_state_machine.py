"""Hypothesis drives the scheduler with random arrivals, shared prefixes,
cancels, stop-string finishes, executor resets, tiny KV pools and tiny
budgets, and checks the block invariants after every step."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_svc.request import RequestStatus
from tests.factories import EOS, make_request, make_scheduler

PREFIXES = [[], [101, 102, 103, 104, 105, 106], [101, 102, 103, 104, 201, 202, 203]]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 24),
        block_size=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 24),
        chunk=st.integers(1, 16),
        policy=st.sampled_from(["fcfs", "priority"]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks, block_size, max_num_seqs, budget, chunk, policy, caching):
        self.sched = make_scheduler(
            num_kv_blocks=num_blocks, block_size=block_size, max_model_len=64, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget, max_prefill_chunk=chunk, policy=policy, enable_prefix_caching=caching,
        )
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
        for req, n in out.scheduled():
            assert req.num_computed_tokens + n <= req.num_tokens
            table = sched.kv.get_block_table(req)
            assert len(table) * sched.config.block_size >= req.num_computed_tokens + n, "table must cover the step"
        sampled = []
        for i, (req, n) in enumerate(out.scheduled()):
            if req.num_computed_tokens + n == req.num_tokens:
                sampled.append((req.handle, tokens[i % len(tokens)], None))
        sched.update_from_output(out, sampled)
        if stop_one and sched.running:  # a stop string matched in the output processor
            sched.finish_request(sched.running[0].request_id, RequestStatus.FINISHED_STOPPED)

    @rule()
    def executor_restart(self):
        self.sched.reset_executor_state()
        assert not self.sched.running and self.sched.num_free_blocks == self.sched.config.num_kv_blocks

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
            sampled = [(r.handle, 7, None) for r, n in out.scheduled() if r.num_computed_tokens + n == r.num_tokens]
            sched.update_from_output(out, sampled)
        assert not sched.has_work, "every admitted request finishes"
        assert all(r.status.is_finished for r in self.admitted)
        assert sched.num_free_blocks == sched.config.num_kv_blocks, "nothing leaks"
        assert not sched.kv.block_tables


SchedulerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_scheduler_state_machine = SchedulerMachine.TestCase
