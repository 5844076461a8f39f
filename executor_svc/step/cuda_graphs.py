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
"""

from __future__ import annotations

import logging

import torch

from executor_svc.attention import AttentionBackend, AttentionMetadata

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512


def graph_buckets(max_batch: int = MAX_GRAPH_BATCH) -> list[int]:
    """Powers of two up to max_batch (and max_batch itself)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 backend: AttentionBackend, device: torch.device, max_blocks_per_seq: int,
                 max_batch: int = MAX_GRAPH_BATCH):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.buckets = graph_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)  # [max_batch]
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # [max_batch]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)  # [max_batch]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [max_batch]
        self.cu_query_lens = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token per row
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> [bucket, vocab], written by each replay
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture(device)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], cu_query_lens=self.cu_query_lens[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            # Host copies only the torch backend reads; graphs run with Triton.
            query_lens_host=[1] * bs, seq_lens_host=[1] * bs,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._meta(bs), self.backend)
        return self.model.compute_logits(hidden)  # [bs, vocab]

    @torch.inference_mode()
    def _capture(self, device: torch.device) -> None:
        pool = torch.cuda.graph_pool_handle()
        # Largest first, so smaller graphs reuse its memory from the shared pool.
        for bs in reversed(self.buckets):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm-up: Triton compiles, the allocator settles
                for _ in range(2):
                    self._forward(bs)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(device)
        log.info("CUDA graphs captured for decode batch sizes %s", self.buckets)

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [n, vocab] of a decode step of n <= max_batch requests,
        one token each; the tensors are on the device. The result is a view
        of a static buffer, valid until the next replay."""
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
        self.graphs[bs].replay()
        return self.logits[bs][:n]
