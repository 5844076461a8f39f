"""The plain-torch references against independent dense computations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import (
    DECODE,
    DTYPE_NAMES,
    LONG_PREFILL,
    MIXED,
    PREFILL,
    SOFTCAP,
    WINDOWS,
    make_paged_batch,
    poison_outside_window,
)

from llmsched_kernels import reference


def dense_causal_attention(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    keys: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    values: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim] fp32
    """SDPA on unpaged tensors; the q_len queries are the last positions of the sequence."""
    q_len, seq_len = query.shape[0], keys.shape[0]
    group = query.shape[1] // keys.shape[1]
    q = query.float().transpose(0, 1)  # [num_heads, q_len, head_dim]
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, seq_len, head_dim]
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, seq_len, head_dim]
    # Bottom-right aligned causal mask: query i sits at position seq_len - q_len + i.
    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)  # [q_len, seq_len]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device), scale=scale)
    return out.transpose(0, 1)  # [q_len, num_heads, head_dim]


REFERENCE_CASES = [
    pytest.param("decode", DECODE, 1, torch.float32, 16, id="fp32-gqa1-bs16-decode"),
    pytest.param("prefill", PREFILL, 2, torch.float32, 32, id="fp32-gqa2-bs32-prefill"),
    pytest.param("mixed", MIXED, 8, torch.float32, 16, id="fp32-gqa8-bs16-mixed"),
    pytest.param("mixed", MIXED, 2, torch.float16, 32, id="fp16-gqa2-bs32-mixed"),
    pytest.param("mixed", MIXED, 1, torch.bfloat16, 16, id="bf16-gqa1-bs16-mixed"),
]


@pytest.mark.parametrize("name,reqs,gqa,dtype,block_size", REFERENCE_CASES)
def test_reference_paged_attention_matches_sdpa(name, reqs, gqa, dtype, block_size):
    num_kv_heads, head_dim = 2, 32
    batch = make_paged_batch(
        reqs,
        num_heads=num_kv_heads * gqa,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=torch.device("cpu"),
        seed=len(reqs) + gqa,
    )
    out = reference.paged_attention(*batch.attention_args())
    assert out.dtype == dtype and out.shape == batch.query.shape

    cu = batch.cu_query_lens.tolist()
    # The only difference from SDPA is the final rounding to the input dtype.
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for req in range(len(reqs)):
        rows = slice(cu[req], cu[req + 1])
        expected = dense_causal_attention(batch.query[rows], batch.keys[req], batch.values[req], batch.scale)
        torch.testing.assert_close(out[rows].float(), expected, atol=tol, rtol=tol, msg=f"request {req}")


def dense_window_softcap_attention(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    keys: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    values: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # [q_len, num_heads, head_dim] fp32
    """Explicit softmax over the whole unpaged sequence (SDPA has no soft-cap), the window
    as a band of the full [q_len, seq_len] mask, as HF transformers builds it."""
    q_len, seq_len = query.shape[0], keys.shape[0]
    group = query.shape[1] // keys.shape[1]
    q = query.float().transpose(0, 1)  # [num_heads, q_len, head_dim]
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, seq_len, head_dim]
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, seq_len, head_dim]
    scores = q @ k.transpose(1, 2) * scale  # [num_heads, q_len, seq_len]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    # Query i sits at position seq_len - q_len + i =: p and sees keys p - window < j <= p.
    offset = seq_len - q_len
    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=offset)  # [q_len, seq_len]
    if window is not None:
        mask &= torch.ones(q_len, seq_len, dtype=torch.bool).triu(diagonal=offset - window + 1)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(0, 1)  # [q_len, num_heads, head_dim]


@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=lambda c: f"cap{c}")
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize(
    "reqs,gqa,dtype",
    [
        pytest.param(DECODE, 1, torch.float32, id="fp32-gqa1-decode"),
        pytest.param(LONG_PREFILL, 2, torch.float32, id="fp32-gqa2-prefill"),
        pytest.param(MIXED, 8, torch.bfloat16, id="bf16-gqa8-mixed"),
    ],
)
def test_reference_window_softcap_matches_dense(reqs, gqa, dtype, window, softcap):
    num_kv_heads, head_dim = 2, 32
    batch = make_paged_batch(
        reqs, num_heads=num_kv_heads * gqa, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
        dtype=dtype, device=torch.device("cpu"), seed=gqa,
    )  # fmt: skip
    out = reference.paged_attention(*batch.attention_args(), sliding_window=window, softcap=softcap)
    cu = batch.cu_query_lens.tolist()
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype]
    for req in range(len(reqs)):
        rows = slice(cu[req], cu[req + 1])
        expected = dense_window_softcap_attention(
            batch.query[rows], batch.keys[req], batch.values[req], batch.scale, window, softcap
        )
        torch.testing.assert_close(
            out[rows].float(), expected, atol=tol, rtol=tol, msg=lambda m: f"request {req}, w {window}, cap {softcap}: {m}"
        )


def test_reference_window_one_is_own_value():
    """W = 1: each query sees only its own position, so the output is its own V row."""
    batch = make_paged_batch(
        MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32,
        device=torch.device("cpu"),
    )  # fmt: skip
    out = reference.paged_attention(*batch.attention_args(), sliding_window=1, softcap=SOFTCAP)
    cu = batch.cu_query_lens.tolist()
    for req in range(len(MIXED)):
        q_len = cu[req + 1] - cu[req]
        own = batch.values[req][-q_len:].repeat_interleave(2, dim=1)  # [q_len, num_heads, head_dim]
        torch.testing.assert_close(out[cu[req] : cu[req + 1]], own, msg=f"request {req}")


def test_reference_never_reads_before_the_window():
    """Positions before every query's window may hold NaN (evicted or reused blocks)."""
    batch = make_paged_batch(
        ((1, 200), (7, 150)), num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32,
        device=torch.device("cpu"),
    )  # fmt: skip
    clean = reference.paged_attention(*batch.attention_args(), sliding_window=17)
    assert poison_outside_window(batch, 17, align=1) > 0
    torch.testing.assert_close(reference.paged_attention(*batch.attention_args(), sliding_window=17), clean)


def test_reference_decode_is_last_row_of_prefill():
    """A decode step over a cached context equals the last row of the full prefill."""
    batch = make_paged_batch(
        ((9, 0),), num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32,
        device=torch.device("cpu"),
    )  # fmt: skip
    full = reference.paged_attention(*batch.attention_args())  # [9, 4, 16]
    decode = reference.paged_attention(
        batch.query[-1:],
        batch.k_cache,
        batch.v_cache,
        torch.tensor([0, 1], dtype=torch.int32),
        batch.seq_lens,
        batch.block_tables,
        batch.scale,
    )
    torch.testing.assert_close(decode, full[-1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: DTYPE_NAMES[d])
def test_reference_write_kv_cache_skips_negative_slots(dtype):
    num_blocks, block_size, num_kv_heads, head_dim = 4, 16, 2, 8
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(4, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(4, num_kv_heads, head_dim).to(dtype)
    slot_mapping = torch.tensor([5, -1, 2 * block_size + 3, -7], dtype=torch.int64)

    reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    torch.testing.assert_close(k_cache[0, 5], key[0], rtol=0, atol=0)
    torch.testing.assert_close(v_cache[2, 3], value[2], rtol=0, atol=0)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    written[0, 5] = written[2, 3] = True
    assert not k_cache[~written].any() and not v_cache[~written].any(), "a padding token was written"
