"""Each Triton kernel against kernels.reference.

Without CUDA these run under the Triton interpreter (see conftest.py), so batches are
small. Parameters are a pairwise cover rather than the full cross product: every pair of
(dtype, GQA ratio, head_dim, block_size) values appears in at least one attention case.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import (
    ATTENTION_TOLERANCES,
    DECODE,
    DTYPE_NAMES,
    MIXED,
    PREFILL,
    PagedBatch,
    huge_stride_cache,
    make_paged_batch,
)

from kernels import reference

pa = pytest.importorskip("kernels.paged_attention")
kv_write = pytest.importorskip("kernels.kv_write")
cb = pytest.importorskip("kernels.copy_blocks")
import triton  # noqa: E402  (after the importorskips: kernels.* import it first)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [8, 64, 80, 128]
GQA_RATIOS = [1, 2, 8]
BLOCK_SIZES = [16, 32]


def _pairwise_attention_cases():
    """12 cases, one per (head_dim, dtype); GQA and block size follow (i + j) mod 3 / mod 2.

    For fixed head_dim or dtype, i + j takes >= 3 consecutive values, so all GQA ratios and
    block sizes appear; (i + j) mod 6 spans 0..5, so every (GQA, block size) pair appears.
    """
    cases = []
    for (i, head_dim), (j, dtype) in itertools.product(enumerate(HEAD_DIMS), enumerate(DTYPES)):
        gqa = GQA_RATIOS[(i + j) % 3]
        block_size = BLOCK_SIZES[(i + j) % 2]
        case_id = f"{DTYPE_NAMES[dtype]}-gqa{gqa}-hd{head_dim}-bs{block_size}-mixed"
        cases.append(pytest.param(dtype, gqa, head_dim, block_size, MIXED, id=case_id))
    return cases


def _scenario_cases():
    """Pure decode and pure prefill launches (their own tile configs), and head_dim 256."""
    spec = [
        (torch.float16, 1, 128, 16, DECODE, "decode"),
        (torch.bfloat16, 8, 64, 32, DECODE, "decode"),
        (torch.float32, 2, 80, 16, DECODE, "decode"),
        (torch.bfloat16, 2, 128, 32, PREFILL, "prefill"),
        (torch.float32, 8, 8, 16, PREFILL, "prefill"),
        # head_dim 256 switches to the narrow-TILE_N configs
        (torch.float16, 2, 256, 32, MIXED, "mixed"),
        (torch.float32, 1, 256, 16, DECODE, "decode"),
    ]
    return [
        pytest.param(dt, gqa, hd, bs, reqs, id=f"{DTYPE_NAMES[dt]}-gqa{gqa}-hd{hd}-bs{bs}-{name}")
        for dt, gqa, hd, bs, reqs, name in spec
    ]


def _check_attention(batch: PagedBatch, dtype: torch.dtype) -> None:
    out = pa.paged_attention(*batch.attention_args())
    expected = reference.paged_attention(*batch.attention_args())
    assert out.shape == expected.shape and out.dtype == dtype
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,gqa,head_dim,block_size,reqs", _pairwise_attention_cases() + _scenario_cases())
def test_paged_attention(device, dtype, gqa, head_dim, block_size, reqs):
    num_kv_heads = 2
    batch = make_paged_batch(
        reqs,
        num_heads=num_kv_heads * gqa,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        seed=head_dim + gqa,
    )
    _check_attention(batch, dtype)


def test_paged_attention_long_decode_uses_split_kv(device):
    """Few (request, KV head) pairs and a long context: the launcher picks split-KV."""
    batch = make_paged_batch(
        ((1, 700), (1, 300)), num_heads=8, num_kv_heads=1, head_dim=64, block_size=32, dtype=torch.float16, device=device
    )
    cfg = pa._pick_config(2, 2, 1, 8, 64, batch.block_tables.shape[1] * 32, torch.float16, batch.query.device)
    assert cfg.num_splits > 1, cfg
    _check_attention(batch, torch.float16)


@pytest.mark.parametrize(
    "block_q,tile_n,num_splits",
    [pytest.param(4, 16, 3, id="split3-q4-n16"), pytest.param(2, 32, 5, id="split5-q2-n32")],
)
def test_paged_attention_forced_config(device, monkeypatch, block_q, tile_n, num_splits):
    """Tile shapes the heuristic would not pick for this batch: split-KV on a mixed batch
    (some slices empty), several query tiles per request, TILE_N spanning 1-2 blocks."""
    gqa = 2
    # Smaller than MIXED (these tiles make many programs), plus a request with no new tokens.
    reqs = ((1, 37), (0, 12), (7, 45), (19, 0), (1, 0))
    batch = make_paged_batch(
        reqs, num_heads=2 * gqa, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, device=device
    )
    forced = pa._Config(block_q=block_q, block_m=16, tile_n=tile_n, num_splits=num_splits, num_warps=4, num_stages=2)
    monkeypatch.setattr(pa, "_pick_config", lambda *args, **kwargs: forced)
    _check_attention(batch, torch.float32)


def test_paged_attention_decode_shaped_batch_with_prefill(device):
    """num_tokens == num_reqs picks the decode tiles, but here q_lens are 0, 2, 1."""
    batch = make_paged_batch(
        ((0, 5), (2, 30), (1, 9)), num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16,
        device=device,
    )  # fmt: skip
    _check_attention(batch, torch.float16)


@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,  # same examples every run: CI failures reproduce
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    reqs=st.lists(st.tuples(st.integers(0, 16), st.integers(0, 40)), min_size=1, max_size=4),
    gqa=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([16, 24, 64]),
    block_size=st.sampled_from([16, 32]),
    block_q=st.sampled_from([1, 2, 4, 8]),
    tile_n=st.sampled_from([16, 32, 64]),
    num_splits=st.sampled_from([1, 2, 3]),
)
def test_paged_attention_random_batches(device, reqs, gqa, head_dim, block_size, block_q, tile_n, num_splits):
    """Random batch layouts x forced tile shapes: the tile -> request mapping, causal
    bounds and split-KV slicing must hold for any combination."""
    reqs = tuple((q, c) if q + c > 0 else (1, 0) for q, c in reqs)  # every request owns >= 1 position
    batch = make_paged_batch(
        reqs, num_heads=2 * gqa, num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=torch.float32,
        device=device,
    )  # fmt: skip
    group_pad = triton.next_power_of_2(gqa)
    forced = pa._Config(
        block_q=block_q,
        block_m=max(16, block_q * group_pad),
        tile_n=tile_n,
        num_splits=num_splits,
        num_warps=4,
        num_stages=2,
    )
    original = pa._pick_config
    pa._pick_config = lambda *args, **kwargs: forced
    try:
        _check_attention(batch, torch.float32)
    finally:
        pa._pick_config = original


def test_paged_attention_strided_query(device):
    """Query as a view into a fused QKV projection (token stride > num_heads * head_dim)."""
    batch = make_paged_batch(
        MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16, device=device
    )
    qkv = torch.randn(batch.query.shape[0], 8, 64, device=device).to(torch.float16)  # [tokens, q+k+v heads, d]
    qkv[:, :4] = batch.query
    batch.query = qkv[:, :4]
    assert not batch.query.is_contiguous()
    _check_attention(batch, torch.float16)


def test_paged_attention_empty_batch(device):
    batch = make_paged_batch(
        ((1, 3),), num_heads=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32, device=device
    )
    out = pa.paged_attention(
        batch.query[:0],
        batch.k_cache,
        batch.v_cache,
        torch.zeros(1, dtype=torch.int32, device=device),
        torch.zeros(0, dtype=torch.int32, device=device),
        torch.zeros(0, 4, dtype=torch.int32, device=device),
        batch.scale,
    )
    assert out.shape == (0, 2, 16)


def _huge_cache_or_skip(block_size, num_kv_heads, head_dim, dtype, device):
    try:
        return huge_stride_cache(block_size, num_kv_heads, head_dim, dtype, device)
    except (RuntimeError, MemoryError) as exc:  # no room for 8 GiB of (virtual) memory
        pytest.skip(f"cannot reserve the 64-bit test cache: {exc}")


def test_paged_attention_int64_block_offsets(device):
    """Block 2's offset (2 * 2^30 elements) overflows int32."""
    block_size, num_kv_heads, head_dim, dtype = 16, 1, 32, torch.float16
    small = make_paged_batch(
        ((1, 40),), num_heads=2, num_kv_heads=1, head_dim=head_dim, block_size=block_size, dtype=dtype,
        device=device, spare_blocks=0, extra_table_cols=0,
    )  # fmt: skip
    assert small.k_cache.shape[0] == 4  # 3 used blocks + the poison block
    k_huge = _huge_cache_or_skip(block_size, num_kv_heads, head_dim, dtype, device)
    v_huge = _huge_cache_or_skip(block_size, num_kv_heads, head_dim, dtype, device)
    # Lay the request's blocks out as [2, 0, 1] in the huge caches.
    order = [2, 0, 1]
    for position_block, huge_block in enumerate(order):
        small_block = int(small.block_tables[0, position_block])
        k_huge[huge_block] = small.k_cache[small_block]
        v_huge[huge_block] = small.v_cache[small_block]
    block_tables = torch.tensor([order], dtype=torch.int32, device=device)

    args = (small.query, k_huge, v_huge, small.cu_query_lens, small.seq_lens, block_tables, small.scale)
    out = pa.paged_attention(*args)
    expected = reference.paged_attention(*small.attention_args())
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


