"""llmsched_kernels.mla_decode (paged multi-head latent attention decode) against
llmsched_kernels.reference.mla_decode, through the Triton interpreter without CUDA:
tiny latents, many heads against one shared latent, contexts spanning many
blocks, and DeepSeek-V3's real head dims on one short request."""

from __future__ import annotations

import pytest
import torch

from llmsched_kernels import reference

mla = pytest.importorskip("llmsched_kernels.mla_decode")


def make_batch(seq_lens, num_heads, value_dim, rope_dim, block_size, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    latent_dim = value_dim + rope_dim
    blocks_per_req = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    cache = torch.randn(num_blocks, block_size, 1, latent_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g)  # scattered blocks
    tables = torch.zeros(len(seq_lens), max(blocks_per_req) + 2, dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks_per_req):
        tables[r, :n] = perm[used : used + n]
        used += n
    query = torch.randn(len(seq_lens), num_heads, latent_dim, generator=g)
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(query), to(cache), torch.tensor(seq_lens, dtype=torch.int32, device=device), tables.to(device)


@pytest.mark.parametrize("seq_lens,num_heads,value_dim,rope_dim,block_size,dtype", [
    ([1, 9, 40], 4, 16, 8, 4, torch.float32),  # the test model's shapes: padded dims, block 4
    ([70, 3], 20, 32, 16, 16, torch.float32),  # two head blocks, the second partial
    ([33], 16, 48, 8, 16, torch.bfloat16),
    ([5], 16, 512, 64, 64, torch.float32),  # DeepSeek-V3's latent (kv_lora_rank 512 + rope 64)
], ids=["tiny", "two-head-blocks", "bf16", "deepseek-dims"])
def test_mla_decode_matches_reference(device, seq_lens, num_heads, value_dim, rope_dim, block_size, dtype):
    query, cache, lens, tables = make_batch(seq_lens, num_heads, value_dim, rope_dim, block_size, dtype, device)
    scale = (value_dim + rope_dim) ** -0.5
    got = mla.mla_decode(query, cache, lens, tables, scale, value_dim)
    want = reference.mla_decode(query, cache, lens, tables, scale, value_dim)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert got.shape == want.shape == (len(seq_lens), num_heads, value_dim)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("seq_lens,num_heads,value_dim,rope_dim,block_size,dtype,cache_dtype,k_scale", [
    ([1, 9, 40], 4, 16, 8, 4, torch.float32, torch.float8_e4m3fn, 0.3),
    ([33], 16, 48, 8, 16, torch.bfloat16, torch.float8_e4m3fn, 1.0),
    ([70, 3], 20, 32, 16, 16, torch.float16, torch.float8_e5m2, 2.5),
], ids=["fp32-e4m3-scaled", "bf16-e4m3", "fp16-e5m2-scaled"])
def test_mla_decode_reads_an_fp8_latent_cache(device, seq_lens, num_heads, value_dim, rope_dim, block_size, dtype,
                                              cache_dtype, k_scale):
    query, cache, lens, tables = make_batch(seq_lens, num_heads, value_dim, rope_dim, block_size, dtype, device)
    cache = reference.quantize_kv(cache, k_scale, cache_dtype)
    scale = (value_dim + rope_dim) ** -0.5
    got = mla.mla_decode(query, cache, lens, tables, scale, value_dim, k_scale=k_scale)
    want = reference.mla_decode(query, cache, lens, tables, scale, value_dim, k_scale=k_scale)
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_triton_backend_runs_mla_decode_steps_on_the_kernel_and_others_on_torch(device, monkeypatch):
    from executor_svc.attention import AttentionMetadata, TritonAttentionBackend

    backend = TritonAttentionBackend()
    calls = []
    monkeypatch.setattr(backend, "_mla_decode", lambda *a, **kw: calls.append("kernel") or mla.mla_decode(*a, **kw))
    query, cache, lens, tables = make_batch([6, 9], 4, 16, 8, 4, torch.float32, device)
    decode = AttentionMetadata(torch.zeros(2, dtype=torch.long), torch.tensor([0, 1, 2], dtype=torch.int32), lens,
                               tables, [1, 1], lens.tolist())
    got = backend.attend_latent(query, cache, decode, 0.2, 16)
    assert calls == ["kernel"]
    torch.testing.assert_close(got, reference.mla_decode(query, cache, lens, tables, 0.2, 16), atol=1e-4, rtol=1e-4)
    prefill = AttentionMetadata(torch.zeros(3, dtype=torch.long), torch.tensor([0, 1, 3], dtype=torch.int32), lens,
                                tables, [1, 2], lens.tolist())
    backend.attend_latent(torch.cat([query, query[1:]]), cache, prefill, 0.2, 16)
    assert calls == ["kernel"], "a step with a prefill runs on the torch path"


def test_batch_invariant_mla_runs_every_query_as_one_decode(device):
    """The triton backend in batch-invariant mode: a prefill chunk's queries are
    each one decode of the paged kernel over its own prefix, so they match the
    torch backend's causal attention, and a query's bits are the same in a chunk
    beside another request as alone."""
    from executor_svc.attention import AttentionMetadata, TorchAttentionBackend, TritonAttentionBackend

    block_size, heads, value_dim, rope_dim = 4, 4, 16, 8
    _, cache, _, _ = make_batch([40], heads, value_dim, rope_dim, block_size, torch.float32, device)
    tables = torch.arange(12, dtype=torch.int32, device=device)[None].repeat(2, 1)  # both read blocks 0-11
    queries = torch.randn(40, heads, value_dim + rope_dim, generator=torch.Generator().manual_seed(3)).to(device)

    def meta(q_lens, seq_lens):
        cu = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        return AttentionMetadata(torch.zeros(sum(q_lens), dtype=torch.long, device=device), cu.to(device),
                                 torch.tensor(seq_lens, dtype=torch.int32, device=device), tables[: len(q_lens)],
                                 list(q_lens), list(seq_lens))

    scale = (value_dim + rope_dim) ** -0.5
    backend = TritonAttentionBackend(batch_invariant=True)
    chunk = backend.attend_latent(queries[30:40], cache, meta([10], [40]), scale, value_dim)  # positions 30-39
    want = TorchAttentionBackend().attend_latent(queries[30:40], cache, meta([10], [40]), scale, value_dim)
    torch.testing.assert_close(chunk, want, atol=1e-4, rtol=1e-4)
    beside = backend.attend_latent(torch.cat([queries[:5], queries[30:40]]), cache, meta([5, 10], [5, 40]), scale,
                                   value_dim)
    alone = backend.attend_latent(queries[39:40], cache, meta([1], [40]), scale, value_dim)
    assert torch.equal(beside[14], chunk[9]) and torch.equal(alone[0], chunk[9]), "position 39 differs by batch"
