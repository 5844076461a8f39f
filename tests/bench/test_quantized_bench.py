"""bench/quantized.py (P20) end to end at a tiny size: it writes the FP8,
W4A16 and W8A16 copies, serves each checkpoint through both services, and reports
weight bytes, resident memory and decode figures with ratios to bf16."""

from __future__ import annotations

import json

from bench import quantized


def test_quantized_bench_reports_memory_and_decode_for_every_checkpoint(tmp_path, capsys):
    out = tmp_path / "p20.json"
    assert quantized.main(["--hidden", "256", "--layers", "1", "--vocab", "1024", "--rounds", "1", "--tokens", "4",
                           "--streams", "2", "--num-threads", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    # 256 x 256 blocks of 128: FP8 plus 4/16384 bytes of scale a weight, against 2 bytes.
    assert 0.5 <= report["ratios"]["fp8"]["linear_bytes"] < 0.51
    # Half a byte a weight plus a bf16 scale per group of 64 (704 intermediate
    # units are not whole groups of 128): 0.2656x, and weight_shape's 16 bytes a layer.
    assert 0.2656 <= report["ratios"]["w4a16"]["linear_bytes"] < 0.27
    # A byte a weight plus a bf16 scale per row of 256 or 704 columns.
    assert 0.5 <= report["ratios"]["w8a16"]["linear_bytes"] < 0.505
    assert report["ratios"]["fp8"]["weight_bytes"] < 1.0  # embeddings and head stay bf16
    for name in ("bf16", "fp8", "w4a16", "w8a16"):
        (run,) = report["runs"][name]
        assert run["one_stream_ms_per_token"] > 0 and run["many_streams_tok_per_s"] > 0
    printed = capsys.readouterr().out
    assert "of which decoder linears" in printed and "2 streams, output tok/s" in printed
