"""CPU linears through the inductor GEMV (executor_svc/model/cpu_gemv.py):
one row, and in bf16 without a native bf16 GEMM several rows.

Oracles: F.linear on the same weights (within the dtype's rounding: the
GEMV sums in another order), and HF's greedy tokens on a random Llama
whose layers and head are large enough to take the GEMV (hidden 512,
intermediate 2048, vocabulary 2048), one request at a time so that every
decode step has one row.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from executor_svc.attention import make_backend
from executor_svc.model import cpu_bf16_gemm, cpu_gemv
from executor_svc.model.checkpoint import load_checkpoint
from executor_svc.model.families import build_model, read_config
from executor_svc.step.kv_cache import KVCachePool
from executor_svc.step.runner import ModelRunner
from llmsched.assets import STORIES260K
from tests.families import hf_greedy, prompts
from tests.unit.test_runner_vs_hf import BLOCK, generate


@pytest.fixture(scope="module")
def medium(tmp_path_factory) -> Path:
    """A random Llama whose MLP weights and head hold 2^20 values or more."""
    import transformers

    directory = tmp_path_factory.mktemp("medium")
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    shutil.copy(STORIES260K / "tokenizer.json", directory / "tokenizer.json")
    return directory


@pytest.fixture(autouse=True)
def fresh_gemv(monkeypatch):
    """Each test compiles the GEMV afresh: what the first call passes
    decides the graph, and a graph left by another test would hide that.
    The C kernels (cpu_bf16_gemm) serve only where a test loads them."""
    monkeypatch.setattr(cpu_bf16_gemm, "_kernel", None)
    cpu_gemv._compiled.clear()
    cpu_gemv._compiled_rows.clear()
    yield
    cpu_gemv._compiled.clear()
    cpu_gemv._compiled_rows.clear()
    torch._dynamo.reset()


def build(path: Path, dtype: torch.dtype = torch.float32):
    ckpt = load_checkpoint(str(path))
    cfg = read_config(ckpt.hf_config)
    return cfg, build_model(cfg, ckpt.lazy_tensors(), 256, torch.device("cpu"), dtype)


def marked(model) -> list[str]:
    return sorted(n for n, m in model.named_modules() if getattr(m, "use_cpu_gemv", False))


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_gemv_computes_what_f_linear_does_for_one_row(dtype, rtol):
    g = torch.Generator().manual_seed(0)
    for n, k in [(1536, 1024), (1000, 2048)]:
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(1, k, generator=g).to(dtype)
        got, want = cpu_gemv.gemv(x, w), torch.nn.functional.linear(x, w)
        assert got.shape == want.shape and got.dtype == dtype
        assert (got.float() - want.float()).abs().max().item() <= rtol * want.float().abs().max().item(), (n, k)
        # The first call bound the compiled GEMV: later ones skip dynamo.
        assert cpu_gemv.calls_direct(dtype), "the GEMV is called through dynamo (DirectCall did not bind)"


def test_one_gemv_first_called_with_a_layer_s_parameter_serves_every_other_shape():
    """Layers hold their weights as parameters, to which dynamo gives
    static sizes; the graph must still serve every layer's shape (it
    served only the first one's, and every other layer's step failed)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1024, generator=g).bfloat16()
    for n in (4096, 3072, 151936 // 8):
        w = torch.nn.Parameter(torch.randn(n, 1024, generator=g).bfloat16(), requires_grad=False)
        got, want = cpu_gemv.gemv(x, w).float(), torch.nn.functional.linear(x, w).float()
        assert got.shape == want.shape, n
        assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item(), n
        assert cpu_gemv.calls_direct(torch.bfloat16), "the GEMV is called through dynamo (DirectCall did not bind)"
    k = torch.nn.Parameter(torch.randn(512, 3072, generator=g).bfloat16(), requires_grad=False)
    xk = torch.randn(1, 3072, generator=g).bfloat16()
    assert torch.allclose(cpu_gemv.gemv(xk, k).float(), torch.nn.functional.linear(xk, k).float(), rtol=1e-2, atol=0.5)


def test_only_large_unquantized_weights_take_the_gemv_and_off_or_invariant_turn_it_off(medium):
    _, model = build(medium)
    assert cpu_gemv.use_cpu_gemv(model) == 5
    # gate_up (4096 x 512), down (512 x 2048) and the head (2048 x 512); q/k/v (1024 x 512) and o
    # (512 x 512) hold fewer than 2^20 values.
    assert marked(model) == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_up_proj",
                             "model.layers.1.mlp.down_proj", "model.layers.1.mlp.gate_up_proj"]
    for setting, invariant in (("off", False), ("auto", True)):
        _, fresh = build(medium)
        assert cpu_gemv.use_cpu_gemv(fresh, setting, invariant) == 0 and not marked(fresh)


