"""The Triton attention backend: the kernels in llmsched_kernels/, one launch per
layer for the K/V write and one for the whole mixed batch."""

from __future__ import annotations

import numpy as np
import torch

from executor_svc.attention.torch_backend import INVARIANT_SPLIT_TOKENS, TorchAttentionBackend

class TritonAttentionBackend:
    """The Triton kernels in llmsched_kernels/: one launch writes a layer's K/V, one
    launch attends the whole mixed batch (decodes, prefills and chunks
    alike). Runs on CUDA, or on CPU under Triton's interpreter
    (TRITON_INTERPRET=1, slow: for tests only). An FP8 cache is encoded
    and decoded inside the kernels, from its bits (llmsched_kernels/fp8_kv.py).

    kernels.* is imported here, not at module level, so the torch backend
    never imports triton.
    """

    name = "triton"

    def __init__(self, batch_invariant: bool = False) -> None:
        # EXECUTOR_BATCH_INVARIANT: every launch takes the same tile shape
        # and no split-KV, whatever the batch (llmsched_kernels/paged_attention.py
        # fixed_split); MLA runs every query token as one decode (_mla_per_token).
        self.batch_invariant = batch_invariant
        try:
            from llmsched_kernels.kv_write import write_kv_cache
            from llmsched_kernels.mla_decode import mla_decode
            from llmsched_kernels.paged_attention import paged_attention
        except ImportError as exc:
            raise RuntimeError(
                f"attention backend 'triton' needs the triton package, which failed to import: {exc}"
            ) from exc
        self._write_kv_cache = write_kv_cache
        self._paged_attention = paged_attention
        self._mla_decode = mla_decode
        self._torch = TorchAttentionBackend(INVARIANT_SPLIT_TOKENS if batch_invariant else None)

    def write_kv(self, key, value, k_cache, v_cache, meta, k_scale=1.0, v_scale=1.0):
        # key, value: [num_tokens, num_kv_heads, head_dim]. The launcher wants
        # head_dim contiguous and a contiguous int32/int64 slot_mapping; what
        # the runner builds already is, so these are no-ops there.
        self._write_kv_cache(
            _unit_last_stride(key), _unit_last_stride(value), k_cache, v_cache,
            _index_tensor(meta.slot_mapping, torch.int64), k_scale=k_scale, v_scale=v_scale,
        )

    def write_latent(self, latent, cache, meta, k_scale=1.0):
        # The K/V write kernel with the latent as both: one cache, written twice.
        self.write_kv(latent, latent, cache, cache, meta, k_scale=k_scale, v_scale=k_scale)

    def attend_latent(self, query, cache, meta, scale, value_dim, k_scale=1.0):
        """Decode-only steps: the paged MLA decode kernel. Steps with
        prefills: the torch backend (prefill is compute-bound and runs once
        per token; a Triton MLA prefill kernel is not written yet). Steps
        whose metadata is on the device only (verify steps in CUDA graphs),
        whose lengths the torch backend cannot read: each token one decode
        (_mla_device_tokens)."""
        if self.batch_invariant:
            return self._mla_per_token(query, cache, meta, scale, value_dim, k_scale)
        if len(meta.query_lens_host) == query.shape[0]:
            return self._mla_decode(
                _unit_last_stride(query), cache, _index_tensor(meta.seq_lens, torch.int32),
                _index_tensor(meta.block_tables, torch.int32), scale, value_dim, k_scale=k_scale)
        if not meta.host_lists:
            return self._mla_device_tokens(query, cache, meta, scale, value_dim, k_scale)
        return self._torch.attend_latent(query, cache, meta, scale, value_dim, k_scale=k_scale)

    def _mla_device_tokens(self, query, cache, meta, scale, value_dim, k_scale):
        """Every query token one decode of the paged kernel over its
        request's keys up to its own position, as _mla_per_token, with the
        tokens' requests and lengths found by device ops from cu_query_lens
        and seq_lens: no host copy, no sync, so a CUDA graph can hold it."""
        cu = meta.cu_query_lens.to(torch.int64)  # [num_reqs + 1]
        token = torch.arange(query.shape[0], device=query.device)  # [num_tokens]
        req = torch.searchsorted(cu[1:], token, right=True)  # each token's request
        seen = meta.seq_lens.to(torch.int64)[req] - cu[req + 1] + 1 + token  # keys up to and including its own
        tables = _index_tensor(meta.block_tables, torch.int32).index_select(0, req)
        return self._mla_decode(_unit_last_stride(query), cache, seen.to(torch.int32), tables.contiguous(), scale,
                                value_dim, k_scale=k_scale)

    def _mla_per_token(self, query, cache, meta, scale, value_dim, k_scale):
        """Batch-invariant MLA: every query token, prefill or decode, is one
        decode of the paged kernel (one program per token, the same tiles
        in the same order), seeing its request's keys up to its own
        position. One path for every token, however the batch is made."""
        q_lens = np.asarray(meta.query_lens_host, dtype=np.int64)
        req = np.repeat(np.arange(len(q_lens)), q_lens)  # [num_tokens]
        first = np.cumsum(q_lens) - q_lens
        seen = np.asarray(meta.seq_lens_host, dtype=np.int64)[req] - q_lens[req] + 1 + np.arange(len(req)) - first[req]
        dev = query.device
        tables = _index_tensor(meta.block_tables, torch.int32).index_select(0, torch.from_numpy(req).to(dev))
        return self._mla_decode(_unit_last_stride(query), cache, torch.from_numpy(seen.astype(np.int32)).to(dev),
                                tables.contiguous(), scale, value_dim, k_scale=k_scale)

    def attend(self, query, k_cache, v_cache, meta, scale, sliding_window=None, softcap=None, sinks=None,
               k_scale=1.0, v_scale=1.0):
        # query: [num_tokens, num_heads, head_dim] -> same shape. sliding_window,
        # softcap and sinks are per call (per layer); None switches the feature off in the kernel.
        return self._paged_attention(
            _unit_last_stride(query), k_cache, v_cache,
            _index_tensor(meta.cu_query_lens, torch.int32),
            _index_tensor(meta.seq_lens, torch.int32),
            _index_tensor(meta.block_tables, torch.int32),
            scale, sliding_window=sliding_window, softcap=softcap,
            sinks=None if sinks is None else sinks.float().contiguous(), k_scale=k_scale, v_scale=v_scale,
            fixed_split=self.batch_invariant,
        )


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _index_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous `dtype` tensor; returns t itself when it already is."""
    return t.to(dtype).contiguous()
