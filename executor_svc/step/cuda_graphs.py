"""CUDA graphs for decode steps (EXECUTOR_CUDA_GRAPHS=auto on CUDA with
the Triton backend).

A decode step of a small batch is dominated by kernel launches: a few
hundred of them for the forward pass and the LM head. Each batch-size
bucket (1, 2, 4, ..., MAX_GRAPH_BATCH) is captured once at start-up, over
static input buffers; a step copies its inputs into the buffers, pads to
the bucket and replays. Prefill and mixed steps, and decode batches past
the largest bucket, run eagerly.

Padding rows write nothing (slot -1, which the KV-write kernel skips) and
attend to one position of a valid block, so their outputs are finite and
thrown away. The attention kernel picks its tiles from host-known shapes
only, which is what makes it capturable; the block table it sees is always
the full-width static one.

An executor that speculates (ngram or draft) also replays graphs for its
verify steps (VerifyGraphs): without them a verify step ran eagerly, at
kernel-launch speed, beside replayed decode steps, and at batch 1 lost
more than its drafts gained. A verify step's rows hold 1 to Q = 1 +
EXECUTOR_SPECULATIVE_TOKENS tokens each, so a graph of `rows` rows takes
rows * Q + 1 tokens in rows + 1 requests whose query lengths are data
(cu_query_lens), not shapes: the real rows come first, as they are, then
padding requests of one token each for the bucket's unused rows, and a
last one that takes every token left over (verify_layout). The padding
requests attend to their own positions over valid blocks and write
nothing.

A proposer that reads the target's hidden states (MTP, EAGLE-3:
head_drafts.py) gets them from the graphs too: each graph then also
computes the proposer's features (`features`) from the forward's final
hidden states, or from the layers' states it kept on the way, into a
static buffer of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from executor_svc.attention import AttentionBackend, AttentionMetadata

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512
# Verify steps of more rows run eagerly. The scheduler stops drafting above
# SCHEDULER_SPECULATIVE_MAX_BATCH running requests (16 by default), and each
# bucket keeps a [rows * Q + 1, vocab] logits buffer.
MAX_VERIFY_BATCH = 32


def graph_buckets(max_batch: int = MAX_GRAPH_BATCH) -> list[int]:
    """Powers of two up to max_batch (and max_batch itself)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


# A graph's outputs: every row's (or token's) logits, and the proposer's
# features of its hidden states (None without a proposer that reads them).
Outputs = tuple[torch.Tensor, "torch.Tensor | None"]
Features = Callable[[torch.Tensor], torch.Tensor]


class DecodeGraphs:
    """Captured decode steps, one graph per bucket. capture=False runs the
    same padded forward over the static buffers without a graph (on a CPU,
    the Triton backend under its interpreter: tests). pool: a graph memory
    pool to share (default: a new one). features: what a proposer reads of
    each step's hidden states (see the module docstring), or None."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 backend: AttentionBackend, device: torch.device, max_blocks_per_seq: int,
                 max_batch: int = MAX_GRAPH_BATCH, pool=None, capture: bool = True, features: Features | None = None):
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model, self.kv_caches, self.backend, self.features = model, kv_caches, backend, features
        self.buckets = graph_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)  # [max_batch]
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # [max_batch]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)  # [max_batch]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [max_batch]
        self.cu_query_lens = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token per row
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.outputs: dict[int, Outputs] = {}  # bucket -> [bucket, vocab] and features, written by each replay
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Shared with the verify graphs (and a draft model's): replays never
        # overlap, and each graph's output buffer stays referenced, so no
        # later capture reuses it.
        self.pool = None
        if capture:
            self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
            self._capture(device)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], cu_query_lens=self.cu_query_lens[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            # Host copies only the torch backend reads; graphs run with Triton.
            query_lens_host=[1] * bs, seq_lens_host=[1] * bs,
        )

    def _forward(self, bs: int) -> Outputs:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._meta(bs), self.backend)
        return forward_outputs(self.model, hidden, self.features)

    @torch.inference_mode()
    def _capture(self, device: torch.device) -> None:
        # Largest first, so smaller graphs reuse its memory from the shared pool.
        for bs in reversed(self.buckets):
            self.graphs[bs], self.outputs[bs] = capture(lambda: self._forward(bs), device, self.pool)
        log.info("CUDA graphs captured for decode batch sizes %s", self.buckets)

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> Outputs:
        """Logits [n, vocab] of a decode step of n <= max_batch requests,
        one token each, and their features (or None); the tensors are on
        the device. The results are views of static buffers, valid until
        the next replay."""
        n = input_ids.shape[0]
        bs = self.bucket_for(n)
        if bs is None:
            raise ValueError(f"decode batch of {n} is past the largest graph ({self.max_batch})")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if bs > n:
            # Padding rows: no KV write, one position of attention. Their
            # ids, positions and tables stay from earlier steps: all valid.
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
        if self.graphs:
            self.graphs[bs].replay()
        return first(self.outputs[bs] if self.graphs else self._forward(bs), n)


def forward_outputs(model: torch.nn.Module, hidden: torch.Tensor, features: Features | None) -> Outputs:
    return model.compute_logits(hidden), None if features is None else features(hidden)


def first(outputs: Outputs, n: int) -> Outputs:
    logits, features = outputs
    return logits[:n], None if features is None else features[:n]


def capture(forward, device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, Outputs]:
    """forward() captured into a graph on `pool`, after two warm-up runs on
    a side stream (Triton compiles, the allocator settles); returns the
    graph and its output, a static buffer each replay writes."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    torch.cuda.synchronize(device)
    return graph, out


