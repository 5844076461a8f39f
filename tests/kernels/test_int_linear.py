"""llmsched_kernels.int_linear (4- and 8-bit integer weights, group scales and zero points,
decoded in the load loop) against llmsched_kernels.reference.int_weight_linear, through
the Triton interpreter without CUDA: edge tiles in both dimensions, odd K for
4 bits, groups within, across and wider than a tile, per-channel, act-order
g_idx, a bias, decode and small prefill batches, fp16, bf16 and fp32; and the
reference itself against a per-element loop."""

from __future__ import annotations

import pytest
import torch

from llmsched_kernels import reference

il = pytest.importorskip("llmsched_kernels.int_linear")


def make(m: int, n: int, k: int, bits: int, group_size: int, dtype: torch.dtype, act_order: bool = False,
         scale_dtype: torch.dtype | None = None, bias: bool = False, seed: int = 0, device: str = "cpu"):
    """x and a random packed weight: asymmetric zeros, scales that keep the
    outputs near 1..10, and with act_order a g_idx that assigns each group's
    columns in a random order (GPTQ desc_act). Returns the kernel's arguments."""
    g = torch.Generator().manual_seed(seed)
    n_groups = -(-k // group_size)
    q = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 2**bits, (n, n_groups), generator=g, dtype=torch.uint8)
    scales = ((torch.rand(n, n_groups, generator=g) + 0.1) * 0.3 / 2**bits).to(scale_dtype or dtype)
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group_size)[torch.randperm(k, generator=g)].to(torch.int32)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x), to(reference.pack_int(q, bits)), to(scales), to(zeros), group_size, bits, to(g_idx), to(b)


