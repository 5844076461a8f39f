"""The executor's vectorised torch backend against kernels/reference.py."""

import pytest
import torch

from executor_svc.attention import AttentionMetadata, TorchAttentionBackend
from kernels import reference


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
    # More decodes than one DECODE_GROUP, lengths unsorted, plus a prefill.
    g = torch.Generator().manual_seed(5)
    seq_lens = torch.randint(1, 40, (70,), generator=g).tolist()
    query_lens = [1] * 70
    query_lens[33], seq_lens[33] = 6, 30
    query, k_cache, v_cache, meta = make_batch(query_lens, seq_lens, num_blocks=70 * 10)
    got = TorchAttentionBackend().attend(query, k_cache, v_cache, meta, 0.25)
    want = reference.paged_attention(query, k_cache, v_cache, meta.cu_query_lens, meta.seq_lens, meta.block_tables, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
