"""Each Triton kernel against llmsched_kernels.reference.

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
    LONG_PREFILL,
    MIXED,
    PREFILL,
    SOFTCAP,
    WINDOWS,
    PagedBatch,
    huge_stride_cache,
    make_paged_batch,
    poison_outside_window,
)

from llmsched_kernels import reference

pa = pytest.importorskip("llmsched_kernels.paged_attention")
kv_write = pytest.importorskip("llmsched_kernels.kv_write")
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


def _check_attention(
    batch: PagedBatch, dtype: torch.dtype, sliding_window: int | None = None, softcap: float | None = None
) -> torch.Tensor:  # the reference output
    features = {"sliding_window": sliding_window, "softcap": softcap}
    out = pa.paged_attention(*batch.attention_args(), **features)
    expected = reference.paged_attention(*batch.attention_args(), **features)
    assert out.shape == expected.shape and out.dtype == dtype
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol, msg=lambda m: f"{features}: {m}")
    return expected


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


FP8_ATTENTION_CASES = [
    # (dtype, cache dtype, gqa, head_dim, block_size, reqs, k_scale, v_scale, window)
    pytest.param(torch.float32, torch.float8_e4m3fn, 2, 64, 16, MIXED, 0.3, 1.7, None, id="fp32-e4m3-mixed"),
    pytest.param(torch.bfloat16, torch.float8_e4m3fn, 8, 128, 32, DECODE, 1.0, 1.0, None, id="bf16-e4m3-decode"),
    pytest.param(torch.float16, torch.float8_e5m2, 1, 80, 16, MIXED, 0.05, 2.0, 17, id="fp16-e5m2-mixed-w17"),
    pytest.param(torch.float32, torch.float8_e5m2, 1, 8, 16, PREFILL, 2.0, 0.5, None, id="fp32-e5m2-prefill-hd8"),
]


@pytest.mark.parametrize("dtype,cache_dtype,gqa,head_dim,block_size,reqs,k_scale,v_scale,window",
                         FP8_ATTENTION_CASES)
def test_paged_attention_fp8_cache(device, dtype, cache_dtype, gqa, head_dim, block_size, reqs, k_scale, v_scale,
                                   window):
    """The kernel decodes the FP8 bits and scales them as the reference reads them
    (stored * scale); the tolerances are the compute dtype's, as for a plain cache."""
    num_kv_heads = 2
    batch = make_paged_batch(reqs, num_heads=num_kv_heads * gqa, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=device, seed=head_dim + gqa)
    batch.k_cache = reference.quantize_kv(batch.k_cache, k_scale, cache_dtype)
    batch.v_cache = reference.quantize_kv(batch.v_cache, v_scale, cache_dtype)
    features = {"sliding_window": window, "k_scale": k_scale, "v_scale": v_scale}
    out = pa.paged_attention(*batch.attention_args(), **features)
    expected = reference.paged_attention(*batch.attention_args(), **features)
    assert out.dtype == dtype
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    # The scales are applied: read unscaled, the same cache attends differently.
    if (k_scale, v_scale) != (1.0, 1.0):
        unscaled = reference.paged_attention(*batch.attention_args(), sliding_window=window)
        assert not torch.allclose(unscaled, expected, atol=atol, rtol=rtol)


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
    window=st.sampled_from(WINDOWS),
    softcap=st.sampled_from([None, SOFTCAP]),
)
def test_paged_attention_random_batches(
    device, reqs, gqa, head_dim, block_size, block_q, tile_n, num_splits, window, softcap
):
    """Random batch layouts x forced tile shapes x window/soft-cap: the tile -> request
    mapping, causal and window bounds and split-KV slicing must hold for any combination."""
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
        _check_attention(batch, torch.float32, window, softcap)
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


# --- sliding window and soft-capping ----------------------------------------------------

WINDOW_SCENARIOS = (("decode", DECODE), ("prefill", LONG_PREFILL), ("mixed", MIXED))