def assert_close(got: torch.Tensor, want: torch.Tensor):
    """fp32: to rounding; 16-bit: the same weights, but sums in another order may
    round to the neighbouring value, so one unit in the last place."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    diff = (got.float() - want.float()).abs()
    if want.dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), diff.max()
    else:
        ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp(min=1)
        assert (diff <= ulp).all(), diff.max()


# (m, n, k, group_size): K's tile is 64 for 16-bit x and 32 for fp32.
SHAPES = {
    "decode_group_spans_tiles": (1, 64, 256, 128),
    "edge_tiles_group_16": (5, 80, 130, 16),
    "edge_tiles_group_32": (5, 72, 96, 32),
    "per_channel": (5, 40, 100, 100),
    "group_48_straddles_tiles_odd_k": (5, 24, 151, 48),
}


@pytest.mark.parametrize("case", SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_int_weight_linear_matches_the_reference(case, bits, dtype):
    m, n, k, group_size = SHAPES[case]
    args = make(m, n, k, bits, group_size, dtype)
    assert_close(il.int_weight_linear(*args), reference.int_weight_linear(*args))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("m, n, k, group_size", [(1, 48, 96, 32), (5, 70, 133, 16)])
def test_act_order_g_idx_gathers_each_columns_group(m, n, k, group_size, bits, dtype):
    args = make(m, n, k, bits, group_size, dtype, act_order=True)
    assert_close(il.int_weight_linear(*args), reference.int_weight_linear(*args))


@pytest.mark.parametrize("dtype, scale_dtype", [(torch.bfloat16, torch.float16), (torch.bfloat16, torch.float32),
                                                (torch.float16, torch.bfloat16), (torch.float32, torch.bfloat16)],
                         ids=str)
def test_scales_in_another_dtype_round_the_weight_as_the_reference_does(dtype, scale_dtype):
    args = make(5, 40, 130, 4, 32, dtype, scale_dtype=scale_dtype)
    assert_close(il.int_weight_linear(*args), reference.int_weight_linear(*args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bias_is_added(dtype):
    args = make(5, 40, 100, 4, 32, dtype, bias=True)
    got = il.int_weight_linear(*args)
    assert_close(got, reference.int_weight_linear(*args))
    assert not torch.allclose(got, il.int_weight_linear(*args[:-1]))


def test_a_prefill_batch_spanning_several_row_tiles():
    args = make(70, 40, 64, 4, 32, torch.float16)  # BLOCK_M is 64: two row tiles, the second mostly padding
    assert_close(il.int_weight_linear(*args), reference.int_weight_linear(*args))


def test_strided_activations_and_an_empty_batch():
    x, *rest = make(4, 40, 64, 8, 32, torch.float16)
    wide = torch.zeros(4, 128, dtype=x.dtype)
    wide[:, ::2] = x  # column stride 2: the launcher copies it
    assert_close(il.int_weight_linear(wide[:, ::2], *rest), reference.int_weight_linear(x, *rest))
    assert il.int_weight_linear(x[:0], *rest).shape == (0, 40)


def test_a_weight_of_the_wrong_packed_width_is_refused():
    x, qweight, *rest = make(2, 8, 32, 4, 16, torch.float32)
    with pytest.raises(AssertionError, match="qweight"):
        il.int_weight_linear(x, qweight, *rest[:3], 8, *rest[4:])  # a 4-bit weight called 8-bit


# The reference itself.


@pytest.mark.parametrize("bits, k", [(4, 10), (4, 11), (8, 11)])
def test_pack_and_unpack_round_trip(bits, k):
    q = torch.randint(0, 2**bits, (3, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = reference.pack_int(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, -(-k // 2) if bits == 4 else k)
    assert torch.equal(reference.unpack_int(packed, bits, k), q)


def test_4_bit_packing_puts_even_columns_in_the_low_nibble_and_pads_odd_k():
    q = torch.tensor([[1, 2, 3], [15, 0, 7]], dtype=torch.uint8)
    assert reference.pack_int(q, 4).tolist() == [[0x21, 0x03], [0x0F, 0x07]]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_dequantize_int_matches_a_per_element_loop(bits, act_order, scale_dtype):
    n, k, group_size = 3, 7, 3
    x, qweight, scales, zeros, _, _, g_idx, _ = make(1, n, k, bits, group_size, scale_dtype, act_order=act_order)
    q = reference.unpack_int(qweight, bits, k)
    want = torch.empty(n, k, dtype=torch.bfloat16)
    for row in range(n):
        for col in range(k):
            grp = int(g_idx[col]) if act_order else col // group_size
            diff = torch.tensor(int(q[row, col]) - int(zeros[row, grp]), dtype=scale_dtype)
            want[row, col] = (diff * scales[row, grp]).to(torch.bfloat16)
    got = reference.dequantize_int(qweight, scales, zeros, group_size, bits, g_idx, k, torch.bfloat16)
    assert torch.equal(got, want)


def test_zero_points_are_asymmetric_and_unsigned():
    """A zero point of 3 on 4 bits maps q = 0..15 to -3..12 times the scale; 8 (symmetric) to -8..7."""
    qweight = reference.pack_int(torch.arange(16, dtype=torch.uint8)[None], 4)
    scales = torch.tensor([[0.5]])
    for zero in (3, 8):
        got = reference.dequantize_int(qweight, scales, torch.tensor([[zero]], dtype=torch.uint8), 16, 4, None, 16,
                                       torch.float32)
        assert torch.equal(got[0], (torch.arange(16) - zero) * 0.5)


def test_the_reference_is_a_linear_with_the_dequantized_weight():
    x, qweight, scales, zeros, group_size, bits, g_idx, bias = make(3, 20, 40, 4, 16, torch.float32, act_order=True,
                                                                    bias=True)
    dense = reference.dequantize_int(qweight, scales, zeros, group_size, bits, g_idx, 40, torch.float32)
    got = reference.int_weight_linear(x, qweight, scales, zeros, group_size, bits, g_idx, bias)
    assert torch.allclose(got, x @ dense.T + bias, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("m, bits, act_order", [(1, 4, False), (300, 4, False), (1, 8, False), (300, 8, True),
                                                (1, 4, True)])
def test_int_weight_linear_on_a_gpu_matches_the_reference_at_llama_shapes(m, bits, act_order):
    """Llama-3-8B's o_proj (4096 -> 4096), group 128, bf16, on the real compiler: decode and
    prefill, W4A16 and W8A16, GPTQ act-order (a few variants: each compiles, in gpu-check's time)."""
    args = make(m, 4096, 4096, bits, 128, torch.bfloat16, act_order=act_order, device="cuda")
    got = il.int_weight_linear(*args).float()
    want = reference.int_weight_linear(*args).float()
    # bf16 outputs of sums over 4096 terms: a few units in the last place.
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().mean().item()), (got - want).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_int_weight_linear_on_a_gpu_with_edge_tiles_per_channel_and_a_bias(dtype):
    args = make(37, 1000, 1001, 4, 1001, dtype, bias=True, device="cuda")
    got = il.int_weight_linear(*args).float()
    want = reference.int_weight_linear(*args).float()
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().mean().item()), (got - want).abs().max()
