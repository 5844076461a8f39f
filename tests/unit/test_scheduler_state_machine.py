"""Hypothesis drives the scheduler with random arrivals, shared prefixes,
cancels, stop-string finishes, executor resets, tiny KV pools and tiny
budgets, with and without a host KV tier (spills, swap preemption, swaps
that fail), drawn tokens or greedy twins (the same prompt, the same output),
and checks the block invariants of both tiers after every step.

An executor mirror runs every plan as the executor would, down to what
each device and host block slot holds: the identity of the token prefix
its KV was computed from. So a step that reads KV that a swap never
brought, a copy that was overwritten, or a block cached before its copy
came back, fails the run."""

from __future__ import annotations

from collections import Counter, defaultdict

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_svc.core.kv_cache_manager import ROOT_HASH, hash_block
from scheduler_svc.core.plan import PromptLogprobsResult
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import SchedulerConfig
from tests.factories import EOS, make_request

PREFIXES = [[], [101, 102, 103, 104, 105, 106], [101, 102, 103, 104, 201, 202, 203]]
# What a greedy executor (ExecutorMirror.greedy) picks from, by a hash of the
# tokens so far: EOS about one time in ten.
GREEDY_TOKENS = [EOS] + [7, 8, 9] * 3


# Tiny pools, block sizes and budgets, both policies, caching on and off,
# no host tier or a host tier from tiny to roomy, every preemption mode.
SCHEDULER_SHAPES = dict(
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 24),
    chunk=st.integers(1, 16),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    host_blocks=st.sampled_from([0, 3, 16, 64]),
    preemption_mode=st.sampled_from(["auto", "recompute", "swap"]),
    # Speculative decoding off, or up to 2 or 4 drafts while at most 1, 4
    # or 16 requests run.
    speculative_tokens=st.sampled_from([0, 0, 2, 4]),
    speculative_max_batch=st.sampled_from([1, 4, 16]),
    # Multi-step decode off, or up to 2 or 4 steps per plan. The fake
    # executor answers its lookahead slots as it does drafts, with a random
    # count yielded: to the scheduler, a run that ended early is a step
    # whose later drafts were rejected.
    multi_step_decode=st.sampled_from([1, 1, 2, 4]),
)


class ParityCost:
    """auto's cost model: swaps half of the victims, either way."""

    def swap_is_cheaper(self, num_blocks: int, num_tokens: int) -> bool:
        return num_tokens % 2 == 0


# Requests there from the start: hypothesis draws many short runs, which
# would otherwise rarely get as far as pressing the pool.
# What a request asks for: tokens, or tokens and its prompt's logprobs, or
# an embedding (prefill only) pooled from the last position (it may use the
# prefix cache) or from every position (it may not).
KINDS = st.sampled_from(["generate", "generate", "prompt_logprobs", "embed_last", "embed_mean"])
FIRST_ARRIVALS = st.lists(st.fixed_dictionaries(dict(
    prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(300, 310), max_size=8),
    max_tokens=st.integers(1, 10), priority=st.integers(0, 3), copies=st.integers(1, 3), kind=KINDS)),
    max_size=3)


def shaped_scheduler(num_blocks, block_size, max_num_seqs, budget, chunk, policy, caching, host_blocks,
                     preemption_mode, speculative_tokens=0, speculative_max_batch=16, multi_step_decode=1):
    return Scheduler(SchedulerConfig(
        num_kv_blocks=num_blocks, block_size=block_size, max_model_len=64, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, max_prefill_chunk=chunk, policy=policy, enable_prefix_caching=caching,
        num_host_blocks=host_blocks, preemption_mode=preemption_mode, speculative_tokens=speculative_tokens,
        speculative_max_batch=speculative_max_batch, multi_step_decode=multi_step_decode,
    ), swap_cost=ParityCost())


