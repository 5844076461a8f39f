"""llmsched_kernels.int_linear.fp4_weight_linear (NVFP4 and MXFP4 weights decoded in the load loop)
against llmsched_kernels.reference.fp4_weight_linear, through the Triton interpreter
without CUDA: edge tiles in both dimensions, K that is not whole groups and odd K
(a padding nibble), per-row global scales that round the quotient, a bias, decode
and prefill batches, fp16, bf16 and fp32; and the reference against the executor's
own dequantization (quant_formats.dequantize_fp4), bit for bit."""

from __future__ import annotations

import pytest
import torch

from llmsched_kernels import reference
from test_int_linear import assert_close

fl = pytest.importorskip("llmsched_kernels.int_linear")


def make(m: int, n: int, k: int, fmt: str, dtype: torch.dtype, bias: bool = False, seed: int = 0,
         device: str = "cpu"):
    """x and a random FP4 weight whose outputs stay near 1..10; returns the kernel's arguments."""
    g = torch.Generator().manual_seed(seed)
    group = 16 if fmt == "nvfp4" else 32
    groups = -(-k // group)
    qweight = torch.randint(0, 256, (n, -(-k // 2)), generator=g, dtype=torch.uint8)
    if fmt == "nvfp4":
        scales = (torch.rand(n, groups, generator=g) * 4 + 0.25).to(torch.float8_e4m3fn)
        # Not powers of two, so scale / global scale rounds; larger than the scales' range, as calibrated.
        global_scale = (1 + torch.rand(n, generator=g)) * 8 * k**0.5
    else:
        scales = (127 - 5 + torch.randint(-1, 2, (n, groups), generator=g)).to(torch.uint8)
        global_scale = None
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x), to(qweight), to(scales), to(global_scale), group, to(b)


# (m, n, k): K's tile is 64 for 16-bit x and 32 for fp32; N's is 32.
SHAPES = {
    "decode": (1, 64, 256),
    "edge_tiles_k_not_whole_groups": (5, 72, 100),
    "odd_k": (3, 40, 151),
    "prefill_spans_row_tiles": (70, 48, 64),
}


@pytest.mark.parametrize("case", SHAPES)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_fp4_weight_linear_matches_the_reference(case, fmt, dtype):
    args = make(*SHAPES[case], fmt, dtype)
    assert_close(fl.fp4_weight_linear(*args), reference.fp4_weight_linear(*args))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_bias_is_added(fmt):
    args = make(5, 40, 64, fmt, torch.bfloat16, bias=True)
    got = fl.fp4_weight_linear(*args)
    assert_close(got, reference.fp4_weight_linear(*args))
    assert not torch.allclose(got, fl.fp4_weight_linear(*args[:-1]))


def test_a_weight_of_the_wrong_group_is_refused():
    x, qweight, scales, global_scale, _, _ = make(2, 8, 64, "nvfp4", torch.float32)
    with pytest.raises(AssertionError, match="group_size 32"):
        fl.fp4_weight_linear(x, qweight, scales, global_scale, 32)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_reference_dequantizes_as_the_executor_does(fmt, dtype):
    """The kernels' definition and the layers' (quant_formats.dequantize_fp4,
    compressed-tensors' decompression) give the same weights, bit for bit."""
    from executor_svc.model.quant_formats import dequantize_fp4

    x, qweight, scales, global_scale, group, _ = make(2, 24, 151, fmt, dtype)
    eye = torch.eye(151, dtype=dtype)  # x = I: the linear's output is W^T
    got = reference.fp4_weight_linear(eye, qweight, scales, global_scale, group).T
    assert torch.equal(got, dequantize_fp4(qweight, scales, global_scale, group, 151, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 100])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_weight_linear_on_a_gpu_matches_the_reference_at_llama_shapes(m, fmt):
    args = make(m, 4096, 4096, fmt, torch.bfloat16, device="cuda")
    got = fl.fp4_weight_linear(*args).float()
    want = reference.fp4_weight_linear(*args).float()
    assert torch.allclose(got, want, atol=2e-2 * want.abs().max().item(), rtol=0), (got - want).abs().max()
