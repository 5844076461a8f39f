"""The scheduler stays torch-free, and the committed stubs are current."""

import filecmp
import subprocess
import sys
from pathlib import Path

from devtools.genproto import generate

REPO = Path(__file__).resolve().parents[2]


def test_scheduler_modules_never_import_torch():
    modules = sorted(
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for p in (REPO / "scheduler_svc").rglob("*.py")
    )
    modules += ["llmsched.server", "llmsched.launch"]
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + (
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
        "assert not bad, f'torch imported: {bad[:5]}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert len(modules) >= 15


def test_generated_grpc_code_is_current(tmp_path):
    generate(tmp_path)
    committed = REPO / "llmsched" / "v1"
    fresh = tmp_path / "llmsched" / "v1"
    names = sorted(p.name for p in fresh.iterdir())
    assert names, "protoc generated nothing"
    stale = [n for n in names if not (committed / n).exists() or not filecmp.cmp(committed / n, fresh / n, shallow=False)]
    assert not stale, f"stale generated files {stale}: run `make protos` and commit"
