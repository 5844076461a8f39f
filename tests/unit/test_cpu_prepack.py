"""EXECUTOR_CPU_BF16_PREPACK (executor_svc/model/cpu_prepack.py): bf16
weights packed once give F.linear's outputs (bit for bit in oneDNN's
layout, to float32 rounding in cpu_bf16_vnni's) at every row count,
eagerly and inside compiled decode graphs, replace the stored weight, and
refuse any plain use. Each kind runs where the CPU has its instructions:
oneDNN's layout needs native bf16 (AVX512-BF16 or AMX), the avx512bf16
kernel AVX512-BF16, the avx512 kernel AVX512F (torch's AVX512 level), the
avx2 kernel AVX2 and FMA; elsewhere the tests say so as they skip."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_svc.attention import make_backend
from executor_svc.loading import weight_bytes
from executor_svc.model import cpu_bf16_vnni, cpu_gemv, cpu_prepack
from executor_svc.step.kv_cache import KVCachePool
from executor_svc.step.runner import ModelRunner
from tests.unit.test_cpu_gemv import BLOCK, build, medium, prompts  # noqa: F401 (a fixture)
from tests.unit.test_runner_vs_hf import generate

CPU = torch.device("cpu")

ONEDNN = pytest.param("onednn", marks=pytest.mark.skipif(
    not (cpu_gemv.native_bf16_gemm() and cpu_prepack.onednn_available()),
    reason="no native bf16 GEMM on this CPU, or no oneDNN weight reorder in this torch"))
AVX512 = pytest.param("avx512bf16", marks=pytest.mark.skipif(not cpu_bf16_vnni.can_build("avx512bf16"),
                                                             reason="the CPU has no AVX512-BF16"))
AVX512F = pytest.param("avx512", marks=pytest.mark.skipif(not cpu_bf16_vnni.can_build("avx512"),
                                                          reason="the CPU has no AVX512 (torch's level)"))
AVX2 = pytest.param("avx2", marks=pytest.mark.skipif(not cpu_bf16_vnni.can_build("avx2"),
                                                     reason="the CPU has no AVX2"))
KINDS = [ONEDNN, AVX512, AVX512F, AVX2]
PAIR_KINDS = [AVX512, AVX512F, AVX2]


def same(kind: str, got: torch.Tensor, want: torch.Tensor) -> bool:
    """oneDNN's layout: F.linear's outputs bit for bit; the pair kernels'
    (cpu_bf16_vnni.py): the same sums in another order, each rounded once
    to bf16."""
    if kind == "onednn":
        return torch.equal(got, want)
    return torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * want.float().abs().max().item())


def packed_weight(layer) -> bool:
    return layer.weight.is_mkldnn or layer.weight.dim() == 4


def runner(cfg, model, compiled: bool) -> ModelRunner:
    return ModelRunner(model, KVCachePool(cfg, 64, BLOCK, CPU, torch.bfloat16), make_backend("torch"), CPU,
                       torch_compile=compiled)


class Layer(torch.nn.Module):
    def __init__(self, n: int, k: int, bias: bool):
        super().__init__()
        g = torch.Generator().manual_seed(n + k)
        self.weight = torch.nn.Parameter(torch.randn(n, k, generator=g).bfloat16(), requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.randn(n, generator=g).bfloat16(), requires_grad=False)
                     if bias else None)


@pytest.fixture(autouse=True)
def built_kernels():
    for kind in cpu_prepack.PAIR_KINDS:
        if cpu_bf16_vnni.can_build(kind):
            assert cpu_bf16_vnni.load(kind), f"the {kind} kernel did not build or failed its check (logged)"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_weight_gives_f_linear_s_outputs_at_every_row_count(bias, kind):
    """1000 outputs leave a partial strip and block; the row counts cover
    the one-block path, every micro-kernel's tail and several row groups."""
    layer = Layer(1000, 1024, bias)
    plain, plain_bias = layer.weight.clone(), None if layer.bias is None else layer.bias.clone()
    assert cpu_prepack.prepack(layer, kind)
    assert packed_weight(layer), "the stored weight was not replaced: the model would hold two copies"
    g = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 5, 16, 17, 64, 100, 300):
        x = torch.randn(rows, 1024, generator=g).bfloat16()
        assert same(kind, cpu_prepack.linear(layer, x), F.linear(x, plain, plain_bias)), f"{rows} rows"
    x3 = torch.randn(2, 5, 1024, generator=g).bfloat16()
    assert same(kind, cpu_prepack.linear(layer, x3), F.linear(x3, plain, plain_bias)), "3-D input"


