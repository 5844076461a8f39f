"""Compile the launchers' real kernel variants for sm_90 and sm_80, without a GPU.

Catches what the interpreter cannot: programs the Triton compiler rejects, register
spills and shared memory over the per-block limit. See aot_compile.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("aot_compile.py")
EXIT_UNSUPPORTED = 3  # aot_compile.EXIT_UNSUPPORTED (not imported: importing it imports triton)
# Shared memory one block may use (bytes).
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[int, dict]:
    """Both architectures compile in parallel: each run is single-threaded."""
    pytest.importorskip("triton")
    out_dir = tmp_path_factory.mktemp("aot")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    runs = {
        arch: subprocess.Popen(
            [sys.executable, str(SCRIPT), "--arch", str(arch), "--out", str(out_dir / f"sm_{arch}.json")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for arch in SHARED_LIMIT
    }
    results = {}
    for arch, proc in runs.items():
        output, _ = proc.communicate(timeout=600)
        if proc.returncode == EXIT_UNSUPPORTED:
            pytest.skip(output.strip().splitlines()[-1])
        assert proc.returncode == 0, f"sm_{arch} compile failed:\n{output[-6000:]}"
        results[arch] = json.loads((out_dir / f"sm_{arch}.json").read_text())
    return results


@pytest.mark.parametrize("arch", sorted(SHARED_LIMIT), ids=lambda a: f"sm_{a}")
def test_kernels_compile_without_spills(compiled, arch):
    usage = compiled[arch]
    assert any(name.startswith("attention") for name in usage) and any("merge_splits" in n for n in usage)
    assert any(name.startswith("fused_moe") for name in usage) and any(n.startswith("mla_decode") for n in usage)
    assert any(n.startswith("int_linear") for n in usage), "the integer weight-only GEMM was not compiled"
    for fmt in ("fp8", "mxfp4", "nvfp4"):
        assert any(f"FORMAT={fmt}" in n for n in usage), f"the fused-MoE kernel on {fmt} experts was not compiled"
    spilling = {name: u for name, u in usage.items() if u["spill_stores"] or u["spill_loads"]}
    assert not spilling, f"register spills on sm_{arch}: {json.dumps(spilling, indent=1)}"


@pytest.mark.parametrize("arch", sorted(SHARED_LIMIT), ids=lambda a: f"sm_{a}")
def test_kernels_fit_shared_memory(compiled, arch):
    too_big = {name: u["shared"] for name, u in compiled[arch].items() if u["shared"] > SHARED_LIMIT[arch]}
    assert not too_big, f"shared memory over {SHARED_LIMIT[arch]} B on sm_{arch}: {too_big}"