def test_one_request_on_the_gemv_serves_hfs_greedy_tokens(medium, monkeypatch):
    calls, linear = [], cpu_gemv.linear

    def counted(x, w):
        calls.append(tuple(w.shape))
        return linear(x, w)

    monkeypatch.setattr(cpu_gemv, "linear", counted)
    cfg, model = build(medium)
    assert cpu_gemv.use_cpu_gemv(model) > 0
    runner = ModelRunner(model, KVCachePool(cfg, 64, BLOCK, torch.device("cpu"), torch.float32),
                         make_backend("torch"), torch.device("cpu"))
    for prompt in prompts(3):
        want = hf_greedy(str(medium), prompt, 12)
        assert want.min_margin > 1e-3, "the oracle's own greedy path is too close to a tie to compare"
        assert generate(runner, [prompt], 12, 7) == [want.tokens], f"prompt {prompt}"
    assert (2048, 512) in calls and (4096, 512) in calls, "the head and gate_up never took the GEMV"


@pytest.mark.slow  # compiles the decode step: about 15 s
def test_a_compiled_decode_step_calls_the_gemv_and_the_passes_and_serves_hfs_greedy_tokens(medium, monkeypatch):
    """EXECUTOR_TORCH_COMPILE=on with marked layers: inside the compiled
    graph each marked linear is the llmsched::cpu_gemv_linear operator,
    which dispatches on the step's rows at run time, as an eager step does.
    Traced instead, dynamo stepped into the bound GEMV and failed, and the
    executor served eagerly. The layers take every row count here, as bf16
    layers do on a CPU without native bf16 (in float32, so that HF's tokens
    are the oracle): one request (one-row steps: the GEMV), then three at
    once (three-row steps: the several-row passes)."""
    from executor_svc.step.compiled_decode import STEPS

    calls, gemv, gemm_rows = [], cpu_gemv.gemv, cpu_gemv.gemm_rows

    def counted(fn):
        def call(x, w):
            calls.append((fn.__name__, x.shape[0]))
            return fn(x, w)
        return call

    cfg, model = build(medium)
    assert cpu_gemv.use_cpu_gemv(model) > 0
    for layer in model.modules():
        if getattr(layer, "use_cpu_gemv", False):
            layer.cpu_gemv_rows = sys.maxsize
    runner = ModelRunner(model, KVCachePool(cfg, 64, BLOCK, torch.device("cpu"), torch.float32),
                         make_backend("torch"), torch.device("cpu"), torch_compile=True)
    try:
        assert runner.compiled is not None and runner.compiled.direct[0], "the decode step did not compile and bind"
        monkeypatch.setattr(cpu_gemv, "gemv", counted(gemv))
        monkeypatch.setattr(cpu_gemv, "gemm_rows", counted(gemm_rows))
        before = STEPS._value.get()
        prompt = prompts(1)[0]
        assert generate(runner, [prompt], 12, 7) == [hf_greedy(str(medium), prompt, 12).tokens]
        assert STEPS._value.get() - before >= 11, "the one-row decode steps did not run compiled"
        assert ("gemv", 1) in calls, f"no compiled one-row step took the GEMV: {sorted(set(calls))}"
        calls.clear()
        before = STEPS._value.get()
        three = prompts(3)
        assert generate(runner, three, 8, 16) == [hf_greedy(str(medium), p, 8).tokens for p in three]
        assert STEPS._value.get() - before >= 6, "the three-row decode steps did not run compiled"
        assert ("gemm_rows", 3) in calls, f"no compiled three-row step took the passes: {sorted(set(calls))}"
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("path", ["kernel", "passes"])
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8, 9, 16, 17, 40, 64, 65, 130])
def test_several_rows_in_bf16_compute_what_f_linear_does(rows, path, monkeypatch):
    """cpu_gemv.linear past one row: up to ROWS_MAX rows the tiled C kernel
    (cpu_bf16_gemm.py), or where it is not built passes of 8 rows (4 for a
    last pass of 4 or fewer, padded with zero rows); past it float32 blocks
    of the weight (made small here, so that a weight spans several), over
    weights of several shapes held as parameters."""
    monkeypatch.setattr(cpu_gemv, "F32_BLOCK_ELEMENTS", 300 * 1024)
    if path == "kernel":
        if not cpu_bf16_gemm.load():
            pytest.skip("the bf16 GEMM kernel cannot be built here (no AVX2 or no C compiler)")
    else:
        monkeypatch.setattr(cpu_bf16_gemm, "available", lambda: False)
    g = torch.Generator().manual_seed(rows)
    for n, k in [(1536, 1024), (1000, 2048)]:
        w = torch.nn.Parameter(torch.randn(n, k, generator=g).bfloat16(), requires_grad=False)
        x = torch.randn(rows, k, generator=g).bfloat16()
        got, want = cpu_gemv.linear(x, w), torch.nn.functional.linear(x, w)
        assert got.shape == want.shape and got.dtype == torch.bfloat16, (rows, n, k)
        # Both sum bf16 products in float32, in another order: the outputs differ by bf16's rounding.
        assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.float().abs().max().item()), \
            (rows, n, k)
    for passed in cpu_gemv.ROWS_PER_PASS:
        entry = cpu_gemv._compiled_rows.get((torch.bfloat16, passed))
        assert entry is None or entry[1].bound, f"the {passed}-row pass is called through dynamo (DirectCall did not bind)"


