"""Inductor's on-disk cache is kept apart per CPU vector ISA
(executor_svc/inductor_cache.py): inductor's own cache key leaves the ISA
out, and code generated for one vector width, rebuilt for another, leaves
outputs unwritten or writes past its buffers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from executor_svc import inductor_cache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A bf16 RMSNorm over rows of 1000 (vector loops with a tail), compiled with
# a dynamic row count, against eager.
PROGRAM = """
import torch
from executor_svc.inductor_cache import key_by_isa
key_by_isa()
def f(x, w):
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), w.float()).to(x.dtype) * 3
gen = torch.Generator().manual_seed(0)
x, w = torch.randn(3, 1000, dtype=torch.bfloat16, generator=gen), torch.randn(1000, dtype=torch.bfloat16)
torch._dynamo.mark_dynamic(x, 0)
got, want = torch.compile(f, fullgraph=True)(x, w), f(x, w)
print("nan", int(torch.isnan(got).sum()), "maxdiff", float((got.float() - want.float()).abs().max()))
"""


def test_the_cache_directory_is_keyed_by_the_vector_isa_once(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    keyed = inductor_cache.key_by_isa()
    assert keyed == tmp_path / f"cpu-{inductor_cache.isa_name()}"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(keyed)
    assert inductor_cache.key_by_isa() == keyed, "a second call (or a child process) keyed the directory again"


def test_a_graph_compiled_under_one_vector_isa_is_not_loaded_under_another(tmp_path):
    """Two processes share TORCHINDUCTOR_CACHE_DIR, the first with this
    machine's widest ISA, the second held to a narrower one. Without the
    keying, the second loads the first's graph: NaN in a third of the rows
    (avx2 after avx512), or glibc aborts the process (no vectors after
    avx2)."""
    capability = torch.backends.cpu.get_cpu_capability()
    pairs = {"AVX512": ("avx512", "avx2"), "AVX2": ("avx2", "default")}
    if capability not in pairs:
        pytest.skip(f"needs an x86 CPU with AVX2 or AVX-512 (torch reports {capability})")
    for isa in pairs[capability]:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "ATEN_CPU_CAPABILITY": isa,
               "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no pool of compile workers to start
        done = subprocess.run([sys.executable, "-c", PROGRAM], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"under {isa}: exit {done.returncode}\n{done.stderr[-2000:]}"
        nan, maxdiff = done.stdout.split()[1], float(done.stdout.split()[3])
        assert nan == "0" and maxdiff < 0.5, f"under {isa} after {pairs[capability][0]}: {done.stdout.strip()}"
    assert len(list(tmp_path.glob("cpu-*"))) == 2, "the two ISAs did not get a directory each"