def _window_softcap_cases():
    """Every (window, soft-cap, scenario) but the plain kernel's, tested above: 21 cases.

    dtype, GQA ratio and head_dim follow (i + j), (i + 2j) and (2i + j) mod 3 for window/
    soft-cap combination i and scenario j: each value meets every scenario (i spans 0..6)
    and every window (i takes two consecutive values, j three).
    """
    combos = [(w, c) for w in WINDOWS for c in (None, SOFTCAP) if (w, c) != (None, None)]
    cases = []
    for i, (window, softcap) in enumerate(combos):
        for j, (name, reqs) in enumerate(WINDOW_SCENARIOS):
            dtype = DTYPES[(i + j) % 3]
            gqa = GQA_RATIOS[(i + 2 * j) % 3]
            head_dim = (32, 64, 80)[(2 * i + j) % 3]
            block_size = BLOCK_SIZES[(i + j) % 2]
            case_id = f"w{window}-cap{softcap}-{DTYPE_NAMES[dtype]}-gqa{gqa}-hd{head_dim}-bs{block_size}-{name}"
            cases.append(pytest.param(dtype, gqa, head_dim, block_size, reqs, window, softcap, id=case_id))
    return cases


def _assert_feature_changes_output(batch, dtype, expected, without: dict, feature: str) -> None:
    """A case proves nothing about a feature that does not change its expected output."""
    plain = reference.paged_attention(*batch.attention_args(), **without)
    atol, _ = ATTENTION_TOLERANCES[dtype]
    change = (expected.float() - plain.float()).abs().max().item()
    assert change > 10 * atol, f"{feature} changes the expected output by only {change:.3g}: the case cannot catch it"


@pytest.mark.parametrize("dtype,gqa,head_dim,block_size,reqs,window,softcap", _window_softcap_cases())
def test_paged_attention_window_softcap(device, dtype, gqa, head_dim, block_size, reqs, window, softcap):
    batch = make_paged_batch(
        reqs, num_heads=2 * gqa, num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype,
        device=device, seed=head_dim + gqa,
    )  # fmt: skip
    expected = _check_attention(batch, dtype, window, softcap)
    if window is not None:
        _assert_feature_changes_output(batch, dtype, expected, {"softcap": softcap}, f"window {window}")
    # With W = 1 a query sees one position: its softmax is 1 whatever the scores.
    if softcap is not None and window != 1:
        _assert_feature_changes_output(batch, dtype, expected, {"sliding_window": window}, f"softcap {softcap}")


@pytest.mark.parametrize("window,softcap", [(1, None), (17, SOFTCAP), (64, None), (300, SOFTCAP)])
def test_paged_attention_split_kv_with_window(device, monkeypatch, window, softcap):
    """Split-KV over the visible tiles only: with W = 1 two of three slices are empty;
    4-query tiles hold rows whose windows start in different slices."""
    reqs = ((1, 700), (1, 300), (4, 90), (1, 0))
    batch = make_paged_batch(
        reqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16, device=device
    )
    forced = pa._Config(block_q=4, block_m=16, tile_n=16, num_splits=3, num_warps=4, num_stages=2)
    monkeypatch.setattr(pa, "_pick_config", lambda *args, **kwargs: forced)
    _check_attention(batch, torch.float16, window, softcap)


def test_split_kv_heuristic_counts_only_the_window():
    """Long contexts are split, but not when a small window leaves little to split."""
    # 1 request, 1 KV head, GQA 8, head_dim 128, an 8192-position block table.
    args = (1, 1, 1, 8, 128, 8192, torch.bfloat16, torch.device("cpu"))
    assert pa._pick_config(*args).num_splits > 1
    assert pa._pick_config(*args, sliding_window=4096).num_splits > 1
    assert pa._pick_config(*args, sliding_window=128).num_splits == 1


# Decodes, chunks and a short prefill whose windows start past whole 64-position tiles.
SKIP_REQS = ((1, 200), (1, 131), (7, 150), (20, 100), (3, 0))
_FORCED_SPLIT = pa._Config(block_q=4, block_m=16, tile_n=16, num_splits=3, num_warps=4, num_stages=2)


