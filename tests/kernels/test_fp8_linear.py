"""llmsched_kernels.fp8_linear (FP8 weights with block scales, decoded in the load
loop) against llmsched_kernels.reference.fp8_block_linear and the executor's torch
path, through the Triton interpreter without CUDA: edge blocks in both
dimensions, stacked scale grids (fused q/k/v), decode- and prefill-sized
batches, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from llmsched_kernels import reference
from tests.quantized import quantize

fl = pytest.importorskip("llmsched_kernels.fp8_linear")


def make(m: int, parts: list[int], k: int, block: tuple[int, int], dtype: torch.dtype, seed: int = 0):
    """x, and a weight of stacked parts (rows each), quantized per part with the
    layout's definition (amax / 448 per block), with its grid rows."""
    g = torch.Generator().manual_seed(seed)
    bn, bk = block
    x = torch.randn(m, k, generator=g).to(dtype)
    weights, grids, grid_rows, first = [], [], [], 0
    for rows in parts:
        q, scale = quantize(torch.randn(rows, k, generator=g) * (1 + torch.rand(rows, 1, generator=g) * 10), bn, bk)
        weights.append(q)
        grids.append(scale)
        grid_rows.append(first + torch.arange(rows) // bn)
        first += scale.shape[0]
    return x, torch.cat(weights), torch.cat(grids), torch.cat(grid_rows)


@pytest.mark.parametrize("m, parts, k, block", [
    (1, [64], 128, (32, 32)),  # decode, blocks that tile the weight
    (5, [80, 24, 24], 100, (32, 48)),  # q/k/v stacked, edge blocks in rows and columns
    (37, [96], 200, (128, 128)),  # prefill; one block wider than the weight's rows
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_linear_matches_the_reference(m, parts, k, block, dtype):
    x, w, s, g = make(m, parts, k, block, dtype)
    got = fl.fp8_block_linear(x, w, s, g, block[1])
    want = reference.fp8_block_linear(x, w, s, g, block[1])
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), (got - want).abs().max()
    else:  # the same bf16 weights; sums in another order may round to the neighbouring bf16 value
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp(min=1)
        assert ((got.float() - want.float()).abs() <= ulp).all(), (got.float() - want.float()).abs().max()


def test_the_reference_is_the_executors_dequantized_linear():
    from executor_svc.model.quantization import dequantize_fp8_blocks

    x, w, s, g = make(3, [50, 30], 90, (16, 32), torch.float32)
    dense = dequantize_fp8_blocks(w, s, g, 32, torch.float32)
    assert torch.allclose(reference.fp8_block_linear(x, w, s, g, 32), x @ dense.T, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_block_linear_on_a_gpu_matches_the_reference_at_deepseek_shapes(m, dtype):
    """DeepSeek-V3's shared-expert gate/up shape (7168 -> 4096, 128 x 128 blocks), on the real compiler."""
    x, w, s, g = make(m, [4096], 7168, (128, 128), dtype)
    x, w, s, g = x.cuda(), w.cuda(), s.cuda(), g.cuda()
    got = fl.fp8_block_linear(x, w, s, g, 128).float()
    want = reference.fp8_block_linear(x, w, s, g, 128).float()
    # bf16/fp16 outputs of sums over 7168 terms: a few units in the last place.
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().mean().item()), (got - want).abs().max()