@pytest.mark.parametrize("kind", PAIR_KINDS)
def test_the_pair_kernels_give_each_row_the_outputs_it_has_alone(kind):
    """Each output is one float32 sum over the column pairs in order,
    whatever the batch: a row's outputs are bit for bit the same alone, in
    the first or the last place of a batch, in any micro-kernel's tail."""
    layer = Layer(700, 1536, True)
    assert cpu_prepack.prepack(layer, kind)
    batch = torch.randn(61, 1536, generator=torch.Generator().manual_seed(2)).bfloat16()
    together = cpu_prepack.linear(layer, batch)
    for row in (0, 5, 47, 48, 60):
        assert torch.equal(cpu_prepack.linear(layer, batch[row:row + 1]), together[row:row + 1]), f"row {row}"
        assert torch.equal(cpu_prepack.linear(layer, batch[row:row + 7]), together[row:row + 7]), f"rows {row}+"


@pytest.mark.skipif(not cpu_bf16_vnni.can_build("avx512"), reason="the CPU has no AVX512 (torch's level)")
def test_the_avx512_kernel_gives_the_avx2_kernel_s_outputs_bit_for_bit():
    """The same sums in the same order in wider registers, at every row
    count through both kernels' micro-kernel tails (1-8 and 1-4 rows)."""
    weight, bias = Layer(700, 1536, True).weight, Layer(700, 1536, True).bias
    packed = cpu_bf16_vnni.pack(weight)
    x = torch.randn(61, 1536, generator=torch.Generator().manual_seed(3)).bfloat16()
    for rows in (1, 2, 3, 5, 7, 8, 9, 13, 48, 61):
        assert torch.equal(cpu_bf16_vnni.linear(x[:rows], packed, bias, 700, "avx512"),
                           cpu_bf16_vnni.linear(x[:rows], packed, bias, 700, "avx2")), f"{rows} rows"


@pytest.mark.parametrize("kind", KINDS)
def test_a_packed_weight_refuses_plain_use_instead_of_computing_with_its_packed_layout(kind):
    layer = Layer(512, 1024, False)
    assert cpu_prepack.prepack(layer, kind)
    with pytest.raises((RuntimeError, NotImplementedError)):
        F.linear(torch.randn(2, 1024).bfloat16(), layer.weight)


@pytest.mark.parametrize("kind", KINDS)
def test_a_bf16_model_packs_its_untied_linears_and_keeps_its_tokens_and_byte_count(medium, kind):
    """The medium model (tie_word_embeddings false): all five big linears,
    the head included, packed. Eager steps give the tokens the stored
    layout gave through F.linear (oneDNN's: the same products bit for bit;
    the AVX512-BF16 kernel's: the same to float32 rounding, and these
    greedy paths have no tie that close); compiled layerwise, each layer's
    graph calls the packed product by that layer's own handle, which the
    warm-up checks against the layer run eagerly (a graph reading layer 0's
    weights everywhere would fail it)."""
    from executor_svc.step.compiled_decode import STEPS

    cfg, model = build(medium, torch.bfloat16)

    three = prompts(3)
    want = generate(runner(cfg, model, False), three, 12, 7)
    before = weight_bytes(model)
    assert cpu_gemv.use_cpu_gemv(model, prepack=kind) == 5
    packed = [m for m in model.modules() if getattr(m, "prepack_handle", None) is not None]
    assert len(packed) == 5 and model.lm_head in packed
    assert all(packed_weight(m) for m in packed)
    assert weight_bytes(model) == before, "packed weights are not counted as they were (no padding at these shapes)"
    assert generate(runner(cfg, model, False), three, 12, 7) == want, "the packed layout changed greedy tokens"
    try:
        compiled = runner(cfg, model, True)
        assert compiled.compiled is not None and compiled.compiled.layerwise and compiled.compiled.direct[0]
        steps = STEPS._value.get()
        assert generate(compiled, three[:1], 12, 7) == want[:1], "the compiled packed steps changed greedy tokens"
        assert STEPS._value.get() - steps >= 11, "decode steps did not run compiled"
        assert compiled.compiled is not None, "a compiled step failed and the runner fell back to eager"
    finally:
        torch._dynamo.reset()


def test_auto_packs_for_the_kernel_this_cpu_has(medium):
    """AVX512-BF16 without AMX: the avx512bf16 kernel; other native bf16
    (AMX): oneDNN's layout; none, with AVX512F: the avx512 kernel; with
    AVX2: the avx2 kernel."""
    _, model = build(medium, torch.bfloat16)
    cpu_gemv.use_cpu_gemv(model)
    down = model.model.layers[0].mlp.down_proj
    if cpu_bf16_vnni.cpu_has_it():
        want = "avx512bf16"
    elif cpu_gemv.native_bf16_gemm():
        want = "onednn" if cpu_prepack.onednn_available() else None
    else:
        want = next((kind for kind in ("avx512", "avx2") if cpu_bf16_vnni.can_build(kind)), None)
    assert getattr(down, "prepack_kind", None) == want
    assert down.weight.is_mkldnn == (want == "onednn") and (down.weight.dim() == 4) == (want in cpu_prepack.PAIR_KINDS)


