"""The scheduling core: a plain synchronous library, no I/O.

Each step, `schedule()` decides which requests run and how many tokens
each computes; the engine sends that plan to the executor, and
`update_from_output()` applies the sampled tokens.

Plans may be in flight while the next one is built (the engine keeps up to
SCHEDULER_MAX_PLANS_IN_FLIGHT). Scheduling a step therefore counts its
tokens as computed at once, and each token it will sample as a placeholder
that the next step computes: the executor appends what it samples to its
own copy of the request, so no plan needs a token the scheduler has not
seen. A result is matched against the step's own entries; an entry whose
request was preempted, reset or finished since is stale and dropped.

A victim of preemption either recomputes later (its blocks are freed) or,
with a host KV tier, is swapped out: the plan copies its computed KV to
host blocks, and the plan that resumes it copies them back in before its
forward (host_tier.py). Plans run in order on the executor, so a swap_out
reads what every earlier plan wrote, including the victim's steps still in
flight: a swapped-out victim keeps their tokens.
"""

from __future__ import annotations

import bisect
import secrets
from collections import Counter
from dataclasses import dataclass, replace
from typing import Protocol

from scheduler_svc.core.host_tier import SwappedOut
from scheduler_svc.core.kv_cache_manager import KVCacheManager, blocks_needed
from scheduler_svc.core.lora_slots import LoraSlots
from scheduler_svc.core.plan import (NewRequestData, PromptLogprobsResult, PromptOutput, SampledToken,
                                     ScheduledRequest, StepPlan)
from scheduler_svc.core.policy import make_policy
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.scheduler_config import SchedulerConfig


