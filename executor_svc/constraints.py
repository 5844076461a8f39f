"""Constrained decoding, the executor's half: one llguidance matcher per
constrained request, a token mask for each of them at every step it
samples, and the sampled token fed back to its matcher.

The scheduler compiles and checks each constraint before queueing the
request (scheduler_svc/structured_output.py) and sends the grammar once, in
NewRequest. Matchers live here, where tokens are sampled: the mask for a
row's next step depends on the token it sampled last, which this process
knows at once, while the scheduler learns it only after it has sent the
next plan. So a step's masks are computed on a worker thread while the
forward pass runs (llguidance releases the GIL), and applied to the logits
before sampling; no row waits for another process.

A request re-sent in full (after a preemption or an executor restart)
carries its output so far, which is replayed into a fresh matcher, so a
matcher always agrees with the tokens its request holds.
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

    handles: list[int]  # the sampling rows' handles, in logits order
    index: np.ndarray  # [k] positions in logits of the constrained rows
    future: Future
    # Filled by the job: [k, vocab words] int32 bitmask, and (handle, error).
    bitmask: np.ndarray | None = None
    errors: list[tuple[int, str]] = field(default_factory=list)


class ConstraintMatchers:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = make_tokenizer(tokenizer_json, vocab_size, eos_token_ids)
        # Masks span the tokenizer's ids, which may outnumber the logits
        # (apply() cuts them to the logits' width).
        self.vocab_size = self.tokenizer.vocab_size
        self.eos_ids = torch.tensor(sorted(eos_token_ids), dtype=torch.int64)
        # A mask row (as uint32 words) allowing exactly the EOS tokens.
        words = (self.vocab_size + 31) // 32
        self._eos_row = np.zeros(words, dtype=np.uint32)
        for t in eos_token_ids:
            self._eos_row[t // 32] |= np.uint32(1) << np.uint32(t % 32)
        self._by_handle: dict[int, _Matcher] = {}
        self._templates: OrderedDict[str, LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="constraint-masks")
        # Which bit of its 32-bit word holds each token, for unpacking masks.
        self._shifts = torch.arange(32, dtype=torch.int32)

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

    def begin(self, handles: list[int]) -> MaskJob | None:
        """Starts computing the masks of the constrained ones among a step's
        sampling rows (handles, in logits order); None when there are none."""
        index = [i for i, h in enumerate(handles) if h in self._by_handle]
        if not index:
            return None
        job = MaskJob(handles, np.array(index, dtype=np.int64), Future())
        job.future = self._thread.submit(self._compute, job)
        return job

    def apply(self, job: MaskJob, logits: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, str]]]:
        """logits [n, vocab] with every token a constrained row may not
        sample at -inf (a new tensor: the caller keeps the model's own
        logits for logprobs), and the rows whose constraint failed."""
        waited = time.perf_counter()
        job.future.result()
        MASK_WAIT_SECONDS.inc(time.perf_counter() - waited)
        words = torch.from_numpy(job.bitmask).to(logits.device)  # [k, ceil(vocab / 32)] int32
        shifts = self._shifts.to(logits.device)
        allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(job.index), -1)[:, : logits.shape[1]]  # [k, vocab]
        errors = job.errors
        empty = ~allowed.any(dim=1)  # [k]: only ids past the logits' width were allowed
        if bool(empty.any()):
            eos = self.eos_ids.to(logits.device)
            allowed[empty.nonzero().squeeze(1)[:, None], eos[None, :]] = 1
            errors = errors + [(job.handles[int(job.index[j])], "the constraint allows no token the model has")
                               for j in empty.nonzero().squeeze(1).tolist()]
        masked = logits.clone()
        rows = torch.from_numpy(job.index).to(logits.device)
        masked[rows] = masked[rows].masked_fill(allowed == 0, float("-inf"))
        return masked, errors

    def advance(self, handles: list[int], tokens: list[int]) -> list[tuple[int, str]]:
        """Feeds each constrained row the token it sampled; returns the rows
        whose matcher refused it."""
        errors = []
        for h, t in zip(handles, tokens):
            m = self._by_handle.get(h)
            if m is None or m.matcher is None:
                continue
            if not m.matcher.consume_token(t):
                errors.append((h, f"token {t} refused: {m.matcher.get_error() or 'matcher in error state'}"))
        return errors

    # ----- on the mask thread ----------------------------------------------

    def _compute(self, job: MaskJob) -> None:
        started = time.perf_counter()
        k = len(job.index)
        bitmask = llg_numpy.allocate_token_bitmask(k, self.vocab_size)  # [k, words], all allowed
        batch: list[tuple[LLMatcher, int]] = []
        entries = []
        for j, i in enumerate(job.index):
            h = job.handles[i]
            m = self._by_handle[h]
            if m.matcher is None:
                m.matcher = self._template(m.grammar).deep_copy()
                if m.replay and not m.matcher.consume_tokens(m.replay):
                    job.errors.append((h, f"replaying {len(m.replay)} output tokens failed: {m.matcher.get_error()}"))
                m.replay = []
            entries.append((j, h, m))
            if not m.matcher.is_error():
                batch.append((m.matcher, j))
        if batch:
            llg_numpy.fill_next_token_bitmask_par(self._executor, batch, bitmask)
        eos = self._eos_row
        for j, h, m in entries:
            row = bitmask[j].view(np.uint32)
            if m.matcher.is_error():
                if not any(e[0] == h for e in job.errors):
                    job.errors.append((h, m.matcher.get_error() or "matcher in error state"))
                row[:] = eos  # sample EOS: the scheduler ends the request and drops the token
                continue
            if m.ignore_eos:
                without_eos = row & ~eos
                if without_eos.any():
                    row[:] = without_eos  # EOS only when it is all that is left
            if not row.any():
                job.errors.append((h, "the constraint allows no token"))
                row[:] = eos
        job.bitmask = bitmask
        MASK_ROWS.inc(k)
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
