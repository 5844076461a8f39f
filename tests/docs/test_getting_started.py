"""Every block docs/getting-started.md marks runnable runs, as written, against
what `make serve` starts on tiny-random: `make serve` itself (its entry
point, on free ports), grpcurl, curl, and the Python snippets.

The addresses in the blocks (localhost:50051, localhost:8080) are replaced
by the free ports the launcher picked; nothing else is changed. Where no
grpcurl is installed (it is a Go binary that neither PyPI nor Debian's
archive carries), tests/docs/grpcurl_standin.py stands in for it on PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.docs.markdown import Block, runnable_blocks

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "getting-started.md"
BLOCKS = runnable_blocks(PAGE.read_text())
SERVE = [b for b in BLOCKS if b.name == "serve"]
RUN_AS_WRITTEN = [b for b in BLOCKS if not b.name]
SERVING_LINE = re.compile(r"serving llmsched\.v1\.Scheduler on (\S+) and the OpenAI API on (\S+)/v1 "
                          r"\(executor on (\S+);")
# The launcher picks every port itself (0 = free), metrics are off, and
# every service binds loopback only.
LAUNCH_ENV = {
    "SCHEDULER_PORT": "0", "EXECUTOR_PORT": "0", "GATEWAY_PORT": "0",
    "SCHEDULER_METRICS_PORT": "0", "EXECUTOR_METRICS_PORT": "0",
    "SCHEDULER_HOST": "127.0.0.1", "GATEWAY_HOST": "127.0.0.1",
    "EXECUTOR_MODEL": "tiny-random", "EXECUTOR_NUM_THREADS": "1",
}

# One launcher for the whole module: keep its tests on one xdist worker.
pytestmark = pytest.mark.xdist_group(name="docs-getting-started")


@dataclass
class Served:
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    scheduler: str = ""
    gateway: str = ""
    executor: str = ""


def _read(served: Served, ready: threading.Event) -> None:
    for line in served.proc.stdout:
        served.lines.append(line)
        if m := SERVING_LINE.search(line):
            served.scheduler, served.gateway, served.executor = m.groups()
            ready.set()


def _stop(proc: subprocess.Popen, timeout_s: float = 30) -> int:
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the launcher ignored Ctrl-C for {timeout_s}s") from None


@pytest.fixture(scope="module")
def served():
    """`make serve`: its recipe runs `python -m llmsched.launch` (checked
    below), so this runs that with the venv's python."""
    proc = subprocess.Popen([sys.executable, "-m", "llmsched.launch"], cwd=REPO, env={**os.environ, **LAUNCH_ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    s, ready = Served(proc), threading.Event()
    threading.Thread(target=_read, args=(s, ready), daemon=True).start()
    deadline = time.monotonic() + 120
    try:
        while not ready.wait(0.2):
            assert proc.poll() is None, f"make serve exited with {proc.returncode}: {''.join(s.lines)[-3000:]}"
            assert time.monotonic() < deadline, f"no serving line within 120 s: {''.join(s.lines)[-3000:]}"
        yield s
    finally:
        if proc.poll() is None:
            _stop(proc)


def grpcurl_path(tmp_path: Path) -> str:
    """PATH with grpcurl on it: the real one where installed, else the stand-in."""
    if shutil.which("grpcurl"):
        return os.environ["PATH"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "grpcurl"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).parent / "grpcurl_standin.py"}" "$@"\n')
    shim.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def localize(code: str, served: Served) -> str:
    """The block with the documented default addresses replaced by the
    launcher's free ports."""
    gateway = served.gateway.removeprefix("http://")
    return code.replace("localhost:50051", served.scheduler).replace("localhost:8080", gateway)


def test_the_page_marks_the_commands_a_newcomer_runs():
    assert [b.code for b in SERVE] == ["make serve"], SERVE
    written = "\n".join(b.code for b in RUN_AS_WRITTEN)
    for command in ("grpcurl -plaintext", "llmsched.v1.Scheduler/Generate", "grpc.health.v1.Health/Check",
                    "curl -s", "/v1/chat/completions", "from openai import OpenAI", "SchedulerStub"):
        assert command in written, f"no runnable block on {PAGE.name} has {command!r}"
    for block in RUN_AS_WRITTEN:
        assert block.lang in ("sh", "python"), f"{block.id}: no way to run a {block.lang} block"
        assert "localhost:" not in localize(block.code, Served(None, scheduler="S", gateway="G")), (
            f"{block.id} names an address the test cannot point at its services")


def test_make_serve_runs_the_launcher_the_test_runs():
    recipe = re.search(r"^serve:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert recipe and recipe.group(1).strip() == "$(BIN)/python -m llmsched.launch", recipe


@pytest.mark.parametrize("block", RUN_AS_WRITTEN, ids=lambda b: b.id)
def test_block_runs_as_written(block: Block, served: Served, tmp_path):
    code = localize(block.code, served)
    if block.lang == "sh":
        argv, env = ["bash", "-euo", "pipefail", "-c", code], {**os.environ, "PATH": grpcurl_path(tmp_path)}
    else:
        argv, env = [sys.executable, "-c", code], dict(os.environ)
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, f"{block.id} exited with {proc.returncode}:\n{proc.stderr[-3000:]}\n{out[-2000:]}"
    assert out.strip(), f"{block.id} printed nothing; stderr: {proc.stderr[-2000:]}"
    if "Health/Check" in code:
        assert '"status": "SERVING"' in out, out
    if "Scheduler/Generate" in code:
        # grpcurl prints .proto field names (finish_reason); newer builds may
        # print JSON names (finishReason).
        assert re.search(r'"finish_?[rR]eason": "FINISH_REASON_(LENGTH|STOP)"', out), out[-2000:]
    if "/v1/completions" in code:
        assert '"text_completion"' in out, out[-2000:]
    if '"stream": true' in code:
        assert out.rstrip().endswith("data: [DONE]"), out[-2000:]


def test_ctrl_c_stops_make_serve_cleanly(served: Served):
    """Last in the module: the other tests share this launcher."""
    children = [int(p) for p in Path(f"/proc/{served.proc.pid}/task/{served.proc.pid}/children").read_text().split()]
    assert len(children) == 3, f"expected the executor, the scheduler and the gateway, got {children}"
    assert _stop(served.proc) == 0, "".join(served.lines)[-3000:]
    alive = [pid for pid in children if Path(f"/proc/{pid}").exists()
             and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]]
    assert not alive, f"services still running after make serve stopped: {alive}"
