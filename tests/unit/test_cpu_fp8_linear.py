"""The CPU FP8 kernel (executor_svc/model/cpu_fp8_linear.py): products
against the dequantizing path's weights at every tail, and FP8 checkpoints
served through it giving HF's greedy tokens. Needs AVX2 (every x86-64 CPU
CI runs on has it); elsewhere load() declines and the tests say so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.attention import make_backend
from executor_svc.model import cpu_fp8_linear
from executor_svc.model.quantization import dequantize_fp8_blocks, quantize_fp8_blocks
from executor_svc.step.kv_cache import KVCachePool
from executor_svc.step.runner import ModelRunner
from tests.families import CASES, hf_greedy, make_checkpoint, prompts
from tests.quantized import write_dequantized, write_fp8
from tests.unit.test_families_vs_hf import runner_for
from tests.unit.test_runner_vs_hf import BLOCK, generate


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_fp8_linear.load(), "the CPU FP8 kernel did not build or failed its check (see the log)"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16])
@pytest.mark.parametrize("n, k, block", [(10, 1040, (8, 48)), (37, 2056, (16, 128)), (64, 64, (1, 64))])
@pytest.mark.parametrize("bf16", [False, True])
def test_products_equal_the_dequantized_weights_products(rows, n, k, block, bf16):
    """Weights past KC columns and block edges, rows in 3+2+2 tails, several
    grid rows in an order a fused layer's parts give (two grids stacked),
    and one scale per row ((1, k)). One row takes the AVX512 GEMV where the
    CPU has it and K and the blocks are multiples of 16 (the first and last
    shapes), else the buffered kernel (2056 columns). The weights
    multiplied are the dequantizing path's bit for bit, so only the sums'
    order differs."""
    gen = torch.Generator().manual_seed(rows * n)
    weight, scales = quantize_fp8_blocks(torch.randn(n, k, generator=gen) * 3, block)
    grid_rows = torch.arange(n) // block[0]
    grid_rows = torch.cat([grid_rows[n // 2:], grid_rows[: n // 2]])  # rows need not take their grid rows in order
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(rows, k, generator=gen)
    want = x @ dequantize_fp8_blocks(weight, scales, grid_rows, block[1], dtype).float().T
    got = cpu_fp8_linear.matmul(x, weight, scales, grid_rows, block[1], bf16=bf16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_subnormal_and_extreme_fp8_values_decode_exactly():
    """Every one of the 254 finite FP8 values (NaN's two bytes aside), as
    one weight row each against x = e_k: the product is the value itself."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    weight = torch.zeros(len(codes), 8, dtype=torch.uint8)
    weight[:, 3] = codes
    weight = weight.view(torch.float8_e4m3fn)
    got = cpu_fp8_linear.matmul(torch.eye(8)[3:4], weight, torch.ones(1, 1), torch.zeros(len(codes), dtype=torch.long),
                                8, bf16=False)
    assert torch.equal(got[0], weight[:, 3].to(torch.float32))


def test_an_fp8_checkpoint_through_the_kernel_serves_hfs_greedy_tokens(tmp_path):
    """Block-scaled FP8 with edge tiles (48 x 40 blocks), three requests:
    their prefill (one step of 75 rows) dequantizes, their decode steps (3
    rows) run the kernel. HF's greedy tokens on the weights the layout defines
    (transformers cannot read edge tiles), and the dequantizing path's."""
    plain = make_checkpoint(CASES["llama3"], tmp_path / "llama")
    path = str(write_fp8(plain, tmp_path / "fp8", (48, 40)))
    oracle = str(write_dequantized(Path(path), tmp_path / "dense", (48, 40)))
    batch, steps = prompts(3, min_len=24, max_len=26), 12
    kernel, dequantizing = runner_for(path), runner_for(path)
    assert cpu_fp8_linear.use_cpu_fp8_kernel(kernel.model) == 8  # q/k/v, o, gate/up and down of 2 layers
    calls, matmul = [], cpu_fp8_linear.matmul
    cpu_fp8_linear.matmul = lambda *a, **kw: calls.append(a[0].shape[0]) or matmul(*a, **kw)
    try:
        got = generate(kernel, batch, steps, chunk=30)
    finally:
        cpu_fp8_linear.matmul = matmul
    assert calls and max(calls) <= cpu_fp8_linear.MAX_ROWS, "the decode steps did not run the kernel"
    for prompt, tokens in zip(batch, got):
        assert tokens == hf_greedy(oracle, prompt, steps).tokens, f"prompt {prompt}"
    assert got == generate(dequantizing, batch, steps, chunk=30)


def test_compiled_decode_steps_call_the_kernel_as_an_operator_and_serve_hfs_greedy_tokens(tmp_path):
    """EXECUTOR_TORCH_COMPILE on an FP8 checkpoint: the compiled decode
    graph calls llmsched::cpu_fp8_linear (a ctypes call inside it would
    break the graph and send every step back to eager)."""
    from executor_svc.step.compiled_decode import STEPS

    plain = make_checkpoint(CASES["llama3"], tmp_path / "llama")
    path = str(write_fp8(plain, tmp_path / "fp8", (32, 32)))
    oracle = str(write_dequantized(Path(path), tmp_path / "dense", (32, 32)))
    batch, steps = prompts(3, min_len=24, max_len=26), 8
    model = runner_for(path).model
    assert cpu_fp8_linear.use_cpu_fp8_kernel(model) == 8  # before the graph compiles, as loading.load marks them
    calls, matmul = [], cpu_fp8_linear.matmul
    cpu_fp8_linear.matmul = lambda *a, **kw: calls.append(a[0].shape[0]) or matmul(*a, **kw)
    before = STEPS._value.get()
    try:
        runner = ModelRunner(model, KVCachePool(model.cfg, 128, BLOCK, torch.device("cpu"), torch.float32),
                             make_backend("torch"), torch.device("cpu"), torch_compile=True)
        calls.clear()  # the warm-up's
        got = generate(runner, batch, steps, chunk=30)
        assert runner.compiled is not None, "the compiled step failed and the runner fell back to eager"
        assert STEPS._value.get() - before > 0, "no decode step ran compiled"
        assert 3 in calls, "the compiled decode steps did not call the kernel"
    finally:
        cpu_fp8_linear.matmul = matmul
        torch._dynamo.reset()
    for prompt, tokens in zip(batch, got):
        assert tokens == hf_greedy(oracle, prompt, steps).tokens, f"prompt {prompt}"


@pytest.mark.parametrize("family, block", [("qwen3-moe", (16, 16)), ("deepseek-v3", (8, 8))])
def test_fp8_experts_through_the_kernel_serve_hfs_greedy_tokens(family, block, tmp_path):
    """FP8 experts (and shared experts, and DeepSeek-V3's latent
    projections) with every routed expert's rows through the kernel: HF
    reads these checkpoints itself, and is the oracle token for token."""
    path = str(write_fp8(make_checkpoint(CASES[family], tmp_path / family), tmp_path / "fp8", block))
    runner = runner_for(path)
    experts = runner.model.model.layers[1].mlp.experts
    assert cpu_fp8_linear.use_cpu_fp8_kernel(runner.model) > 0 and experts.cpu_fp8
    calls, matmul = [], cpu_fp8_linear.matmul
    cpu_fp8_linear.matmul = lambda *a, **kw: calls.append(a[1].data_ptr()) or matmul(*a, **kw)
    batch, steps = prompts(2), 12
    try:
        got = generate(runner, batch, steps, chunk=7)
    finally:
        cpu_fp8_linear.matmul = matmul
    expert_weights = {w.data_ptr() for w in (*experts.w13, *experts.w2)}
    assert expert_weights & set(calls), "no expert ran the kernel"
    for prompt, tokens in zip(batch, got):
        want = hf_greedy(path, prompt, steps)
        assert want.min_margin > 1e-3, "the oracle's own greedy path is too close to a tie to compare"
        assert tokens == want.tokens, f"prompt {prompt}"
