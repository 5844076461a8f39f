"""The Triton attention backend against the torch one, in process, and how
EXECUTOR_ATTENTION_BACKEND resolves.

Without CUDA the Triton kernels run under Triton's CPU interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton),
so the batches here are small.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from executor_svc.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    make_backend,
    resolve_backend_name,
)
from executor_svc.config import ExecutorSettings
from tests.conftest import REPO_ROOT

pytest.importorskip("triton")
from executor_svc.attention import TritonAttentionBackend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def mixed_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, num_blocks=48, seed=0):
    """A step batch laid out as executor_svc/step/runner.py lays it out: every
    request's first seq_len - q_len positions already cached (random K/V),
    its q_len new tokens' K/V still to be written at the following slots."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    need = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i : i + n] + [0] * (max(need) - n))  # zero padding, as the runner pads
        i += n
    block_tables = torch.tensor(tables, dtype=torch.int32)
    positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
    reqs = [r for r, q in enumerate(query_lens) for _ in range(q)]
    slot_mapping = torch.tensor(
        [tables[r][p // block_size] * block_size + p % block_size for r, p in zip(reqs, positions)], dtype=torch.int64
    )
    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    n = sum(query_lens)
    query = torch.randn(n, num_heads, head_dim, generator=g)
    key = torch.randn(n, num_kv_heads, head_dim, generator=g)
    value = torch.randn(n, num_kv_heads, head_dim, generator=g)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(DEVICE),
        cu_query_lens=cu.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
    )
    tensors = [t.to(DEVICE) for t in (query, key, value, k_cache, v_cache)]
    return (*tensors, meta)


def run_layer(backend, query, key, value, k_cache, v_cache, meta, scale):
    """What one attention layer of the model does: write, then attend."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    backend.write_kv(key, value, k_cache, v_cache, meta)
    out = backend.attend(query, k_cache, v_cache, meta, scale)
    return out, k_cache, v_cache


# Most batches mix decodes (q_len 1), a whole prefill (q_len == seq_len) and a
# prefill chunk after cached context (q_len < seq_len), in varied orders.
CASES = [
    # query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size
    pytest.param([1, 7, 1, 5], [9, 7, 3, 13], 8, 4, 8, 4, id="stories-shape-gqa2-hd8-bs4"),
    pytest.param([4, 1, 6, 1, 1], [4, 18, 21, 1, 33], 4, 1, 16, 16, id="gqa4-hd16-bs16"),
    # Decodes only, long enough context and few enough programs for the
    # kernel's split-KV path (its CPU stand-in has 4 "SMs").
    pytest.param([1, 1], [300, 45], 2, 1, 16, 16, id="decode-only-split-kv"),
]


@pytest.mark.parametrize("query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size", CASES)
def test_triton_backend_matches_torch_backend_on_a_mixed_batch(
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size
):
    inputs = mixed_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    want_out, want_k, want_v = run_layer(TorchAttentionBackend(), *inputs, scale)
    got_out, got_k, got_v = run_layer(TritonAttentionBackend(), *inputs, scale)
    # Cache writes are copies: bit-identical, and only the mapped slots changed.
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    _, key, value, k_cache, _, meta = inputs
    changed = (got_k != k_cache).flatten(0, 1).any(-1).any(-1).nonzero().flatten()
    assert set(changed.tolist()) <= set(meta.slot_mapping.tolist())
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)


def test_triton_backend_adapts_metadata_dtypes_and_layout():
    """The launchers assert int32 cu_query_lens / seq_lens / block_tables, an
    int32-or-int64 contiguous slot_mapping and head_dim-contiguous q/k/v; the
    backend converts what does not fit instead of tripping those asserts."""
    query, key, value, k_cache, v_cache, meta = mixed_batch([1, 3], [6, 3], 4, 2, 8, 4)
    scale = 8**-0.5
    want = run_layer(TorchAttentionBackend(), query, key, value, k_cache, v_cache, meta, scale)
    odd = AttentionMetadata(
        slot_mapping=meta.slot_mapping.to(torch.int32).repeat_interleave(2)[::2],  # int32, strided
        cu_query_lens=meta.cu_query_lens.long(),
        seq_lens=meta.seq_lens.long(),
        block_tables=meta.block_tables.long(),
        query_lens_host=meta.query_lens_host,
        seq_lens_host=meta.seq_lens_host,
    )
    assert not odd.slot_mapping.is_contiguous()
    # Same values, but head_dim no longer the contiguous axis.
    query_t = query.transpose(1, 2).contiguous().transpose(1, 2)
    key_t = key.transpose(1, 2).contiguous().transpose(1, 2)
    got = run_layer(TritonAttentionBackend(), query_t, key_t, value, k_cache, v_cache, odd, scale)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


def test_auto_resolves_to_torch_on_cpu_and_triton_on_cuda(monkeypatch):
    monkeypatch.delenv("EXECUTOR_ATTENTION_BACKEND", raising=False)
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
    assert resolve_backend_name("auto", "cuda:0") == "triton"
    assert make_backend("auto", torch.device("cpu")).name == "torch"
    assert make_backend("torch", torch.device("cpu")).name == "torch"
    assert ExecutorSettings().attention_backend == "auto"
    if not torch.cuda.is_available():
        assert make_backend("auto").name == "torch"  # no device given: cuda when available


def test_explicit_triton_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert make_backend("triton", torch.device("cpu")).name == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_backend("triton", torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    # What the executor does at start-up with EXECUTOR_ATTENTION_BACKEND=triton.
    monkeypatch.setenv("EXECUTOR_ATTENTION_BACKEND", "triton")
    with pytest.raises(ValueError, match="EXECUTOR_ATTENTION_BACKEND=triton needs a CUDA device"):
        make_backend(ExecutorSettings().attention_backend, "cpu")


def test_unknown_backend_name_is_rejected():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        make_backend("flash", torch.device("cpu"))
    with pytest.raises(ValueError):
        ExecutorSettings(attention_backend="flash")


def test_torch_backend_never_imports_triton():
    code = (
        "import sys, torch\n"
        "from executor_svc.attention import make_backend\n"
        "assert make_backend('auto', torch.device('cpu')).name == 'torch'\n"
        "assert make_backend('torch', torch.device('cpu')).name == 'torch'\n"
        "assert 'triton' not in sys.modules and 'llmsched_kernels.paged_attention' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=120)


@pytest.mark.parametrize("option", [{"sliding_window": 4}, {"softcap": 2.0}, {"sliding_window": 1, "softcap": 2.0}])
def test_triton_and_torch_backends_agree_with_window_and_softcap(option):
    query, _, _, k_cache, v_cache, meta = mixed_batch([1, 3], [6, 3], 4, 2, 8, 4)
    scale = 8**-0.5
    plain = TorchAttentionBackend().attend(query, k_cache, v_cache, meta, scale)
    torch_out = TorchAttentionBackend().attend(query, k_cache, v_cache, meta, scale, **option)
    triton_out = TritonAttentionBackend().attend(query, k_cache, v_cache, meta, scale, **option)
    torch.testing.assert_close(triton_out, torch_out, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(torch_out, plain, atol=1e-4), f"{option} changed nothing: the check cannot fail"