@pytest.mark.parametrize(
    "reqs,num_kv_heads,window,forced",
    [
        *(pytest.param(SKIP_REQS, 2, w, None, id=f"mixed-w{w}") for w in (1, 17, 64)),
        # Fewer tokens: 4-query tiles x 3 slices make many interpreted programs.
        *(pytest.param(SKIP_REQS[:3], 2, w, _FORCED_SPLIT, id=f"mixed-split3-w{w}") for w in (1, 17, 64)),
        # The launcher's own split-KV decode: 4 slices of the 512-position window.
        pytest.param(((1, 2000), (1, 900)), 1, 512, None, id="decode-auto-split-w512"),
    ],
)
def test_paged_attention_skips_kv_tiles_outside_the_window(device, monkeypatch, reqs, num_kv_heads, window, forced):
    """KV tiles wholly outside every query's window are never loaded, not merely masked.

    Every position in a 64-position tile before the window of a request's first query is
    NaN in K and V (poison_outside_window). A kernel that loads those tiles and masks
    them gets NaN: the masked scores become -inf, but P @ V multiplies the poisoned V
    rows by 0, and 0 * NaN = NaN. Only skipping gives a finite, correct output. The
    expected output is the reference's on the cache before poisoning.
    Checked: with the kernel's loop forced to start at tile 0 (first_kv_tile = 0) every
    case here fails on NaN.
    """
    gqa = 8 // num_kv_heads
    batch = make_paged_batch(
        reqs, num_heads=num_kv_heads * gqa, num_kv_heads=num_kv_heads, head_dim=64, block_size=16,
        dtype=torch.float16, device=device,
    )  # fmt: skip
    expected = reference.paged_attention(*batch.attention_args(), sliding_window=window)
    poisoned = poison_outside_window(batch, window)
    assert poisoned >= 2 * 64, f"only {poisoned} positions poisoned: the case does not test skipping"
    if forced is None:
        cfg = pa._pick_config(
            batch.query.shape[0], len(reqs), num_kv_heads, gqa, 64, batch.block_tables.shape[1] * 16,
            torch.float16, batch.query.device, window,
        )  # fmt: skip
        assert 64 % cfg.tile_n == 0, f"poisoned tiles of 64 positions do not align with TILE_N {cfg.tile_n}"
        if num_kv_heads == 1:
            assert cfg.num_splits > 1, f"the decode case must exercise split-KV: {cfg}"
    else:
        monkeypatch.setattr(pa, "_pick_config", lambda *args, **kwargs: forced)

    out = pa.paged_attention(*batch.attention_args(), sliding_window=window)
    assert torch.isfinite(out).all(), "the kernel read a KV tile wholly outside the window (NaN poison in the output)"
    atol, rtol = ATTENTION_TOLERANCES[torch.float16]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def test_paged_attention_rejects_bad_window_and_softcap(device):
    batch = make_paged_batch(
        ((1, 3),), num_heads=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32, device=device
    )
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window"):
            pa.paged_attention(*batch.attention_args(), sliding_window=bad)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap"):
            pa.paged_attention(*batch.attention_args(), softcap=bad)


