"""bench/attention.py end to end at toy sizes: the table and JSON are complete
and every implementation agrees with dense SDPA. Checks the report, not speed."""

from __future__ import annotations

import json

from bench import attention


def test_attention_bench_writes_every_point_and_the_step(tmp_path, stories_path, capsys):
    out = tmp_path / "attention.json"
    attention.main([
        "--num-reqs", "5", "--contexts", "40", "96", "--rounds", "1",
        "--step-context", "50", "--model-path", str(stories_path), "--out", str(out),
    ])  # fmt: skip
    report = json.loads(out.read_text())
    points = {(r["shape"], r["context"]) for r in report["attention"]}
    assert points == {(s, c) for s in ("stories260K", "bench-small") for c in (40, 96)}
    for r in report["attention"]:
        assert r["max_abs_err"] < 1e-5, f"ours differs from dense SDPA at {r['shape']} x {r['context']}"
        assert r["ours_ms"] > 0 and r["dense_ms"] > 0 and r["gather_ms"] > 0
        assert r["ours_vs_dense"] == r["ours_ms"] / r["dense_ms"]
    step = report["step"]
    assert step["num_reqs"] == 5 and step["context"] == 50 and step["gather_ms"] > 0 and step["ours_ms"] > 0
    assert 0 < step["ours_forward_ms"] <= step["ours_ms"] and 0 < step["gather_forward_ms"] <= step["gather_ms"]
    printed = capsys.readouterr().out
    assert "ours/dense" in printed and "decode step, stories260K, 5 requests x 50 context" in printed


def test_gather_baseline_matches_the_backend():
    """The pre-#11 decode path kept as the baseline still computes the same attention."""
    import torch

    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, 30, 16, 4, 8, generator=g)
    tables = torch.randperm(30, generator=g)[:28].view(7, 4).to(torch.int32)
    meta = attention.decode_metadata(tables, 61)
    meta.seq_lens_host[2] = 9  # unequal lengths exercise the padding mask
    meta.seq_lens[2] = 9
    query = torch.randn(7, 8, 8, generator=g)
    want = attention.TorchAttentionBackend().attend(query, k_cache, v_cache, meta, 0.3)
    got = attention.GatherBackend().attend(query, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
