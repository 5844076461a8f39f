"""Inductor's on-disk cache, one directory per CPU vector ISA.

Inductor's FX graph cache is keyed on the graph and its settings, not on
the vector ISA its C++ was generated for, though the generated loops step
by that ISA's vector width: a graph cached where AVX-512 was picked steps
16 floats at a time, and the same source rebuilt for AVX2 (8 lanes) leaves
half of each step's outputs unwritten; the other way round, 8-float steps
with 16-lane stores write past their buffers. Measured on one AVX-512
machine with ATEN_CPU_CAPABILITY switched between runs sharing a cache: a
Qwen3-0.6B-shaped decode layer gave NaN in half its outputs under avx2
after an avx512 run, and an avx512 run after an avx2 one aborted with
glibc's "free(): invalid next size". A cache shared between hosts (a home
directory on NFS, a volume mounted on mixed nodes, an image built on
another CPU) meets the same, so the executor keeps each ISA's entries apart.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def isa_name() -> str:
    """The vector ISA inductor generates CPU code for here (as
    ATEN_CPU_CAPABILITY leaves it), with torch's CPU capability."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = str(pick_vec_isa()) if pick_vec_isa() else "novec"
    except Exception:  # no C++ compiler to probe with: nothing will compile either
        isa = "unprobed"
    return f"{isa}-{torch.backends.cpu.get_cpu_capability()}".lower().replace(" ", "_")


def key_by_isa() -> Path:
    """Points TORCHINDUCTOR_CACHE_DIR (or inductor's default) at its
    subdirectory for this ISA, `cpu-<isa>`; idempotent, so a process that
    inherits an already keyed directory keeps it. Returns the directory."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    sub = f"cpu-{isa_name()}"
    keyed = base if base.name == sub else base / sub
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(keyed)
    log.info("inductor's cache for this CPU's vector ISA: %s", keyed)
    return keyed
