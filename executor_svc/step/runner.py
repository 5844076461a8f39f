"""Runs one step plan: applies its diffs to the request rows, builds the
flattened batch with vectorized ops over the scheduled rows, runs the model
and samples every row at once.

No step does work proportional to a request's context or to the blocks it
holds: the executor's mirror of each request (request_rows.py) is updated
from the plan's diffs, and the step's inputs are gathered from it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Container

import numpy as np
import torch

from executor_svc.attention import AttentionBackend, AttentionMetadata
from executor_svc.step.batch import decode_inputs, step_inputs
from executor_svc.step.compiled_decode import STEPS as COMPILED_STEPS
from executor_svc.step.compiled_decode import CompiledDecode
from executor_svc.step.constraints import ConstraintMatchers, MaskJob
from executor_svc.step.cuda_graphs import DecodeGraphs, VerifyGraphs
from executor_svc.step.host_kv import HostKVPool, SwapResult
from executor_svc.step.host_memory import retain_freed_memory, to_device
from executor_svc.step.kv_cache import KVCachePool
from executor_svc.step.logits_processors import LogitsProcessors
from executor_svc.model.model import CausalLM
from executor_svc.model.lora import LoraSet
from executor_svc.model.pooling import Pooling
from executor_svc.step.request_rows import PlanError, RequestRows
from executor_svc.step.sampler import SampleOutput, SamplingBatch, SamplingSettings, argmax, sample

log = logging.getLogger(__name__)

# Prompt positions whose logprobs one lm_head call computes: the logits of a
# whole chunk at once would take chunk x vocabulary floats.
PROMPT_LOGPROBS_ROWS = 256


@dataclass(slots=True)
class NewRequestData:
    handle: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: SamplingSettings
    num_output_tokens: int
    # The llguidance grammar of a constrained request, and whether EOS
    # waits until it is the only token left (NewRequest.constraint).
    grammar: str | None = None
    ignore_eos: bool = False
    # An embedding request (NewRequest.embed): prefill only, pooled.
    embed: bool = False
    # The LoRA adapter's name (NewRequest.adapter); "" = the base model.
    adapter: str = ""


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_handles: list[int] = field(default_factory=list)
    cached_num_scheduled_tokens: list[int] = field(default_factory=list)
    new_block_handles: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)
    finished_handles: list[int] = field(default_factory=list)
    # Copies between the device pool and the host tier, as parallel lists.
    swap_out_device_blocks: list[int] = field(default_factory=list)
    swap_out_host_blocks: list[int] = field(default_factory=list)
    swap_in_host_blocks: list[int] = field(default_factory=list)
    swap_in_device_blocks: list[int] = field(default_factory=list)
    # Requests granted lookahead slots, and how many (StepPlan.draft_*):
    # drafts to verify, or, in a multi-step plan, further decode steps.
    draft_handles: list[int] = field(default_factory=list)
    draft_counts: list[int] = field(default_factory=list)
    # LoRA slots to empty, then (slot, adapter) pairs to load, before the
    # forward (StepPlan.lora_*).
    lora_evict_slots: list[int] = field(default_factory=list)
    lora_load_slots: list[int] = field(default_factory=list)
    lora_load_adapters: list[str] = field(default_factory=list)
    # StepPlan.multi_step, stop_token_ids and multi_step_drafts
    # (ModelRunner._execute_multi_step).
    multi_step: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    multi_step_drafts: int = 0
    # What the step stream needs beside the step itself (step_loop.py): the
    # scheduler's epoch, whether an idle wait came before (telemetry), the
    # trace to join, and the message as received, for the other
    # tensor-parallel ranks (empty on one device).
    epoch: int = 0
    after_idle: bool = False
    traceparent: str = ""
    wire: bytes = b""

    @property
    def has_swaps(self) -> bool:
        return bool(self.swap_out_host_blocks or self.swap_in_host_blocks)


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of one request's prompt tokens [first, first + len(logprobs)),
    with top_k alternatives each, flattened."""

    handle: int
    first: int
    logprobs: list[float]
    top_k: int = 0
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


# A logprobs entry for a token whose request asked for none, in a result
# whose other tokens carry them (StepResult.logprobs is parallel to tokens).
NO_LOGPROBS = (0.0, [], [])
# A speculating row's outcome: its row, the tokens it yields, and their
# logprobs (None when it asked for none).
Verified = tuple[int, list[int], list | None]


class FromRank0:
    """The proposer of a tensor-parallel rank other than 0: rank 0 proposes
    and shares its drafts (ModelRunner._propose)."""

    def propose(self, r, rows, counts):
        raise RuntimeError("only rank 0 proposes drafts")


