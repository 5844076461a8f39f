"""What changes a request's logits before temperature: logit_bias, the
min_tokens mask and the penalties, in vLLM's order (HF applies the same
three the same way).

1. logit_bias: logits[t] += bias[t] (OpenAI).
2. min_tokens: while fewer than min_tokens tokens were generated, the
   tokens that would end the request (EOS, stop_token_ids) are -inf.
3. repetition_penalty (HF's RepetitionPenaltyLogitsProcessor), over every
   token of the prompt and the output: logit * p where the logit is
   negative, logit / p otherwise.
4. frequency and presence penalties (OpenAI), over output tokens only:
   logit -= frequency * count + presence * (count > 0).

The penalties read each request's token counts, kept on the logits'
device by TokenCounts: a [slots, vocab] buffer of output counts and one of
the prompt's tokens, a slot only for a request that asks for a penalty.
A slot is filled once when its request arrives (prompt, plus the outputs
of a recomputed request), and each sampled token adds one to its count
with a scatter, so no step walks a request's context on the host, and
requests without penalties cost nothing.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.step.host_memory import to_device

INITIAL_SLOTS = 4


class TokenCounts:
    """Per-request token counts on the device, for the penalties."""

    def __init__(self, vocab_size: int, device: torch.device, slots: int = INITIAL_SLOTS):
        self.vocab_size, self.device = vocab_size, device
        self.capacity = 0
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)  # [slots, vocab]
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # [slots, vocab]
        self._free: list[int] = []
        self._initial = slots

    def _grow(self) -> None:
        # Doubling copies each slot at most once on average; slots keep
        # their index, so nothing that names one changes.
        old, new = self.capacity, max(self._initial, 2 * self.capacity)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.float32, device=self.device)
        seen = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        if old:
            counts[:old] = self.output_counts
            seen[:old] = self.prompt_seen
        self.output_counts, self.prompt_seen = counts, seen
        for s in range(old, new):
            heapq.heappush(self._free, s)
        self.capacity = new

    def reset(self) -> None:
        self._free = list(range(self.capacity))

    def add(self, prompt_ids: list[int], output_ids: list[int]) -> int:
        """Takes a slot for a request and fills it; returns the slot."""
        if not self._free:
            self._grow()
        slot = heapq.heappop(self._free)
        self.output_counts[slot].zero_()
        self.prompt_seen[slot].zero_()
        if prompt_ids:
            self.prompt_seen[slot, to_device(np.asarray(prompt_ids, dtype=np.int64), self.device)] = True
        if output_ids:
            ids = to_device(np.asarray(output_ids, dtype=np.int64), self.device)
            self.output_counts[slot].index_add_(0, ids, torch.ones(len(output_ids), device=self.device))
        return slot

    def free(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def record(self, slots: np.ndarray, token_ids: np.ndarray) -> None:
        """Each (slot, token): that token's count goes up by one (a slot
        repeats for a speculating request's several tokens)."""
        if not len(slots):
            return
        flat = to_device((slots * self.vocab_size + token_ids).astype(np.int64), self.device)  # [m]
        self.output_counts.view(-1).index_add_(0, flat, torch.ones(len(slots), device=self.device))


@dataclass(slots=True)
class LogitsProcessors:
    """One step's work before temperature, only for the rows that need it;
    every index is a row of the step's logits."""

    # logit_bias as flat (row, token) entries: [e] each.
    bias_rows: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # The min_tokens mask as flat (row, token) entries: [e] each.
    held_rows: torch.Tensor | None = None
    held_ids: torch.Tensor | None = None
    # Penalised rows [m], their TokenCounts slots [m] and penalties [m].
    penalty_rows: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    counts: TokenCounts | None = None
    # [m, vocab] counts added to the penalised rows' output counts: at a
    # speculative step's verified position, the drafts before it.
    extra_counts: torch.Tensor | None = None

    @property
    def is_empty(self) -> bool:
        return self.bias_rows is None and self.held_rows is None and self.penalty_rows is None

    @classmethod
    def build(cls, bias: list[tuple[int, np.ndarray, np.ndarray]], held: list[tuple[int, np.ndarray]],
              penalised: np.ndarray, slots: np.ndarray, presence: np.ndarray, frequency: np.ndarray,
              repetition: np.ndarray, counts: TokenCounts | None, device: torch.device,
              extra_counts: torch.Tensor | None = None) -> LogitsProcessors:
        """bias: (row, ids, values) per biased row; held: (row, ids) per row
        under min_tokens; penalised rows with their slots and penalties, and
        what to add to their output counts (extra_counts, or None)."""
        p = cls()
        if bias:
            p.bias_rows = to_device(np.concatenate([np.full(len(ids), row, np.int64) for row, ids, _ in bias]), device)
            p.bias_ids = to_device(np.concatenate([ids for _, ids, _ in bias]), device)
            p.bias_values = to_device(np.concatenate([values for _, _, values in bias]), device)
        if held:
            p.held_rows = to_device(np.concatenate([np.full(len(ids), row, np.int64) for row, ids in held]), device)
            p.held_ids = to_device(np.concatenate([ids for _, ids in held]), device)
        if len(penalised):
            p.penalty_rows, p.slots = to_device(penalised, device), to_device(slots, device)
            p.presence, p.frequency = to_device(presence, device), to_device(frequency, device)
            p.repetition, p.counts = to_device(repetition, device), counts
            p.extra_counts = extra_counts
        return p

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n, vocab] float32, changed in place and returned."""
        if self.bias_rows is not None:
            logits.index_put_((self.bias_rows, self.bias_ids), self.bias_values, accumulate=True)
        if self.held_rows is not None:
            logits[self.held_rows, self.held_ids] = float("-inf")
        if self.penalty_rows is not None:
            rows = logits[self.penalty_rows]  # [m, vocab]
            output_counts = self.counts.output_counts[self.slots]
            if self.extra_counts is not None:
                output_counts = output_counts + self.extra_counts
            logits[self.penalty_rows] = apply_penalties(
                rows, output_counts, self.counts.prompt_seen[self.slots], self.presence, self.frequency,
                self.repetition)
        return logits


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_seen: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """logits, output_counts [m, vocab] float32, prompt_seen [m, vocab] bool,
    penalties [m]: repetition over prompt and output, then frequency and
    presence over output."""
    generated = output_counts > 0  # [m, vocab]
    rep = repetition[:, None]  # [m, 1]
    penalised = torch.where(logits < 0, logits * rep, logits / rep)
    logits = torch.where(prompt_seen | generated, penalised, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * generated
