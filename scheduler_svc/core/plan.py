"""What one step decides (StepPlan) and what the executor answers
(StepResult), as plain dataclasses under the names of the protobuf
messages they become and come from (convert.py); nothing here knows
protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.core.host_tier import SwapPlan
from scheduler_svc.core.request import Request


@dataclass(slots=True)
class NewRequestData:
    """A request the executor does not hold yet: sent once, in full."""

    handle: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_output_tokens: int
    request: Request

    @classmethod
    def from_request(cls, request: Request, block_ids: list[int], num_scheduled_tokens: int) -> "NewRequestData":
        return cls(
            handle=request.handle,
            token_ids=request.all_token_ids,
            block_ids=list(block_ids),
            num_computed_tokens=request.num_computed_tokens,
            num_scheduled_tokens=num_scheduled_tokens,
            num_output_tokens=len(request.output_token_ids),
            request=request,
        )


@dataclass(slots=True)
class ScheduledRequest:
    """One request's part in a step, as it was when the step was planned."""

    request: Request
    num_tokens: int
    # num_computed_tokens before this step: the step computes positions
    # [start, start + num_tokens).
    start: int
    # The step reaches the request's last token, so the executor samples one.
    samples: bool
    # request.epoch when planned; a different epoch at update time means the
    # executor lost the request since, and this part of the result is stale.
    epoch: int
    # Lookahead slots: positions past the next token that this step may
    # fill (num_tokens includes them). They are speculative drafts verified
    # in one forward, or, in a multi-step plan (StepPlan.multi_step), more
    # steps run one after another (decode steps, or steps that verify up to
    # StepPlan.multi_step_drafts drafts each). Either way the step yields 1
    # to 1 + num_lookahead tokens, and the rest roll back
    # (Scheduler.update_from_output).
    num_lookahead: int = 0

    @property
    def is_stale(self) -> bool:
        return self.request.epoch != self.epoch or self.request.status.is_finished


@dataclass(slots=True)
class StepPlan:
    step_id: int
    # Scheduler.executor_epoch when planned (see StepPlan.epoch).
    executor_epoch: int = 0
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Requests the executor holds: parallel lists.
    cached_requests: list[Request] = field(default_factory=list)
    cached_num_scheduled_tokens: list[int] = field(default_factory=list)
    # Blocks appended to cached requests' tables, as parallel lists.
    new_block_handles: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)
    # Requests granted lookahead slots this step and their counts, in
    # parallel (ScheduledRequest.num_lookahead); on the wire, draft_handles
    # and draft_counts.
    lookahead_handles: list[int] = field(default_factory=list)
    lookahead_counts: list[int] = field(default_factory=list)
    # The lookahead slots are steps the executor runs one after another
    # (multi-step decode), not drafts verified in one forward. A plan is
    # one or the other (Scheduler._multi_step_lookahead).
    multi_step: bool = False
    # Multi-step on an executor that speculates: the most drafts each of a
    # row's steps verifies (0: plain decode steps).
    multi_step_drafts: int = 0
    # Multi-step only: a row that samples one of these ends its run early
    # (every scheduled row's stop token ids and, unless it ignores EOS, its
    # EOS ids): the scheduler would finish it there anyway.
    stop_token_ids: list[int] = field(default_factory=list)
    # Handles the executor must forget before this step.
    finished_handles: list[int] = field(default_factory=list)
    # Requests preempted while building this step (see Request.preempted_by).
    preempted: list[Request] = field(default_factory=list)
    # Copies between the tiers, run before the forward; None when none.
    swaps: SwapPlan | None = None
    # Whether the result's swap outcomes have been applied
    # (Scheduler.confirm_swaps): once per plan, before its other outputs.
    swaps_confirmed: bool = False
    # LoRA slots (lora_slots.py) to empty, then (slot, adapter) pairs to
    # load, before the forward.
    lora_evicts: list[int] = field(default_factory=list)
    lora_loads: list[tuple[int, str]] = field(default_factory=list)
    # Every scheduled request, in scheduling order, keyed by handle: results
    # are matched against the step's own requests, never against whoever
    # holds a handle by the time the result arrives.
    entries: dict[int, ScheduledRequest] = field(default_factory=dict)

    @property
    def num_preempted(self) -> int:
        return len(self.preempted)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(self.cached_num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        """Nothing for the executor to do. A plan that only copies blocks
        (a victim swapped out while nothing else could run) is not empty:
        it must be sent, or the host blocks would never be written."""
        return not self.new_requests and not self.cached_requests and not self.swaps

    def scheduled(self) -> list[tuple[Request, int]]:
        """(request, tokens scheduled) for every request in the step."""
        return [(e.request, e.num_tokens) for e in self.entries.values()]

    def sampling_handles(self) -> list[int]:
        """Handles of the requests the executor samples a token for."""
        return [h for h, e in self.entries.items() if e.samples]


@dataclass(slots=True)
class SampledToken:
    """One token from a step result, already matched to its request."""

    request: Request
    token_id: int
    logprobs: tuple[float, list[int], list[float]] | None = None


@dataclass(slots=True)
class PromptOutput:
    """What a step read from a request's prompt positions, already matched
    to its request: logprobs of prompt tokens [first, first + len(logprobs))
    as (token id, logprob, top ids, top logprobs), or, for an embedding
    request, its pooled vector (the request is then finished)."""

    request: Request
    first: int = 0
    logprobs: list[tuple[int, float, list[int], list[float]]] = field(default_factory=list)
    embedding: list[float] | None = None


@dataclass(slots=True)
class PromptLogprobsResult:
    """StepResult.prompt_logprobs for one request, out of protobuf."""

    handle: int
    first: int
    logprobs: list[float]
    top_k: int = 0
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """The executor's answer to one plan, out of protobuf."""

    sampled: list[tuple[int, int, tuple | None]] = field(default_factory=list)
    # (handle, message) of requests whose constraint failed on the executor.
    request_errors: list[tuple[int, str]] = field(default_factory=list)
    # Non-empty when the step failed; the executor dropped all request state.
    error: str = ""
    # The plan was not run (an earlier plan of its epoch failed).
    discarded: bool = False
    forward_ns: int = 0
    sample_ns: int = 0
    # Copies of the plan's swaps (SwapPlan) that failed on the executor,
    # and the time its copies took.
    failed_swap_outs: list[int] = field(default_factory=list)
    failed_swap_ins: list[int] = field(default_factory=list)
    swap_ns: int = 0
    # What the step read from prompt positions (executor.proto's
    # PromptLogprobs and Embedding).
    prompt_logprobs: list[PromptLogprobsResult] = field(default_factory=list)
    embeddings: list[tuple[int, list[float]]] = field(default_factory=list)
    # (handle, drafts verified, drafts accepted) per verifying forward of a
    # speculating request: once per step, several times in a multi-step
    # plan (the plan allowed up to ScheduledRequest.num_lookahead in all).
    verified_drafts: list[tuple[int, int, int]] = field(default_factory=list)
    # Time the plan's LoRA evictions and loads took on the executor, and
    # how many loads read their adapter from disk.
    lora_load_ns: int = 0
    lora_disk_reads: int = 0
