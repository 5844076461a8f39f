"""Builders for paged-KV test batches, shared by the kernel tests.

A batch is described by per-request (q_len, context_len): q_len new tokens whose K/V are
already in the cache, after context_len earlier cached positions (prefix-cache hit or
earlier prefill chunks). seq_len = context_len + q_len.
"""

from __future__ import annotations

import dataclasses

import torch

from llmsched_kernels import reference

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# (atol, rtol) per dtype for kernel-vs-reference attention outputs. The kernels feed
# softmax probabilities to the P @ V matmul in the input dtype (as flash attention does),
# so half-precision outputs may differ from the fp32-probability reference by an ulp or two.
ATTENTION_TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}

# Mixed batch: decode, first-chunk prefill, later prefill chunk on a cached prefix,
# a prefill longer than one 64-row query tile, a one-token prompt.
MIXED = ((1, 37), (1, 70), (19, 0), (7, 45), (66, 13), (1, 0))
DECODE = ((1, 1), (1, 16), (1, 64), (1, 100), (1, 131))
PREFILL = ((23, 0), (40, 0))
# Prefill longer than the largest test window (64), so every window changes the result.
LONG_PREFILL = ((90, 0), (23, 0))

# Window sizes the issue asks for (None = no window) and a soft-cap small enough to
# change outputs by far more than ATTENTION_TOLERANCES for unit-scale random q/k.
WINDOWS = (None, 1, 17, 64)
SOFTCAP = 2.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_query_lens: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    scale: float
    keys: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim], dense
    values: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim], dense

    def context_lens(self) -> list[int]:
        q_lens = (self.cu_query_lens[1:] - self.cu_query_lens[:-1]).tolist()
        return [s - q for s, q in zip(self.seq_lens.tolist(), q_lens)]

    def attention_args(self):
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.cu_query_lens,
            self.seq_lens,
            self.block_tables,
            self.scale,
        )


def make_paged_batch(
    reqs: tuple[tuple[int, int], ...],  # (q_len, context_len) per request
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    spare_blocks: int = 3,
    extra_table_cols: int = 2,
) -> PagedBatch:
    """Random batch whose K/V sit in randomly permuted cache blocks.

    Every cache slot that no request owns is NaN, and block-table padding points at a
    NaN "poison" block, so a kernel that reads a position it must not see produces NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    q_lens = [q for q, _ in reqs]
    seq_lens = [q + c for q, c in reqs]
    blocks_needed = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + spare_blocks + 1
    poison_block = num_blocks - 1

    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = torch.full((len(reqs), max(blocks_needed) + extra_table_cols), poison_block, dtype=torch.int32)
    free_blocks = torch.randperm(num_blocks - 1, generator=gen).tolist()

    keys, values = [], []
    for req, seq_len in enumerate(seq_lens):
        owned = [free_blocks.pop() for _ in range(blocks_needed[req])]
        block_tables[req, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
        key = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)  # [seq_len, kvh, d]
        value = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)  # [seq_len, kvh, d]
        positions = torch.arange(seq_len)
        slots = block_tables[req, positions // block_size].long() * block_size + positions % block_size
        reference.write_kv_cache(key, value, k_cache, v_cache, slots)
        keys.append(key.to(device))
        values.append(value.to(device))

    cu_query_lens = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    query = torch.randn(int(cu_query_lens[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        query=query.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        cu_query_lens=cu_query_lens.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        scale=head_dim**-0.5,
        keys=keys,
        values=values,
    )


def poison_outside_window(batch: PagedBatch, window: int, align: int = 64) -> int:
    """NaN into every cached position of a request that lies in an ``align``-position
    tile wholly before the window of the request's first query; returns how many.

    The first query of a request has the earliest window, so no query of the request
    sees these positions, and with ``align`` a multiple of the kernel's TILE_N they
    fill whole KV tiles. A kernel that loads such a tile and only masks it multiplies
    the poisoned V rows by probability 0, and 0 * NaN = NaN: only skipping the tile
    keeps the output finite.
    """
    block_size = batch.k_cache.shape[1]
    poisoned = 0
    for req, context_len in enumerate(batch.context_lens()):
        end = max(0, context_len - window + 1) // align * align  # first query sees >= context_len - W + 1
        positions = torch.arange(end, device=batch.k_cache.device)  # [end]
        block_ids = batch.block_tables[req].long()[positions // block_size]  # [end]
        batch.k_cache[block_ids, positions % block_size] = float("nan")
        batch.v_cache[block_ids, positions % block_size] = float("nan")
        poisoned += end
    return poisoned


def huge_stride_cache(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:  # [3, block_size, num_kv_heads, head_dim], block stride 2^30 elements
    """A 3-block cache view whose block 2 starts 2^31 elements past block 0.

    block_id * block_stride overflows int32 for block 2 (2 * 2^30 = 2^31), which catches
    kernels that forget to widen block ids to int64. The view starts 2^31 elements into
    its storage so that a wrapped (negative) offset still lands inside the allocation
    (wrong data, not a crash). The storage is 2^32 + a few elements of virtual memory;
    only the touched pages become resident, a few MB.
    """
    block_stride = 2**30
    view_offset = 2**31
    block_numel = block_size * num_kv_heads * head_dim
    storage = torch.empty(view_offset + 2 * block_stride + block_numel, dtype=dtype, device=device)
    return storage.as_strided(
        (3, block_size, num_kv_heads, head_dim),
        (block_stride, num_kv_heads * head_dim, head_dim, 1),
        view_offset,
    )