# --- write_kv_cache ---------------------------------------------------------------------

KV_WRITE_CASES = [
    pytest.param(torch.float32, 1, 8, 16, id="fp32-kvh1-hd8-bs16"),
    pytest.param(torch.float16, 2, 80, 32, id="fp16-kvh2-hd80-bs32"),
    pytest.param(torch.bfloat16, 8, 128, 16, id="bf16-kvh8-hd128-bs16"),
    pytest.param(torch.float16, 3, 64, 16, id="fp16-kvh3-hd64-bs16"),
]


@pytest.mark.parametrize("dtype,num_kv_heads,head_dim,block_size", KV_WRITE_CASES)
def test_write_kv_cache(device, dtype, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, num_tokens = 6, 21
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[[3, 10, 20]] = -1  # padding tokens
    slot_mapping = slot_mapping.to(device)

    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, k_expected, v_expected, slot_mapping)
    kv_write.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(k_cache, k_expected, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_expected, atol=0, rtol=0)


def test_write_kv_cache_strided_key(device):
    """K and V as views into a fused QKV projection."""
    num_tokens, num_kv_heads, head_dim, block_size = 5, 2, 64, 16
    qkv = torch.randn(num_tokens, 8, head_dim, device=device)  # [tokens, 4 q + 2 k + 2 v heads, d]
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    k_cache = torch.zeros(2, block_size, num_kv_heads, head_dim, device=device)
    v_cache = torch.zeros_like(k_cache)
    slot_mapping = torch.tensor([0, 17, -1, 3, 31], dtype=torch.int64, device=device)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, k_expected, v_expected, slot_mapping)
    kv_write.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(k_cache, k_expected, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_expected, atol=0, rtol=0)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["slots-i64", "slots-i32"])