def test_triton_backend_passes_window_and_softcap_to_the_kernel(device):
    """executor_svc's TritonAttentionBackend.attend forwards the per-call features."""
    from executor_svc.attention import AttentionMetadata, TritonAttentionBackend  # noqa: PLC0415

    batch = make_paged_batch(
        MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, device=device
    )
    q_lens = (batch.cu_query_lens[1:] - batch.cu_query_lens[:-1]).tolist()
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),  # attend does not write
        cu_query_lens=batch.cu_query_lens,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        query_lens_host=q_lens,
        seq_lens_host=batch.seq_lens.tolist(),
    )
    out = TritonAttentionBackend().attend(
        batch.query, batch.k_cache, batch.v_cache, meta, batch.scale, sliding_window=17, softcap=SOFTCAP
    )
    expected = reference.paged_attention(*batch.attention_args(), sliding_window=17, softcap=SOFTCAP)
    atol, rtol = ATTENTION_TOLERANCES[torch.float32]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def test_triton_backend_writes_and_reads_an_fp8_cache_as_the_torch_backend(device):
    """executor_svc's two backends on one FP8 cache with a layer's scales: the Triton
    backend's writes are the torch backend's bytes, and its attention their output."""
    from executor_svc.attention import AttentionMetadata, TorchAttentionBackend, TritonAttentionBackend  # noqa: PLC0415

    batch = make_paged_batch(
        MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, device=device
    )
    q_lens = (batch.cu_query_lens[1:] - batch.cu_query_lens[:-1]).tolist()
    num_tokens = sum(q_lens)
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(num_tokens, 2, 32, generator=gen).to(device) * 3
    value = torch.randn(num_tokens, 2, 32, generator=gen).to(device)
    # This step's tokens: the last q_len positions of each request.
    slots = [int(batch.block_tables[r, p // 16]) * 16 + p % 16
             for r, (q, s) in enumerate(zip(q_lens, batch.seq_lens.tolist())) for p in range(s - q, s)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), cu_query_lens=batch.cu_query_lens,
        seq_lens=batch.seq_lens, block_tables=batch.block_tables, query_lens_host=q_lens,
        seq_lens_host=batch.seq_lens.tolist(),
    )
    scales = {"k_scale": 0.7, "v_scale": 1.3}
    # The batch marks slots no request owns with NaN, which the torch backend's whole-block
    # gathers read (and mask); the executor's pool starts zeroed.
    batch.k_cache, batch.v_cache = batch.k_cache.nan_to_num(0.0), batch.v_cache.nan_to_num(0.0)
    caches = {}
    for name, backend in (("torch", TorchAttentionBackend()), ("triton", TritonAttentionBackend())):
        k_cache = reference.quantize_kv(batch.k_cache, scales["k_scale"], torch.float8_e4m3fn)
        v_cache = reference.quantize_kv(batch.v_cache, scales["v_scale"], torch.float8_e4m3fn)
        backend.write_kv(key, value, k_cache, v_cache, meta, **scales)
        caches[name] = (k_cache, v_cache, backend.attend(batch.query, k_cache, v_cache, meta, batch.scale, **scales))
    for got, want in zip(caches["triton"][:2], caches["torch"][:2]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    atol, rtol = ATTENTION_TOLERANCES[torch.float32]
    torch.testing.assert_close(caches["triton"][2], caches["torch"][2], atol=atol, rtol=rtol)


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


FP8_KV_WRITE_CASES = [
    pytest.param(torch.float32, torch.float8_e4m3fn, 1.0, 1.0, id="fp32-e4m3-unscaled"),
    pytest.param(torch.bfloat16, torch.float8_e4m3fn, 0.37, 2.5, id="bf16-e4m3-scaled"),
    pytest.param(torch.float16, torch.float8_e5m2, 0.05, 1.0, id="fp16-e5m2-scaled"),
]


@pytest.mark.parametrize("dtype,cache_dtype,k_scale,v_scale", FP8_KV_WRITE_CASES)
def test_write_kv_cache_fp8(device, dtype, cache_dtype, k_scale, v_scale):
    """Bit for bit the reference's codes: value / scale rounded to nearest even, and
    values past the format's range saturated (the keys' * 300 pass e4m3's 448)."""
    gen = torch.Generator().manual_seed(7)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 5, 16, 3, 64, 19
    key = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 300).to(dtype).to(device)
    key[0, 0, :4] = torch.tensor([1e-6, -3e-3, 0.0, -0.0])  # subnormals and signed zeros
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[[2, 11]] = -1  # padding tokens
    slot_mapping = slot_mapping.to(device)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, k_expected, v_expected, slot_mapping, k_scale, v_scale)
    kv_write.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(k_cache.view(torch.uint8), k_expected.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_expected.view(torch.uint8))
    assert k_cache.float().isfinite().all()


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