def test_without_a_native_bf16_gemm_bf16_layers_take_several_row_passes_and_compute_the_same(medium, monkeypatch):
    """On a CPU whose bf16 GEMM is not native (AVX2: each row costs a
    GEMV's time) with the weights as stored (EXECUTOR_CPU_BF16_PREPACK=off;
    auto packs them for the avx512 or avx2 kernel there), steps of up to ROWS_MAX
    rows go through gemm_rows (the tiled kernel where it builds, else the
    passes); the layer's outputs stay those of torch's GEMM within bf16's
    rounding."""
    monkeypatch.setattr(cpu_gemv, "native_bf16_gemm", lambda: False)
    _, model = build(medium, torch.bfloat16)
    assert cpu_gemv.use_cpu_gemv(model, prepack="off") == 5
    mlp = model.model.layers[0].mlp
    assert mlp.gate_up_proj.cpu_gemv_rows == mlp.down_proj.cpu_gemv_rows > cpu_gemv.ROWS_MAX
    assert model.model.layers[0].self_attn.qkv_proj.cpu_gemv_rows == 1, "a layer too small for the GEMV was marked"
    calls, linear = [], cpu_gemv.linear

    def counted(x, w):
        calls.append(x.shape[0])
        return linear(x, w)

    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        monkeypatch.setattr(cpu_gemv, "linear", counted)
        got = mlp(x)
        for layer in (mlp.gate_up_proj, mlp.down_proj):
            layer.use_cpu_gemv = False
        want = mlp(x)
    assert calls == [6, 6], "the MLP's two linears did not take the several-row passes"
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())
    monkeypatch.setattr(cpu_gemv, "native_bf16_gemm", lambda: True)
    _, native = build(medium, torch.bfloat16)
    cpu_gemv.use_cpu_gemv(native, prepack="off")
    assert native.model.layers[0].mlp.gate_up_proj.cpu_gemv_rows == 1, "a native bf16 GEMM was passed over"


def test_the_bf16_prepack_setting_s_old_name_is_refused_rather_than_ignored(monkeypatch):
    from executor_svc.config import ExecutorSettings
    from llmsched.errors import StartupError, load_settings

    monkeypatch.setenv("EXECUTOR_CPU_ONEDNN_REORDER", "off")
    with pytest.raises(StartupError, match="EXECUTOR_CPU_ONEDNN_REORDER is set, but was renamed "
                                           "EXECUTOR_CPU_BF16_PREPACK"):
        load_settings(ExecutorSettings)
