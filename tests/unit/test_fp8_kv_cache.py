"""EXECUTOR_KV_CACHE_DTYPE=fp8_e4m3 | fp8_e5m2: the pool holds one byte per
value (so about twice the blocks of a 16-bit cache in the same memory),
values go in divided by the layer's scale and come back multiplied by it,
the host tier moves FP8 blocks unchanged, checkpoint scales load by name,
and an unknown dtype is refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor_svc.attention import AttentionMetadata, TorchAttentionBackend
from executor_svc.attention.kv_quant import dequantize, quantize
from executor_svc.config import ExecutorSettings
from executor_svc.loading import check_torch_compile
from executor_svc.model.checkpoint import load_checkpoint
from executor_svc.model.families import build_model, family_of, read_config
from executor_svc.model.model import build_model as build_decoder
from executor_svc.step.host_kv import HostKVPool
from executor_svc.step.kv_cache import KVCachePool, num_blocks_for_budget, resolve_kv_cache_dtype
from llmsched_kernels import reference
from llmsched.errors import StartupError, load_settings
from tests.families import CASES, make_checkpoint
from tests.integration.test_fp8_kv_cache import run
from tests.unit.test_mla import DEEPSEEK_V3

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Largest relative rounding error of a normal value: half an ulp (3 and 2 mantissa bits).
REL_ERROR = {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}


@pytest.fixture(scope="module")
def stories(stories_path):
    ckpt = load_checkpoint(str(stories_path))
    return ckpt, read_config(ckpt.hf_config)


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("name", FP8)
def test_an_fp8_pool_holds_about_twice_the_blocks_in_the_same_memory(stories, compute, name):
    _, llama = stories
    for cfg in (llama, read_config(DEEPSEEK_V3 | {"num_hidden_layers": 2})):
        auto = num_blocks_for_budget(cfg, 16, resolve_kv_cache_dtype("auto", compute), 64)
        fp8 = num_blocks_for_budget(cfg, 16, resolve_kv_cache_dtype(name, compute), 64)
        ratio = fp8 / auto
        want = 4 if compute == torch.float32 else 2  # bytes per value in the compute dtype
        assert ratio >= 1.95 and ratio == pytest.approx(want, rel=0.01), (cfg.architecture, ratio)
    pool = KVCachePool(llama, 4, 16, torch.device("cpu"), FP8[name])
    assert pool.storage.dtype == FP8[name] and pool.storage.element_size() == 1
    # What the handshake reports as kv_bytes_per_token: K and V, 4 KV heads x 8 dims, 5 layers, 1 byte each.
    assert pool.bytes_per_token == 2 * 4 * 8 * 5


def test_an_unknown_kv_cache_dtype_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("EXECUTOR_KV_CACHE_DTYPE", "fp8")
    with pytest.raises(StartupError, match=r"EXECUTOR_KV_CACHE_DTYPE='fp8': Input should be 'auto', 'fp8_e4m3' or "
                                           r"'fp8_e5m2'"):
        load_settings(ExecutorSettings)
    monkeypatch.setenv("EXECUTOR_KV_CACHE_DTYPE", "fp8_e4m3")
    assert load_settings(ExecutorSettings).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match=r"EXECUTOR_KV_CACHE_DTYPE='int8' is not supported; supported: auto, "
                                         r"fp8_e4m3, fp8_e5m2"):
        resolve_kv_cache_dtype("int8", torch.float32)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(StartupError, match="EXECUTOR_TORCH_COMPILE=on is not implemented with "
                                           "EXECUTOR_KV_CACHE_DTYPE=fp8_e5m2"):
        check_torch_compile("on", torch.device("cpu"), 1, None, "fp8_e5m2")


@pytest.mark.parametrize("dtype", FP8.values(), ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.37, 4.0])
def test_values_come_back_within_fp8_rounding_times_the_scale_and_saturate(dtype, scale):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 8, generator=g) * 3
    stored = quantize(x, scale, dtype)
    assert stored.dtype == dtype
    back = dequantize(stored, scale, torch.float32)
    normal = x.abs() / scale >= torch.finfo(dtype).smallest_normal
    err = ((back - x).abs() / x.abs())[normal]
    assert err.max() <= REL_ERROR[dtype] * 1.0001, err.max()
    assert torch.equal(back, stored.float() * scale)  # the read is stored * scale
    # Beyond the finite range: the largest finite value, never inf or NaN.
    limit = torch.finfo(dtype).max
    huge = dequantize(quantize(torch.tensor([1e9, -1e9]), scale, dtype), scale, torch.float32)
    assert torch.equal(huge, torch.tensor([limit, -limit]) * scale)
    # A cache in the compute dtype stores the values themselves, scales or not.
    assert quantize(x, scale, torch.float32) is x and dequantize(x, scale, torch.float32) is x


def _batch(query_lens, seq_lens, dtype, *, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=0):
    """Every request's K/V written through the backend (one slot per position), and a query batch."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 3
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.randperm(num_blocks, generator=g)[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    slots = torch.cat([tables[r].repeat_interleave(block_size)[:s] * block_size
                       + torch.arange(s) % block_size for r, s in enumerate(seq_lens)])
    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(query_lens).cumsum(0)
    meta = AttentionMetadata(slot_mapping=slots, cu_query_lens=cu, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             block_tables=tables.to(torch.int32), query_lens_host=list(query_lens),
                             seq_lens_host=list(seq_lens))
    keys = torch.randn(len(slots), num_kv_heads, head_dim, generator=g) * 2
    values = torch.randn(len(slots), num_kv_heads, head_dim, generator=g)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=g)
    return query, keys, values, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", FP8.values(), ids=str)
