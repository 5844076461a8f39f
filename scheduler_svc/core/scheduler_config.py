"""The scheduler's configuration: the executor's KV geometry and the
SCHEDULER_* settings that shape each step (engine_core.scheduler_config
builds it from both)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    # At most this many requests run in one step.
    max_num_seqs: int = 256
    # At most this many tokens (prefill + decode) are computed in one step.
    max_num_batched_tokens: int = 2048
    # At most this many prompt tokens of one request per step (chunked
    # prefill), so a long prompt cannot take a whole step's budget.
    max_prefill_chunk: int = 512
    # fcfs: arrival order. priority: `priority` first (lower = more urgent),
    # then arrival; both for admission and for choosing preemption victims.
    # fair: VTC across tenants (policy.py).
    policy: Literal["fcfs", "priority", "fair"] = "fcfs"
    enable_prefix_caching: bool = True
    # fair: the service a prompt and an output token count for, and the
    # tenants' weights ((tenant, weight) pairs; others weigh 1).
    prompt_token_weight: float = 1.0
    output_token_weight: float = 2.0
    tenant_weights: tuple[tuple[str, float], ...] = ()
    # Blocks in the executor's host KV tier; 0 = none.
    num_host_blocks: int = 0
    # How a victim is preempted: swap its KV out to the host tier, or drop
    # it and recompute. auto swaps when the host tier has room and the
    # copy is cheaper (SwapCost); swap whenever the host tier has room.
    preemption_mode: Literal["auto", "recompute", "swap"] = "auto"
    # Speculative decoding: the executor's most drafts per request per step
    # (0 = it does not speculate), and the batch size above which no request
    # drafts (Scheduler._num_lookahead).
    speculative_tokens: int = 0
    speculative_max_batch: int = 16
    # Multi-step decode: at most this many decode steps per plan when
    # nothing needs the scheduler between them (1 = off), while at most
    # multi_step_max_batch requests run (Scheduler._multi_step_lookahead).
    multi_step_decode: int = 1
    multi_step_max_batch: int = 8
    # The executor is batch-invariant (EXECUTOR_BATCH_INVARIANT): a prompt's
    # chunks then end at multiples of invariant_chunk and are never cut
    # short by the step's budget (Scheduler._num_tokens_to_schedule).
    batch_invariant: bool = False
    # The executor's LoRA adapters, and its device slots for them
    # (lora_slots.py; 0 = one per adapter).
    lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0
    # The executor takes LoRA adapters at runtime (EXECUTOR_RUNTIME_LORA_DIR):
    # slots exist even with no start-up adapter.
    runtime_lora: bool = False
    # Steps an adapter keeps its slot while another waits for one, before
    # its running requests are parked and the slot passes on.
    lora_quantum_steps: int = 4

    @property
    def invariant_chunk(self) -> int:
        """The chunk size of batch-invariant mode: max_prefill_chunk within
        the step budget, rounded down to whole blocks (at least one, unless
        the budget is smaller than a block: then the budget, or no chunk
        would ever fit)."""
        if self.max_num_batched_tokens < self.block_size:
            return self.max_num_batched_tokens
        most = min(self.max_prefill_chunk, self.max_num_batched_tokens)
        return max(self.block_size, most // self.block_size * self.block_size)
