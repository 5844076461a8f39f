"""The executor's mirror of request state, one preallocated row per request.

The scheduler sends a request's token ids and block ids once; later plans
only name its handle, the blocks it gained and how many tokens to compute,
and the executor appends the tokens it samples itself. Each plan's diffs
update rows in place, so building a step never walks a request's whole
context or block list.

Rows are host numpy arrays (cheap to index from Python and vectorized over
the scheduled rows). The block table also lives on the model's device: on
CPU it is the same memory, on CUDA a device copy that receives only the
entries a plan adds.

The number of rows doubles when every row is taken, rather than coming
from a setting: the executor learns the batch size from the plans it gets,
and a doubling copies each row at most once on average.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from executor_svc.step.host_memory import to_device
from executor_svc.step.logits_processors import TokenCounts
from executor_svc.step.sampler import GREEDY_BELOW_TEMPERATURE, SamplingSettings, signed_seed

INITIAL_ROWS = 16


class PlanError(ValueError):
    """The plan contradicts the executor's mirror of request state."""


class RequestRows:
    def __init__(self, max_model_len: int, block_size: int, device: torch.device, rows: int = INITIAL_ROWS,
                 vocab_size: int = 0):
        self.max_model_len, self.block_size, self.device = max_model_len, block_size, device
        # Token counts of the requests with penalties, on the device
        # (logits_processors.py); penalty_slot[row] = -1 for the others.
        self.counts = TokenCounts(vocab_size, device)
        # logit_bias (ids, values) and the ids min_tokens holds back, of
        # the rows that set them; has_bias[row] says so without a lookup.
        self.logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.held_ids: dict[int, np.ndarray] = {}
        # Embedding rows' pooling so far (mean: the sum of the hidden states
        # computed; CLS: the first one), until their last prompt chunk.
        self.pooled: dict[int, torch.Tensor] = {}
        # One more column than max_model_len: a request that computed all
        # max_model_len positions still stores the token it sampled.
        self.width = max_model_len + 1
        self.max_blocks = -(-self.width // block_size)
        self.capacity = 0
        self.handle_rows: dict[int, int] = {}
        self._free: list[int] = []  # min-heap: low rows first keeps a batch's rows contiguous
        self._alloc(rows)

    def _alloc(self, rows: int) -> None:
        old = self.capacity

        def grow(a: np.ndarray | None, shape: tuple[int, ...], dtype) -> np.ndarray:
            new = np.zeros(shape, dtype=dtype)
            if a is not None:
                new[:old] = a
            return new

        get = lambda name: getattr(self, name, None)  # noqa: E731
        self.token_ids = grow(get("token_ids"), (rows, self.width), np.int32)  # [rows, width]
        self.block_table_host = grow(get("block_table_host"), (rows, self.max_blocks), np.int32)  # [rows, max_blocks]
        self.num_tokens = grow(get("num_tokens"), (rows,), np.int64)  # token ids known
        self.num_computed = grow(get("num_computed"), (rows,), np.int64)  # tokens with KV in the cache
        # Tokens with KV in a draft model's pool (draft_model.py): it lags
        # num_computed and is never ahead of it after a step.
        self.num_draft_computed = grow(get("num_draft_computed"), (rows,), np.int64)
        self.num_blocks = grow(get("num_blocks"), (rows,), np.int64)
        self.num_output = grow(get("num_output"), (rows,), np.int64)  # generated tokens: the seeded position
        self.handle = grow(get("handle"), (rows,), np.int64)
        self.temperature = grow(get("temperature"), (rows,), np.float32)
        self.top_p = grow(get("top_p"), (rows,), np.float32)
        self.top_k = grow(get("top_k"), (rows,), np.int64)
        self.seed = grow(get("seed"), (rows,), np.int64)
        self.seeded = grow(get("seeded"), (rows,), bool)
        self.num_logprobs = grow(get("num_logprobs"), (rows,), np.int64)
        self.presence_penalty = grow(get("presence_penalty"), (rows,), np.float32)
        self.frequency_penalty = grow(get("frequency_penalty"), (rows,), np.float32)
        self.repetition_penalty = grow(get("repetition_penalty"), (rows,), np.float32)
        self.penalty_slot = grow(get("penalty_slot"), (rows,), np.int64)
        self.penalty_slot[old:] = -1
        self.min_p = grow(get("min_p"), (rows,), np.float32)
        self.min_tokens = grow(get("min_tokens"), (rows,), np.int64)
        self.has_bias = grow(get("has_bias"), (rows,), bool)
        # Greedy with nothing else to apply (no logprobs, penalties,
        # logit_bias or min_tokens): its token is the argmax, no more.
        self.plain_greedy = grow(get("plain_greedy"), (rows,), bool)
        self.prompt_logprobs = grow(get("prompt_logprobs"), (rows,), np.int64)  # top alternatives; -1 = none
        self.embed = grow(get("embed"), (rows,), bool)  # prefill only: pooled, never sampled
        # The LoRA adapter's id (its index in LoraSet.names, model/lora.py),
        # not its slot: the scheduler may move a parked request's adapter
        # to another slot. -1 = the base model.
        self.adapter = grow(get("adapter"), (rows,), np.int64)
        if self.device.type == "cpu":
            self.block_table = torch.from_numpy(self.block_table_host)  # [rows, max_blocks], shared
        else:
            table = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=self.device)
            if old:
                table[:old] = self.block_table
            self.block_table = table
        for r in range(old, rows):
            heapq.heappush(self._free, r)
        self.capacity = rows

    def reset(self) -> None:
        self.handle_rows.clear()
        self._free = list(range(self.capacity))
        self.counts.reset()
        self.penalty_slot[:] = -1
        self.logit_bias.clear()
        self.held_ids.clear()
        self.pooled.clear()

    def row_of(self, handle: int) -> int:
        try:
            return self.handle_rows[handle]
        except KeyError:
            raise PlanError(f"plan names request handle {handle}, which the executor does not hold") from None

    def finish(self, handle: int) -> None:
        row = self.handle_rows.pop(handle, None)
        if row is not None:
            heapq.heappush(self._free, row)
            self.pooled.pop(row, None)
            if self.penalty_slot[row] >= 0:
                self.counts.free(int(self.penalty_slot[row]))
                self.penalty_slot[row] = -1

    def add(self, handle: int, token_ids: list[int], block_ids: list[int], num_computed: int,
            sampling: SamplingSettings, num_output: int, embed: bool = False,
            adapter: int = -1) -> tuple[int, np.ndarray]:
        """Takes a row for a new (or re-sent) request; returns it and the
        flat block-table indices it wrote."""
        n, nb = len(token_ids), len(block_ids)
        if n > self.max_model_len:
            raise PlanError(f"handle {handle}: {n} tokens exceed max_model_len {self.max_model_len}")
        if nb > self.max_blocks:
            raise PlanError(f"handle {handle}: {nb} blocks exceed the {self.max_blocks} a request can use")
        if not 0 <= num_computed <= n:
            raise PlanError(f"handle {handle}: {num_computed} computed tokens out of {n}")
        self.finish(handle)  # a handle re-sent without a finish replaces its old state
        if not self._free:
            self._alloc(2 * self.capacity)
        row = heapq.heappop(self._free)
        self.handle_rows[handle] = row
        self.token_ids[row, :n] = token_ids
        self.block_table_host[row, :nb] = block_ids
        self.num_tokens[row], self.num_computed[row], self.num_blocks[row] = n, num_computed, nb
        self.num_draft_computed[row] = 0  # whatever its blocks hold, the draft model recomputes
        self.num_output[row], self.handle[row] = num_output, handle
        self.temperature[row], self.top_p[row], self.top_k[row] = sampling.temperature, sampling.top_p, sampling.top_k
        self.seeded[row] = sampling.seed is not None
        self.seed[row] = signed_seed(sampling.seed or 0)
        self.num_logprobs[row] = sampling.logprobs
        self.presence_penalty[row] = sampling.presence_penalty
        self.frequency_penalty[row] = sampling.frequency_penalty
        self.repetition_penalty[row] = sampling.repetition_penalty
        self.min_p[row], self.min_tokens[row] = sampling.min_p, sampling.min_tokens
        self.prompt_logprobs[row] = -1 if sampling.prompt_logprobs is None else sampling.prompt_logprobs
        self.embed[row] = embed
        self.adapter[row] = adapter
        if sampling.has_penalties:
            num_prompt = n - num_output
            self.penalty_slot[row] = self.counts.add(token_ids[:num_prompt], token_ids[num_prompt:])
        else:
            self.penalty_slot[row] = -1
        self.has_bias[row] = bool(sampling.logit_bias)
        if sampling.logit_bias:
            ids, values = zip(*sampling.logit_bias)
            self.logit_bias[row] = (np.array(ids, dtype=np.int64), np.array(values, dtype=np.float32))
        else:
            self.logit_bias.pop(row, None)
        if sampling.min_tokens and sampling.min_tokens_held_ids:
            self.held_ids[row] = np.array(sampling.min_tokens_held_ids, dtype=np.int64)
        else:
            self.held_ids.pop(row, None)
            self.min_tokens[row] = 0  # nothing to hold back
        self.plain_greedy[row] = (sampling.temperature < GREEDY_BELOW_TEMPERATURE and not sampling.logprobs
                                  and self.penalty_slot[row] < 0 and not sampling.logit_bias
                                  and not self.min_tokens[row])
        return row, row * self.max_blocks + np.arange(nb)

    def append_block(self, handle: int, block_id: int) -> int:
        """Appends a block to a request's table; returns its flat index."""
        row = self.row_of(handle)
        col = self.num_blocks[row]
        if col >= self.max_blocks:
            raise PlanError(f"handle {handle}: more than {self.max_blocks} blocks")
        self.block_table_host[row, col] = block_id
        self.num_blocks[row] = col + 1
        return row * self.max_blocks + col

    def sync_block_table(self, flat_index: np.ndarray) -> None:
        """Sends the host table's entries at flat_index to the device copy
        (nothing to do on CPU, where both are the same memory)."""
        if self.device.type == "cpu" or not len(flat_index):
            return
        values = self.block_table_host.reshape(-1)[flat_index]
        self.block_table.view(-1)[to_device(flat_index, self.device)] = to_device(values, self.device)