def test_auto_without_native_bf16_takes_the_widest_kernel_the_cpu_runs(monkeypatch):
    """Intel Skylake-SP to Ice Lake (AVX512F, no bf16): avx512; AVX2
    alone: avx2."""
    monkeypatch.setattr(cpu_bf16_vnni, "cpu_has_it", lambda: False)
    want = next((kind for kind in ("avx512", "avx2") if cpu_bf16_vnni.can_build(kind)), None)
    assert cpu_prepack.choose("auto", native_bf16=False) == want
    if want is not None:  # (a kernel is only run where the CPU has its instructions)
        monkeypatch.setattr(cpu_bf16_vnni, "can_build", lambda kind: kind == "avx2")
        monkeypatch.setattr(cpu_bf16_vnni, "_kernels", {})
        assert cpu_prepack.choose("auto", native_bf16=False) == "avx2"


def test_a_head_tied_to_the_embedding_keeps_its_stored_layout_for_onednn(medium):
    if not (cpu_gemv.native_bf16_gemm() and cpu_prepack.onednn_available()):
        pytest.skip("no native bf16 GEMM on this CPU, or no oneDNN weight reorder in this torch")
    _, model = build(medium, torch.bfloat16)
    model.lm_head.weight = model.model.embed_tokens.weight
    cpu_gemv.use_cpu_gemv(model, prepack="onednn")
    assert model.lm_head.prepack_handle is None and model.lm_head.weight.dim() == 2
    assert not model.lm_head.weight.is_mkldnn
    assert model.model.layers[0].mlp.down_proj.prepack_handle is not None


@pytest.mark.parametrize("kind", PAIR_KINDS)
def test_a_head_tied_to_the_embedding_is_packed_once_for_a_pair_kernel_and_the_embedding_reads_it(medium, kind):
    """One copy, packed: the head multiplies by it, the embedding gathers
    its rows from it (the same values bit for bit), the byte count is the
    tied model's, and greedy tokens are the stored layout's, eager and
    compiled."""
    cfg, model = build(medium, torch.bfloat16)
    embedding = model.model.embed_tokens
    model.lm_head.weight = embedding.weight
    stored = embedding.weight.detach().clone()

    three = prompts(3)
    want = generate(runner(cfg, model, False), three, 12, 7)
    before = weight_bytes(model)
    assert cpu_gemv.use_cpu_gemv(model, prepack=kind) == 5
    assert model.lm_head.prepack_handle is not None and model.lm_head.weight.dim() == 4
    assert embedding.weight is model.lm_head.weight and embedding.packed_rows, "the embedding kept a second copy"
    assert weight_bytes(model) == before, "the tied weight is counted twice or not at all"
    ids = torch.tensor([[0, 5, 17], [2047, 16, 1]])
    assert torch.equal(embedding(ids), stored[ids]), "rows gathered from the packed layout differ from the stored ones"
    assert generate(runner(cfg, model, False), three, 12, 7) == want, "the packed tied head changed greedy tokens"
    try:
        compiled = runner(cfg, model, True)
        assert compiled.compiled is not None
        assert generate(compiled, three[:1], 12, 7) == want[:1], "compiled steps changed greedy tokens"
        assert compiled.compiled is not None, "a compiled step failed and the runner fell back to eager"
    finally:
        torch._dynamo.reset()


def test_off_keeps_every_stored_layout(medium):
    _, model = build(medium, torch.bfloat16)
    cpu_gemv.use_cpu_gemv(model, prepack="off")
    assert not any(p.is_mkldnn or p.dim() > 2 for p in model.parameters())
    assert all(getattr(m, "prepack_handle", None) is None for m in model.modules())


def test_without_a_c_compiler_no_pair_kernel_serves_and_the_weights_keep_their_layout(medium, monkeypatch, tmp_path,
                                                                                     caplog):
    import logging

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpu_bf16_vnni, "_kernels", {})
    with caplog.at_level(logging.INFO):
        assert cpu_prepack.choose("avx2", native_bf16=False) is None
        assert cpu_prepack.choose("avx512bf16", native_bf16=True) is None
    if cpu_bf16_vnni.can_build("avx2"):
        assert "avx2 bf16 kernel: not built" in caplog.text and "no-such-cc" in caplog.text
    monkeypatch.setattr(cpu_gemv, "native_bf16_gemm", lambda: False)
    _, model = build(medium, torch.bfloat16)
    cpu_gemv.use_cpu_gemv(model)
    assert all(getattr(m, "prepack_handle", None) is None for m in model.modules())
    assert not any(p.dim() > 2 for p in model.parameters())
