"""`python -m bench --workload trace` against the real services, and the
simulator's report of the same trace: the same requests, and the same
report shape, key for key (issue 26)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from simulator.cost_model import LinearCostModel
from simulator.profile import Geometry, HostCost, Profile

REPO = Path(__file__).resolve().parents[2]
TRACE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:46.9951690,96,109
2023-11-16 18:15:47.2224670,879,55
2023-11-16 18:15:47.3910170,91,16
2023-11-16 18:15:47.5000000,300,30
2023-11-16 18:15:48.1000000,120,12
"""


def shape(x):
    """Keys at every level; a list of records is the union of its records'
    shapes; everything else is a leaf."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        shapes = [shape(v) for v in x if isinstance(v, (dict, list))]
        return ["list", *(shapes[:1] if all(s == shapes[0] for s in shapes) else shapes)] if shapes else ["list"]
    return "leaf"


def test_shape_sees_keys_at_every_level():
    assert shape({"a": [{"b": 1}, {"b": None}], "c": 2.0}) == {"a": ["list", {"b": "leaf"}], "c": "leaf"}
    assert shape({"a": [{"b": 1}, {"x": 1}]}) != shape({"a": [{"b": 1}, {"b": 1}]})


@pytest.mark.slow
def test_a_simulated_report_has_the_shape_of_a_real_trace_replay(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    options = ["--trace", str(trace), "--length-scale", "0.25", "--seed", "3"]
    real_out = tmp_path / "real.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "--launch", "--model", "tiny-random", "--workload", "trace",
                           *options, "--no-plots", "--no-progress", "--out", str(real_out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = json.loads(real_out.read_text())
    assert real["mode"] == "online" and real["workload"]["name"] == "trace"
    assert real["summary"]["completed"] == 6 and real["server"]["kv_blocks_held_after"] == 0

    info = real["server"]["before"]
    profile = Profile("tiny", True, {"model": "tiny-random", "device": "cpu", "tensor_parallel_size": 1},
                      Geometry(info["block_size"], info["num_kv_blocks"], info["max_model_len"],
                               real["workload"]["vocab_size"]),
                      LinearCostModel((2e-3, 2e-5, 0.0, 5e-5, 0.0, 0.0)), HostCost(per_step_s=1e-4))
    profile.write(tmp_path / "profile.json")
    sim_out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, "-m", "simulator", "run", "--profile", str(tmp_path / "profile.json"),
                           *options, "--out", str(sim_out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sim = json.loads(sim_out.read_text())

    assert shape(sim) == shape(real)
    # The same readers: the same requests, token for token in length.
    assert sim["workload"] == real["workload"]
    assert [r["prompt_tokens"] for r in sim["requests"]] == [r["prompt_tokens"] for r in real["requests"]]
    assert [r["output_tokens"] for r in sim["requests"]] == [r["output_tokens"] for r in real["requests"]]
    assert sim["mode"] == "simulated" and sim["config"]["endpoint"] == "simulator"
    # bench's plots draw it (matplotlib is in the bench extra).
    assert (tmp_path / "sim_latency_cdf.png").exists() and (tmp_path / "sim_throughput.png").exists()