def assert_drained(sched, admitted) -> None:
    """After teardown ran the scheduler dry: everyone finished, nothing
    leaked, and both free lists are whole."""
    assert not sched.has_work, "every admitted request finishes"
    assert all(r.status.is_finished for r in admitted)
    assert sched.num_free_blocks == sched.config.num_kv_blocks, "nothing leaks"
    assert not sched.kv.block_tables
    host = sched.kv.host
    if host is not None:
        assert not host.swapped and not host._pending_spills and not host._in_flight
        assert host.num_free_blocks == host.num_blocks, "nothing leaks from the host tier"


class Row:
    """The executor's copy of one request."""

    def __init__(self, token_ids, num_computed, block_ids, mirror, request=None):
        self.tokens, self.computed, self.table = [], num_computed, list(block_ids)
        # An embedding row returns a vector where it would sample; a row with
        # prompt logprobs returns one per prompt position it computes.
        self.embed = request is not None and request.embed
        self.num_prompt = request.num_prompt_tokens if request is not None else 0
        # Sent only while nothing was generated (convert.plan_to_proto).
        self.prompt_logprobs = (request is not None and request.sampling.prompt_logprobs is not None
                                and len(token_ids) == self.num_prompt)
        self.ids: list[int] = []  # per known token: the identity of the prefix ending there
        self.poisoned = False  # a swap_in of its failed: what it computes is garbage
        self.mirror = mirror
        for t in token_ids:
            self.append(t)

    def truncate(self, n: int) -> None:
        """Forgets the tokens past the first n (rejected drafts)."""
        del self.tokens[n:], self.ids[n:]

    def append(self, token: int) -> None:
        parent = self.ids[-1] if self.ids else 0
        pid = hash((parent, token, len(self.tokens)))
        self.tokens.append(token)
        self.ids.append(pid)
        self.mirror.parent[pid] = parent
        bs = self.mirror.block_size
        if len(self.tokens) % bs == 0:  # a full block: what the scheduler calls it
            i = len(self.tokens) // bs - 1
            prev = self.mirror.block_hash.get(self.ids[i * bs - 1], ROOT_HASH) if i else ROOT_HASH
            self.mirror.block_hash[pid] = hash_block(prev, self.tokens[i * bs:])


