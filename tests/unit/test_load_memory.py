"""Loading keeps about one copy of the weights in host memory, and a
tensor-parallel rank about its 1/N share (bench/load_memory.py measures the
same on a ~340 MB checkpoint)."""

from __future__ import annotations

import pytest

from bench.load_memory import make_checkpoint, measure, measure_ranks


@pytest.mark.parametrize("checkpoint_dtype", ["float32", "bfloat16"])
def test_loading_a_sharded_checkpoint_peaks_near_one_copy_of_the_weights(checkpoint_dtype, tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", hidden=512, layers=4, vocab=8192, dtype=checkpoint_dtype, shard="10MB")
    r = measure(ckpt, "float32")
    assert r["shards"] >= 3, r
    # A ~77 MB model: the allocator's fixed slack (7-19 MB measured across
    # machines) stays well under the bound. A loader that holds the whole
    # state dict while building the model needs about 2x.
    assert r["ratio"] < 1.4, f"peak RSS grew {r['ratio']:.2f}x the weight bytes while loading: {r}"


def test_each_tensor_parallel_rank_peaks_near_its_half_of_the_weights(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", hidden=512, layers=4, vocab=8192, dtype="float32", shard="10MB")
    ranks = measure_ranks(ckpt, "float32", size=2)
    assert [r["rank"] for r in ranks] == [0, 1], ranks
    for r in ranks:
        assert r["shards"] >= 3 and r["size"] == 2, r
        assert r["shard_mb"] < 0.55 * r["weights_mb"], f"rank {r['rank']} holds more than half the weights: {r}"
        # Half the weights plus slack (the resident pages of the 10 MB shard
        # being read, the allocator's): 0.60-0.64x on the development
        # machine, ~10 MB over the half; the bound leaves room for the 19 MB
        # of slack seen elsewhere at TP=1 (0.75x). A rank that holds every
        # whole tensor at once, or builds the whole model, peaks at 1x or more.
        assert r["ratio"] < 0.8, (f"rank {r['rank']}'s peak RSS grew {r['ratio']:.2f}x the whole model's weight "
                                  f"bytes while loading its half: {r}")


def test_loading_a_moe_and_mla_checkpoint_peaks_within_1_2x_its_weights(tmp_path):
    """DeepSeek-V3's layers (MLA, 8 experts loaded one tensor at a time into
    their fused tensors) keep the same bound: no second copy of the weights."""
    ckpt = make_checkpoint(tmp_path / "ckpt", hidden=512, layers=3, vocab=8192, dtype="float32", shard="10MB",
                           family="deepseek-v3")
    r = measure(ckpt, "float32")
    assert r["shards"] >= 3 and r["weights_mb"] > 80, r
    assert r["ratio"] < 1.2, f"peak RSS grew {r['ratio']:.2f}x the weight bytes while loading: {r}"