def test_write_kv_cache_int64_block_offsets(device, slot_dtype):
    block_size, num_kv_heads, head_dim, dtype = 16, 2, 16, torch.float16
    k_cache = _huge_cache_or_skip(block_size, num_kv_heads, head_dim, dtype, device)
    v_cache = _huge_cache_or_skip(block_size, num_kv_heads, head_dim, dtype, device)
    k_cache.zero_()
    v_cache.zero_()
    key = torch.randn(3, num_kv_heads, head_dim, device=device).to(dtype)
    value = torch.randn(3, num_kv_heads, head_dim, device=device).to(dtype)
    slot_mapping = torch.tensor([2 * block_size + 5, 1, 2 * block_size + 15], dtype=slot_dtype, device=device)

    kv_write.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    for token, (block, offset) in enumerate([(2, 5), (0, 1), (2, 15)]):
        torch.testing.assert_close(k_cache[block, offset], key[token], atol=0, rtol=0)
        torch.testing.assert_close(v_cache[block, offset], value[token], atol=0, rtol=0)


# --- copy_blocks ------------------------------------------------------------------------

COPY_CASES = [
    pytest.param(torch.float32, 1, 8, 16, id="fp32-kvh1-hd8-bs16"),
    pytest.param(torch.bfloat16, 8, 128, 32, id="bf16-kvh8-hd128-bs32"),
    pytest.param(torch.float16, 2, 80, 16, id="fp16-kvh2-hd80-bs16"),
]


