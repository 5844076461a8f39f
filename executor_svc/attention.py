"""Attention over the paged KV cache, behind one small interface.

The model calls `write_kv` then `attend` for every layer and never knows
which backend runs. The KV cache of one layer is a pair of tensors
`[num_blocks, block_size, num_kv_heads, head_dim]`; a token's slot is
`block_id * block_size + offset`, as laid out by the scheduler's block
tables.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one flattened, unpadded step batch (requests back to back)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    cu_query_lens: torch.Tensor  # [num_reqs + 1] int32: query offsets per request
    seq_lens: torch.Tensor  # [num_reqs] int32: context length incl. this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    # Host-side copies, so the torch backend can split the batch without
    # device syncs.
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_host)


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None: ...

    def attend(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        sliding_window: int | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        """sliding_window W: a query at position i sees keys i-W < j <= i.
        softcap c: scaled scores become c * tanh(scores / c) before masking."""
        ...


# Decode requests attended per SDPA call by the torch backend.
DECODE_GROUP = 32


class TorchAttentionBackend:
    """Plain PyTorch: decode requests batched in one masked SDPA call over
    their gathered blocks, prefill chunks one request at a time (their query
    lengths differ, so batching them would mostly multiply padding)."""

    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, meta):
        # key, value: [num_tokens, num_kv_heads, head_dim]
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = key
        v_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = value

    def attend(self, query, k_cache, v_cache, meta, scale, sliding_window=None, softcap=None):
        # query: [num_tokens, num_heads, head_dim]
        out = torch.empty_like(query)
        window = (sliding_window, softcap)
        block_size = k_cache.shape[1]
        decode_reqs: list[int] = []
        decode_tokens: list[int] = []
        start = 0
        for r, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            if q_len == 1:
                decode_reqs.append(r)
                decode_tokens.append(start)
            else:
                out[start : start + q_len] = self._prefill_one(
                    query[start : start + q_len], k_cache, v_cache, meta.block_tables[r], seq_len, block_size, scale,
                    *window,
                )
            start += q_len
        # Decodes sorted by context length and batched in groups, so each
        # group gathers little more than its own context: one batch padded
        # to the longest context read several times the KV it needed.
        order = sorted(range(len(decode_reqs)), key=lambda i: meta.seq_lens_host[decode_reqs[i]])
        for g in range(0, len(order), DECODE_GROUP):
            group = order[g : g + DECODE_GROUP]
            tokens = torch.tensor([decode_tokens[i] for i in group], dtype=torch.long, device=query.device)
            reqs = torch.tensor([decode_reqs[i] for i in group], dtype=torch.long, device=query.device)
            max_seq = meta.seq_lens_host[decode_reqs[group[-1]]]
            out[tokens] = self._decode_batch(query[tokens], k_cache, v_cache, meta, reqs, max_seq, scale, *window)
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        # cache: [num_blocks, block_size, num_kv_heads, head_dim]; block_ids: [..., nb]
        # index_select on the flat block dimension copies whole blocks, about
        # twice as fast on CPU as advanced indexing with a 2-D index.
        blocks = cache.index_select(0, block_ids.reshape(-1))  # [n * nb, block_size, num_kv_heads, head_dim]
        return blocks.view(*block_ids.shape[:-1], -1, *cache.shape[2:])  # [..., nb * block_size, kvh, d]

    def _prefill_one(self, q, k_cache, v_cache, block_table, seq_len, block_size, scale, sliding_window, softcap):
        # q: [q_len, num_heads, head_dim]
        q_len = q.shape[0]
        num_blocks = -(-seq_len // block_size)
        k = self._gather(k_cache, block_table[:num_blocks])[:seq_len]  # [seq_len, kvh, d]
        v = self._gather(v_cache, block_table[:num_blocks])[:seq_len]
        if seq_len == q_len and sliding_window is None and softcap is None:
            mask, causal = None, True
        else:
            # Query i sits at position seq_len - q_len + i and sees keys <= it
            # (and, with a window W, keys > it - W).
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            mask = k_pos <= q_pos  # [q_len, seq_len]
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            causal = False
        o = _sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, causal, scale, softcap)
        return o.transpose(0, 1)  # [q_len, num_heads, head_dim]

    def _decode_batch(self, q, k_cache, v_cache, meta, reqs, max_seq, scale, sliding_window, softcap):
        # q: [num_decodes, num_heads, head_dim]
        block_size = k_cache.shape[1]
        num_blocks = -(-max_seq // block_size)
        tables = meta.block_tables[reqs, :num_blocks]  # [num_decodes, num_blocks]
        k = self._gather(k_cache, tables)[:, :max_seq]  # [num_decodes, max_seq, kvh, d]
        v = self._gather(v_cache, tables)[:, :max_seq]
        seq_lens = meta.seq_lens[reqs].to(torch.long)  # [num_decodes]
        k_pos = torch.arange(max_seq, device=q.device)[None, :]
        mask = k_pos < seq_lens[:, None]  # [num_decodes, max_seq]
        if sliding_window is not None:  # the query sits at seq_len - 1
            mask &= k_pos >= seq_lens[:, None] - sliding_window
        o = _sdpa(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :], False, scale, softcap)
        return o.squeeze(2)  # [num_decodes, num_heads, head_dim]


def _sdpa(q, k, v, mask, causal, scale, softcap):
    """SDPA over [..., heads, q_len, d] x [..., kv_heads, kv_len, d]; SDPA
    cannot soft-cap scores, so a capped layer takes the explicit path (as
    HF's eager attention does: cap, mask, fp32 softmax)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap  # [..., heads, q_len, kv_len]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


class TritonAttentionBackend:
    """The Triton kernels in kernels/: one launch writes a layer's K/V, one
    launch attends the whole mixed batch (decodes, prefills and chunks
    alike). Runs on CUDA, or on CPU under Triton's interpreter
    (TRITON_INTERPRET=1, slow: for tests only).

    kernels.* is imported here, not at module level, so the torch backend
    never imports triton.
    """

    name = "triton"

    def __init__(self) -> None:
        try:
            from kernels.kv_write import write_kv_cache
            from kernels.paged_attention import paged_attention
        except ImportError as exc:
            raise RuntimeError(
                f"attention backend 'triton' needs the triton package, which failed to import: {exc}"
            ) from exc
        self._write_kv_cache = write_kv_cache
        self._paged_attention = paged_attention

    def write_kv(self, key, value, k_cache, v_cache, meta):
        # key, value: [num_tokens, num_kv_heads, head_dim]. The launcher wants
        # head_dim contiguous and a contiguous int32/int64 slot_mapping; what
        # the runner builds already is, so these are no-ops there.
        self._write_kv_cache(
            _unit_last_stride(key), _unit_last_stride(value), k_cache, v_cache,
            _index_tensor(meta.slot_mapping, torch.int64),
        )

    def attend(self, query, k_cache, v_cache, meta, scale, sliding_window=None, softcap=None):
        # query: [num_tokens, num_heads, head_dim] -> same shape
        if sliding_window is not None or softcap is not None:
            # kernelwin's branch adds both to kernels/paged_attention.py and
            # passes them through here.
            raise NotImplementedError("the Triton paged-attention kernel has no sliding window or soft-cap yet")
        return self._paged_attention(
            _unit_last_stride(query), k_cache, v_cache,
            _index_tensor(meta.cu_query_lens, torch.int32),
            _index_tensor(meta.seq_lens, torch.int32),
            _index_tensor(meta.block_tables, torch.int32),
            scale,
        )


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _index_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous `dtype` tensor; returns t itself when it already is."""
    return t.to(dtype).contiguous()


BACKEND_NAMES = ("auto", "torch", "triton")


def _interpreting() -> bool:
    # The exact test kernels/paged_attention.py uses to switch its bf16
    # interpreter workaround on, so both agree on what "interpreting" means.
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend_name(name: str, device: torch.device | str | None = None) -> str:
    """auto -> triton on CUDA, torch anywhere else; other names unchanged.

    device is where the model runs; None means cuda when available.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")
    if name != "auto":
        return name
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "triton" if torch.device(device).type == "cuda" else "torch"


def make_backend(name: str, device: torch.device | str | None = None) -> AttentionBackend:
    """The backend for EXECUTOR_ATTENTION_BACKEND=name on device.

    auto picks triton on CUDA (torch if triton cannot be imported, with a
    warning) and torch elsewhere. An explicit triton off CUDA is refused
    unless TRITON_INTERPRET=1 is set, which must be set before the process
    imports triton.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    resolved = resolve_backend_name(name, device)
    if resolved == "torch":
        backend: AttentionBackend = TorchAttentionBackend()
    elif name == "auto":
        try:
            backend = TritonAttentionBackend()
        except RuntimeError as exc:
            log.warning("attention backend auto: %s; falling back to torch", exc)
            backend = TorchAttentionBackend()
    else:
        if device.type != "cuda" and not _interpreting():
            raise ValueError(
                f"EXECUTOR_ATTENTION_BACKEND=triton needs a CUDA device, but the executor runs on {device}; "
                "use auto or torch there, or set TRITON_INTERPRET=1 (Triton's slow CPU interpreter, for tests)"
            )
        backend = TritonAttentionBackend()
    log.info("attention backend: %s (requested %s, device %s)", backend.name, name, device)
    return backend
