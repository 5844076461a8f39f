"""Regenerates the committed gRPC stubs in llmsched/v1 from protos/.

The .proto files live at protos/llmsched/v1/, mirroring their package, so
protoc writes `from llmsched.v1 import ...` imports that need no fixing.
Run: python -m devtools.genproto
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "llmsched" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py under out_dir/llmsched/v1."""
    from grpc_tools import protoc  # test/dev dependency only

    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    # protoc resolves relative proto paths against -I; run from PROTO_ROOT's
    # view by passing relative names.
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")


if __name__ == "__main__":
    generate(REPO_ROOT)
    print("regenerated", *(p.name for p in proto_files()), file=sys.stderr)