def test_the_torch_backend_writes_and_reads_fp8_as_the_reference_does(dtype):
    k_scale, v_scale = 0.4, 1.7
    # decodes (one split into pieces by the small chunk below), a prefill, a chunk after cached context
    query_lens, seq_lens = [1, 1, 9, 3], [5, 30, 9, 14]
    query, keys, values, k_cache, v_cache, meta = _batch(query_lens, seq_lens, dtype)
    backend = TorchAttentionBackend()
    backend.write_kv(keys, values, k_cache, v_cache, meta, k_scale=k_scale, v_scale=v_scale)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.write_kv_cache(keys, values, ref_k, ref_v, meta.slot_mapping, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    got = backend.attend(query, k_cache, v_cache, meta, 0.25, k_scale=k_scale, v_scale=v_scale)
    want = reference.paged_attention(query, ref_k, ref_v, meta.cu_query_lens, meta.seq_lens, meta.block_tables, 0.25,
                                     k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # ...and the scales matter: without them the same cache reads differently.
    unscaled = backend.attend(query, k_cache, v_cache, AttentionMetadata(**{
        f: getattr(meta, f) for f in ("slot_mapping", "cu_query_lens", "seq_lens", "block_tables",
                                      "query_lens_host", "seq_lens_host")}), 0.25)
    assert not torch.allclose(unscaled, got, atol=1e-2)
    # Against the values themselves (no cache rounding): FP8's error, no more.
    exact = reference.paged_attention(query, *_dense_caches(keys, values, k_cache, meta), meta.cu_query_lens,
                                      meta.seq_lens, meta.block_tables, 0.25)
    mean_error = (got - exact).abs().mean().item()
    assert mean_error < (0.03 if dtype == torch.float8_e4m3fn else 0.06), mean_error  # measured 0.018, 0.036


def _dense_caches(keys, values, like, meta):
    k, v = torch.zeros(like.shape), torch.zeros(like.shape)
    reference.write_kv_cache(keys, values, k, v, meta.slot_mapping)
    return k, v


def test_the_torch_backend_reads_an_fp8_latent_with_its_scale(stories):
    dtype, k_scale = torch.float8_e4m3fn, 0.6
    query, latent, _, cache, _, meta = _batch([1, 1], [7, 12], dtype, num_heads=4, num_kv_heads=1, head_dim=24)
    backend = TorchAttentionBackend()
    backend.write_latent(latent, cache, meta, k_scale=k_scale)
    query = query[:, :, :24]
    got = backend.attend_latent(query, cache, meta, 0.3, 16, k_scale=k_scale)
    want = reference.mla_decode(query, cache, meta.seq_lens, meta.block_tables, 0.3, 16, k_scale=k_scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_host_tier_moves_fp8_blocks_unchanged(stories):
    _, cfg = stories
    cpu = torch.device("cpu")
    pool = KVCachePool(cfg, 6, 4, cpu, torch.float8_e5m2)
    host = HostKVPool(pool, 3, cpu)
    assert host.storage.dtype == torch.float8_e5m2 and host.block_bytes == 4 * pool.bytes_per_token
    pool.storage.copy_(torch.randn(pool.storage.shape).to(torch.float8_e5m2))
    before = pool.storage[:, :, [1, 4]].clone()
    assert host.swap(pool.storage, [1, 4], [2, 0], [], []).failed_outs == []
    pool.storage.view(torch.uint8)[:, :, [1, 4]] = 0xFF  # NaN in e5m2
    host.swap(pool.storage, [], [], [2, 0], [5, 3])
    assert torch.equal(pool.storage[:, :, [5, 3]].view(torch.uint8), before.view(torch.uint8))


def test_checkpoint_kv_scales_load_onto_their_layers_and_bad_ones_are_refused(stories):
    ckpt, cfg = stories
    cpu = torch.device("cpu")
    tensors = dict(ckpt.state_dict)
    plain = build_model(cfg, tensors, 64, cpu, torch.float32)
    assert {(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in plain.model.layers} == {(1.0, 1.0)}
    scaled = tensors | {"model.layers.1.self_attn.k_scale": torch.tensor(0.25),
                        "model.layers.1.self_attn.v_scale": torch.tensor([2.0]),
                        "model.layers.3.self_attn.k_scale": torch.tensor(0.5)}
    model = build_model(cfg, scaled, 64, cpu, torch.float32)
    got = [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in model.model.layers]
    assert got == [(1.0, 1.0), (0.25, 2.0), (1.0, 1.0), (0.5, 1.0), (1.0, 1.0)]
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_scale: shape \(4,\); only one KV-cache scale "
                                         r"per layer \(per tensor\) is implemented"):
        build_model(cfg, tensors | {"model.layers.1.self_attn.k_scale": torch.ones(4)}, 64, cpu, torch.float32)
    with pytest.raises(ValueError, match="not a usable KV-cache scale"):
        build_model(cfg, tensors | {"model.layers.1.self_attn.v_scale": torch.tensor(0.0)}, 64, cpu, torch.float32)
    with pytest.raises(ValueError, match=r"unexpected=\['model.layers.9.self_attn.k_scale'\]"):
        build_model(cfg, tensors | {"model.layers.9.self_attn.k_scale": torch.tensor(1.0)}, 64, cpu, torch.float32)


@pytest.mark.parametrize("family", ["deepseek-v3", "gpt-oss"])
def test_latent_and_sink_attention_models_run_on_an_fp8_cache_close_to_auto(tmp_path, family):
    """DeepSeek-V3's latent cache and gpt-oss's sinks and windows, through the
    model with each layer's scales (k 0.5, v 2.0), teacher-forced on auto's
    tokens: no flip where auto's top-1/top-2 gap is >= 1.5, and the logits
    move by a small part of their spread. DeepSeek-V3's layers are all dense
    here: its group-limited routing turns a rounding into another expert
    choice, which moves the logits by more than the cache does (measured:
    a mean change of 11% of their spread with routing, 2% without)."""
    case = CASES[family]
    if family == "deepseek-v3":
        dense = {"first_k_dense_replace": case.config["num_hidden_layers"]}
        case = dataclasses.replace(case, config=case.config | dense)
    ckpt = load_checkpoint(str(make_checkpoint(case, tmp_path)))
    cfg = read_config(ckpt.hf_config, ckpt.generation_config)
    fam = family_of(cfg)
    model = build_decoder(cfg, ckpt.tensors(), 256, torch.device("cpu"), torch.float32, model_cls=fam.model_cls,
                          rename=fam.rename)
    for layer in model.model.layers:
        layer.self_attn.k_scale, layer.self_attn.v_scale = 0.5, 2.0
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(20)]
    tokens, auto = run(model, cfg, prompt, "auto", None, num_tokens=24)
    _, fp8 = run(model, cfg, prompt, "fp8_e4m3", tokens, num_tokens=24)
    top2 = auto.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= 1.5
    assert (fp8.argmax(-1) == auto.argmax(-1))[clear].all()
    change = ((fp8 - auto).abs().mean() / auto.std()).item()
    assert 0 < change < 0.05, change
