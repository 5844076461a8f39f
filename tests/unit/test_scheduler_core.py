"""scheduler_svc/core/ is the scheduler's synchronous core: it imports no
grpc, no protobuf stubs, no asyncio and no torch, neither in its source
nor through what it imports, so the simulator and the scheduler benchmarks
run it as a plain library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "scheduler_svc" / "core"
FORBIDDEN = ("grpc", "google.protobuf", "llmsched.v1", "asyncio", "torch")


def _core_modules() -> list[str]:
    return sorted(".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                  for p in CORE.rglob("*.py"))


def test_no_core_module_names_a_forbidden_package():
    named = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            named += [f"{path.relative_to(REPO)} imports {n}" for n in names
                      if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]
    assert not named, "\n".join(named)


def test_importing_the_whole_core_loads_no_forbidden_package():
    modules = _core_modules()
    assert len(modules) >= 12 and "scheduler_svc.core.engine_core" in modules
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + f"bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in {FORBIDDEN!r}))\n"
            + "print('\\n'.join(bad))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert not result.stdout.strip(), f"the core loads: {result.stdout.split()}"
