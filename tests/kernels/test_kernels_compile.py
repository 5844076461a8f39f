"""Compile the launchers' real kernel variants for sm_90 and sm_80, without a GPU.

Catches what the interpreter cannot: programs the Triton compiler rejects, register
spills and shared memory over the per-block limit. See aot_compile.py.

The compile takes two CPU-minutes per architecture, and its result is fixed by its
inputs: the kernels' sources, aot_compile.py and the Triton version. aot_usage.json
keeps the last result under a hash of those inputs; while the hash matches, the tests
check that result, and any change to a kernel, the script or Triton compiles again.
After changing a kernel, refresh it (the compile runs, and the file is written only if
the tests' checks then pass): AOT_USAGE_WRITE=1 python -m pytest tests/kernels/test_kernels_compile.py
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("aot_compile.py")
CACHE = Path(__file__).with_name("aot_usage.json")
REPO = Path(__file__).resolve().parents[2]
EXIT_UNSUPPORTED = 3  # aot_compile.EXIT_UNSUPPORTED (not imported: importing it imports triton)
# Shared memory one block may use (bytes).
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}


def inputs_key(triton_version: str) -> str:
    """What determines the compile's result: every kernel source, the script, Triton."""
    digest = hashlib.sha256(f"triton {triton_version}\n".encode())
    for path in sorted((REPO / "llmsched_kernels").rglob("*.py")) + [SCRIPT]:
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\n" + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[int, dict]:
    """The result kept for these very inputs, else both architectures
    compiled in parallel (each run is single-threaded)."""
    triton = pytest.importorskip("triton")
    key = inputs_key(triton.__version__)
    if CACHE.exists() and not os.environ.get("AOT_USAGE_WRITE"):
        kept = json.loads(CACHE.read_text())
        if kept["key"] == key:
            return {int(arch): usage for arch, usage in kept["usage"].items()}
    results = _compile(tmp_path_factory.mktemp("aot"))
    if os.environ.get("AOT_USAGE_WRITE"):
        for arch in results:  # written only if this result passes what the tests check
            _check_spills_and_variants(results[arch], arch)
            _check_shared_memory(results[arch], arch)
        CACHE.write_text(json.dumps({"key": key, "triton": triton.__version__,
                                     "usage": {str(arch): usage for arch, usage in results.items()}},
                                    indent=1, sort_keys=True) + "\n")
    return results


def _compile(out_dir: Path) -> dict[int, dict]:
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
    _check_spills_and_variants(compiled[arch], arch)


@pytest.mark.parametrize("arch", sorted(SHARED_LIMIT), ids=lambda a: f"sm_{a}")
def test_kernels_fit_shared_memory(compiled, arch):
    _check_shared_memory(compiled[arch], arch)


def _check_spills_and_variants(usage: dict, arch: int) -> None:
    assert any(name.startswith("attention") for name in usage) and any("merge_splits" in n for n in usage)
    assert any(name.startswith("fused_moe") for name in usage) and any(n.startswith("mla_decode") for n in usage)
    assert any(n.startswith("int_linear") for n in usage), "the integer weight-only GEMM was not compiled"
    for fmt in ("nvfp4", "mxfp4"):
        assert any(n.startswith("int_linear") and f"FORMAT={fmt}" in n for n in usage), (
            f"the weight-only GEMM on {fmt} weights was not compiled")
    assert any(n.startswith("lora_shrink") for n in usage) and any(n.startswith("lora_expand") for n in usage), (
        "the multi-LoRA kernels were not compiled")
    for fmt in ("fp8", "mxfp4", "nvfp4", "int"):
        assert any(f"FORMAT={fmt}" in n for n in usage), f"the fused-MoE kernel on {fmt} experts was not compiled"
    spilling = {name: u for name, u in usage.items() if u["spill_stores"] or u["spill_loads"]}
    assert not spilling, f"register spills on sm_{arch}: {json.dumps(spilling, indent=1)}"


def _check_shared_memory(usage: dict, arch: int) -> None:
    too_big = {name: u["shared"] for name, u in usage.items() if u["shared"] > SHARED_LIMIT[arch]}
    assert not too_big, f"shared memory over {SHARED_LIMIT[arch]} B on sm_{arch}: {too_big}"