@dataclass(frozen=True, slots=True)
class Load:
    """What the scheduler holds at one moment (Scheduler.load): the gauges
    the server publishes after each step, and the simulator's averages."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    # Tokens whose KV the running requests hold, against the slots their
    # blocks give them (the difference is the pool's internal waste).
    tokens_held: int
    slots_allocated: int


class SwapCost(Protocol):
    def swap_is_cheaper(self, num_blocks: int, num_tokens: int) -> bool:
        """Copying num_blocks out and back in costs less than recomputing
        num_tokens tokens."""


class _AlwaysSwap:
    def swap_is_cheaper(self, num_blocks: int, num_tokens: int) -> bool:
        return True


class Scheduler:
    def __init__(self, config: SchedulerConfig, swap_cost: SwapCost | None = None):
        self.config = config
        self.kv = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                 config.num_host_blocks)
        # Without measurements, a copy is taken to be cheaper: it moves the
        # block's bytes, where recomputing runs the whole model on its tokens.
        self.swap_cost = swap_cost or _AlwaysSwap()
        self.policy = make_policy(config.policy, config.prompt_token_weight, config.output_token_weight,
                                  dict(config.tenant_weights))
        self.waiting = self.policy.make_queue()
        # The executor's LoRA adapter slots (lora_slots.py); None without
        # adapters, start-up or runtime.
        self.lora = LoraSlots(config.max_loras or len(config.lora_adapters), config.lora_adapters,
                              config.lora_quantum_steps) if config.lora_adapters or config.runtime_lora else None
        # Sorted by order_key: the last one is the first to be preempted.
        self.running: list[Request] = []
        self._next_arrival = 0
        self.requests: dict[str, Request] = {}
        self._free_handles: list[int] = []
        self._next_handle = 0
        # Handles to tell the executor to forget in the next plan.
        self._to_forget: list[int] = []
        # Handles of finished requests whose forget is not planned yet.
        self._to_release: list[int] = []
        # (step id of the plan carrying their forget, handles): reusable once
        # that step's result is applied, so no plan in flight names them.
        self._releasing: list[tuple[int, list[int]]] = []
        self._step_id = 0
        # Moves on at every executor reset; plans of an older epoch still in
        # flight are ignored when their results arrive.
        self.executor_epoch = 0
        self.num_preemptions = 0
        self.num_preemptions_by_mode: Counter[str] = Counter()
        # Tokens whose KV had been computed, was lost (preemption by
        # recompute, a swap that failed, an executor reset) and was computed
        # again, by Request.lost_cause.
        self.num_recomputed_tokens: Counter[str] = Counter()
        # Sampled tokens dropped because their request had finished, been
        # preempted or reset while the step was in flight.
        self.num_dropped_tokens = 0
        # Speculative decoding: drafts verified, and drafts accepted, over
        # the results applied; accepted_lengths[a] = steps that accepted a.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_lengths: Counter[int] = Counter()
        # Multi-step decode: lookahead steps granted, and those the executor
        # ran (the rest ended early: a stop token, an arrival or a cancel).
        self.num_lookahead_steps = 0
        self.num_lookahead_steps_run = 0

    # ----- admission -------------------------------------------------------

    def fits(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never run, or None when it can."""
        total = num_prompt_tokens + max_tokens
        if total > self.config.max_model_len:
            return f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds max_model_len {self.config.max_model_len}"
        if blocks_needed(total, self.config.block_size) > self.config.num_kv_blocks:
            return f"prompt + max_tokens ({total} tokens) exceeds the KV pool ({self.config.num_kv_blocks} blocks of {self.config.block_size})"
        return None

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already live")
        reason = self.fits(request.num_prompt_tokens, request.sampling.max_tokens)
        if reason:
            raise ValueError(reason)
        if request.adapter and (self.lora is None or request.adapter not in self.lora.adapters):
            raise ValueError(f"adapter {request.adapter!r} is not served")
        request.handle = self._alloc_handle()
        if (self.config.batch_invariant or self.config.speculative_tokens) and request.sampling.seed is None:
            # Its draws keyed by a seed of its own and the token's index
            # (the executor's sampler), never by its row in a batch; kept
            # for its whole life, so a recompute after a preemption draws
            # what it would have drawn. Speculating, a model-based proposer
            # (draft model, MTP, EAGLE-3) draws its drafts with the uniforms
            # the target's draw at each position will use, so the two
            # coincide where the models agree; without a seed it could only
            # draft its argmax. Unseeded output stays unreproducible: the
            # seed is random and never returned.
            request.sampling = replace(request.sampling, seed=secrets.randbits(64))
        request.arrival_seq = self._next_arrival
        self._next_arrival += 1
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def order_key(self, req: Request) -> tuple[int, int]:
        """Smaller runs first and is preempted last (within a tenant, under fair)."""
        return self.policy.order_key(req)

    def _alloc_handle(self) -> int:
        # Reusing small handles keeps the plan's varints short.
        if self._free_handles:
            return self._free_handles.pop()
        self._next_handle += 1
        return self._next_handle - 1

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- the step --------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The rule: each request's num_computed_tokens catches up with its
        num_tokens, under a per-step token budget. Prefill, chunked prefill
        and decode are this one loop; a decode is just a request one token
        behind. Running requests go first, in policy order; when one needs a
        block and none is free, the least urgent running request is
        preempted (its blocks freed, recomputed later). Waiting requests are
        admitted in policy order, starting from their longest cached prefix,
        and only in a step that preempted nothing. With LoRA adapters, a
        request whose adapter cannot have a device slot this step is passed
        over, running (parked) or waiting (lora_slots.py)."""
        cfg = self.config
        out = StepPlan(step_id=self._step_id, executor_epoch=self.executor_epoch)
        self._step_id += 1
        self.waiting.begin_step()
        if self.lora is not None:
            self.lora.begin_step(out.step_id, self.running, self.waiting, self.order_key)
        budget = cfg.max_num_batched_tokens
        if self.waiting and self.waiting.peek().num_failed_steps and self._admit(out, budget) is not None:
            # A request whose step failed is retried alone, so a second
            # failure names it and spares the rest of the batch.
            return self._finish_plan(out)

        # Multi-step decode: each decode row's lookahead slots this plan
        # (0: none), and whether the plan runs them as decode steps.
        steps_ahead, out.multi_step_drafts = self._multi_step_lookahead()
        out.multi_step = steps_ahead > 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._last_token_in_flight(req):
                i += 1  # it finishes when that result arrives
                continue
            if self.lora is not None and not self.lora.can_admit(req.adapter):
                i += 1  # parked: its adapter is out of the slots, or on its way out (lora_slots.py)
                continue
            n = self._num_tokens_to_schedule(req, budget)
            if n is None:
                i += 1  # its fixed-size chunk waits for a step with room for it
                continue
            lookahead = self._num_lookahead(req, n, budget, steps_ahead)
            n += lookahead
            new_blocks = self.kv.allocate_slots(req, n)
            while new_blocks is None:
                # Only from those not yet in this plan: a victim scheduled
                # already would be forgotten before the step that names it.
                # And never the first running request while another can go:
                # a policy that may pick the requester itself (fair) could
                # otherwise have two requests preempt each other in turn,
                # each losing its progress, and never finish either. The
                # first in policy order only ever progresses, so the pool
                # always drains.
                victim = self.policy.pick_victim(self.running[i:] if i or len(self.running) == 1
                                                 else self.running[1:])
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
                new_blocks = self.kv.allocate_slots(req, n)
            if new_blocks is None:
                break  # req preempted itself: nothing after it can run either
            if self.lora is not None:
                self.lora.admit(req.adapter)
            self._record(out, req, n, new_blocks, lookahead)
            budget -= n
            i += 1

        num_parked = self.lora.num_parked if self.lora is not None else 0  # they do not run
        while (self.waiting and not out.num_preempted and budget > 0
               and len(self.running) - num_parked < cfg.max_num_seqs):
            req = self._next_to_admit()
            if req is None or req.num_failed_steps:
                break  # every waiting adapter lacks a slot; or a suspect, which runs alone, next step
            n = self._admit(out, budget, req)
            if n is None:
                break  # the head waits for blocks; nobody overtakes it
            budget -= n
        return self._finish_plan(out)

    def _next_to_admit(self) -> Request | None:
        """The head of the queue; with LoRA adapters, the first in policy
        order whose adapter may run this step (lora_slots.py): the others
        are passed over, their adapters waiting for a slot."""
        if self.lora is None:
            return self.waiting.peek()
        return self.waiting.first_not_of(self.lora.blocked)

    def _admit(self, out: StepPlan, budget: int, req: Request | None = None) -> int | None:
        """Moves req (the head of the queue by default) to running, starting
        from its longest cached prefix. Returns the tokens scheduled, or
        None when the pool or the LoRA slots cannot hold it (nothing
        changes then)."""
        req = req or self.waiting.peek()
        if self.lora is not None and not self.lora.can_admit(req.adapter):
            return None
        if not self.kv.can_resume(req):
            return None  # swapped out by a plan whose result is still to come
        hit = self.kv.find_cached_prefix(req)
        if hit.stops_at_pending_spill:
            # Its prefix goes on in a block on its way to the host tier,
            # confirmed a step or two from now (that plan is built or in
            # flight): waiting for it is cheaper than computing the rest.
            # A copy that fails is dropped, and the chain then just stops.
            return None
        req.num_computed_tokens = hit.num_tokens
        n = self._num_tokens_to_schedule(req, budget)
        if n is None:
            req.num_computed_tokens = 0
            return None
        new_blocks = self.kv.allocate_slots(req, n, hit)
        if new_blocks is None:
            req.num_computed_tokens = 0
            return None
        self.kv.record_hit(hit)
        if req.num_preemptions == 0:
            req.num_cached_prompt_tokens = min(hit.num_tokens, req.num_prompt_tokens)
        self.waiting.take(req)
        if self.lora is not None:
            self.lora.admit(req.adapter)
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=self.order_key)
        self._record(out, req, n, new_blocks)
        return n

    def flush_forgets(self) -> StepPlan | None:
        """A plan of forgets alone, for when nothing else will be scheduled:
        the executor then drops finished requests' state (their rows and
        constraint matchers) now, not whenever the next request arrives.
        None when there is nothing to forget."""
        if not self._to_forget:
            return None
        out = StepPlan(step_id=self._step_id, executor_epoch=self.executor_epoch)
        self._step_id += 1
        return self._finish_plan(out, send_empty=True)

    def _finish_plan(self, out: StepPlan, send_empty: bool = False) -> StepPlan:
        out.swaps = self.kv.end_plan()
        if self.lora is not None:
            out.lora_evicts, out.lora_loads = self.lora.end_plan(out.step_id)
        if out.is_empty and not send_empty:
            return out  # not sent: its forgets wait for the next plan
        out.finished_handles, self._to_forget = self._to_forget, []
        if self._to_release:
            self._releasing.append((out.step_id, self._to_release))
            self._to_release = []
        return out

    def _last_token_in_flight(self, req: Request) -> bool:
        """A step in flight samples the request's last allowed token, so
        scheduling it again could only compute past its end."""
        if req.embed:
            return req.num_computed_tokens >= req.num_tokens  # its last chunk is in flight
        return req.num_output_placeholders > 0 and (
            len(req.output_token_ids) + req.num_output_placeholders >= req.sampling.max_tokens
            or req.num_tokens_with_placeholders >= self.config.max_model_len
        )

    def _num_tokens_to_schedule(self, req: Request, budget: int) -> int | None:
        """Tokens to compute for req this step: what it lacks, at most one
        chunk, within the budget. Batch-invariant mode: a chunk ends at the
        next multiple of invariant_chunk (block-aligned, so a cached prefix,
        which is whole blocks, ends where a chunk could), whatever the load:
        None when the budget cannot hold it this step, never a shorter one.
        A prompt is then cut at the same positions cached or not, under any
        load."""
        left = req.num_tokens_with_placeholders - req.num_computed_tokens
        if left <= 0:
            raise RuntimeError(f"request {req.request_id} is scheduled with nothing left to compute")
        cfg = self.config
        if cfg.batch_invariant and left > 1:
            c = cfg.invariant_chunk
            n = min(left, (req.num_computed_tokens // c + 1) * c - req.num_computed_tokens)
            return n if n <= budget else None
        n = min(left, budget)
        if n > 1:
            n = min(n, cfg.max_prefill_chunk)
        return n

    def _num_lookahead(self, req: Request, n: int, budget: int, steps_ahead: int) -> int:
        """Lookahead slots for a decode step of a running request: in a
        multi-step plan its steps_ahead slots; else its speculative drafts
        (_num_drafts). Never past max_tokens or max_model_len (the step
        yields up to 1 + lookahead tokens), nor past the step's budget."""
        if n != 1 or not req.on_executor:
            return 0
        most = steps_ahead or (self._num_drafts() if req.can_speculate else 0)
        if not most or req.num_tokens_with_placeholders - req.num_computed_tokens != 1:  # a prompt's chunk of 1
            return 0
        cfg = self.config
        left = req.sampling.max_tokens - len(req.output_token_ids) - req.num_output_placeholders - 1
        room = cfg.max_model_len - req.num_tokens_with_placeholders - 1
        return max(0, min(most, left, room, budget - 1))

    def _num_drafts(self) -> int:
        """Drafts a speculating request verifies per step at today's load:
        the executor's most while at most half of speculative_max_batch
        run, half as many (at least 1) up to speculative_max_batch, none
        above it."""
        cfg, running = self.config, len(self.running)
        if not cfg.speculative_tokens or running > cfg.speculative_max_batch:
            return 0
        return cfg.speculative_tokens if 2 * running <= cfg.speculative_max_batch else max(1, cfg.speculative_tokens // 2)

    def _multi_step_lookahead(self) -> tuple[int, int]:
        """Multi-step decode: how many lookahead slots this plan grants each
        decode row (0: a plain plan), and the most drafts each of its steps
        verifies. Without speculation a row runs up to multi_step_decode
        decode steps (multi_step_decode - 1 slots). With it (_num_drafts),
        each step verifies up to that many drafts, and the row gets the
        slots of those drafts on top: one plan yields up to
        multi_step_decode + drafts tokens, in as many steps as the drafts'
        acceptance needs, at most as many as without speculation plus
        drafts (every step accepting none).
        Only while at most multi_step_max_batch requests run (a larger batch
        spreads the per-step cost it saves over more tokens already, and
        measured no faster), and when nothing needs the scheduler between
        steps: nobody waits (a new arrival, or a preempted or swapped-out
        request to resume), every running request is a plain decode (no
        prompt chunk, no embedding), none is constrained (its grammar is
        advanced by the executor as its tokens come; such a batch steps one
        plan at a time, speculating in single steps if it may), and the
        pool has a free block for every slot granted (a full pool would
        only preempt for tokens that may never be needed). Stop strings
        need nothing: a result's tokens past one are cut (stop_by_string),
        as a speculative step's are; the plan names the stop token ids,
        where the executor ends a row's run early."""
        cfg = self.config
        ahead = cfg.multi_step_decode - 1
        if ahead <= 0 or self.waiting or not self.running or len(self.running) > cfg.multi_step_max_batch:
            return 0, 0
        if self.lora is not None and self.lora.num_parked:
            return 0, 0  # their adapter's turn comes in plans (lora_slots.py): they would wait k times as long
        drafts = self._num_drafts()
        ahead += drafts
        need = 0
        for req in self.running:
            if (req.embed or not req.on_executor or req.constraint is not None
                    or req.num_tokens_with_placeholders - req.num_computed_tokens > 1):
                return 0, 0
            need += self.kv.num_blocks_to_take(req, 1 + ahead)
        return (ahead, drafts) if self.kv.pool.can_allocate(need) else (0, 0)

    def _record(self, out: StepPlan, req: Request, n: int, new_blocks: list[int], lookahead: int = 0) -> None:
        if req.on_executor:
            out.cached_requests.append(req)
            out.cached_num_scheduled_tokens.append(n)
            if new_blocks:
                out.new_block_handles.extend([req.handle] * len(new_blocks))
                out.new_block_ids.extend(new_blocks)
            if lookahead:
                out.lookahead_handles.append(req.handle)
                out.lookahead_counts.append(lookahead)
                if out.multi_step:
                    stops = req.sampling.stop_token_ids
                    if not req.sampling.ignore_eos:
                        stops = stops | req.eos_token_ids
                    out.stop_token_ids.extend(t for t in stops if t not in out.stop_token_ids)
        else:
            out.new_requests.append(NewRequestData.from_request(req, self.kv.get_block_table(req), n))
            req.on_executor = True
        start = req.num_computed_tokens
        if start < req.num_lost_tokens:
            self.num_recomputed_tokens[req.lost_cause] += min(start + n, req.num_lost_tokens) - start
        samples = start + n - lookahead == req.num_tokens_with_placeholders and not req.embed
        out.entries[req.handle] = ScheduledRequest(req, n, start, samples, req.epoch, lookahead)
        self.policy.charge(req, start, n - lookahead, samples)
        req.num_computed_tokens += n
        if samples:
            req.num_output_placeholders += 1 + lookahead
            req.num_lookahead_in_flight += lookahead

    def _preempt(self, req: Request) -> None:
        """Takes the request off the executor and puts it back in the queue,
        swapped out (this plan copies its computed KV to the host tier, and
        the plan that resumes it copies it back) or, when the mode, the host
        tier's room or the cost say no, with its blocks freed, to recompute
        prompt + output so far."""
        self.running.remove(req)
        swapped = self._should_swap(req) and self.kv.swap_out(req, req.num_computed_tokens)
        self.kv.free(req)
        self._forget_on_executor(req)
        if swapped:
            # Its steps in flight stand: their tokens count when their results
            # arrive, and it resumes only after that (its copy is confirmed
            # by a later result). It holds no device block meanwhile.
            req.num_computed_tokens = 0
        else:
            self._drop_executor_progress(req, "recompute")
        req.preempted_by = "swap" if swapped else "recompute"
        self.num_preemptions_by_mode[req.preempted_by] += 1
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(req)

    def _should_swap(self, req: Request) -> bool:
        mode = self.config.preemption_mode
        # An embedding's pooling so far lives in the executor's row, which a
        # preemption drops: it recomputes.
        # Nor a request whose speculative step is in flight: until its
        # result, which of its computed positions hold verified tokens is
        # unknown.
        if (mode == "recompute" or req.embed or req.num_lookahead_in_flight or self.kv.host is None
                or req.num_computed_tokens == 0):
            return False
        if mode == "swap":
            return True
        return self.swap_cost.swap_is_cheaper(blocks_needed(req.num_computed_tokens, self.config.block_size),
                                              req.num_computed_tokens)

    @staticmethod
    def _drop_executor_progress(req: Request, cause: str) -> None:
        """The executor no longer holds the request: what is in flight for
        it is stale, and it recomputes from its known tokens."""
        req.num_lost_tokens = max(req.num_lost_tokens, min(req.num_computed_tokens, req.num_tokens))
        req.lost_cause = cause
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.num_lookahead_in_flight = 0
        req.epoch += 1

    def _lose_swapped(self, record: SwappedOut) -> None:
        """A swapped-out request's copy is gone (a swap that failed, the
        executor's loss): it recomputes. Its steps in flight, if any, are
        void too (the executor dropped them)."""
        req = record.request
        req.num_lost_tokens = max(req.num_lost_tokens, record.num_tokens)
        req.lost_cause = "swap"
        if req.num_output_placeholders:
            req.num_output_placeholders = 0
            req.epoch += 1

    def _forget_on_executor(self, req: Request) -> bool:
        """Queues the executor-side cleanup; True if there was state to drop."""
        if not req.on_executor:
            return False
        self._to_forget.append(req.handle)
        req.on_executor = False
        return True

    def update_from_output(self, out: StepPlan, sampled: list[tuple[int, int, tuple | None]],
                           failed_swap_outs: list[int] = (), failed_swap_ins: list[int] = (),
                           verified_drafts: list[tuple[int, int, int]] | None = None) -> list[SampledToken]:
        """Applies a step's result, in step order: confirms its swaps,
        turns placeholders into the sampled tokens, makes newly computed
        full blocks findable, and finishes requests that hit a token-level
        stop (EOS, stop token, max_tokens, max_model_len). Tokens of stale
        entries are dropped. verified_drafts: (handle, drafts verified,
        drafts accepted) per verifying forward (without it, a speculating
        step verified the plan's count), for the acceptance figures."""
        self.confirm_swaps(out, failed_swap_outs, failed_swap_ins)
        if self.lora is not None:
            self.lora.complete(out.step_id)
        for e in out.entries.values():
            if not e.is_stale:
                e.request.num_failed_steps = 0
                # Every input of this step is known by now (the step before
                # it has been applied), so its blocks can be named.
                self.kv.cache_computed_blocks(e.request, e.start + e.num_tokens)
        verifying: dict[int, list[tuple[int, int]]] = {}
        for handle, verified, accepted in verified_drafts or ():
            verifying.setdefault(handle, []).append((verified, accepted))
        results: list[SampledToken] = []
        for handle, tokens in _by_handle(sampled):
            e = out.entries.get(handle)
            if e is None or not e.samples or len(tokens) > 1 + e.num_lookahead:
                raise RuntimeError(f"executor sampled {len(tokens)} tokens for handle {handle}, which step "
                                   f"{out.step_id} {'samples once' if e is not None and e.samples else 'did not sample'}"
                                   + (f" after {e.num_lookahead} lookahead slots" if e is not None and e.num_lookahead else ""))
            if e.is_stale:
                self.num_dropped_tokens += len(tokens)
                continue
            req = e.request
            req.num_output_placeholders -= 1 + e.num_lookahead
            if e.num_lookahead:
                # Lookahead slots past the tokens yielded (rejected drafts,
                # or decode steps a multi-step run did not reach) count as
                # not computed; what a rejected draft wrote there is
                # overwritten by later steps. A step planned for it since
                # (while this one was in flight) assumed every slot filled;
                # the executor ran it from where the yielded tokens end, so
                # it moves back by as much.
                req.num_lookahead_in_flight -= e.num_lookahead
                req.num_computed_tokens -= 1 + e.num_lookahead - len(tokens)
                if out.multi_step:
                    self.num_lookahead_steps += e.num_lookahead
                    self.num_lookahead_steps_run += len(tokens) - 1
                if verified_drafts is not None:
                    verifications = verifying.get(handle, ())
                else:  # one forward verified every slot, or none did
                    verifications = () if out.multi_step else ((e.num_lookahead, len(tokens) - 1),)
                for verified, accepted in verifications:
                    if verified:  # else the proposer found nothing: a plain decode step
                        self.num_draft_tokens += verified
                        self.num_accepted_tokens += accepted
                        self.accepted_lengths[accepted] += 1
                if len(tokens) > 1:
                    self.policy.charge_accepted_drafts(req, len(tokens) - 1)
            for token, logprobs in tokens:
                req.output_token_ids.append(token)
                results.append(SampledToken(req, token, logprobs))
                status = self._check_stop(req, token)
                if status is not None:
                    self.finish_request(req.request_id, status)  # tokens accepted past its stop are cut
                    break
        while self._releasing and self._releasing[0][0] <= out.step_id:
            self._free_handles.extend(self._releasing.pop(0)[1])
        return results

    def confirm_swaps(self, out: StepPlan, failed_swap_outs: list[int] = (), failed_swap_ins: list[int] = ()
                      ) -> None:
        """Applies a step's swap outcomes, before anything else it returned:
        a request whose swap-in failed read garbage KV, so whatever it
        computed in this step (prompt logprobs, an embedding, tokens) is
        stale by then, never served nor cached. Once per plan; a later call
        (update_from_output's own) does nothing."""
        if out.swaps is None or out.swaps_confirmed:
            return
        out.swaps_confirmed = True
        self._complete_swaps(out, set(failed_swap_outs), set(failed_swap_ins))

    def apply_prompt_outputs(self, out: StepPlan, prompt_logprobs: list[PromptLogprobsResult],
                             embeddings: list[tuple[int, list[float]]]) -> list[PromptOutput]:
        """Matches what a step read from prompt positions to its requests
        (stale entries dropped, as their tokens are). An embedding request
        whose vector arrived is finished: its computed blocks become
        findable first, for later prompts with the same prefix. Call after
        confirm_swaps (a failed swap-in voids these outputs) and before
        update_from_output: the prompt's logprobs come before its first
        token."""
        if out.swaps is not None and not out.swaps_confirmed:
            raise RuntimeError(f"step {out.step_id}'s prompt outputs applied before its swap outcomes: "
                               "a failed swap-in's garbage would be served and cached")
        results: list[PromptOutput] = []
        for p in prompt_logprobs:
            e = self._entry_for(out, p.handle, "prompt logprobs")
            if e.is_stale:
                continue
            req = e.request
            k = p.top_k
            results.append(PromptOutput(req, p.first, [
                (req.prompt_token_ids[p.first + i], lp, p.top_token_ids[i * k:(i + 1) * k],
                 p.top_logprobs[i * k:(i + 1) * k]) for i, lp in enumerate(p.logprobs)]))
        for handle, values in embeddings:
            e = self._entry_for(out, handle, "an embedding")
            if e.is_stale:
                continue
            self.kv.cache_computed_blocks(e.request, e.start + e.num_tokens)
            results.append(PromptOutput(e.request, embedding=values))
            self.finish_request(e.request.request_id, RequestStatus.FINISHED_STOPPED)
        return results

    @staticmethod
    def _entry_for(out: StepPlan, handle: int, what: str) -> ScheduledRequest:
        e = out.entries.get(handle)
        if e is None:
            raise RuntimeError(f"executor returned {what} for handle {handle}, which step {out.step_id} did not run")
        return e

    def _complete_swaps(self, out: StepPlan, failed_outs: set[int], failed_ins: set[int]) -> None:
        lost, failed = self.kv.complete_swaps(out.swaps, failed_outs, failed_ins)
        for record in lost:
            self._lose_swapped(record)
        for req in failed:
            # Its blocks from the host tier hold garbage, and so does what
            # this step and any later one computed for it: it recomputes,
            # like a failed step's requests, and nobody else is touched.
            e = out.entries.get(req.handle)
            if e is None or e.request is not req or e.is_stale:
                continue  # finished, or preempted by recompute, since
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
                self.kv.free(req)
                self._forget_on_executor(req)
                self.waiting.push(req)
            else:
                # Swapped out by a later plan: that copy is garbage too.
                record = self.kv.host.drop(req, keep_cached=False)
                req.num_lost_tokens = max(req.num_lost_tokens, record.num_tokens if record else 0)
            self._drop_executor_progress(req, "swap")
            req.status = RequestStatus.WAITING

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        s = req.sampling
        # A constrained request samples EOS only where its grammar may end
        # (with ignore_eos, only where nothing else is left): it ends there.
        stops_at_eos = not s.ignore_eos or req.constraint is not None
        if (stops_at_eos and token in req.eos_token_ids) or token in s.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= s.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a live request and frees its blocks at once. Idempotent:
        returns None for an unknown or already finished request."""
        assert status.is_finished
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        self.kv.forget(req)
        if self._forget_on_executor(req):
            self._to_release.append(req.handle)
        else:
            # Preempted or never run, but a plan already built may name it.
            self._releasing.append((self._step_id - 1, [req.handle]))
        return req

    def stop_by_string(self, req: Request, num_cut: int) -> None:
        """The output processor found a stop string: the request ends with
        the token that completed it. The num_cut tokens a speculative step
        yielded after that one leave its output (and its usage), as
        decoding one token per step would never have made them; it may
        have finished already in that step (EOS, max_tokens after the stop
        string), which stands."""
        if num_cut:
            del req.output_token_ids[len(req.output_token_ids) - num_cut:]
        self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)

    def reset_executor_state(self, host_lost: bool = True) -> None:
        """The executor lost every request (restart or failed step): free all
        blocks and requeue the running requests, in order, for recompute.
        Swapped-out requests keep their confirmed copies unless the host
        tier is lost too (host_lost: the executor process is gone)."""
        for req in self.running:
            self.kv.free(req)
            req.on_executor = False
            self._drop_executor_progress(req, "reset")
            req.status = RequestStatus.WAITING
            self.waiting.push(req)
        self.running.clear()
        self.executor_epoch += 1
        if self.lora is not None:
            self.lora.reset()
        # The device's KV content is gone, so nothing cached there can be
        # trusted; nor can any copy of a plan in flight.
        for record in self.kv.reset_executor(host_lost):
            self._lose_swapped(record)
        # The executor forgot everything and results of plans in flight are
        # ignored: pending forgets are moot and every handle is reusable.
        self._to_forget.clear()
        self._free_handles.extend(self._to_release)
        self._to_release.clear()
        for _, handles in self._releasing:
            self._free_handles.extend(handles)
        self._releasing.clear()

    def replace_host_tier(self, num_host_blocks: int) -> None:
        """The executor came back (after reset_executor_state(host_lost=True))
        with a host tier of another size: live requests stay, and the tier
        starts empty at its new size."""
        self.kv.replace_host_tier(num_host_blocks)
        self.config = replace(self.config, num_host_blocks=num_host_blocks)

    # ----- introspection ---------------------------------------------------

    def load(self) -> Load:
        tables = self.kv.block_tables
        return Load(len(self.running), len(self.waiting), self.num_free_blocks,
                    tokens_held=sum(min(r.num_computed_tokens, r.num_tokens) for r in self.running),
                    slots_allocated=self.config.block_size * sum(len(tables[r.request_id]) for r in self.running))

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self.kv.host.num_free_blocks if self.kv.host is not None else 0


def _by_handle(sampled: list[tuple[int, int, tuple | None]]) -> list[tuple[int, list[tuple[int, tuple | None]]]]:
    """A result's (handle, token, logprobs) as (handle, its tokens in order):
    a request that speculated has several, one after the other."""
    out: list[tuple[int, list[tuple[int, tuple | None]]]] = []
    for handle, token, logprobs in sampled:
        if out and out[-1][0] == handle:
            out[-1][1].append((token, logprobs))
        else:
            out.append((handle, [(token, logprobs)]))
    return out