# --- larger batches on a real GPU -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("window,softcap", [(None, None), (512, 50.0)], ids=["plain", "w512-cap50"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_NAMES[d])
def test_paged_attention_large_mixed_batch_gpu(dtype, window, softcap):
    gen = torch.Generator().manual_seed(0)
    decode = [(1, int(c)) for c in torch.randint(1, 3000, (48,), generator=gen)]
    chunks = [(int(q), int(c)) for q, c in zip(torch.randint(1, 600, (6,), generator=gen), [0, 0, 512, 1024, 77, 4000])]
    batch = make_paged_batch(
        tuple(decode + chunks), num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype,
        device=torch.device("cuda"),
    )  # fmt: skip
    _check_attention(batch, dtype, window, softcap)


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


@pytest.mark.parametrize("num_splits,window", [(1, None), (1, 17), (3, None)])
def test_paged_attention_sinks(device, monkeypatch, num_splits, window):
    """gpt-oss's per-head sink logits, in the single-pass epilogue and in the
    split-KV merge; the sinks change the output well past the tolerance."""
    reqs = MIXED if num_splits == 1 else ((1, 300), (1, 90), (1, 5))
    batch = make_paged_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
                             device=device, seed=7)
    if num_splits > 1:
        forced = pa._Config(block_q=1, block_m=16, tile_n=16, num_splits=num_splits, num_warps=4, num_stages=2)
        monkeypatch.setattr(pa, "_pick_config", lambda *args, **kwargs: forced)
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0], device=device)
    features = {"sliding_window": window, "sinks": sinks}
    out = pa.paged_attention(*batch.attention_args(), **features)
    expected = reference.paged_attention(*batch.attention_args(), **features)
    atol, rtol = ATTENTION_TOLERANCES[torch.float32]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    _assert_feature_changes_output(batch, torch.float32, expected, {"sliding_window": window}, "sinks")


def _fixed_split_case(device, reqs, fixed_split):
    """Request 0's last query (position 599 of its context) through paged_attention,
    in a batch of (request, q_len, seq_len); every request reads request r's own
    blocks, keys and queries (seeded by r), so request 0's are the same in every batch."""
    block_size, kvh, heads, d, blocks = 16, 2, 4, 16, 38
    k_cache = torch.randn(8 * blocks, block_size, kvh, d, generator=torch.Generator().manual_seed(1))
    v_cache = torch.randn(8 * blocks, block_size, kvh, d, generator=torch.Generator().manual_seed(2))
    queries = [torch.randn(blocks * block_size, heads, d, generator=torch.Generator().manual_seed(10 + r))
               for r in range(8)]
    q = torch.cat([queries[r][s - n:s] for r, n, s in reqs])
    cu = torch.tensor([0] + [n for _, n, _ in reqs], dtype=torch.int32).cumsum(0).to(torch.int32)
    seq = torch.tensor([s for _, _, s in reqs], dtype=torch.int32)
    tables = torch.stack([torch.arange(blocks * r, blocks * (r + 1), dtype=torch.int32) for r, _, _ in reqs])
    out = pa.paged_attention(q.to(device), k_cache.to(device), v_cache.to(device), cu.to(device), seq.to(device),
                             tables.to(device), d**-0.5, fixed_split=fixed_split)
    at = int(cu[[r for r, _, _ in reqs].index(0) + 1]) - 1
    return out[at].cpu()


def test_paged_attention_fixed_split_gives_a_query_the_same_bits_in_any_batch(device):
    """Batch-invariant mode's kernel config: one tile shape, no split-KV. Request 0's
    query at position 599 alone (where split-KV would be picked), among other decodes,
    and at the end of a 40-token prefill chunk beside a decode."""
    alone = _fixed_split_case(device, [(0, 1, 600)], True)
    batches = {
        "among decodes": [(3, 1, 90), (0, 1, 600), (5, 1, 150)],
        "ending a 40-token chunk beside a decode": [(1, 1, 30), (0, 40, 600)],
    }
    for name, reqs in batches.items():
        assert torch.equal(_fixed_split_case(device, reqs, True), alone), f"fixed split: differs {name}"
    # The control: without it the decode alone is split over the context, the chunk is not.
    assert not torch.equal(_fixed_split_case(device, [(0, 40, 600)], False),
                           _fixed_split_case(device, [(0, 1, 600)], False)), "the control shows no difference"
