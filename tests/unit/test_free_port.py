"""llmsched.server.free_port across processes: a port handed to one
process is not handed to another while its child may still be starting,
as happens when pytest-xdist workers start services side by side. Without
the reservation the kernel's bind(0) repeats ports: two sets of 300 from
about 14,000 share several."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT

PICK = "from llmsched.server import free_port; print(' '.join(str(free_port()) for _ in range(300)))"


def test_two_processes_picking_ports_at_once_never_get_the_same_one():
    procs = [subprocess.Popen([sys.executable, "-c", PICK], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    picked = [set(map(int, p.communicate(timeout=60)[0].split())) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert [len(p) for p in picked] == [300, 300], "a process was handed the same port twice"
    assert not picked[0] & picked[1], f"handed to both processes: {sorted(picked[0] & picked[1])}"
