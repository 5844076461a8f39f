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

import getpass
import logging
import os
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def isa_name() -> str:
    """torch's CPU capability (what inductor picks its vector ISA from, as
    ATEN_CPU_CAPABILITY leaves it) and the CPU's bf16 and AMX support.
    Probed without importing inductor, which would bring in dynamo for an
    executor that never compiles."""
    features = [name for name, probe in (("bf16", torch.cpu._is_avx512_bf16_supported),
                                         ("amx", torch.cpu._is_amx_tile_supported)) if probe()]
    return "-".join([torch.backends.cpu.get_cpu_capability().lower(), *features])


def key_by_isa() -> Path:
    """Points TORCHINDUCTOR_CACHE_DIR (or inductor's default, a directory
    under the temp dir) at its subdirectory for this ISA, `cpu-<isa>`;
    idempotent, so a process that inherits an already keyed directory
    keeps it. Returns the directory."""
    base = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                or Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    sub = f"cpu-{isa_name()}"
    keyed = base if base.name == sub else base / sub
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(keyed)
    log.info("inductor's cache for this CPU's vector ISA: %s", keyed)
    return keyed