def verify_layout(q: np.ndarray, seq_lens: np.ndarray, rows: int, q_len: int) -> tuple[np.ndarray, np.ndarray]:
    """A verify step of len(q) rows, row i computing q[i] <= q_len tokens
    and reaching length seq_lens[i], laid out in a graph of `rows` rows
    (rows * q_len + 1 tokens in rows + 1 requests): cu_query_lens [rows +
    2] and seq_lens [rows + 1], int32. The step's rows keep their tokens and
    lengths; requests len(q) .. rows - 1 hold one padding token each, and
    the last request every token left (at least one), each padding request
    as long as its query (it attends to its own tokens only)."""
    n, total = len(q), rows * q_len + 1
    query = np.ones(rows + 1, dtype=np.int64)
    query[:n] = q
    query[rows] = total - int(query[:rows].sum())
    cu = np.zeros(rows + 2, dtype=np.int32)
    np.cumsum(query, out=cu[1:])
    lens = query.astype(np.int32)
    lens[:n] = seq_lens
    return cu, lens


class VerifyGraphs:
    """Captured verify steps (see the module docstring): one graph per
    bucket of rows (1, 2, 4, ... MAX_VERIFY_BATCH), each over rows * q_len
    + 1 tokens. capture=False runs the same staged forward without a
    graph, so the layout can be checked on a CPU (the Triton backend under
    its interpreter)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 backend: AttentionBackend, device: torch.device, max_blocks_per_seq: int, block_size: int,
                 q_len: int, pool=None, capture: bool = True, max_batch: int = MAX_VERIFY_BATCH,
                 features: Features | None = None):
        self.model, self.kv_caches, self.backend, self.q_len = model, kv_caches, backend, q_len
        self.features = features
        # The last padding request holds up to rows * (q_len - 1) + 1
        # tokens, which its block table must cover.
        room = max_blocks_per_seq * block_size
        self.buckets = [b for b in graph_buckets(max_batch) if b * (q_len - 1) + 1 <= room]
        if not self.buckets:
            raise ValueError(f"no verify graph fits {room} positions a request with {q_len} tokens a row")
        self.max_batch = self.buckets[-1]
        tokens, reqs = self.max_batch * q_len + 1, self.max_batch + 1
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.long, device=device)
        self.cu_query_lens = torch.zeros(reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(reqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(reqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.outputs: dict[int, Outputs] = {}  # bucket -> [bucket * q_len + 1, vocab] and features
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture(device, pool)

    def _forward(self, bs: int) -> Outputs:
        tokens = bs * self.q_len + 1
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens], cu_query_lens=self.cu_query_lens[:bs + 2],
            seq_lens=self.seq_lens[:bs + 1], block_tables=self.block_tables[:bs + 1],
            # Host copies only the torch backend reads; graphs run with
            # Triton. Their number is the requests'; their values are not
            # this step's (host_lists).
            query_lens_host=[1] * (bs + 1), seq_lens_host=[1] * (bs + 1), host_lists=False,
        )
        hidden = self.model(self.input_ids[:tokens], self.positions[:tokens], self.kv_caches, meta, self.backend)
        return forward_outputs(self.model, hidden, self.features)

    def _stage_layout(self, q: np.ndarray, seq_lens: np.ndarray, bs: int) -> None:
        cu, lens = verify_layout(q, seq_lens, bs, self.q_len)
        self.cu_query_lens[:bs + 2].copy_(torch.from_numpy(cu))
        self.seq_lens[:bs + 1].copy_(torch.from_numpy(lens))

    @torch.inference_mode()
    def _capture(self, device: torch.device, pool) -> None:
        for bs in reversed(self.buckets):
            # Every row one token, none written (slot -1): the warm-up runs
            # must leave the pool as it was.
            self._stage_layout(np.ones(bs, dtype=np.int64), np.ones(bs, dtype=np.int64), bs)
            self.graphs[bs], self.outputs[bs] = capture(lambda: self._forward(bs), device, pool)
        log.info("CUDA graphs captured for verify steps of %s rows, %d tokens a row", self.buckets, self.q_len)

    def fits(self, q: np.ndarray) -> bool:
        """Whether a verify step whose rows compute q tokens each replays a graph."""
        return len(q) <= self.max_batch and int(q.max()) <= self.q_len

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            q: np.ndarray) -> Outputs:
        """Every token's logits [num_tokens, vocab] of a verify step whose
        rows compute q[i] tokens each (fits(q)), laid out as the runner's
        batch is, and their features (or None); its K/V are written at
        meta.slot_mapping. Views of static buffers, valid until the next
        replay."""
        n, num_tokens = len(q), int(q.sum())
        bs = next(b for b in self.buckets if b >= n)
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        # Padding tokens write nothing; their ids and positions stay from
        # earlier steps (all valid), as do the padding requests' tables.
        self.slot_mapping[num_tokens:bs * self.q_len + 1].fill_(-1)
        self._stage_layout(q, np.asarray(meta.seq_lens_host), bs)
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if self.graphs:
            self.graphs[bs].replay()
        return first(self.outputs[bs] if self.graphs else self._forward(bs), num_tokens)
