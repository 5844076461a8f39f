"""The executor's vectorised torch backend against llmsched_kernels/reference.py."""

import pytest
import torch

from executor_svc.attention import AttentionMetadata, TorchAttentionBackend
from llmsched_kernels import reference


def make_batch(query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = perm[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).to(torch.int32)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=g)
    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(query_lens).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), cu_query_lens=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        query_lens_host=list(query_lens), seq_lens_host=list(seq_lens),
    )
    return query, k_cache, v_cache, meta


@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [
        ([1, 1, 1], [5, 17, 9]),  # decodes only
        ([7], [7]),  # one full prefill
        ([5], [13]),  # chunk after cached context
        ([1, 6, 1, 3], [12, 6, 3, 20]),  # mixed
    ],
    ids=["decode", "prefill", "chunked-prefill", "mixed"],
)
def test_torch_backend_matches_reference(query_lens, seq_lens):
    query, k_cache, v_cache, meta = make_batch(query_lens, seq_lens)
    scale = 16**-0.5
    got = TorchAttentionBackend().attend(query, k_cache, v_cache, meta, scale)
    want = reference.paged_attention(query, k_cache, v_cache, meta.cu_query_lens, meta.seq_lens, meta.block_tables, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_torch_backend_writes_kv_to_the_mapped_slots():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    key = torch.arange(9.0).view(3, 1, 3)
    meta = AttentionMetadata(torch.tensor([5, 0, 2]), None, None, None, [3], [3])
    TorchAttentionBackend().write_kv(key, -key, k_cache, v_cache, meta)
    assert torch.equal(k_cache.view(-1, 1, 3)[[5, 0, 2]], key)
    assert torch.equal(v_cache.view(-1, 1, 3)[[5, 0, 2]], -key)


def test_many_decodes_of_mixed_lengths_are_grouped_without_changing_results():
    # Many decodes, lengths unsorted, plus a prefill: sorting and chunking must not change results.
    g = torch.Generator().manual_seed(5)
    seq_lens = torch.randint(1, 40, (70,), generator=g).tolist()
    query_lens = [1] * 70
    query_lens[33], seq_lens[33] = 6, 30
    query, k_cache, v_cache, meta = make_batch(query_lens, seq_lens, num_blocks=70 * 10)
    got = TorchAttentionBackend().attend(query, k_cache, v_cache, meta, 0.25)
    want = reference.paged_attention(query, k_cache, v_cache, meta.cu_query_lens, meta.seq_lens, meta.block_tables, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# Sliding windows and softcapping, against a dense float64 computation written from
# HF transformers' definitions: with window W the query at position i sees key j iff
# i - W < j <= i; softcap s turns the scaled scores into s * tanh(scores / s) before
# the mask.


def dense_attention(query, keys, values, scale, window=None, softcap=None):
    """query: [q_len, h, d], the last q_len positions of keys/values: [seq_len, kvh, d]."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.double().repeat_interleave(group, dim=1)  # [seq_len, h, d]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale  # [h, q_len, seq_len]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(seq_len - q_len, seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    visible = j <= i
    if window is not None:
        visible &= j > i - window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).float()


def paged_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """reqs: (q_len, context_len) per request. Dense K/V per request, scattered into
    random cache blocks; block-table rows padded with 0 as the runner pads them."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in reqs]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, keys, values, used = [], [], [], 0
    for s, n in zip(seq_lens, need):
        blocks = perm[used : used + n]
        used += n
        tables.append(blocks + [0] * (max(need) - n))
        keys.append(k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:s].clone())
        values.append(v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:s].clone())
    query_lens = [q for q, _ in reqs]
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=g)
    cu = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(query_lens).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), cu_query_lens=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_host=query_lens, seq_lens_host=seq_lens,
    )
    return query, k_cache, v_cache, meta, keys, values


BATCHES = {
    "decode": [(1, 0), (1, 16), (1, 40), (1, 99), (1, 130)],
    "prefill": [(23, 0), (70, 0), (2, 0)],
    "chunked-prefill": [(9, 40), (17, 64), (33, 3)],
    "mixed": [(1, 37), (19, 0), (7, 45), (1, 0), (66, 13), (1, 130)],
}
WINDOWS = [None, 1, 17, 64]