@dataclass(slots=True)
class StepResult:
    step_id: int
    sampled_handles: list[int]
    sampled_token_ids: list[int]
    logprobs: list[tuple[float, list[int], list[float]]] | None
    prepare_ns: int
    forward_ns: int
    sample_ns: int
    # (handle, why) for requests whose constraint failed this step.
    request_errors: list[tuple[int, str]] = field(default_factory=list)
    # The step's copies between the tiers (None without any).
    swaps: SwapResult | None = None
    # Why the whole step failed; the executor then forgot every request.
    error: str | None = None
    # A plan of an epoch that already failed, not run (step_loop.py).
    was_discarded: bool = False
    # What the step read from prompt positions: prompt logprobs, and the
    # pooled vectors of embedding requests it completed, as (handle, values).
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    embeddings: list[tuple[int, list[float]]] = field(default_factory=list)
    # (handle, drafts verified, drafts accepted) of each request the plan
    # let speculate, per verifying forward (a multi-step plan's repeat).
    verified_drafts: list[tuple[int, int, int]] = field(default_factory=list)
    # Time the plan's LoRA evictions and loads took, and how many of its
    # loads read the adapter from disk (not in the host cache).
    lora_load_ns: int = 0
    lora_disk_reads: int = 0
    # Forwards the plan ran: more than one in a multi-step run.
    num_forwards: int = 1

    @classmethod
    def failed(cls, step_id: int, error: str) -> "StepResult":
        return cls(step_id, [], [], None, 0, 0, 0, error=error)

    @classmethod
    def discarded(cls, step_id: int) -> "StepResult":
        return cls(step_id, [], [], None, 0, 0, 0, was_discarded=True)


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVCachePool, backend: AttentionBackend, device: torch.device,
                 fail_on_token: int = -1, max_model_len: int | None = None, cuda_graphs: bool = False,
                 torch_compile: bool = False, tp=None, constraints: ConstraintMatchers | None = None,
                 host_kv: HostKVPool | None = None, pooling: Pooling | None = None, proposer=None,
                 batch_invariant: bool = False, lora: LoraSet | None = None, speculative_tokens: int = 0):
        self.model, self.pool, self.backend, self.device = model, pool, backend, device
        # The LoRA adapters attached to the model (model/lora.py), or None.
        self.lora = lora
        # EXECUTOR_BATCH_INVARIANT (model/batch_invariant.py): the model's
        # GEMMs and the backend are already made invariant by the caller;
        # here, one eager path for every step, and unseeded draws keyed by
        # the request rather than by the global generator's order.
        self.batch_invariant = batch_invariant
        if batch_invariant and (cuda_graphs or torch_compile):
            raise ValueError("batch-invariant mode runs every step eagerly: CUDA graphs and the compiled decode "
                             "step are batch-size-dependent paths")
        # How embedding requests pool (pooling.py); None: the checkpoint has
        # no pooling config, and the scheduler sends none.
        self.pooling = pooling
        # Speculative decoding's proposer (NgramProposer, DraftModel; under
        # tensor parallelism, FromRank0 on the other ranks), or None when
        # the executor does not speculate (a plan with drafts then fails).
        self.proposer = proposer
        # A proposer that reads every step's hidden states (mtp.py).
        self.observes = getattr(proposer, "observes", False)
        # The host KV tier (host_kv.py); None when EXECUTOR_HOST_KV_CACHE_MEMORY_MB is 0.
        self.host_kv = host_kv
        # Constraint matchers of constrained requests (constraints.py); None
        # on ranks other than 0, which do not sample.
        self.constraints = constraints
        # tensor_parallel.TPGroup or None. Every rank runs execute() on the
        # same plans; rank 0 alone samples and shares the ids.
        self.tp = tp
        self.fail_on_token = fail_on_token  # fault injection for tests; -1 = off
        self.kv_caches = pool.layer_caches()
        self.vocab_size = model.cfg.vocab_size
        # Positions past the model's RoPE tables cannot be computed.
        self.max_model_len = max_model_len or model.max_len
        self.rows = RequestRows(self.max_model_len, pool.block_size, device, vocab_size=self.vocab_size)
        # Decode steps replay captured graphs (cuda_graphs.py); the caller
        # decides whether the device and backend allow it. A proposer that
        # reads each step's hidden states (MTP, EAGLE-3) gets its features
        # of them from the graphs too.
        self.features = proposer.features if self.observes else None
        self.graphs = (DecodeGraphs(model, self.kv_caches, backend, device, self.rows.max_blocks,
                                    features=self.features) if cuda_graphs else None)
        # And so do verify steps of drafts, up to speculative_tokens a row.
        self.verify_graphs = None
        if self.graphs is not None and proposer is not None and speculative_tokens:
            self.verify_graphs = self._capture_verify(speculative_tokens + 1)
            # A draft model's own steps (draft_model.py).
            if hasattr(proposer, "use_graphs"):
                proposer.use_graphs(self.rows.max_blocks, speculative_tokens + 1, self.graphs.pool)
        # Small decode steps on CPU run one compiled graph (compiled_decode.py).
        # So do verify steps of an executor that speculates, unless its
        # proposer reads each step's hidden states (MTP), which the graph
        # does not return.
        self.compiled = (CompiledDecode(model, pool, verifies=proposer is not None and not self.observes)
                         if torch_compile else None)
        if device.type == "cpu":
            retain_freed_memory()
        # Multi-step decode: what plans received since bring (step_loop.
        # RunInterrupts.pending): whether a new request waits, which ends
        # every run early so the scheduler admits it sooner, and the handles
        # they finish, whose runs end. Set by the step loop; heeded on one
        # device only (a tensor-parallel group's ranks run the same steps).
        self.run_interrupts: Callable[[], tuple[bool, Container[int]]] | None = None

    def reset(self) -> None:
        """Forgets every request, e.g. when a new scheduler connects (whose
        LoRA slots start empty)."""
        self.rows.reset()
        if self.lora is not None:
            self.lora.evict_all()
        if self.constraints is not None:
            self.constraints.reset()

    def _apply_diffs(self, step: StepPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Updates the rows; returns the scheduled rows, their token counts
        and their draft counts."""
        rows, constraints = self.rows, self.constraints
        for h in step.finished_handles:
            rows.finish(h)
            if constraints is not None:
                constraints.remove(h)
        scheduled: list[int] = []
        counts: list[int] = []
        written: list[np.ndarray] = []
        for new in step.new_requests:
            if new.embed and self.pooling is None:
                raise PlanError(f"handle {new.handle}: an embedding request, but the checkpoint has no pooling config")
            row, flat = rows.add(new.handle, new.token_ids, new.block_ids, new.num_computed_tokens, new.sampling,
                                 new.num_output_tokens, new.embed, self._adapter_id(new))
            if self.batch_invariant and new.sampling.seed is None:
                # Its own stream, keyed by this seed and the output position
                # (sampler.seeded_uniform): no other row's draws move it. (The
                # scheduler seeds unseeded requests in this mode, once for
                # their life; this covers a plan that comes without one.)
                rows.seed[row], rows.seeded[row] = np.random.default_rng().integers(-(1 << 63), 1 << 63), True
            if constraints is not None:
                if new.grammar is None:
                    constraints.remove(new.handle)
                else:
                    outputs = new.token_ids[len(new.token_ids) - new.num_output_tokens:] if new.num_output_tokens else []
                    constraints.add(new.handle, new.grammar, new.ignore_eos, outputs)
            if self.observes:
                self.proposer.forget(row)
            scheduled.append(row)
            counts.append(new.num_scheduled_tokens)
            written.append(flat)
        if step.new_block_handles:
            written.append(np.array([rows.append_block(h, b) for h, b in zip(step.new_block_handles, step.new_block_ids)],
                                    dtype=np.int64))
        if written:
            rows.sync_block_table(np.concatenate(written))
        num_new = len(scheduled)
        scheduled.extend(rows.row_of(h) for h in step.cached_handles)
        counts.extend(step.cached_num_scheduled_tokens)
        drafts = np.zeros(len(scheduled), dtype=np.int64)
        if step.draft_handles:
            if self.proposer is None:
                raise PlanError("plan has drafts, but this executor does not speculate")
            at = {h: num_new + i for i, h in enumerate(step.cached_handles)}
            for h, k in zip(step.draft_handles, step.draft_counts):
                if h not in at:
                    raise PlanError(f"handle {h}: drafts for a request the plan does not schedule as running")
                drafts[at[h]] = k
        return np.array(scheduled, dtype=np.int64), np.array(counts, dtype=np.int64), drafts

    def _check_adapters_loaded(self, rows: np.ndarray) -> None:
        """Every scheduled row's adapter is in a slot once the plan's loads
        ran: a row is never served with another adapter's weights."""
        ids = self.rows.adapter[rows]  # [n]
        missing = (ids >= 0) & (self.lora.slot_by_id[np.maximum(ids, 0)] < 0)
        if missing.any():
            row = int(rows[np.flatnonzero(missing)[0]])
            raise PlanError(f"handle {self.rows.handle[row]}: adapter {self.lora.names[ids[missing][0]]!r} is in no "
                            "LoRA slot (the plan runs a request whose adapter no plan loaded)")

    def _adapter_id(self, new: NewRequestData) -> int:
        """The id of the request's adapter (model/lora.py); -1: the base model."""
        if not new.adapter:
            return -1
        adapter_id = None if self.lora is None else self.lora.id_of(new.adapter)
        if adapter_id is None:
            raise PlanError(f"handle {new.handle}: adapter {new.adapter!r} is not served here")
        return adapter_id

    def _propose(self, rows: np.ndarray, drafts: np.ndarray, allowed: np.ndarray) -> None:
        """Each rows[i] (i in allowed) may verify up to drafts[i] drafts; sets
        drafts[i] to how many the proposer found, cut to what a constrained
        row's grammar takes (a draft it refuses could never be drawn there),
        and writes them where the row's next tokens go. Under tensor
        parallelism rank 0 proposes and shares: every rank must verify the
        same drafts, and only rank 0 holds the grammars (and a draft model;
        an MTP layer is sharded, so every rank runs it, and rank 0 draws)."""
        r, at, limits = self.rows, rows[allowed], drafts[allowed]
        if self.tp is not None:
            # Shared as each row's count, then its limit's worth of slots.
            size = len(at) + int(limits.sum())
            offsets = (len(at) + np.cumsum(limits) - limits).tolist()  # where each row's slots start
        if self.tp is not None and self.tp.rank != 0:
            if self.observes:
                self.proposer.propose(r, at, limits)  # its layer is sharded: every rank runs it
            flat = np.array(self.tp.share_tokens(None, size), dtype=np.int64)
            found = [flat[o:o + k] for o, k in zip(offsets, flat[:len(at)].tolist())]
        else:
            try:
                found = self.proposer.propose(r, at, limits)
                if self.constraints is not None:
                    found = [f[:self.constraints.num_valid_drafts(int(r.handle[row]), f)] for row, f in zip(at, found)]
            except Exception:
                if self.tp is not None:
                    self.tp.share_tokens(None, size)  # the other ranks fail this step too
                raise
            if self.tp is not None:
                flat = np.zeros(size, dtype=np.int64)
                flat[:len(at)] = [len(f) for f in found]
                for o, f in zip(offsets, found):
                    flat[o:o + len(f)] = f
                self.tp.share_tokens(flat.tolist(), size)
        for i, row, f in zip(allowed.tolist(), at.tolist(), found):
            if len(f):
                n = int(r.num_tokens[row])
                r.token_ids[row, n:n + len(f)] = f
            drafts[i] = len(f)

    def _check(self, rows: np.ndarray, q: np.ndarray, start: np.ndarray, end: np.ndarray,
               drafts: np.ndarray) -> np.ndarray:
        """Refuses counts the rows cannot take; returns the rows' known token counts."""
        r = self.rows
        n_known = r.num_tokens[rows]
        # One combined test of the counts, which a valid plan passes; only
        # if it fails do the separate tests say what is wrong (run each
        # time, they took a twentieth of a tiny model's decode step).
        if ((q <= 0) | (end > n_known + drafts) | (end > r.num_blocks[rows] * r.block_size)
                | (end > r.max_model_len)).any():
            bad = (q <= 0) | (end > n_known + drafts)
            if bad.any():
                i = int(bad.argmax())
                raise PlanError(f"handle {r.handle[rows[i]]}: {q[i]} tokens scheduled after {start[i]} computed, "
                                f"but it has {n_known[i]}")
            bad = -(-end // r.block_size) > r.num_blocks[rows]
            if bad.any():
                i = int(bad.argmax())
                raise PlanError(f"handle {r.handle[rows[i]]}: block table of {r.num_blocks[rows[i]]} blocks "
                                f"cannot hold {end[i]} tokens")
            i = int(end.argmax())
            raise PlanError(f"handle {r.handle[rows[i]]}: position {end[i] - 1} is past max_model_len {r.max_model_len}")
        if len(rows) > 1 and (rows[1:] == rows[:-1]).any():  # rows are sorted
            raise PlanError("plan schedules a request twice in one step")
        if drafts.any():
            bad = (drafts > 0) & ((start != n_known - 1) | (end != n_known + drafts))
            if bad.any():
                i = int(bad.argmax())
                raise PlanError(f"handle {r.handle[rows[i]]}: {drafts[i]} drafts, but the step is not its next "
                                "token and the drafts after it")
        return n_known

    def _swap(self, step: StepPlan) -> SwapResult | None:
        """The plan's copies between the tiers, before anything reads or
        writes the blocks they touch (on CUDA, issued on a side stream that
        the forward waits for)."""
        if not step.has_swaps:
            return None
        if self.host_kv is None:
            raise PlanError("plan swaps blocks, but this executor has no host KV tier")
        return self.host_kv.swap(self.pool.storage, step.swap_out_device_blocks, step.swap_out_host_blocks,
                                 step.swap_in_host_blocks, step.swap_in_device_blocks)

    def _apply_lora_ops(self, step: StepPlan) -> tuple[int, int]:
        """The plan's LoRA evictions, then loads (model/lora.py); returns
        their time and how many loads read from disk."""
        if not step.lora_evict_slots and not step.lora_load_slots:
            return 0, 0
        if self.lora is None:
            raise PlanError("plan loads LoRA adapters, but this executor serves none")
        t0 = time.perf_counter_ns()
        try:
            for slot in step.lora_evict_slots:
                self.lora.evict(slot)
            disk = sum(self.lora.load(slot, name) for slot, name in zip(step.lora_load_slots, step.lora_load_adapters,
                                                                        strict=True))
        except ValueError as exc:
            raise PlanError(str(exc)) from exc
        return time.perf_counter_ns() - t0, disk

    @torch.inference_mode()
    def execute(self, step: StepPlan) -> StepResult:
        if step.multi_step and step.draft_handles:
            return self._execute_multi_step(step)
        return self._execute_step(step)

    def _execute_multi_step(self, step: StepPlan) -> StepResult:
        """A multi-step plan: its lookahead rows (draft_handles, each
        scheduled its next token and k slots after it) run steps one after
        another until each has yielded 1 + k tokens. The first step is the
        plan with the slots taken off (its diffs, new requests and every
        other row run there); each later one is a step of the rows with
        slots left, the tokens yielded before as their input. Without
        multi_step_drafts each step is a decode step (one token); with it,
        each verifies up to that many of the proposer's drafts, never past
        the row's slots, and yields 1 + the drafts it accepts. Each step is
        the single-step path itself, so sampling (greedy, per-position
        seeded draws, penalties, logprobs, verification) is what one step
        per plan gives. A row stops after a stop token or once a plan
        received meanwhile finishes it, and every row stops once one brings
        a new request or, run on the event loop, at the run's deadline
        (run_interrupts). Tokens come back grouped by
        request, in step order; slots not run count as not computed, as
        rejected drafts' do."""
        lookahead = dict(zip(step.draft_handles, step.draft_counts))
        scheduled = dict(zip(step.cached_handles, step.cached_num_scheduled_tokens))
        for h, k in lookahead.items():
            if k <= 0 or scheduled.get(h) != 1 + k:
                raise PlanError(f"handle {h}: {k} lookahead slots, but the plan schedules it {scheduled.get(h)} "
                                f"tokens as running, not {1 + k}")
        most = step.multi_step_drafts
        if most and self.proposer is None:
            raise PlanError("plan verifies drafts in its steps, but this executor does not speculate")
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, list] = {}
        with_logprobs = False

        def step_drafts(left: dict[int, int]) -> dict[int, int]:
            """Drafts each row may verify with left[h] slots still to fill."""
            return {h: d for h, k in left.items() if (d := min(most, k - 1)) > 0}

        def collect(res: StepResult) -> dict[int, list[int]]:
            """Adds a step's tokens to the run's; returns the step's own."""
            nonlocal with_logprobs
            with_logprobs |= res.logprobs is not None
            new: dict[int, list[int]] = {}
            for i, (h, t) in enumerate(zip(res.sampled_handles, res.sampled_token_ids)):
                new.setdefault(h, []).append(t)
                tokens.setdefault(h, []).append(t)
                logprobs.setdefault(h, []).append(res.logprobs[i] if res.logprobs is not None else NO_LOGPROBS)
            return new

        stops = set(step.stop_token_ids)

        def still_running(left: dict[int, int], new: dict[int, list[int]], failed: set[int]) -> dict[int, int]:
            """The rows that run another step: slots to fill, none failed,
            and no stop token among this step's tokens."""
            return {h: lookahead[h] + 1 - len(tokens[h]) for h in left
                    if h not in failed and len(tokens[h]) <= lookahead[h] and stops.isdisjoint(new.get(h, ()))}

        drafts = step_drafts({h: k + 1 for h, k in lookahead.items()})
        first = replace(step, cached_num_scheduled_tokens=[n - lookahead.get(h, 0) + drafts.get(h, 0) for h, n in zip(
                            step.cached_handles, step.cached_num_scheduled_tokens)],
                        draft_handles=list(drafts), draft_counts=list(drafts.values()), multi_step=False,
                        multi_step_drafts=0)
        result = self._execute_step(first)
        new = collect(result)
        failed = {h for h, _ in result.request_errors}
        for h in lookahead:
            if h not in tokens and h not in failed:
                raise PlanError(f"handle {h}: lookahead slots, but its step does not sample (not a decode)")
        left = still_running(lookahead, new, failed)
        rows_of = {h: self.rows.row_of(h) for h in left}
        while left:
            if self.tp is None and self.run_interrupts is not None:
                arrival, finished = self.run_interrupts()
                if arrival:
                    break
                left = {h: k for h, k in left.items() if h not in finished}
                if not left:
                    break
            drafts = step_drafts(left)
            # A step of rows the first one already placed: no diffs to apply,
            # nothing to swap or load (the plan's own step did that).
            t0 = time.perf_counter_ns()
            order = sorted(left, key=rows_of.__getitem__)
            sub = self._step_rows(step.step_id, np.array([rows_of[h] for h in order], dtype=np.int64),
                                  np.array([1 + drafts.get(h, 0) for h in order], dtype=np.int64),
                                  np.array([drafts.get(h, 0) for h in order], dtype=np.int64), t0)
            new = collect(sub)
            result.prepare_ns += sub.prepare_ns
            result.forward_ns += sub.forward_ns
            result.sample_ns += sub.sample_ns
            result.request_errors += sub.request_errors
            result.verified_drafts += sub.verified_drafts
            result.num_forwards += 1
            left = still_running(left, new, {h for h, _ in sub.request_errors})
        result.sampled_handles = [h for h in tokens for _ in tokens[h]]
        result.sampled_token_ids = [t for h in tokens for t in tokens[h]]
        result.logprobs = [lp for h in tokens for lp in logprobs[h]] if with_logprobs else None
        return result

    def _execute_step(self, step: StepPlan) -> StepResult:
        swaps = self._swap(step)  # timed on its own (SwapResult.swap_ns)
        lora_ns, lora_disk = self._apply_lora_ops(step)
        t0 = time.perf_counter_ns()
        rows, q, drafts = self._apply_diffs(step)  # [n] each
        if self.lora is not None:
            self._check_adapters_loaded(rows)
        if not len(rows):
            if swaps is not None:
                self.host_kv.finish(swaps)
            return StepResult(step.step_id, [], [], None, time.perf_counter_ns() - t0, 0, 0, swaps=swaps,
                              lora_load_ns=lora_ns, lora_disk_reads=lora_disk)
        # The batch runs in row order: when its rows are contiguous, as in a
        # steady decode, the block table is a view of the persistent one.
        if len(rows) > 1:
            order = np.argsort(rows, kind="stable")
            rows, q, drafts = rows[order], q[order], drafts[order]
        return self._step_rows(step.step_id, rows, q, drafts, t0, swaps, lora_ns, lora_disk)

    def _step_rows(self, step_id: int, rows: np.ndarray, q: np.ndarray, drafts: np.ndarray, t0: int,
                   swaps: SwapResult | None = None, lora_ns: int = 0, lora_disk: int = 0) -> StepResult:
        """One forward of rows (ascending, at least one) computing q[i]
        tokens each from where they stand, rows[i] allowed drafts[i] drafts:
        the step once the plan's diffs, swaps and adapter loads are applied.
        t0: when the step's preparation began."""
        r, dev = self.rows, self.device
        start = r.num_computed[rows]
        end = start + q
        n_known = self._check(rows, q, start, end, drafts)
        allowed = np.flatnonzero(drafts)
        if len(allowed):
            # The plan allows drafts[i]; the row verifies what the proposer
            # finds (none: it just decodes). Its positions past them count
            # as not computed, as rejected drafts' do.
            self._propose(rows, drafts, allowed)
            q[allowed] = 1 + drafts[allowed]
            end = start + q
        if self._decodes_compiled(rows, q, end, n_known, drafts):
            # With drafts allowed but none found, too (the general path cost
            # 0.40 ms against 0.28 a one-row stories260K step).
            result = self._compiled_decode_step(step_id, rows, start, t0, swaps, lora_ns, lora_disk)
            if len(allowed):
                result.verified_drafts = [(int(h), 0, 0) for h in r.handle[rows[allowed]]]
                r.num_draft_computed[rows] = np.minimum(r.num_draft_computed[rows], r.num_computed[rows])
            return result
        speculates = drafts > 0

        batch = step_inputs(r, rows, start, q, dev)
        cu, num_tokens, meta, max_blocks = batch.cu, batch.num_tokens, batch.meta, batch.max_blocks
        if self.fail_on_token >= 0 and (batch.input_ids == self.fail_on_token).any():
            raise RuntimeError(f"injected fault: batch holds token {self.fail_on_token}")
        embeds = r.embed[rows]
        # Rows whose outputs read prompt positions: prompt logprobs, pooling.
        reads_prompt = embeds | (r.prompt_logprobs[rows] >= 0)
        # Prompt fully computed: this row samples (a speculating row, whose
        # end is past its known tokens, is verified instead).
        samples = (end == r.num_tokens[rows]) & ~embeds
        sample_rows = rows[samples]
        sample_tokens = cu[1:][samples] - 1  # index of each sampling row's last token
        # Constrained rows' masks are computed on a worker thread while the
        # forward runs (constraints.py).
        masks = verify_masks = None
        if self.constraints is not None and len(sample_rows):
            masks = self.constraints.begin(r.handle[sample_rows].tolist())
        if self.constraints is not None and speculates.any():
            # And a mask for every position a constrained row verifies.
            verifying = rows[speculates]
            n_known = r.num_tokens[verifying]
            verify_masks = self.constraints.begin(
                r.handle[verifying].tolist(),
                [r.token_ids[row, n:n + k].tolist() for row, n, k in zip(verifying, n_known, drafts[speculates])])
        ids_t, positions_t = batch.ids, batch.positions
        with_adapters = False
        if self.lora is not None:
            adapter_ids = r.adapter[rows]  # [n]
            with_adapters = bool((adapter_ids >= 0).any())
            slots = np.where(adapter_ids >= 0, self.lora.slot_by_id[np.maximum(adapter_ids, 0)], -1)  # [n]
            # Each token's adapter slot: a vectorized repeat, never a loop over requests.
            self.lora.batch.set(np.repeat(slots, q) if with_adapters else None, dev)
        t1 = time.perf_counter_ns()

        logits = None  # rank 0's only, under tensor parallelism
        prompt_logprobs: list[PromptLogprobs] = []
        embeddings: list[tuple[int, list[float]]] = []
        verified: list[Verified] = []
        verify_errors: list[tuple[int, str]] = []
        # Captured graphs and compiled steps hold no LoRA deltas: adapter steps run eagerly.
        decode_only = num_tokens == len(sample_rows) == len(rows) and not reads_prompt.any() and not with_adapters
        # A verify step: every row either decodes one token or verifies its
        # drafts (compiled_decode.py runs those too).
        verify_only = (speculates.any() and not reads_prompt.any() and not with_adapters
                       and len(sample_rows) == len(rows) - int(speculates.sum()) and bool((q[~speculates] == 1).all()))
        features = None  # the proposer's, of every token's hidden state (self.observes)
        token_logits = None  # a compiled or replayed verify step's, every token's: [num_tokens, vocab]
        if self.graphs is not None and decode_only and len(rows) <= self.graphs.max_batch:
            logits, features = self.graphs.run(ids_t, positions_t, meta)  # [n, vocab]
        elif self.verify_graphs is not None and verify_only and self.verify_graphs.fits(q):
            token_logits, features = self.verify_graphs.run(ids_t, positions_t, meta, q)  # [num_tokens, vocab]
        elif (self.compiled is not None and decode_only and not self.observes
              and self.compiled.fits(len(rows), max_blocks)):
            logits = self._run_compiled(ids_t, positions_t, meta.slot_mapping, meta.block_tables,
                                        meta.seq_lens)  # [n, vocab], or None: run eagerly
        elif (self.compiled is not None and self.compiled.verifies and verify_only
              and self.compiled.fits(len(rows), max_blocks)):
            token_logits = self._run_compiled_verify(ids_t, positions_t, meta, q)  # or None: run eagerly
        if token_logits is not None:
            verified, verify_errors = self._verify(lambda index: token_logits[index], rows[speculates],
                                                   cu[:-1][speculates], drafts[speculates], verify_masks)
            if len(sample_rows):
                logits = token_logits[to_device(sample_tokens, dev)]
        elif logits is None:
            hidden = self.model(ids_t, positions_t, self.kv_caches, meta, self.backend)  # [num_tokens, hidden]
            if self.observes:
                features = self.features(hidden)
            if reads_prompt.any():
                prompt_logprobs = self._prompt_logprobs(hidden, rows, cu, start, end)
                embeddings = self._pool(hidden, rows[embeds], cu[:-1][embeds], cu[1:][embeds], start[embeds],
                                        end[embeds])
            if speculates.any():
                verified, verify_errors = self._verify(lambda index: self.model.compute_logits(hidden[index]),
                                                       rows[speculates], cu[:-1][speculates], drafts[speculates],
                                                       verify_masks)
            if len(sample_rows):
                last = hidden if len(sample_rows) == num_tokens else hidden[to_device(sample_tokens, dev)]
                logits = self.model.compute_logits(last)  # [num_sampled, vocab]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # so forward_ns is the forward's time, not its launch
        t2 = time.perf_counter_ns()

        r.num_computed[rows] = end
        handles: list[int] = []
        tokens: list[int] = []
        logprobs = None
        errors: list[tuple[int, str]] = []
        if len(sample_rows):
            handles, tokens, logprobs, errors = self._take_samples(logits, sample_rows, masks)
        num_accepted: dict[int, int] = {}  # by row: drafts each verifying row accepted
        for row, accepted, accepted_logprobs in verified:
            n, m = int(r.num_tokens[row]), len(accepted)
            num_accepted[int(row)] = m - 1
            r.token_ids[row, n:n + m] = accepted
            r.num_tokens[row] = n + m
            r.num_output[row] += m
            # KV past the last accepted draft is the rejected drafts': not computed.
            r.num_computed[row] = n - 1 + m
            if r.penalty_slot[row] >= 0:
                r.counts.record(np.full(m, r.penalty_slot[row]), np.asarray(accepted, dtype=np.int64))
            if accepted_logprobs is not None and logprobs is None:
                logprobs = [NO_LOGPROBS] * len(tokens)  # parallel to the tokens; those rows asked for none
            handles += [int(r.handle[row])] * m
            tokens += accepted
            if logprobs is not None:
                logprobs += accepted_logprobs if accepted_logprobs is not None else [NO_LOGPROBS] * m
        if len(allowed):
            # A draft model's KV past a row's last accepted draft holds rejected ones.
            r.num_draft_computed[rows] = np.minimum(r.num_draft_computed[rows], r.num_computed[rows])
        if features is not None:
            self.proposer.observe(r, features, rows, cu, start)
        if swaps is not None:
            self.host_kv.finish(swaps)  # long done: the forward waited for them
        t3 = time.perf_counter_ns()
        return StepResult(step_id, handles, tokens, logprobs, t1 - t0, t2 - t1, t3 - t2,
                          errors + verify_errors, swaps, prompt_logprobs=prompt_logprobs, embeddings=embeddings,
                          verified_drafts=[(int(r.handle[row]), int(d), num_accepted.get(int(row), 0))
                                           for row, d in zip(rows[allowed], drafts[allowed])],
                          lora_load_ns=lora_ns, lora_disk_reads=lora_disk)

    def _take_samples(self, logits: torch.Tensor, rows: np.ndarray, masks: MaskJob | None
                      ) -> tuple[list[int], list[int], list | None, list[tuple[int, str]]]:
        """Draws each of rows' next token from its logits and appends it to
        the row. Returns the rows' handles, their tokens, logprobs (or None)
        and the rows whose constraint failed."""
        r = self.rows
        handles = r.handle[rows].tolist()
        logprobs, errors = None, []
        if self.tp is not None and self.tp.rank != 0:
            tokens = self.tp.share_tokens(None, len(rows))
        else:
            tokens, logprobs, errors = self._sample(logits, rows, handles, masks)
        n_known = r.num_tokens[rows]
        r.token_ids[rows, n_known] = tokens
        r.num_tokens[rows] = n_known + 1
        r.num_output[rows] += 1
        slots = r.penalty_slot[rows]  # [n], -1 = no penalties
        counted = slots >= 0
        if counted.any():
            r.counts.record(slots[counted], np.asarray(tokens, dtype=np.int64)[counted])
        return handles, tokens, logprobs, errors

    def _decodes_compiled(self, rows: np.ndarray, q: np.ndarray, end: np.ndarray, n_known: np.ndarray,
                          drafts: np.ndarray) -> bool:
        """Whether the step is a plain decode of the compiled CPU graph: each
        row computes its last known token and samples the next, none drafts,
        reads prompt positions (prompt logprobs, pooling) or has an adapter,
        and no proposer reads the hidden states. _step_rows' general path
        would take the same graph; this one only builds less on the way."""
        r = self.rows
        if (self.compiled is None or self.observes or self.fail_on_token >= 0
                or not self.compiled.fits(len(rows), -(-int(end.max()) // r.block_size))):
            return False
        plain = (q == 1) & (end == n_known) & (drafts == 0) & ~r.embed[rows] & (r.prompt_logprobs[rows] < 0)
        if self.lora is not None:
            plain &= r.adapter[rows] < 0
        return bool(plain.all())

    def _compiled_decode_step(self, step_id: int, rows: np.ndarray, start: np.ndarray, t0: int,
                              swaps: SwapResult | None, lora_ns: int, lora_disk: int) -> StepResult:
        """_step_rows for a step _decodes_compiled accepts: its inputs come
        straight from the rows' host arrays (batch.decode_inputs), without
        the attention metadata the eager backends need. If the graph fails,
        the step runs on the general path (eagerly, from then on)."""
        r = self.rows
        ids, positions, slot_mapping, block_ids, seq_lens = decode_inputs(r, rows, start)
        # Constrained rows' masks are computed while the forward runs, as on the general path.
        masks = None if self.constraints is None else self.constraints.begin(r.handle[rows].tolist())
        t1 = time.perf_counter_ns()
        logits = self._run_compiled(ids, positions, slot_mapping, block_ids, seq_lens)
        if logits is None:
            if masks is not None:
                masks.future.result()  # the general path starts its own
            return self._step_rows(step_id, rows, np.ones(len(rows), dtype=np.int64), np.zeros(len(rows), np.int64),
                                   t0, swaps, lora_ns, lora_disk)
        t2 = time.perf_counter_ns()
        r.num_computed[rows] = start + 1
        handles, tokens, logprobs, errors = self._take_samples(logits, rows, masks)
        if swaps is not None:
            self.host_kv.finish(swaps)  # long done: the forward waited for them
        return StepResult(step_id, handles, tokens, logprobs, t1 - t0, t2 - t1, time.perf_counter_ns() - t2, errors,
                          swaps, lora_load_ns=lora_ns, lora_disk_reads=lora_disk)

    def _verify(self, logits_at: Callable[[torch.Tensor], torch.Tensor], rows: np.ndarray, first: np.ndarray,
                drafts: np.ndarray, masks: MaskJob | None) -> tuple[list[Verified], list[tuple[int, str]]]:
        """The batch's tokens first[i]:first[i] + 1 + drafts[i] are rows[i]'s
        last known token and its drafts; logits_at(index) gives the logits at
        the batch's tokens `index`. At each of those positions the row's token is
        sampled as plain decoding would sample it there: the argmax for a
        greedy row; for a sampled one the same draw, its uniform keyed by the
        seed and the output position (sampler.py). Where a draft equals that
        token the forward saw what decoding would have produced, so the next
        position's token stands too; the first that differs ends the row,
        and the token sampled there is its last. Each token is thus drawn
        from the model's distribution given the tokens before it, exactly as
        without drafts, and a seeded request yields the same tokens with
        speculation on or off. A constrained row draws each position from
        logits under that position's mask (masks: the grammar's after the
        drafts before it), as plain decoding would after those tokens, and
        its matcher then consumes the tokens it yields. Returns (row, the 1
        to 1 + drafts tokens it yields, their logprobs if it asked), and the
        rows whose constraint failed."""
        r = self.rows
        span = 1 + drafts
        index = np.concatenate([np.arange(a, a + s) for a, s in zip(first.tolist(), span.tolist())])
        at = np.repeat(rows, span)  # each position's row
        offset = index - np.repeat(first, span)  # each position's place after the last known token
        # [positions, vocab]; under tensor parallelism only rank 0 gets them,
        # draws, and shares what it drew: every rank then accepts the same
        # drafts (theirs are the same: each proposed from the same tokens).
        logits = logits_at(to_device(index, self.device))
        errors: list[tuple[int, str]] = []
        if self.tp is not None and self.tp.rank != 0:
            out = SampleOutput(self.tp.share_tokens(None, len(index)), None)
        elif masks is None and r.plain_greedy[rows].all():
            # Greedy rows without logprobs or processors: the argmax at each
            # position, without a SamplingBatch, as in _sample.
            out = SampleOutput(argmax(logits).tolist(), None)
            if self.tp is not None:
                self.tp.share_tokens(out.token_ids, len(index))
        else:
            # logit_bias, min_tokens and penalties as at each position: its
            # output index, and the drafts before it counted as generated
            # (the position stands only if they are accepted).
            out, errors = self._draw(logits, lambda: SamplingBatch.from_arrays(
                r.temperature[at], r.top_p[at], r.top_k[at], r.seed[at], r.seeded[at], r.num_output[at] + offset,
                r.num_logprobs[at], self.device, self.vocab_size, min_p=r.min_p[at],
                processors=self._processors(at, r.num_output[at] + offset, offset)), rows, masks)
        sampled = np.array(out.token_ids, dtype=np.int64)
        results, i = [], 0
        for row, k in zip(rows.tolist(), drafts.tolist()):
            n = int(r.num_tokens[row])
            agree = sampled[i:i + k] == r.token_ids[row, n:n + k]
            m = 1 + (k if agree.all() else int(agree.argmin()))
            lps = out.logprobs[i:i + m] if out.logprobs is not None and r.num_logprobs[row] > 0 else None
            results.append((row, sampled[i:i + m].tolist(), lps))
            i += 1 + k
        if masks is not None:
            errors += self.constraints.advance_verified([int(r.handle[row]) for row, _, _ in results],
                                                        [accepted for _, accepted, _ in results])
        return results, errors

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: np.ndarray, cu: np.ndarray, start: np.ndarray,
                         end: np.ndarray) -> list[PromptLogprobs]:
        """The model's own log-softmax (no bias, penalty or mask) at every
        prompt position this step computed, for the prompt token after it:
        position p gives token p + 1's. The prompt's last position predicts
        the first sampled token, so it gives none. Under tensor parallelism
        every rank runs the lm_head (it is split) and rank 0 alone gets the
        logits."""
        r, dev = self.rows, self.device
        picks: list[np.ndarray] = []
        spans: list[tuple[int, int, int, int]] = []  # (row, first token, count, top k)
        for i in np.flatnonzero(r.prompt_logprobs[rows] >= 0):
            row = int(rows[i])
            num_prompt = int(r.num_tokens[row] - r.num_output[row])
            n = min(int(end[i]), num_prompt - 1) - int(start[i])
            if n > 0:
                picks.append(np.arange(cu[i], cu[i] + n))
                spans.append((row, int(start[i]) + 1, n, int(r.prompt_logprobs[row])))
        if not spans:
            return []
        index = np.concatenate(picks)
        targets = np.concatenate([r.token_ids[row, first:first + n] for row, first, n, _ in spans]).astype(np.int64)
        max_k = max(k for *_, k in spans)
        lps, top_lps, top_ids = [], [], []
        for s in range(0, len(index), PROMPT_LOGPROBS_ROWS):
            logits = self.model.compute_logits(hidden[to_device(index[s:s + PROMPT_LOGPROBS_ROWS], dev)])
            if logits is None:
                continue  # not rank 0
            logp = torch.log_softmax(logits, dim=-1)  # [m, vocab] fp32
            lps.append(logp.gather(1, to_device(targets[s:s + PROMPT_LOGPROBS_ROWS], dev)[:, None])[:, 0].cpu())
            if max_k:
                values, ids = logp.topk(max_k, dim=-1)
                top_lps.append(values.cpu())
                top_ids.append(ids.cpu())
        if not lps:
            return []
        lp = torch.cat(lps).tolist()
        if max_k:
            all_top_lps, all_top_ids = torch.cat(top_lps), torch.cat(top_ids)
        out, at = [], 0
        for row, first, n, k in spans:
            entry = PromptLogprobs(int(r.handle[row]), first, lp[at:at + n], k)
            if k:
                entry.top_logprobs = all_top_lps[at:at + n, :k].reshape(-1).tolist()
                entry.top_token_ids = all_top_ids[at:at + n, :k].reshape(-1).tolist()
            out.append(entry)
            at += n
        return out

    def _pool(self, hidden: torch.Tensor, rows: np.ndarray, first: np.ndarray, last: np.ndarray, start: np.ndarray,
              end: np.ndarray) -> list[tuple[int, list[float]]]:
        """Embedding rows: hidden[first[i]:last[i]] are positions
        [start[i], end[i]) of rows[i]. Pooled in float32 across a prompt's
        chunks; a row whose prompt this step completes gets its vector."""
        r, mode, out = self.rows, self.pooling.mode if self.pooling else "", []  # called with no rows when no pooling
        for row, a, b, s, e in zip(rows.tolist(), first.tolist(), last.tolist(), start.tolist(), end.tolist()):
            h = hidden[a:b]
            if s and mode != "last" and row not in r.pooled:
                raise PlanError(f"handle {int(r.handle[row])}: {mode} pooling needs every prompt position, but "
                                f"positions before {s} were not computed here")
            if mode == "mean":
                part = h.float().sum(0)
                r.pooled[row] = part if s == 0 else r.pooled[row] + part
            elif mode == "cls" and s == 0:
                r.pooled[row] = h[0].float()
            if e == r.num_tokens[row]:
                if mode == "last":
                    vector = h[-1].float()
                else:
                    vector = r.pooled.pop(row) / (e if mode == "mean" else 1)
                out.append((int(r.handle[row]), self.pooling.finish(vector)))
        return out

    def _capture_verify(self, q_len: int) -> VerifyGraphs | None:
        """Verify graphs for rows of up to q_len tokens; None (verify steps
        run eagerly, decode steps still replay) if capture fails."""
        try:
            return VerifyGraphs(self.model, self.kv_caches, self.backend, self.device, self.rows.max_blocks,
                                self.pool.block_size, q_len, pool=self.graphs.pool, features=self.features)
        except Exception:
            log.exception("capturing the verify steps' CUDA graphs failed; verify steps run eagerly")
            return None

    def _run_compiled(self, ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor | None:
        """Logits from the compiled decode graph; None (and eager from now on)
        if it would have to compile again."""
        try:
            logits = self.compiled.run(ids, positions, slot_mapping, block_tables, seq_lens)
        except Exception:
            log.exception("the compiled decode step failed; decode steps run eagerly from now on")
            self.compiled = None
            return None
        COMPILED_STEPS.inc()
        return logits

    def _run_compiled_verify(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                             tokens_per_row: np.ndarray) -> torch.Tensor | None:
        """Every token's logits from the compiled verify graph; None (and
        eager verify steps from now on) if it would have to compile again."""
        try:
            logits = self.compiled.run_verify(ids, positions, meta.slot_mapping, meta.block_tables, tokens_per_row)
        except Exception:
            log.exception("the compiled verify step failed; verify steps run eagerly from now on")
            self.compiled.stop_verifying()
            return None
        COMPILED_STEPS.inc()
        return logits

    def _processors(self, rows: np.ndarray, output_pos: np.ndarray | None = None,
                    drafts_before: np.ndarray | None = None) -> LogitsProcessors | None:
        """logit_bias, min_tokens and penalties of the sampled rows; a few
        vectorized checks when no row sets any (the common step). A row may
        appear more than once (a speculating row's verified positions), with
        output_pos the index of the token each draws (default: the row's
        next) and drafts_before how many of its drafts come before it, which
        its penalties count as generated."""
        r = self.rows
        biased = r.has_bias[rows]
        holding = r.min_tokens[rows] > (r.num_output[rows] if output_pos is None else output_pos)
        slots = r.penalty_slot[rows]
        penalised = slots >= 0
        if not (biased.any() or holding.any() or penalised.any()):
            return None
        bias = [(i, *r.logit_bias[int(rows[i])]) for i in np.flatnonzero(biased)]
        held = [(i, r.held_ids[int(rows[i])]) for i in np.flatnonzero(holding)]
        which = np.flatnonzero(penalised)
        prow = rows[which]
        extra = None
        if drafts_before is not None and drafts_before[which].any():
            # Each penalised position's drafts before it: one count each.
            before = drafts_before[which]
            at = np.repeat(np.arange(len(which)), before)
            first = np.repeat(r.num_tokens[prow], before)
            step = np.arange(before.sum()) - np.repeat(np.cumsum(before) - before, before)
            ids = r.token_ids[np.repeat(prow, before), first + step].astype(np.int64)
            extra = torch.zeros(len(which), self.vocab_size, dtype=torch.float32, device=self.device)
            extra.view(-1).index_add_(0, to_device(at * self.vocab_size + ids, self.device),
                                      torch.ones(len(ids), device=self.device))
        return LogitsProcessors.build(bias, held, which, slots[which], r.presence_penalty[prow],
                                      r.frequency_penalty[prow], r.repetition_penalty[prow], r.counts, self.device,
                                      extra)

    def _sample(self, logits: torch.Tensor, rows: np.ndarray, handles: list[int],
                masks: MaskJob | None) -> tuple[list[int], list | None, list[tuple[int, str]]]:
        r = self.rows
        if masks is None and r.plain_greedy[rows].all():
            # The common greedy step: its argmax, without a SamplingBatch
            # (about 40 µs a step on a CPU, next to a 0.3 ms forward).
            tokens = argmax(logits).tolist()
            if self.tp is not None:
                self.tp.share_tokens(tokens, len(logits))
            return tokens, None, []
        out, errors = self._draw(logits, lambda: SamplingBatch.from_arrays(
            r.temperature[rows], r.top_p[rows], r.top_k[rows], r.seed[rows], r.seeded[rows], r.num_output[rows],
            r.num_logprobs[rows], self.device, self.vocab_size, min_p=r.min_p[rows],
            processors=self._processors(rows)), rows, masks, handles)
        return out.token_ids, out.logprobs, errors

    def _draw(self, logits: torch.Tensor, make_batch, rows: np.ndarray, masks: MaskJob | None,
              advance: list[int] | None = None) -> tuple[SampleOutput, list[tuple[int, str]]]:
        """Rank 0's draw from logits (one row per sampled position; rows, each
        position's request row): the batch make_batch builds, the
        constraints' masks applied, and under tensor parallelism the draws
        shared with the other ranks (or, if anything fails, their failure).
        advance: the handles whose matchers consume the draws (plain
        decoding's rows; a speculative step advances its own after
        acceptance). Returns the draws and the rows whose constraint failed."""
        r = self.rows
        errors: list[tuple[int, str]] = []
        try:
            batch = make_batch()
            if masks is None:
                out = sample(logits, batch)
            else:
                # Sampled from the masked logits; logprobs stay the model's own.
                wants_logprobs = bool(r.num_logprobs[rows].any())
                masked, errors = self.constraints.apply(masks, logits, in_place=not wants_logprobs)
                out = sample(masked, batch, logprob_logits=logits if wants_logprobs else None)
                if advance is not None:
                    errors = errors + self.constraints.advance(advance, out.token_ids)
        except Exception:
            if self.tp is not None:
                self.tp.share_tokens(None, len(logits))  # the other ranks fail this step too
            raise
        if self.tp is not None:
            self.tp.share_tokens(out.token_ids, len(logits))
        return out, errors
