"""Trace readers (bench/traces.py): the Azure CSV and Mooncake JSONL
formats, and the window, rate, length and context options."""

from __future__ import annotations


import pytest

from bench.traces import (PromptMaker, TraceOptions, mean_rate, parse_window, read_trace, trace_workload)
from llmsched.assets import AZURE_CONV, MOONCAKE_CONV
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.request import Request, SamplingParams

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,55
2023-11-16 18:16:46.0000000,100,10
"""
MOONCAKE = """{"timestamp": 0, "input_length": 1200, "output_length": 50, "hash_ids": [0, 1, 2]}
{"timestamp": 500, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 3]}
{"timestamp": 1500, "input_length": 300, "output_length": 7, "hash_ids": [4]}
"""


@pytest.fixture
def azure(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text(AZURE)
    return path


@pytest.fixture
def mooncake(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(MOONCAKE)
    return path


def test_azure_arrivals_count_from_the_first_request(azure):
    t = read_trace(azure)
    assert t.format == "azure"
    assert [(r.prompt_len, r.output_len) for r in t.records] == [(374, 44), (396, 109), (879, 55), (100, 10)]
    assert [r.arrival_s for r in t.records] == pytest.approx([0.0, 4.314579, 4.541877, 59.31941], abs=1e-9)


def test_window_rate_and_length_scale(azure):
    t = read_trace(azure, TraceOptions(window=(4.0, 60.0), rate_scale=2.0, length_scale=0.5))
    assert [(r.prompt_len, r.output_len) for r in t.records] == [(198, 54), (440, 28), (50, 5)]
    assert [r.arrival_s for r in t.records] == pytest.approx([0.1572895, 0.2709385, 27.659705], abs=1e-9)
    assert t.params()["num_requests"] == 3
    assert mean_rate(t) == pytest.approx(3 / 27.659705)


def test_clamp_keeps_the_ratio_of_prompt_to_output(azure):
    t = read_trace(azure, TraceOptions(max_model_len=256))
    for r in t.records:
        assert r.prompt_len + r.output_len <= 256 and r.prompt_len >= 1 and r.output_len >= 1
    first = t.records[0]
    assert first.prompt_len / (first.prompt_len + first.output_len) == pytest.approx(374 / 418, abs=0.01)
    assert t.num_clamped == 3 and t.records[3].prompt_len == 100


def test_mooncake_shared_hash_ids_share_token_blocks(mooncake):
    t = read_trace(mooncake, TraceOptions(length_scale=1 / 16))  # 512-token blocks -> 32 tokens
    assert [r.block_tokens for r in t.records] == [32, 32, 32]
    assert [round(r.arrival_s, 3) for r in t.records] == [0.0, 0.5, 1.5]
    maker = PromptMaker(vocab_size=500, seed=0, max_len=100)
    a, b, c = (maker.prompt(r) for r in t.records)
    assert (len(a), len(b), len(c)) == (75, 69, 19)
    assert a[:64] == b[:64] and a[64:] != b[64:69]  # hash ids 0, 1 shared; 2 and 3 differ
    assert c[:19] != a[:19]
    # The scheduler's prefix cache finds those two shared blocks of 32.
    kv = KVCacheManager(num_blocks=64, block_size=32)
    first = Request("a", a, SamplingParams(max_tokens=1), frozenset())
    kv.allocate_slots(first, len(a))
    kv.cache_computed_blocks(first, len(a))
    assert kv.find_cached_prefix(Request("b", b, SamplingParams(max_tokens=1), frozenset())).num_tokens == 64


def test_azure_prompts_are_seeded_and_never_share_a_first_block(azure):
    t = read_trace(azure, TraceOptions(length_scale=0.1))
    w1, w2 = trace_workload(t, 512), trace_workload(t, 512)
    p1 = [r.prompt_token_ids for r in w1.requests]
    assert p1 == [r.prompt_token_ids for r in w2.requests]
    assert [len(p) for p in p1] == [r.prompt_len for r in t.records]
    assert len({tuple(p[:8]) for p in p1}) == len(p1)
    assert all(3 <= tok < 512 for p in p1 for tok in p)
    other = trace_workload(read_trace(azure, TraceOptions(length_scale=0.1, seed=1)), 512)
    assert [r.prompt_token_ids for r in other.requests] != p1


def test_bad_input_is_refused_naming_what_is_wrong(tmp_path, azure):
    with pytest.raises(ValueError, match="START:END"):
        parse_window("600")
    assert parse_window("600:") == (600.0, None) and parse_window("1:2.5") == (1.0, 2.5)
    with pytest.raises(ValueError, match="no requests in the window"):
        read_trace(azure, TraceOptions(window=(1000.0, None)))
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        read_trace(bad)
    with pytest.raises(ValueError, match="suffix"):
        read_trace(tmp_path / "x.txt")


def test_the_carried_trace_slices_read_in_place():
    conv = read_trace(AZURE_CONV, TraceOptions(window=(0, 60)))
    assert 150 < len(conv.records) < 250
    moon = read_trace(MOONCAKE_CONV,
                      TraceOptions(window=(0, 30), length_scale=1 / 32, max_model_len=512))
    assert all(r.prompt_len + r.output_len <= 512 for r in moon.records)
    assert all(len(r.hash_ids) * r.block_tokens >= r.prompt_len for r in moon.records)
