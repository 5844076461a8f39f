"""Host memory for the executor's step: copies to the device, and freed
memory kept in the process instead of handed back.

With glibc's defaults, every large temporary a CPU step allocates (logits,
probabilities, activations: hundreds of KiB each) is mmap'd or trimmed back
to the OS when freed, and the next step pays page faults to get it again.
On a 256-row sampling step that more than doubles the host time. Raising
the mmap and trim thresholds lets malloc reuse the memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import numpy as np
import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Freed heap memory kept before trimming; allocations below the mmap
# threshold come from the reusable heap.
TRIM_THRESHOLD = 256 << 20
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this setting on 64-bit

_done = False


def retain_freed_memory() -> None:
    """Process-wide and idempotent; a no-op where libc is not glibc."""
    global _done
    if _done:
        return
    _done = True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt: freed host memory goes back to the allocator's defaults")
        return
    if not (mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)):
        log.warning("mallopt refused the trim/mmap thresholds; CPU steps may page-fault on temporaries")


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on device: shared memory on CPU; on CUDA a pinned copy
    sent without blocking the host (the caching host allocator keeps the
    pinned block alive until the copy has run)."""
    t = torch.from_numpy(a)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
