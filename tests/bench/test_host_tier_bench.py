"""`python -m bench.host_tier`: the multi-turn workload through the real
services with the host tier off and on. Checks the comparison is made and
sound (outputs equal, the tier used), not speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import workloads as wl

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_multi_turn_with_the_tier_off_and_on_gives_the_same_outputs_from_fewer_computed_tokens(tmp_path,
                                                                                                stories_path):
    # 4 sessions of 2 turns (histories of up to 17 blocks) against 24 device blocks.
    cmd = [sys.executable, "-m", "bench.host_tier", "p16", "--model", str(stories_path), "--device-blocks", "24",
           "--host-mb", "16", "--out-dir", str(tmp_path), "--", "--num-sessions", "4", "--num-turns", "2",
           "--think-time", "0.2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "p16.json").read_text())
    assert result["outputs_identical_across_runs"]
    off, on = result["medians"]["off"], result["medians"]["on"]
    assert off["completed"] == on["completed"] == 8
    assert on["prefix_hit_tokens_host"] > 0 and off["prefix_hit_tokens_host"] == 0
    assert on["computed_prompt_tokens_turns_2_on"] < off["computed_prompt_tokens_turns_2_on"]
    on_report = json.loads((tmp_path / "p16-on-0.json").read_text())
    assert on_report["server"]["kv_blocks_held_after"] == 0
    assert [r["turn"] for r in on_report["requests"]] == [0] * 4 + [1] * 4
    # Each second turn is sent its drawn pause after the session's first answer.
    first_end = {r["session"]: r["end_s"] for r in on_report["requests"] if r["turn"] == 0}
    drawn = {r.session: r.think_s for r in wl.multi_turn(512, 0, wl.MultiTurnSpec(num_sessions=4, num_turns=2,
                                                                                   think_time_s=0.2)).requests
             if r.turn == 1}
    for r in on_report["requests"][4:]:
        waited = r["send_s"] - first_end[r["session"]]
        assert waited >= drawn[r["session"]] - 0.01, f"session {r['session']} waited {waited:.3f} s, drew " \
                                                     f"{drawn[r['session']]:.3f} s"
    assert "multi-turn" in proc.stdout or "computed_prompt_tokens_turns_2_on" in proc.stdout
