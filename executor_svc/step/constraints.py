"""Constrained decoding, the executor's half: one llguidance matcher per
constrained request, a token mask for each of them at every step it
samples, and the sampled token fed back to its matcher.

The scheduler compiles and checks each constraint before queueing the
request (scheduler_svc/constraints.py) and sends the grammar once, in
NewRequest. Matchers live here, where tokens are sampled: the mask for a
row's next step depends on the token it sampled last, which this process
knows at once, while the scheduler learns it only after it has sent the
next plan. So a step's masks are computed on a worker thread while the
forward pass runs (llguidance releases the GIL), and applied to the logits
before sampling; no row waits for another process.

A request re-sent in full (after a preemption or an executor restart)
carries its output so far, which is replayed into a fresh matcher, so a
matcher always agrees with the tokens its request holds.

A speculating row (runner.py) first has its drafts cut to those its grammar
takes (num_valid_drafts); its step then gets a mask for every position it
verifies, each the grammar's after the drafts before it, computed by
advancing the matcher over the drafts and rolling it back; and once the
step knows which tokens the row yields, its matcher consumes exactly those
(advance_verified), as it would have one step at a time.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import torch
from llguidance import LLMatcher
from prometheus_client import Counter, Gauge, Histogram

from llmsched.llguidance_tokenizer import make_tokenizer

MATCHERS = Gauge("llmsched_executor_constraint_matchers", "Constraint matchers held, one per constrained request")
MASK_SECONDS = Histogram(
    "llmsched_executor_constraint_mask_seconds",
    "Time to compute one step's token masks (on a worker thread, beside the forward pass)",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
MASK_ROWS = Counter("llmsched_executor_constraint_mask_rows", "Token masks computed (one per constrained row a step)")
MASK_WAIT_SECONDS = Counter(
    "llmsched_executor_constraint_mask_wait_seconds",
    "Time steps spent waiting for their masks after the forward pass had finished")

# Compiled grammars kept by content; a new request copies its matcher from
# one (LLMatcher.deep_copy) instead of compiling again.
TEMPLATE_CACHE_SIZE = 64


@dataclass(slots=True)
class _Matcher:
    grammar: str
    ignore_eos: bool
    # Output tokens to replay before the first mask (a re-sent request); the
    # matcher itself is built on the mask thread, off the step's path.
    replay: list[int]
    matcher: LLMatcher | None = None


@dataclass(slots=True)
class MaskJob:
    """The masks of one step, being computed."""

    handles: list[int]  # [k] the request of each mask
    index: np.ndarray  # [k] the position in logits each mask applies to
    matchers: list[_Matcher]  # [k]
    bitmask: np.ndarray  # [k, vocab words] int32, filled by the mask thread
    # A verifying step's (first mask, drafts) per constrained row: its
    # masks are rows first .. first + len(drafts). None in a plain step,
    # where mask j is matchers[j]'s next.
    drafts: list[tuple[int, list[int]]] | None = None
    future: Future | None = None
    errors: list[tuple[int, str]] = field(default_factory=list)  # (handle, why), from replays


class ConstraintMatchers:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = make_tokenizer(tokenizer_json, vocab_size, eos_token_ids)
        # Masks span the tokenizer's ids, which may outnumber the logits
        # (apply() cuts them to the logits' width).
        self.vocab_size = self.tokenizer.vocab_size
        self.eos_ids = np.array(sorted(eos_token_ids), dtype=np.int64)
        # A mask row (as uint32 words) allowing exactly the EOS tokens.
        words = (self.vocab_size + 31) // 32
        self._eos_row = np.zeros(words, dtype=np.uint32)
        for t in eos_token_ids:
            self._eos_row[t // 32] |= np.uint32(1) << np.uint32(t % 32)
        self._by_handle: dict[int, _Matcher] = {}
        self._templates: OrderedDict[str, LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="constraint-masks")

    def __len__(self) -> int:
        return len(self._by_handle)

    # ----- request state, applied from each plan's diffs -------------------

    def add(self, handle: int, grammar: str, ignore_eos: bool, output_tokens: list[int]) -> None:
        self._by_handle[handle] = _Matcher(grammar, ignore_eos, list(output_tokens))
        MATCHERS.set(len(self._by_handle))

    def remove(self, handle: int) -> None:
        if self._by_handle.pop(handle, None) is not None:
            MATCHERS.set(len(self._by_handle))

    def reset(self) -> None:
        self._by_handle.clear()
        MATCHERS.set(0)

    # ----- one step --------------------------------------------------------

    def begin(self, handles: list[int], drafts: list[list[int]] | None = None) -> MaskJob | None:
        """Starts computing the masks of the constrained ones among a step's
        sampling rows (handles, in logits order); None when there are none.
        With drafts (a verifying step's, drafts[i] row i's), row i has
        1 + len(drafts[i]) positions in the logits, in order, and each
        position's mask is the grammar's after the drafts before it."""
        spans = [1] * len(handles) if drafts is None else [1 + len(d) for d in drafts]
        firsts = np.cumsum([0] + spans[:-1])
        rows = [i for i, h in enumerate(handles) if h in self._by_handle]
        if not rows:
            return None
        index = np.concatenate([np.arange(firsts[i], firsts[i] + spans[i]) for i in rows])
        job_handles = [handles[i] for i in rows for _ in range(spans[i])]
        matchers = [self._by_handle[h] for h in job_handles]
        bitmask = llg_numpy.allocate_token_bitmask(len(index), self.vocab_size)
        job = MaskJob(job_handles, index, matchers, bitmask)
        if drafts is not None:
            # A mask the library leaves unwritten (it stops at a draft its
            # matcher refuses) then allows nothing, and apply() reports it,
            # instead of allowing everything.
            bitmask[:] = 0
            masks_before = np.cumsum([0] + [spans[i] for i in rows[:-1]])
            job.drafts = [(int(first), list(drafts[i])) for first, i in zip(masks_before, rows)]
        job.future = self._thread.submit(self._compute, job)
        return job

    def num_valid_drafts(self, handle: int, drafts: np.ndarray) -> int:
        """How many of a speculating row's drafts to verify: all of them
        for an unconstrained row; for a constrained one the longest prefix
        its grammar takes from where it is, short of any EOS (a draft EOS
        would end the request, and llguidance cannot roll one back), and
        none while its matcher is not built yet or has failed (the row
        then decodes one token, as plain decoding would)."""
        m = self._by_handle.get(handle)
        if m is None:
            return len(drafts)
        if m.matcher is None or m.matcher.is_error():
            return 0
        eos = np.flatnonzero(np.isin(drafts, self.eos_ids))
        n = int(eos[0]) if len(eos) else len(drafts)
        return m.matcher.validate_tokens(drafts[:n].tolist()) if n else 0

    def apply(self, job: MaskJob, logits: torch.Tensor, in_place: bool) -> tuple[torch.Tensor, list[tuple[int, str]]]:
        """logits [n, vocab] with every token a constrained row may not
        sample at -inf, and the rows whose constraint failed. In place, or
        on a copy when the caller still needs the model's own logits (for
        logprobs)."""
        waited = time.perf_counter()
        job.future.result()
        MASK_WAIT_SECONDS.inc(time.perf_counter() - waited)
        errors = list(job.errors)

        def report(j: int, why: str) -> None:  # once per request, of its masks
            if not any(h == job.handles[j] for h, _ in errors):
                errors.append((job.handles[j], why))

        words = job.bitmask.view(np.uint32)  # [k, vocab words]
        failed = [j for j, m in enumerate(job.matchers) if m.matcher.is_error()]
        for j in failed:
            report(j, job.matchers[j].matcher.get_error() or "matcher failed")
        words[failed] = self._eos_row  # sample EOS: the scheduler ends the request and drops the token
        # Under ignore_eos, EOS only when it is all that is left.
        holds = np.array([m.ignore_eos for m in job.matchers])
        if holds.any():
            without_eos = words & ~self._eos_row
            holds &= without_eos[:, : (logits.shape[1] + 31) // 32].any(axis=1)
            words[holds] = without_eos[holds]
        # Bit b of word w is token 32w + b; ids past the logits' width (a
        # tokenizer larger than the model) cannot be sampled.
        allowed = np.unpackbits(job.bitmask.view(np.uint8), axis=1, count=logits.shape[1], bitorder="little")
        for j in np.flatnonzero(~allowed.any(axis=1)):
            report(j, "the constraint allows no token the model has")
            allowed[j, self.eos_ids] = 1
        rows = torch.from_numpy(job.index).to(logits.device)
        disallowed = torch.from_numpy(allowed == 0).to(logits.device)  # [k, vocab]
        constrained = logits.index_select(0, rows).masked_fill_(disallowed, float("-inf"))
        masked = logits if in_place else logits.clone()
        return masked.index_copy_(0, rows, constrained), errors

    def advance(self, handles: list[int], tokens: list[int]) -> list[tuple[int, str]]:
        """Feeds each constrained row the token it sampled; returns the rows
        whose matcher refused it."""
        fed = [(h, self._by_handle[h].matcher, t) for h, t in zip(handles, tokens)
               if h in self._by_handle and self._by_handle[h].matcher is not None]
        ok = self._executor.consume_token_par([(m, t) for _, m, t in fed]) if fed else []
        return [(h, f"token {t} refused: {m.get_error() or 'matcher in error state'}")
                for (h, m, t), good in zip(fed, ok) if not good]

    def advance_verified(self, handles: list[int], accepted: list[list[int]]) -> list[tuple[int, str]]:
        """Feeds each constrained verifying row the tokens it yields (the
        drafts accepted and the token after them), in order; returns the
        rows whose matcher refused one."""
        errors = []
        for h, tokens in zip(handles, accepted):
            m = self._by_handle.get(h)
            if m is not None and not m.matcher.consume_tokens(tokens):
                errors.append((h, f"tokens {tokens} refused: {m.matcher.get_error() or 'matcher in error state'}"))
        return errors

    # ----- on the mask thread ----------------------------------------------

    def _compute(self, job: MaskJob) -> None:
        """Only llguidance calls that release the GIL, so the step's thread
        runs the forward meanwhile undisturbed."""
        started = time.perf_counter()
        for j, m in enumerate(job.matchers):
            if m.matcher is None:  # new, or re-sent: build it, replay its output
                m.matcher = self._template(m.grammar).deep_copy()
                if m.replay and not m.matcher.consume_tokens(m.replay):
                    job.errors.append((job.handles[j],
                                       f"replaying {len(m.replay)} output tokens failed: {m.matcher.get_error()}"))
                m.replay = []
        if job.drafts is None:
            batch = [(m.matcher, j) for j, m in enumerate(job.matchers) if not m.matcher.is_error()]
            if batch:
                llg_numpy.fill_next_token_bitmask_par(self._executor, batch, job.bitmask)
        else:
            # Each row's matcher consumes its drafts one by one, writing the
            # mask after each, and is rolled back (num_valid_drafts let only
            # drafts it takes through).
            batch = [(job.matchers[first].matcher, first, drafts) for first, drafts in job.drafts
                     if not job.matchers[first].matcher.is_error()]
            if batch:
                llg_numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, batch, job.bitmask)
        MASK_ROWS.inc(len(job.matchers))
        MASK_SECONDS.observe(time.perf_counter() - started)

    def _template(self, grammar: str) -> LLMatcher:
        template = self._templates.get(grammar)
        if template is None:
            template = LLMatcher(self.tokenizer, grammar)  # builds the parser; drops the GIL meanwhile
            self._templates[grammar] = template
            while len(self._templates) > TEMPLATE_CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(grammar)
        return template
