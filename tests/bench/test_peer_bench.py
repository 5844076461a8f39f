"""bench.peer and bench.llama_cpp without building or serving anything: the
parsing of llama-server's answers and of /proc, the cmake commands, the
cache keys and the arithmetic of the report."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import llama_cpp as lc
from bench import peer

COMPLETION = {
    "index": 0, "content": " Tim was", "tokens": [312, 290, 41], "id_slot": 3, "stop": True,
    "model": "stories260K.gguf", "tokens_predicted": 3, "tokens_evaluated": 5, "stop_type": "limit",
    "timings": {"cache_n": 0, "prompt_n": 5, "prompt_ms": 0.61, "prompt_per_token_ms": 0.122,
                "prompt_per_second": 8196.7, "predicted_n": 3, "predicted_ms": 1.05,
                "predicted_per_token_ms": 0.35, "predicted_per_second": 2857.1},
}


def test_completion_body_is_greedy_exact_length_and_uncached():
    body = lc.completion_body([1, 403, 407], 200)
    assert body["prompt"] == [1, 403, 407] and body["n_predict"] == 200
    assert body["ignore_eos"] and body["return_tokens"] and not body["cache_prompt"] and not body["stream"]
    assert body["samplers"] == ["top_k"] and body["top_k"] == 1 and body["temperature"] == 0
    assert lc.completion_body([1], 4, stream=True)["stream"]


def test_parse_completion_reads_tokens_and_timings():
    done = lc.parse_completion(COMPLETION)
    assert done.tokens == [312, 290, 41]
    assert done.predicted_per_token_ms == pytest.approx(0.35)
    with pytest.raises(RuntimeError, match="slot"):
        lc.parse_completion({"error": {"code": 500, "message": "no free slot"}})


def test_stream_lines_and_client_timing():
    assert lc.parse_stream_line(b"\n") is None
    assert lc.parse_stream_line(b"data: [DONE]\n") is None
    assert lc.parse_stream_line(b": keep-alive\n") is None
    assert lc.parse_stream_line(b'data: {"content": "a", "tokens": [7], "stop": false}\n')["tokens"] == [7]
    done = lc.Completion(tokens=[1, 2, 3, 4, 5], timings={}, chunk_times=[10.0, 10.001, 10.002, 10.003, 10.004])
    assert done.client_ms_per_token() == pytest.approx(1.0)
    assert math.isnan(lc.Completion([1], {}, [1.0]).client_ms_per_token())


def test_cmake_commands_build_only_the_cpu_server(tmp_path):
    conf = lc.configure_args(tmp_path / "src", tmp_path / "build")
    assert conf[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "build")]
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"):
        assert flag in conf
    assert lc.build_args(tmp_path / "build", 2) == ["cmake", "--build", str(tmp_path / "build"), "--target",
                                                      "llama-server", "-j", "2"]


def test_an_avx2_build_turns_native_tuning_off_and_has_a_build_directory_of_its_own(tmp_path):
    assert "-DGGML_NATIVE=OFF" in lc.configure_args(tmp_path / "src", tmp_path / "b", "avx2")
    assert not any("NATIVE" in flag for flag in lc.configure_args(tmp_path / "src", tmp_path / "b"))
    native, avx2 = lc.Paths.make("9.9.9", tmp_path), lc.Paths.make("9.9.9", tmp_path, "avx2")
    assert native.build == tmp_path / "9.9.9" / "build" and avx2.build == tmp_path / "9.9.9" / "build-avx2"
    assert native.source == avx2.source, "each build would unpack the sdist again"
    with pytest.raises(ValueError, match="avx512"):
        lc.Paths.make("9.9.9", tmp_path, "avx512")


def test_ours_is_limited_to_avx2_with_it_unless_the_executor_env_says_otherwise():
    env = peer.ours_env("avx2", {"EXECUTOR_CPU_BF16_PREPACK": "off"}, 2)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["EXECUTOR_CPU_BF16_PREPACK"] == "off" and env["EXECUTOR_NUM_THREADS"] == "2"
    assert peer.ours_env("native", {}, 0) == {}


def test_cache_paths_follow_the_pinned_version_and_the_override(tmp_path, monkeypatch):
    monkeypatch.setenv(lc.CACHE_ENV, str(tmp_path / "env"))
    paths = lc.Paths.make()
    assert paths.root == tmp_path / "env" / lc.SDIST_VERSION
    assert paths.llama_cpp == paths.root / f"llama_cpp_python-{lc.SDIST_VERSION}" / "vendor" / "llama.cpp"
    assert paths.server == paths.root / "build" / "bin" / "llama-server"
    assert lc.Paths.make("0.1.0", tmp_path / "opt").root == tmp_path / "opt" / "0.1.0"
    assert lc.sdist_name("0.3.36") == "llama_cpp_python-0.3.36.tar.gz"
    with pytest.raises(SystemExit, match="pinned"):
        lc.fetch_sdist(paths, tmp_path / "llama_cpp_python-0.0.1.tar.gz")


def test_a_built_server_is_reused_without_building(tmp_path):
    paths = lc.Paths.make("9.9.9", tmp_path)
    paths.server.parent.mkdir(parents=True)
    paths.server.write_text("#!/bin/sh\n")
    assert lc.build_server(paths) == paths.server  # no sdist, no cmake: the cache answers


def test_gguf_key_changes_with_the_checkpoint_and_the_type(tmp_path):
    ckpt = tmp_path / "m"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    key = lc.checkpoint_key(ckpt, "f32")
    assert key.startswith("m-") and key.endswith("-f32.gguf")
    assert lc.checkpoint_key(ckpt, "q8_0") != key
    (ckpt / "model.safetensors").write_bytes(b"x")
    assert lc.checkpoint_key(ckpt, "f32") != key


def test_server_args_give_every_slot_the_whole_context():
    args = lc.server_args(Path("/b/llama-server"), Path("/m.gguf"), 8080, 2, 64, 512)
    assert args[0] == "/b/llama-server"
    opts = dict(zip(args[1::2], args[2::2]))
    assert opts["-t"] == opts["-tb"] == "2" and opts["-np"] == "64" and opts["-c"] == str(64 * 512)


PROC_STAT = """cpu  1000 10 300 5000 20 0 5 40 0 0
cpu0 500 5 150 2500 10 0 3 20 0 0
intr 12345
"""


def test_proc_stat_steal_share():
    before = peer.parse_proc_stat(PROC_STAT)
    assert before["steal"] == 40 and before["idle"] == 5000
    after = dict(before, user=before["user"] + 150, idle=before["idle"] + 40, steal=before["steal"] + 10)
    assert peer.steal_share(before, after) == pytest.approx(10 / 200)
    assert peer.steal_share(before, before) == 0.0
    old_kernel = peer.parse_proc_stat("cpu  1 2 3 4 5 6 7\n")  # no steal column
    assert old_kernel["steal"] == 0
    with pytest.raises(ValueError):
        peer.parse_proc_stat("cpu0 1 2 3\n")


def test_pid_stat_cpu_seconds_survive_odd_command_names():
    fields = ["S", "1", "1", "1", "0", "-1", "4194304", "100", "0", "0", "0", "250", "50"] + ["0"] * 30
    text = "4242 (llama server) x) " + " ".join(fields)
    assert peer.parse_pid_stat(text, 100) == pytest.approx(3.0)


def _round(ours_tps, llama_tps, hf_tps, ours_ms, llama_ms):
    fig = {"steal_share": 0.01, "cpu_s_total": 2.0}
    return {"ours": {"throughput": {"tok_per_s": ours_tps, **fig}, "single": {"ms_per_token": ours_ms, **fig}},
            "llama-server": {"throughput": {"tok_per_s": llama_tps, **fig},
                             "single": {"ms_per_token": llama_ms, **fig}},
            "hf-static": {"throughput": {"tok_per_s": hf_tps, **fig}}}


def test_summary_medians_and_ratios():
    rounds = [_round(1200, 1600, 400, 7.0, 0.5), _round(1000, 2000, 500, 8.0, 0.4),
              _round(1500, 1500, 450, 6.0, 0.6)]
    s = peer.summarize(rounds)
    assert s["median"]["ours"]["tok_per_s"] == 1200 and s["median"]["llama-server"]["ms_per_token"] == 0.5
    assert "ms_per_token" not in s["median"]["hf-static"]
    tput = s["ratios"]["ours/llama-server"]["tok_per_s"]
    assert tput["per_round"] == pytest.approx([0.75, 0.5, 1.0])
    assert tput["median_of_rounds"] == pytest.approx(0.75) and tput["of_medians"] == pytest.approx(1200 / 1600)
    ms = s["ratios"]["ours/llama-server"]["ms_per_token"]
    assert ms["per_round"] == pytest.approx([14.0, 20.0, 10.0]) and ms["median_of_rounds"] == pytest.approx(14.0)
    assert set(s["ratios"]["ours/hf-static"]) == {"tok_per_s"}
    assert s["ratios"]["ours/hf-static"]["tok_per_s"]["per_round"] == pytest.approx([3.0, 2.0, 1500 / 450])


def test_ratios_refuse_unequal_rounds():
    with pytest.raises(ValueError):
        peer.ratios([1.0, 2.0], [1.0])
    assert math.isnan(peer.ratios([1.0], [0.0])[0])


def test_round_order_rotates():
    assert [peer.round_order(r)[0] for r in range(4)] == ["ours", "llama-server", "hf-static", "ours"]
    assert sorted(peer.round_order(1)) == sorted(peer.SYSTEMS)


def test_agreement_counts_identical_requests():
    a = peer.agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]])
    assert a == {"compared": 2, "identical": 1, "first_diffs": [1]}


def test_int8_rows_round_trip_within_half_a_step():
    import torch

    from bench.peer_models import quantize_int8_rows

    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, scale = quantize_int8_rows(w)
    assert q.dtype == torch.int8 and q.shape == (8, 64) and scale.shape == (8, 1)
    assert int(q.abs().max()) == 127
    err = (q.float() * scale.float() - w.float()).abs()
    assert bool((err <= scale.float() * 0.5 + 1e-3).all())


def test_streams_work_is_equal_requests():
    work = peer.streams_work(16, 16, 32, 151936, 0, 32)
    assert len(work.requests) == 16 and {r.max_tokens for r in work.requests} == {32}
    assert {len(p) for p in work.prompts} == {16} and all(3 <= t < 151936 for p in work.prompts for t in p)
    assert len(work.warmup) == peer.WARMUP_REQUESTS and work.single_tokens == 32


def test_meter_records_wall_steal_load_and_cpu_of_this_process():
    with peer.Meter({"self": 0}) as meter:
        sum(i * i for i in range(200_000))
    rec = meter.record()
    assert rec["wall_s"] > 0 and 0 <= rec["steal_share"] <= 1 and rec["load_1m"] >= 0
    assert rec["cpu_s"]["self"] > 0 and rec["cpu_s_total"] == rec["cpu_s"]["self"]
