"""EXECUTOR_CPU_ONEDNN_REORDER (executor_svc/model/cpu_onednn.py): on a CPU
with native bf16, bf16 weights reordered once for oneDNN give F.linear's
outputs bit for bit at every row count, eagerly and inside compiled decode
graphs, replace the stored weight, and refuse any plain use. These need
native bf16 instructions (AVX512-BF16 or AMX): elsewhere the layout is
never used, and the tests say so as they skip."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_svc.attention import make_backend
from executor_svc.loading import weight_bytes
from executor_svc.model import cpu_gemv, cpu_onednn
from executor_svc.step.kv_cache import KVCachePool
from executor_svc.step.runner import ModelRunner
from tests.unit.test_cpu_gemv import BLOCK, build, medium, prompts  # noqa: F401 (a fixture)
from tests.unit.test_runner_vs_hf import generate

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(not (cpu_gemv.native_bf16_gemm() and cpu_onednn.available()),
                                reason="no native bf16 GEMM on this CPU: weights keep their stored layout here")


class Layer(torch.nn.Module):
    def __init__(self, n: int, k: int, bias: bool):
        super().__init__()
        g = torch.Generator().manual_seed(n + k)
        self.weight = torch.nn.Parameter(torch.randn(n, k, generator=g).bfloat16(), requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.randn(n, generator=g).bfloat16(), requires_grad=False)
                     if bias else None)


@pytest.mark.parametrize("bias", [False, True])
def test_a_reordered_weight_gives_f_linear_s_outputs_bit_for_bit_at_every_row_count(bias):
    layer = Layer(1000, 1024, bias)
    plain, plain_bias = layer.weight.clone(), None if layer.bias is None else layer.bias.clone()
    assert cpu_onednn.reorder(layer)
    assert layer.weight.is_mkldnn, "the stored weight was not replaced: the model would hold two copies"
    g = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 16, 17, 64, 300):
        x = torch.randn(rows, 1024, generator=g).bfloat16()
        assert torch.equal(cpu_onednn.linear(layer, x), F.linear(x, plain, plain_bias)), f"{rows} rows"
    x3 = torch.randn(2, 5, 1024, generator=g).bfloat16()
    assert torch.equal(cpu_onednn.linear(layer, x3), F.linear(x3, plain, plain_bias)), "3-D input"


def test_a_reordered_weight_refuses_plain_use_instead_of_computing_with_its_blocked_layout():
    layer = Layer(512, 1024, False)
    assert cpu_onednn.reorder(layer)
    with pytest.raises((RuntimeError, NotImplementedError)):
        F.linear(torch.randn(2, 1024).bfloat16(), layer.weight)


def test_a_bf16_model_reorders_its_untied_linears_and_keeps_its_tokens_and_byte_count(medium):
    """The medium model (tie_word_embeddings false): all five big linears,
    the head included, reordered. Eager steps give the tokens the stored
    layout gave through F.linear (the same products bit for bit); compiled
    layerwise, each layer's graph calls the reordered product by that
    layer's own handle, which the warm-up checks against the layer run
    eagerly (a graph reading layer 0's weights everywhere would fail it)."""
    from executor_svc.step.compiled_decode import STEPS

    cfg, model = build(medium, torch.bfloat16)

    def runner(compiled: bool) -> ModelRunner:
        return ModelRunner(model, KVCachePool(cfg, 64, BLOCK, CPU, torch.bfloat16), make_backend("torch"), CPU,
                           torch_compile=compiled)

    three = prompts(3)
    want = generate(runner(False), three, 12, 7)
    before = weight_bytes(model)
    assert cpu_gemv.use_cpu_gemv(model) == 5
    reordered = [m for m in model.modules() if getattr(m, "onednn_handle", None) is not None]
    assert len(reordered) == 5 and model.lm_head in reordered
    assert weight_bytes(model) == before, "reordered weights are not counted as they were"
    assert generate(runner(False), three, 12, 7) == want, "the reordered layout changed greedy tokens"
    try:
        compiled = runner(True)
        assert compiled.compiled is not None and compiled.compiled.layerwise and compiled.compiled.direct[0]
        steps = STEPS._value.get()
        assert len(generate(compiled, three[:1], 12, 7)[0]) == 12
        assert STEPS._value.get() - steps >= 11, "decode steps did not run compiled"
        assert compiled.compiled is not None, "a compiled step failed and the runner fell back to eager"
    finally:
        torch._dynamo.reset()


def test_a_head_tied_to_the_embedding_keeps_its_stored_layout(medium):
    _, model = build(medium, torch.bfloat16)
    model.lm_head.weight = model.model.embed_tokens.weight
    cpu_gemv.use_cpu_gemv(model)
    assert model.lm_head.onednn_handle is None and not model.lm_head.weight.is_mkldnn
    assert model.model.layers[0].mlp.down_proj.onednn_handle is not None


def test_off_keeps_every_stored_layout(medium):
    _, model = build(medium, torch.bfloat16)
    cpu_gemv.use_cpu_gemv(model, onednn_reorder="off")
    assert not any(p.is_mkldnn for p in model.parameters())