def expected_outputs(query, meta, keys, values, scale, window, softcap):
    cu = meta.cu_query_lens.tolist()
    return torch.cat([
        dense_attention(query[cu[r] : cu[r + 1]], keys[r], values[r], scale, window, softcap)
        for r in range(meta.num_reqs)
    ])


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"window-{w}")
@pytest.mark.parametrize("softcap", [None, 1.5], ids=lambda s: f"softcap-{s}")
@pytest.mark.parametrize("heads", [(8, 2, 4), (4, 4, 16)], ids=["gqa4-bs4", "mha-bs16"])
def test_torch_backend_window_and_softcap_match_dense_attention(batch, window, softcap, heads):
    num_heads, num_kv_heads, block_size = heads
    query, k_cache, v_cache, meta, keys, values = paged_batch(BATCHES[batch], num_heads, num_kv_heads, 16, block_size)
    scale = 16**-0.5
    got = TorchAttentionBackend().attend(query, k_cache, v_cache, meta, scale, sliding_window=window, softcap=softcap)
    want = expected_outputs(query, meta, keys, values, scale, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The kernels' reference takes the same parameters with the same meaning.
    ref = reference.paged_attention(
        query, k_cache, v_cache, meta.cu_query_lens, meta.seq_lens, meta.block_tables, scale, window, softcap
    )
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)


def test_window_and_softcap_change_the_result():
    """The cases above would pass vacuously if neither parameter did anything."""
    query, k_cache, v_cache, meta, _, _ = paged_batch(BATCHES["mixed"], 8, 2, 16, 4)
    backend = TorchAttentionBackend()
    plain = backend.attend(query, k_cache, v_cache, meta, 0.25)
    windowed = backend.attend(query, k_cache, v_cache, meta, 0.25, sliding_window=17)
    capped = backend.attend(query, k_cache, v_cache, meta, 0.25, softcap=1.5)
    last = slice(-1, None)  # the decode at position 130 has 113 keys outside a 17-wide window
    assert not torch.allclose(windowed[last], plain[last]), "a 17-token window did not change a 131-token decode"
    assert not torch.allclose(capped, plain), "softcap 1.5 did not change the scores"


def test_sliding_window_never_reads_blocks_wholly_outside_it():
    # NaN in every block that lies wholly before each request's window: reading one
    # (even masked) would turn the output NaN, since 0 * NaN is NaN.
    reqs, block_size, window = [(1, 99), (5, 60), (1, 3)], 4, 17
    query, k_cache, v_cache, meta, keys, values = paged_batch(reqs, 4, 2, 16, block_size)
    for r, (q_len, ctx) in enumerate(reqs):
        first_visible = max(0, ctx - window + 1)  # of the request's first query
        for b in range(first_visible // block_size):
            k_cache[meta.block_tables[r, b]] = float("nan")
            v_cache[meta.block_tables[r, b]] = float("nan")
    got = TorchAttentionBackend().attend(query, k_cache, v_cache, meta, 0.25, sliding_window=window)
    want = expected_outputs(query, meta, keys, values, 0.25, window, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 1.5), (30, 1.5)])
