"""EXECUTOR_CPU_BF16_PREPACK (executor_svc/model/cpu_prepack.py): on a CPU
with native bf16, bf16 weights packed once give F.linear's outputs (bit for
bit in oneDNN's layout, to float32 rounding in the AVX512-BF16 kernel's) at
every row count, eagerly and inside compiled decode graphs, replace the
stored weight, and refuse any plain use. These need native bf16
instructions (AVX512-BF16 or AMX; the AVX512-BF16 kind, AVX512-BF16):
elsewhere the layouts are never used, and the tests say so as they skip."""

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

pytestmark = pytest.mark.skipif(not cpu_gemv.native_bf16_gemm(),
                                reason="no native bf16 GEMM on this CPU: weights keep their stored layout here")

ONEDNN = pytest.param("onednn", marks=pytest.mark.skipif(not cpu_prepack.onednn_available(),
                                                         reason="this torch has no oneDNN weight reorder"))
AVX512 = pytest.param("avx512bf16", marks=pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(),
                                                             reason="the CPU has no AVX512-BF16"))
KINDS = [ONEDNN, AVX512]


def same(kind: str, got: torch.Tensor, want: torch.Tensor) -> bool:
    """oneDNN's layout: F.linear's outputs bit for bit; the AVX512-BF16
    kernel's: the same sums in another order, each rounded once to bf16."""
    if kind == "onednn":
        return torch.equal(got, want)
    return torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * want.float().abs().max().item())


def packed_weight(layer) -> bool:
    return layer.weight.is_mkldnn or layer.weight.dim() == 4


class Layer(torch.nn.Module):
    def __init__(self, n: int, k: int, bias: bool):
        super().__init__()
        g = torch.Generator().manual_seed(n + k)
        self.weight = torch.nn.Parameter(torch.randn(n, k, generator=g).bfloat16(), requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.randn(n, generator=g).bfloat16(), requires_grad=False)
                     if bias else None)


@pytest.fixture(autouse=True)
def built_kernel():
    if torch.cpu._is_avx512_bf16_supported():
        assert cpu_bf16_vnni.load(), "the AVX512-BF16 kernel did not build or failed its check (logged)"


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


def test_the_avx512_bf16_kernel_gives_each_row_the_outputs_it_has_alone():
    """Each output is one float32 sum over the column pairs in order,
    whatever the batch: a row's outputs are bit for bit the same alone, in
    the first or the last place of a batch, in any micro-kernel's tail."""
    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("the CPU has no AVX512-BF16")
    layer = Layer(700, 1536, True)
    assert cpu_prepack.prepack(layer, "avx512bf16")
    batch = torch.randn(61, 1536, generator=torch.Generator().manual_seed(2)).bfloat16()
    together = cpu_prepack.linear(layer, batch)
    for row in (0, 5, 47, 48, 60):
        assert torch.equal(cpu_prepack.linear(layer, batch[row:row + 1]), together[row:row + 1]), f"row {row}"
        assert torch.equal(cpu_prepack.linear(layer, batch[row:row + 7]), together[row:row + 7]), f"rows {row}+"


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

    def runner(compiled: bool) -> ModelRunner:
        return ModelRunner(model, KVCachePool(cfg, 64, BLOCK, CPU, torch.bfloat16), make_backend("torch"), CPU,
                           torch_compile=compiled)

    three = prompts(3)
    want = generate(runner(False), three, 12, 7)
    before = weight_bytes(model)
    assert cpu_gemv.use_cpu_gemv(model, prepack=kind) == 5
    packed = [m for m in model.modules() if getattr(m, "prepack_handle", None) is not None]
    assert len(packed) == 5 and model.lm_head in packed
    assert all(packed_weight(m) for m in packed)
    assert weight_bytes(model) == before, "packed weights are not counted as they were (no padding at these shapes)"
    assert generate(runner(False), three, 12, 7) == want, "the packed layout changed greedy tokens"
    try:
        compiled = runner(True)
        assert compiled.compiled is not None and compiled.compiled.layerwise and compiled.compiled.direct[0]
        steps = STEPS._value.get()
        assert generate(compiled, three[:1], 12, 7) == want[:1], "the compiled packed steps changed greedy tokens"
        assert STEPS._value.get() - steps >= 11, "decode steps did not run compiled"
        assert compiled.compiled is not None, "a compiled step failed and the runner fell back to eager"
    finally:
        torch._dynamo.reset()


def test_auto_packs_for_the_avx512_bf16_kernel_where_the_cpu_has_it_without_amx(medium):
    _, model = build(medium, torch.bfloat16)
    cpu_gemv.use_cpu_gemv(model)
    down = model.model.layers[0].mlp.down_proj
    ours = torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported()
    assert (down.weight.dim() == 4) == ours and down.weight.is_mkldnn == (not ours)


def test_a_head_tied_to_the_embedding_keeps_its_stored_layout_for_onednn(medium):
    if not cpu_prepack.onednn_available():
        pytest.skip("this torch has no oneDNN weight reorder")
    _, model = build(medium, torch.bfloat16)
    model.lm_head.weight = model.model.embed_tokens.weight
    cpu_gemv.use_cpu_gemv(model, prepack="onednn")
    assert model.lm_head.prepack_handle is None and model.lm_head.weight.dim() == 2
    assert not model.lm_head.weight.is_mkldnn
    assert model.model.layers[0].mlp.down_proj.prepack_handle is not None


def test_a_head_tied_to_the_embedding_is_packed_once_for_the_avx512_bf16_kernel_and_the_embedding_reads_it(medium):
    """One copy, packed: the head multiplies by it, the embedding gathers
    its rows from it (the same values bit for bit), the byte count is the
    tied model's, and greedy tokens are the stored layout's, eager and
    compiled."""
    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("the CPU has no AVX512-BF16")
    cfg, model = build(medium, torch.bfloat16)
    embedding = model.model.embed_tokens
    model.lm_head.weight = embedding.weight
    stored = embedding.weight.detach().clone()

    def runner(compiled: bool) -> ModelRunner:
        return ModelRunner(model, KVCachePool(cfg, 64, BLOCK, CPU, torch.bfloat16), make_backend("torch"), CPU,
                           torch_compile=compiled)

    three = prompts(3)
    want = generate(runner(False), three, 12, 7)
    before = weight_bytes(model)
    assert cpu_gemv.use_cpu_gemv(model, prepack="avx512bf16") == 5
    assert model.lm_head.prepack_handle is not None and model.lm_head.weight.dim() == 4
    assert embedding.weight is model.lm_head.weight and embedding.packed_rows, "the embedding kept a second copy"
    assert weight_bytes(model) == before, "the tied weight is counted twice or not at all"
    ids = torch.tensor([[0, 5, 17], [2047, 16, 1]])
    assert torch.equal(embedding(ids), stored[ids]), "rows gathered from the packed layout differ from the stored ones"
    assert generate(runner(False), three, 12, 7) == want, "the packed tied head changed greedy tokens"
    try:
        compiled = runner(True)
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

