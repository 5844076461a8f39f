"""Attention over the paged KV cache, behind one small interface.

The model calls `write_kv` then `attend` for every layer and never knows
which backend runs. The KV cache of one layer is a pair of tensors
`[num_blocks, block_size, num_kv_heads, head_dim]`; a token's slot is
`block_id * block_size + offset`, as laid out by the scheduler's block
tables.

The package holds the metadata and the interface (metadata.py), the torch
backend (torch_backend.py), the Triton backend (triton_backend.py), and
here the choice between them (EXECUTOR_ATTENTION_BACKEND).
"""

from __future__ import annotations

import logging
import os

import torch

from executor_svc.attention.metadata import AttentionBackend, AttentionMetadata
from executor_svc.attention.torch_backend import INVARIANT_SPLIT_TOKENS, TorchAttentionBackend, dense_attention
from executor_svc.attention.triton_backend import TritonAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "TritonAttentionBackend",
           "dense_attention", "make_backend", "resolve_backend_name", "BACKEND_NAMES"]

log = logging.getLogger(__name__)


BACKEND_NAMES = ("auto", "torch", "triton")


def _interpreting() -> bool:
    # The exact test llmsched_kernels/paged_attention.py uses to switch its bf16
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


def make_backend(name: str, device: torch.device | str | None = None,
                 batch_invariant: bool = False) -> AttentionBackend:
    """The backend for EXECUTOR_ATTENTION_BACKEND=name on device; with
    batch_invariant (EXECUTOR_BATCH_INVARIANT), one that splits every
    query's keys the same way whatever the batch (torch: fixed pieces of
    INVARIANT_SPLIT_TOKENS; triton: one fixed tile shape, no split-KV).

    auto picks triton on CUDA (torch if triton cannot be imported, with a
    warning) and torch elsewhere. An explicit triton off CUDA is refused
    unless TRITON_INTERPRET=1 is set, which must be set before the process
    imports triton.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    resolved = resolve_backend_name(name, device)
    split = INVARIANT_SPLIT_TOKENS if batch_invariant else None
    if resolved == "torch":
        backend: AttentionBackend = TorchAttentionBackend(split)
    elif name == "auto":
        try:
            backend = TritonAttentionBackend(batch_invariant)
        except RuntimeError as exc:
            log.warning("attention backend auto: %s; falling back to torch", exc)
            backend = TorchAttentionBackend(split)
    else:
        if device.type != "cuda" and not _interpreting():
            raise ValueError(
                f"EXECUTOR_ATTENTION_BACKEND=triton needs a CUDA device, but the executor runs on {device}; "
                "use auto or torch there, or set TRITON_INTERPRET=1 (Triton's slow CPU interpreter, for tests)"
            )
        backend = TritonAttentionBackend(batch_invariant)
    log.info("attention backend: %s (requested %s, device %s%s)", backend.name, name, device,
             ", batch-invariant" if batch_invariant else "")
    return backend