@pytest.mark.parametrize("dtype,num_kv_heads,head_dim,block_size", COPY_CASES)
def test_copy_blocks(device, dtype, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(8, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(8, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    block_mapping = torch.tensor([[0, 5], [3, 1], [7, 2], [3, 6]], dtype=torch.int64, device=device)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.copy_blocks(k_expected, v_expected, block_mapping)
    cb.copy_blocks(k_cache, v_cache, block_mapping)
    torch.testing.assert_close(k_cache, k_expected, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_expected, atol=0, rtol=0)


def test_copy_blocks_int64_block_offsets(device):
    block_size, num_kv_heads, head_dim, dtype = 16, 2, 16, torch.float16
    k_cache = _huge_cache_or_skip(block_size, num_kv_heads, head_dim, dtype, device)
    v_cache = _huge_cache_or_skip(block_size, num_kv_heads, head_dim, dtype, device)
    for block in range(3):
        k_cache[block] = torch.randn(block_size, num_kv_heads, head_dim, device=device).to(dtype)
        v_cache[block] = torch.randn(block_size, num_kv_heads, head_dim, device=device).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()  # [3, block_size, kvh, d]

    cb.copy_blocks(k_cache, v_cache, torch.tensor([[2, 1]], dtype=torch.int64, device=device))  # read past 2^31
    torch.testing.assert_close(k_cache[1], k_before[2], atol=0, rtol=0)
    torch.testing.assert_close(v_cache[1], v_before[2], atol=0, rtol=0)
    cb.copy_blocks(k_cache, v_cache, torch.tensor([[0, 2]], dtype=torch.int64, device=device))  # write past 2^31
    torch.testing.assert_close(k_cache[2], k_before[0], atol=0, rtol=0)
    torch.testing.assert_close(v_cache[2], v_before[0], atol=0, rtol=0)


# --- larger batches on a real GPU -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_NAMES[d])
def test_paged_attention_large_mixed_batch_gpu(dtype):
    gen = torch.Generator().manual_seed(0)
    decode = [(1, int(c)) for c in torch.randint(1, 3000, (48,), generator=gen)]
    chunks = [(int(q), int(c)) for q, c in zip(torch.randint(1, 600, (6,), generator=gen), [0, 0, 512, 1024, 77, 4000])]
    batch = make_paged_batch(
        tuple(decode + chunks), num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype,
        device=torch.device("cuda"),
    )  # fmt: skip
    _check_attention(batch, dtype)


@pytest.mark.gpu
def test_paged_attention_cuda_graph_replay():
    """The launcher does no host sync, so a decode step can be captured and replayed."""
    device = torch.device("cuda")
    batch = make_paged_batch(DECODE, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                             dtype=torch.bfloat16, device=device)  # fmt: skip
    args = batch.attention_args()
    pa.paged_attention(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pa.paged_attention(*args)
    batch.query.copy_(torch.randn_like(batch.query))
    graph.replay()
    torch.cuda.synchronize()
    expected = reference.paged_attention(*args)
    atol, rtol = ATTENTION_TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
