"""Request state as the scheduler keeps it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler_svc.core.clock import SYSTEM_CLOCK


@dataclass(frozen=True, slots=True)
class CompiledConstraint:
    """A request's output constraint, compiled and checked by
    constraints.py: what the plan sends the executor's matcher."""

    kind: str
    grammar: str  # llguidance's grammar JSON, as the executor's matcher takes it


class RequestStatus(enum.IntEnum):
    """Ordered: every status after RUNNING is a finished one."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.RUNNING


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Validated and resolved: no "unset" values left."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # EOS, stop tokens and stop strings wait until this many output tokens.
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), by id
    # Top alternatives with each prompt token's logprob; None = no prompt logprobs.
    prompt_logprobs: int | None = None


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int]
    priority: int = 0
    arrival_time: float = field(default_factory=SYSTEM_CLOCK.monotonic)
    # Small integer naming the request on the step channel.
    handle: int = -1
    # Order of arrival at the scheduler; ties in priority go to the earlier.
    arrival_seq: int = -1
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens (prompt + output) whose KV is in the executor's cache or is
    # computed by a step already sent (in flight).
    num_computed_tokens: int = 0
    # Tokens sampled by steps in flight: the executor knows them, the
    # scheduler not yet. Each counts as a token to compute in the next step.
    num_output_placeholders: int = 0
    # Moves on whenever the executor loses this request's state (preemption,
    # executor reset), so results of steps sent before are recognised as
    # stale and dropped.
    epoch: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Whether the executor currently holds this request's state; false
    # before first scheduling and after a preemption.
    on_executor: bool = False
    num_preemptions: int = 0
    # How the last preemption took it off the executor: "swap" (its KV
    # copied to the host tier) or "recompute".
    preempted_by: str = ""
    # Tokens whose KV was computed once and then lost, and why ("recompute",
    # "swap" when a swapped-out copy was lost, "reset"): computing them
    # again counts as recompute (Scheduler.num_recomputed_tokens).
    num_lost_tokens: int = 0
    lost_cause: str = ""
    # Executor steps this request was in that failed; from 1 on it is
    # retried in a step of its own.
    num_failed_steps: int = 0
    num_cached_prompt_tokens: int = 0
    # The compiled `structured` constraint (constraints.py), enforced
    # by the executor; None = free generation.
    constraint: CompiledConstraint | None = None
    # Whose request this is (tenants.py), for fair share, per-tenant limits
    # and metrics.
    tenant: str = "default"
    # What its prefix-cache hashes are salted with (tenants.prefix_salt):
    # only requests with the same salt share blocks.
    prefix_salt: bytes = b""
    # The LoRA adapter it runs with ("" = the base model). Folded into its
    # prefix-cache hashes: KV computed under one adapter is never another's.
    adapter: str = ""
    # Prompt positions already counted as served (policy.py): recomputing
    # them after a preemption does not count again.
    num_charged_prompt_tokens: int = 0
    # An embedding request (the Embed RPC): its prompt is computed as a
    # prefill-only row, nothing is sampled, and the step that completes it
    # returns the pooled vector.
    embed: bool = False
    # Its outputs read prompt positions the prefix cache would skip (prompt
    # logprobs, or an embedding pooled over every position): it takes no
    # cached blocks and computes its whole prompt.
    skip_prefix_cache: bool = False
    # Lookahead slots of its steps in flight (0: none in flight):
    # speculative drafts, or a multi-step plan's further decode steps. Each
    # such step holds 1 + its slots in placeholders and counts them all as
    # computed, as if every slot will yield a token; its result says how
    # many did, and the request's later steps move back by the rest
    # (Scheduler.update_from_output). Until then it is never swapped: which
    # of its computed positions hold known tokens is unknown.
    num_lookahead_in_flight: int = 0

    @property
    def can_speculate(self) -> bool:
        """Whether its drafts can be verified exactly: each verified position
        samples as plain decoding would there (greedy or seeded draws alike;
        the executor applies logit_bias, min_tokens, penalties and the
        constraint's mask as at that position, counting the drafts before it
        as generated), and a stop string that completes mid-step cuts the
        step's later tokens (Scheduler.stop_by_string). Every generating
        request can; an embedding request samples nothing."""
        return not self.embed

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