def test_decodes_in_many_chunks_and_split_contexts_match_dense_attention(monkeypatch, window, softcap):
    from executor_svc.attention import torch_backend as attention

    # 48 keys of 2 heads x 16 fp32 per chunk: contexts past 48 tokens are split
    # into pieces merged by their log-sum-exp.
    monkeypatch.setattr(attention, "DECODE_CHUNK_BYTES", 48 * 2 * 16 * 4)
    g = torch.Generator().manual_seed(3)
    reqs = [(1, int(c)) for c in torch.randint(0, 130, (25,), generator=g)]
    reqs[7] = (9, 20)
    query, k_cache, v_cache, meta, keys, values = paged_batch(reqs, 8, 2, 16, 4)
    got = TorchAttentionBackend().attend(query, k_cache, v_cache, meta, 0.25, sliding_window=window, softcap=softcap)
    want = expected_outputs(query, meta, keys, values, 0.25, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plan = meta.cache[("torch", 4, window)]
    assert len(plan.decodes) > 3, "the chunk budget should have cut 24 decodes into several chunks"
    if window is None:
        assert plan.row_decodes is not None, "contexts up to 130 tokens should have been split into 48-token pieces"


def test_per_step_plan_is_built_once_and_reused_by_every_layer():
    query, k_cache, v_cache, meta, _, _ = paged_batch(BATCHES["mixed"], 8, 2, 16, 4)
    backend = TorchAttentionBackend()
    first = backend.attend(query, k_cache, v_cache, meta, 0.25)
    plan = meta.cache[("torch", 4, None)]
    second = backend.attend(query, k_cache * 2, v_cache, meta, 0.25)  # another layer's cache
    assert meta.cache[("torch", 4, None)] is plan and len(meta.cache) == 1
    assert not torch.equal(first, second)
    backend.attend(query, k_cache, v_cache, meta, 0.25, sliding_window=17)
    assert len(meta.cache) == 2, "a layer with a window needs its own plan"


def test_zero_or_negative_window_is_refused():
    query, k_cache, v_cache, meta, _, _ = paged_batch([(1, 4)], 4, 2, 16, 4)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        TorchAttentionBackend().attend(query, k_cache, v_cache, meta, 0.25, sliding_window=0)


@pytest.mark.parametrize("window", [None, 17])
def test_bf16_mixed_batch_with_split_contexts_matches_dense_attention(monkeypatch, window):
    from executor_svc.attention import torch_backend as attention

    monkeypatch.setattr(attention, "DECODE_CHUNK_BYTES", 48 * 2 * 16 * 2)  # 48 tokens of 2 heads x 16 bf16
    query, k_cache, v_cache, meta, keys, values = paged_batch(BATCHES["mixed"], 8, 2, 16, 4)
    query, k_cache, v_cache = query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    got = TorchAttentionBackend().attend(query, k_cache, v_cache, meta, 0.25, sliding_window=window)
    assert got.dtype == torch.bfloat16
    keys, values = [k.bfloat16() for k in keys], [v.bfloat16() for v in values]
    want = expected_outputs(query, meta, keys, values, 0.25, window, None)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("split", [False, True])
def test_sinks_match_the_reference_in_prefill_decode_and_split_decode(split, monkeypatch):
    """gpt-oss's sinks: an explicit softmax column in prefills, a sigmoid(lse - sink)
    factor on decodes, after split pieces merge."""
    from executor_svc.attention import torch_backend as attention

    if split:
        monkeypatch.setattr(attention, "DECODE_CHUNK_BYTES", 64 * 4 * 8)  # pieces of a few blocks
    g = torch.Generator().manual_seed(3)
    num_heads, kvh, d, block = 4, 2, 8, 4
    k_cache, v_cache = torch.randn(64, block, kvh, d, generator=g), torch.randn(64, block, kvh, d, generator=g)
    q_lens, seq_lens = [1, 7, 1, 3], [40, 7, 13, 30]
    tables = torch.arange(64, dtype=torch.int32).view(4, 16)
    query = torch.randn(sum(q_lens), num_heads, d, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long),
        cu_query_lens=torch.tensor([0, 1, 8, 9, 12], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        query_lens_host=q_lens, seq_lens_host=seq_lens)
    sinks = torch.tensor([1.5, -0.5, 3.0, 0.0])
    got = TorchAttentionBackend().attend(query, k_cache, v_cache, meta, 0.35, sliding_window=9, sinks=sinks)
    want = reference.paged_attention(query, k_cache, v_cache, meta.cu_query_lens, meta.seq_lens, tables, 0.35,
                                     sliding_window=9, sinks=sinks)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    without = reference.paged_attention(query, k_cache, v_cache, meta.cu_query_lens, meta.seq_lens, tables, 0.35,
                                        sliding_window=9)
    assert (want - without).abs().max() > 1e-2