class ExecutorMirror:
    """What the executor holds per handle, and what every device and host
    block slot holds (a prefix identity, or None: never written, or
    garbage), updated by plans in the order the executor runs them. It
    checks that each plan is consistent with what came before it, that each
    step reads exactly the KV of its request's tokens, and that it samples
    exactly where the scheduler placed placeholders."""

    def __init__(self, sched, greedy: bool = False):
        cfg = sched.config
        self.block_size = cfg.block_size
        # Greedy: each token a function of the tokens before it, whatever
        # the caller's draw, as greedy decoding would make it. Requests with
        # the same prompt then have the same output and name the same blocks,
        # so one's prefix hits take the other's blocks up to its last token.
        self.greedy = greedy
        self.requests: dict[int, Row] = {}
        self.device = [[None] * cfg.block_size for _ in range(cfg.num_kv_blocks)]
        self.host = [[None] * cfg.block_size for _ in range(cfg.num_host_blocks)]
        self.parent: dict[int, int] = {}
        self.block_hash: dict[int, bytes] = {}
        # By step id: the prompt logprobs and embeddings of a plan run, until
        # its result is applied (apply).
        self.prompt_outputs: dict[int, tuple[list, list]] = {}
        # By step id: the drafts each row of a plan run rejected; and the
        # plans in flight (unapplied) when a plan was made (note_planned).
        self.rejections: dict[int, list[tuple[Row, int]]] = {}
        self.in_flight_when_planned: dict[int, list[int]] = {}

    def note_planned(self, out, in_flight) -> None:
        """out was planned while in_flight were unapplied: the scheduler
        counted their drafts as accepted."""
        self.in_flight_when_planned[out.step_id] = [p.step_id for p in in_flight]

    def forget_all(self, host_lost: bool, num_host_blocks: int | None = None) -> None:
        """The executor dropped its request state (a failed step) or died
        (every block's content gone, the host tier's too; it may come back
        with num_host_blocks)."""
        self.requests.clear()
        self.rejections.clear()
        if host_lost:
            self.device = [[None] * self.block_size for _ in self.device]
            self.host = [[None] * self.block_size for _ in range(len(self.host) if num_host_blocks is None
                                                                   else num_host_blocks)]

    def run(self, out, token=lambda i: 7, failed_outs=frozenset(), failed_ins=frozenset(), forward=True,
            accept=lambda i, k: i % (k + 1)) -> list:
        """Runs a plan; returns (handle, token) for every token a row yields:
        one for a row that samples, 1 + accept(i, drafts) (the accepted
        drafts, then one more) for a row that speculates, whose drafts are
        token(...) values and whose KV is written for every draft."""
        bs = self.block_size
        for h in out.finished_handles:
            self.requests.pop(h, None)
        poisoned = set()
        if out.swaps is not None:
            sw = out.swaps
            for i, (d, hb) in enumerate(zip(sw.out_device, sw.out_host)):
                self.host[hb] = [None] * bs if i in failed_outs else list(self.device[d])
            for i, (hb, d) in enumerate(zip(sw.in_host, sw.in_device)):
                self.device[d] = [None] * bs if i in failed_ins else list(self.host[hb])
                if i in failed_ins:
                    poisoned.add(sw.in_for[i][0].handle)
        if not forward:
            return []
        for new in out.new_requests:
            assert new.handle not in self.requests, f"handle {new.handle} added while the executor still holds it"
            self.requests[new.handle] = Row(new.token_ids, new.num_computed_tokens, new.block_ids, self, new.request)
        for h, b in zip(out.new_block_handles, out.new_block_ids):
            self.requests[h].table.append(b)
        sampled, lps, embeddings, rejections = [], [], [], []
        for h, e in out.entries.items():
            row = self.requests.get(h)
            assert row is not None, f"step {out.step_id} names handle {h}, which the executor does not hold"
            if self.greedy:
                def token(i, row=row):
                    return GREEDY_TOKENS[hash(tuple(row.tokens)) % len(GREEDY_TOKENS)]
            # The executor runs the step from what it computed: earlier than
            # the plan says by exactly the drafts of this row that steps in
            # flight when it was planned rejected.
            start = row.computed
            unknown = sum(n for step in self.in_flight_when_planned.get(out.step_id, ())
                          for r, n in self.rejections.get(step, ()) if r is row)
            assert e.start - start == unknown, (
                f"handle {h}: executor computed {start}, plan starts at {e.start}, and steps in flight when it "
                f"was planned rejected {unknown} of its drafts")
            end = start + e.num_tokens
            known = len(row.tokens)
            assert end <= known + e.num_lookahead, f"handle {h}: plan computes past the tokens the executor knows"
            if e.num_lookahead:
                assert start == known - 1 and end == known + e.num_lookahead, "drafts follow the next token"
                drafts = [token(len(sampled) + j) for j in range(e.num_lookahead)]
                for t in drafts:  # proposed: their KV is written like any token's, then mostly rolled back
                    row.append(t)
            assert len(row.table) * bs >= end, "table must cover the step"
            row.poisoned |= h in poisoned
            if not row.poisoned:
                for p in range(start):  # attention reads every earlier position
                    got = self.device[row.table[p // bs]][p % bs]
                    assert got == row.ids[p], f"handle {h} reads wrong KV at position {p} (block {row.table[p // bs]})"
            for p in range(start, end):
                self.device[row.table[p // bs]][p % bs] = None if row.poisoned else row.ids[p]
            if e.num_lookahead:
                accepted = min(e.num_lookahead, max(0, accept(len(sampled), e.num_lookahead)))
                yielded = drafts[:accepted] + [token(len(sampled) + e.num_lookahead)]
                row.truncate(known + accepted)
                for t in yielded[accepted:]:
                    row.append(t)
                row.computed = known + accepted
                rejections.append((row, e.num_lookahead - accepted))
                sampled += [(h, t) for t in yielded]
                continue
            row.computed = end
            if row.prompt_logprobs and min(end, row.num_prompt - 1) > start:
                lps.append(PromptLogprobsResult(h, start + 1, [-1.0] * (min(end, row.num_prompt - 1) - start)))
            if row.embed and end == len(row.tokens):
                embeddings.append((h, [float(end)]))
            elif end == len(row.tokens):
                t = token(len(sampled))
                row.append(t)
                sampled.append((h, t))
        assert sorted({h for h, _ in sampled}) == sorted(out.sampling_handles()), (
            "executor and scheduler disagree on who samples")
        self.prompt_outputs[out.step_id] = (lps, embeddings)
        self.rejections[out.step_id] = rejections
        return sampled

    def apply(self, sched, out, sampled, failed_outs=frozenset(), failed_ins=frozenset()):
        """Applies a plan's result as the engine does: what it read from
        prompt positions first, then its tokens. Each embedding request ends
        with its one vector, having sampled nothing."""
        lps, embeddings = self.prompt_outputs.pop(out.step_id, ([], []))
        sched.confirm_swaps(out, failed_outs, failed_ins)
        for output in sched.apply_prompt_outputs(out, lps, embeddings):
            req = output.request
            if output.embedding is not None:
                assert req.embed and req.status == RequestStatus.FINISHED_STOPPED and not req.output_token_ids
                assert output.embedding == [float(req.num_prompt_tokens)], "pooled over its whole prompt"
            else:
                assert req.sampling.prompt_logprobs is not None and output.first >= 1
                assert output.first + len(output.logprobs) <= req.num_prompt_tokens
        return sched.update_from_output(out, [(h, t, None) for h, t in sampled], failed_outs, failed_ins)

    def holds(self, slots, h: bytes) -> bool:
        """A block's slots hold, in order, the KV of the prefix block named h."""
        if any(s is None for s in slots) or self.block_hash.get(slots[-1]) != h:
            return False
        return all(self.parent[slots[k]] == slots[k - 1] for k in range(1, len(slots)))


def live_in_arrival_order(sched) -> list[str]:
    """Request ids come from a counter shared by every test, so sorting
    them would order a replayed run differently (req-998 after req-1001)."""
    return [r.request_id for r in sorted(sched.requests.values(), key=lambda r: r.arrival_seq)]


def note_swaps(out) -> None:
    """What a plan moved, for --hypothesis-show-statistics."""
    for req in out.preempted:
        event(f"preempted by {req.preempted_by}")
    if out.swaps is None:
        return
    kinds = {"spill" if isinstance(w, bytes) else "swap out" for w in out.swaps.out_for}
    kinds |= {"host hit" if h is not None else "swap in" for _, h in out.swaps.in_for}
    for kind in sorted(kinds):
        event(kind)


def drawn_failures(data, out) -> tuple[frozenset, frozenset]:
    """Swap pairs of a plan that the executor fails to copy, when any."""
    if out.swaps is None or not data.draw(st.integers(0, 3), label="fail swaps") == 0:
        return frozenset(), frozenset()
    n_out, n_in = len(out.swaps.out_host), len(out.swaps.in_host)
    fo = data.draw(st.frozensets(st.integers(0, n_out - 1), max_size=2) if n_out else st.just(frozenset()))
    fi = data.draw(st.frozensets(st.integers(0, n_in - 1), max_size=2) if n_in else st.just(frozenset()))
    if fo or fi:
        event("a swap failed")
    return fo, fi


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(first=FIRST_ARRIVALS, greedy=st.booleans(), **SCHEDULER_SHAPES)
    def setup(self, first, greedy, **shape):
        self.sched = shaped_scheduler(**shape)
        self.admitted = []
        self.executor = ExecutorMirror(self.sched, greedy)
        for arrival in first:
            self.arrive(**arrival)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(300, 310), max_size=8),
          max_tokens=st.integers(1, 10), priority=st.integers(0, 3), copies=st.integers(1, 3), kind=KINDS)
    def arrive(self, prefix, suffix, max_tokens, priority, copies, kind="generate"):
        """One request, or a few alike (the same prefix, then a suffix of
        their own), as a burst of traffic would bring."""
        if kind.startswith("embed"):
            max_tokens = 0
        for i in range(copies):
            # Copies differ in their last token, except under a greedy
            # executor: twins there, as a burst of the same prompt would be.
            prompt = prefix + suffix + [320 + i] * (i > 0 and not self.executor.greedy) or [999]
            if self.sched.fits(len(prompt), max_tokens) is not None:
                return
            req = make_request(prompt=prompt, max_tokens=max_tokens, priority=priority,
                               **({"prompt_logprobs": 1} if kind == "prompt_logprobs" else {}))
            req.embed = kind.startswith("embed")
            req.skip_prefix_cache = kind in ("prompt_logprobs", "embed_mean")
            self.sched.add_request(req)
            self.admitted.append(req)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def cancel(self, data):
        request_id = data.draw(st.sampled_from(live_in_arrival_order(self.sched)))
        req = self.sched.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        assert req is not None and req.request_id not in self.sched.kv.block_tables
        assert self.sched.finish_request(request_id, RequestStatus.FINISHED_ABORTED) is None, "cancel is idempotent"

    @rule(tokens=st.lists(st.sampled_from([EOS, 7, 8, 9]), min_size=8, max_size=8), stop_one=st.booleans(),
          data=st.data())
    def step(self, tokens, stop_one, data):
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
        note_swaps(out)
        failed_outs, failed_ins = drawn_failures(data, out)
        sampled = self.executor.run(out, lambda i: tokens[i % len(tokens)], failed_outs, failed_ins,
                                     accept=lambda i, k: data.draw(st.integers(0, k), label="drafts accepted"))
        self.executor.apply(sched, out, sampled, failed_outs, failed_ins)
        if stop_one and sched.running:  # a stop string matched in the output processor
            sched.finish_request(sched.running[0].request_id, RequestStatus.FINISHED_STOPPED)

    @rule(num_steps=st.integers(2, 8))
    def run(self, num_steps):
        """Several steps in a row, none finishing early: outputs grow, and so
        does the pressure on the pool."""
        for _ in range(num_steps):
            out = self.sched.schedule()
            note_swaps(out)
            self.executor.apply(self.sched, out, self.executor.run(out))

    @rule(host_blocks=st.sampled_from([None, 0, 4, 32]))
    def executor_restart(self, host_blocks):
        """The executor process dies, its host tier with it, and comes back
        with the same host tier (None) or one of another size."""
        self.sched.reset_executor_state(host_lost=True)
        if host_blocks is not None:
            self.sched.replace_host_tier(host_blocks)
        self.executor.forget_all(host_lost=True, num_host_blocks=host_blocks)
        assert not self.sched.running and self.sched.num_free_blocks == self.sched.config.num_kv_blocks
        assert self.sched.kv.host is None or not self.sched.kv.host.swapped

    @precondition(lambda self: not self.sched.has_work)
    @rule()
    def go_idle(self):
        """The engine, about to wait for requests, sends what is left to
        forget in a plan of its own."""
        out = self.sched.flush_forgets()
        if out is not None:
            live = {r.handle for r in self.sched.requests.values()}
            assert out.is_empty and out.finished_handles and not set(out.finished_handles) & live
            assert out.swaps is None
            self.executor.run(out)
            assert self.sched.update_from_output(out, []) == []
        assert self.sched.flush_forgets() is None, "everything was forgotten"

    @invariant()
    def a_request_that_skips_the_prefix_cache_takes_no_cached_block(self):
        for req in self.sched.running:
            if req.skip_prefix_cache:
                assert req.num_cached_prompt_tokens == 0, f"{req.request_id} took cached blocks"

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
    def host_blocks_are_each_in_exactly_one_place(self):
        """Free (cached or not), pending a spill copy, or held by one
        swapped-out request: reference counts say which, and balance."""
        host = self.sched.kv.host
        if host is None:
            return
        pool = host.pool
        holders = Counter(b for r in host.swapped.values() for b in r.host_blocks)
        holders.update(host._pending_spills.values())
        for b in range(pool.num_blocks):
            assert holders[b] <= 1, f"host block {b} has {holders[b]} holders"
            assert pool.ref_counts[b] == holders[b], (
                f"host block {b}: ref_count {pool.ref_counts[b]}, {holders[b]} holders")
            if holders[b]:
                assert pool.block_hashes[b] is None, f"host block {b} is cached while a copy into it is pending"
        assert pool.num_free_blocks + sum(holders.values()) == pool.num_blocks, "free + held = total"
        for h, b in pool.cached.items():
            assert pool.block_hashes[b] == h
        for rid, record in host.swapped.items():
            req = record.request
            assert rid in self.sched.requests and req.status == RequestStatus.WAITING, "only waiting requests swap"
            assert not record.confirmed or req.num_output_placeholders == 0, "a confirmed copy has no token in flight"

    @invariant()
    def no_block_is_cached_before_its_copy_is_confirmed(self):
        """Every block either tier names by a hash holds that prefix block's
        KV, in what the executor has run so far: plans in flight cannot
        have made it so."""
        sched, mirror = self.sched, self.executor
        for h, b in sched.kv.pool.cached.items():
            assert mirror.holds(mirror.device[b], h), f"device block {b} cached, but does not hold its content"
        if sched.kv.host is not None:
            for h, b in sched.kv.host.pool.cached.items():
                assert mirror.holds(mirror.host[b], h), f"host block {b} cached before its copy came back"

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
            sampled = self.executor.run(out)
            self.executor.apply(sched, out, sampled)
        assert_drained(sched, self.admitted)


SchedulerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_scheduler_state_machine = SchedulerMachine.TestCase


class PipelinedSchedulerMachine(RuleBasedStateMachine):
    """The scheduler as the engine drives it with 2 plans in flight: plans
    are built before earlier results arrive, results come back in order,
    requests are cancelled, stopped, preempted and swapped out with tokens
    in flight, swaps fail, and the executor fails steps or dies. Besides
    the block invariants it checks that no dropped token is ever streamed
    and that no handle is reused while a plan in flight names it."""

    MAX_IN_FLIGHT = 2

    @initialize(first=FIRST_ARRIVALS, greedy=st.booleans(), **SCHEDULER_SHAPES)
    def setup(self, first, greedy, **shape):
        self.sched = shaped_scheduler(**shape)
        self.admitted = []
        self.in_flight = []
        self.executor = ExecutorMirror(self.sched, greedy)
        self.streamed: dict[str, list[int]] = defaultdict(list)
        for arrival in first:
            self.arrive(**arrival)

    arrive = SchedulerMachine.arrive

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def cancel(self, data):
        request_id = data.draw(st.sampled_from(live_in_arrival_order(self.sched)))
        assert self.sched.finish_request(request_id, RequestStatus.FINISHED_ABORTED) is not None

    @precondition(lambda self: len(self.in_flight) < PipelinedSchedulerMachine.MAX_IN_FLIGHT)
    @rule()
    def plan(self):
        out = self.sched.schedule()
        if not out.is_empty:
            self._send(out)

    def _send(self, out) -> None:
        self.executor.note_planned(out, self.in_flight)
        self.in_flight.append(out)

    @precondition(lambda self: self.in_flight)
    @rule(tokens=st.lists(st.sampled_from([EOS, 7, 8, 9]), min_size=8, max_size=8), stop_one=st.booleans(),
          data=st.data())
    def complete(self, tokens, stop_one, data):
        sched = self.sched
        out = self.in_flight.pop(0)
        note_swaps(out)
        failed_outs, failed_ins = drawn_failures(data, out)
        sampled = self.executor.run(out, lambda i: tokens[i % len(tokens)], failed_outs, failed_ins,
                                     accept=lambda i, k: data.draw(st.integers(0, k), label="drafts accepted"))
        finished_before = {r.request_id for r in self.admitted if r.status.is_finished}
        results = self.executor.apply(sched, out, sampled, failed_outs, failed_ins)
        for t in results:
            rid = t.request.request_id
            assert rid not in finished_before, f"token streamed for {rid} after it finished"
            self.streamed[rid].append(t.token_id)
        for req in self.admitted:
            assert self.streamed[req.request_id] == req.output_token_ids, "streamed tokens differ from the output"
        if stop_one and sched.running:  # a stop string matched in the output processor
            sched.finish_request(sched.running[0].request_id, RequestStatus.FINISHED_STOPPED)

    @rule(num_steps=st.integers(2, 8))
    def run(self, num_steps):
        """Several steps as the engine runs them, two plans in flight, none
        finishing early: outputs grow, and so does the pressure on the pool."""
        for _ in range(num_steps):
            while len(self.in_flight) < self.MAX_IN_FLIGHT and not (out := self.sched.schedule()).is_empty:
                self._send(out)
            if not self.in_flight:
                return
            out = self.in_flight.pop(0)
            note_swaps(out)
            results = self.executor.apply(self.sched, out, self.executor.run(out))
            for t in results:
                self.streamed[t.request.request_id].append(t.token_id)

    @precondition(lambda self: self.in_flight)
    @rule(host_lost=st.booleans())
    def step_fails(self, host_lost):
        """The oldest plan fails on the executor (after its swaps ran, or
        not): it forgets everything and discards the rest of that epoch;
        the scheduler recomputes. Or the executor dies, host tier and all."""
        self.executor.run(self.in_flight[0], forward=False)
        self.in_flight.clear()
        self.executor.forget_all(host_lost)
        self.sched.reset_executor_state(host_lost=host_lost)
        assert not self.sched.running and self.sched.num_free_blocks == self.sched.config.num_kv_blocks
        host = self.sched.kv.host
        if host is not None:
            assert not host._pending_spills and not host._in_flight
            assert all(r.confirmed for r in host.swapped.values())
            assert not host_lost or not host.swapped

    @invariant()
    def placeholders_match_steps_in_flight(self):
        if not hasattr(self, "sched"):
            return
        expected = Counter()
        for out in self.in_flight:
            for e in out.entries.values():
                if not e.is_stale:
                    expected[e.request.request_id] += e.samples * (1 + e.num_lookahead)  # a draft may be a token
        for req in self.sched.requests.values():
            # A request swapped out with a step in flight still expects its token.
            assert req.num_output_placeholders == expected[req.request_id], (
                f"{req.request_id}: {req.num_output_placeholders} placeholders, {expected[req.request_id]} in flight")
            assert len(req.output_token_ids) + req.num_output_placeholders <= req.sampling.max_tokens, (
                "scheduled past max_tokens")
        for req in self.sched.waiting:
            assert req.num_computed_tokens == 0
            if self.sched.kv.host is None or req.request_id not in self.sched.kv.host.swapped:
                assert req.num_output_placeholders == 0

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
    host_blocks_are_each_in_exactly_one_place = SchedulerMachine.host_blocks_are_each_in_exactly_one_place
    no_block_is_cached_before_its_copy_is_confirmed = SchedulerMachine.no_block_is_cached_before_its_copy_is_confirmed
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
                self._send(out)
            if self.in_flight:
                out = self.in_flight.pop(0)
                self.executor.apply(sched, out, self.executor.run(out))
        assert_drained(sched, self.admitted)


PipelinedSchedulerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_scheduler_with_two_plans_in_flight = PipelinedSchedulerMachine.TestCase
