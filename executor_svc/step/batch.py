"""One forward's inputs: the scheduled rows' query tokens back to back
(unpadded), their positions, KV slots and attention metadata, gathered
from the request rows with vectorized ops. The target model's steps and
the draft model's (draft_model.py) build theirs the same way, over the
same block tables."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.attention import AttentionMetadata
from executor_svc.step.host_memory import to_device
from executor_svc.step.request_rows import RequestRows


@dataclass(slots=True)
class StepInputs:
    cu: np.ndarray  # [n + 1] int64: where each row's query tokens start
    input_ids: np.ndarray  # [num_tokens] int32, on the host
    ids: torch.Tensor  # [num_tokens] int64, on the device
    positions: torch.Tensor  # [num_tokens] int64, on the device
    meta: AttentionMetadata
    max_blocks: int  # block-table columns the batch reads

    @property
    def num_tokens(self) -> int:
        return int(self.cu[-1])


def step_inputs(r: RequestRows, rows: np.ndarray, start: np.ndarray, q: np.ndarray,
                device: torch.device, shift: int = 0) -> StepInputs:
    """rows[i] computes q[i] tokens from position start[i]; rows ascending.
    With shift, each position's input is the token that many places after
    it (a multi-token-prediction layer reads the next one)."""
    block_size = r.block_size
    end = start + q
    cu = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    num_tokens = int(cu[-1])
    if num_tokens == len(rows):  # decode only
        positions, tok_rows = start, rows  # [num_tokens]
    else:
        positions = np.arange(num_tokens) - np.repeat(cu[:-1] - start, q)  # [num_tokens]
        tok_rows = np.repeat(rows, q)
    input_ids = r.token_ids.reshape(-1)[tok_rows * r.width + positions + shift]  # [num_tokens] int32
    # slot = block_table[row, pos // block_size] * block_size + pos % block_size
    slots = r.block_table_host.reshape(-1)[tok_rows * r.max_blocks + positions // block_size]
    slot_mapping = slots.astype(np.int64) * block_size + positions % block_size  # [num_tokens]
    max_blocks = int(-(-end.max() // block_size))
    first = int(rows[0])
    if int(rows[-1]) - first + 1 == len(rows):
        block_tables = r.block_table[first : first + len(rows), :max_blocks]  # [n, max_blocks] view
    else:
        block_tables = r.block_table[to_device(rows, device), :max_blocks]  # [n, max_blocks]
    meta = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, device),
        cu_query_lens=to_device(cu.astype(np.int32), device),
        seq_lens=to_device(end.astype(np.int32), device),
        block_tables=block_tables,
        query_lens_host=q.tolist(),
        seq_lens_host=end.tolist(),
    )
    return StepInputs(cu, input_ids, to_device(input_ids.astype(np.int64), device), to_device(positions, device),
                      meta, max_blocks)


def decode_inputs(r: RequestRows, rows: np.ndarray, start: np.ndarray
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CPU decode step's inputs for the compiled graph (compiled_decode.py),
    rows[i] (ascending) computing its token at position start[i]: token ids,
    positions, KV slots (int64, [n] each), the block table ([n, blocks
    read], int64, as the graph indexes with it) and the rows' lengths (int32,
    [n]). Host arrays, shared with the tensors: no attention metadata, whose
    host lists and device copies only the eager backends read."""
    block_size = r.block_size
    input_ids = r.token_ids[rows, start].astype(np.int64)
    slot_mapping = r.block_table_host[rows, start // block_size].astype(np.int64) * block_size + start % block_size
    width = -(-(int(start.max()) + 1) // block_size)
    first = int(rows[0])
    if int(rows[-1]) - first + 1 == len(rows):
        block_ids = r.block_table_host[first : first + len(rows), :width]
    else:
        block_ids = r.block_table_host[rows, :width]
    return (torch.from_numpy(input_ids), torch.from_numpy(start), torch.from_numpy(slot_mapping),
            torch.from_numpy(block_ids.astype(np.int64)), torch.from_numpy((start + 1).astype(np.int32)))
