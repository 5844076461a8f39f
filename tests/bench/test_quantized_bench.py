"""bench/quantized.py (P20) end to end at a tiny size: it writes the FP8
copy, serves both checkpoints through both services, and reports weight
bytes, resident memory and decode figures with FP8 / bf16 ratios."""

from __future__ import annotations

import json

from bench import quantized


def test_quantized_bench_reports_memory_and_decode_for_both_checkpoints(tmp_path, capsys):
    out = tmp_path / "p20.json"
    assert quantized.main(["--hidden", "256", "--layers", "1", "--vocab", "1024", "--rounds", "1", "--tokens", "4",
                           "--streams", "2", "--num-threads", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    # 256 x 256 blocks of 128: FP8 plus 4/16384 bytes of scale a weight, against 2 bytes.
    assert 0.5 <= report["ratios"]["linear_bytes"] < 0.51
    assert report["ratios"]["weight_bytes"] < 1.0  # embeddings and head stay bf16
    for name in ("bf16", "fp8"):
        (run,) = report["runs"][name]
        assert run["one_stream_ms_per_token"] > 0 and run["many_streams_tok_per_s"] > 0
    printed = capsys.readouterr().out
    assert "of which decoder linears" in printed and "2 streams, output tok/s" in printed
