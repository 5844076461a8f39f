"""llmsched_kernels.fused_moe on quantized experts (FP8 blocks, MXFP4, NVFP4), decoded
in the kernel's load loop, against llmsched_kernels.reference.fused_moe on the
reference's dequantized weights, through the Triton interpreter without CUDA:
ragged N and K (FP8 edge blocks, a scale column per tile or per element),
top_k > 1 with idle experts, bf16 and fp32, biases, a tensor-parallel down
projection whose units start mid-group; then the executor's FusedExperts and
GptOssExperts on the triton path against their torch loop."""

from __future__ import annotations

import pytest
import torch

from llmsched_kernels import reference
from test_fused_moe import TOLERANCE, clamped_glu, silu_glu
from tests.quantized import MXFP4, NVFP4, NVFP4_ACTIVATIONS

fm = pytest.importorskip("llmsched_kernels.fused_moe")


def _fp8(e: int, n: int, k: int, block: tuple[int, int], grid_rows: torch.Tensor, g: torch.Generator):
    """Random FP8 experts [e, n, k] with float32 block scales, and their dequantized float32 weights."""
    weight = (torch.randn(e, n, k, generator=g) * 64).to(torch.float8_e4m3fn)
    grid = int(grid_rows.max()) + 1
    scales = torch.rand(e, grid, -(-k // block[1]), generator=g) / (64 * k**0.5) + 1e-4
    dense = torch.stack([reference.dequantize_fp8_block(weight[i], scales[i], grid_rows, block[1]) for i in range(e)])
    return fm.QuantizedExperts.fp8_blocks(weight, scales, grid_rows, block[1]), dense


def _fp4(fmt: str, e: int, n: int, groups: int, g: torch.Generator, exponent: int):
    """Random MXFP4 / NVFP4 experts [e, n, groups * group] and their dequantized float32 weights."""
    group = 32 if fmt == "mxfp4" else 16
    blocks = torch.randint(0, 256, (e, n, groups, group // 2), generator=g, dtype=torch.uint8)
    if fmt == "mxfp4":
        scales = (127 + exponent + torch.randint(-1, 2, (e, n, groups), generator=g)).to(torch.uint8)
        dense = torch.stack([reference.dequantize_mxfp4(blocks[i], scales[i], torch.float32) for i in range(e)])
        return blocks, scales, None, dense
    scales = (torch.rand(e, n, groups, generator=g) * 4 + 0.25).to(torch.float8_e4m3fn)
    # One global scale per expert and half (gate's rows, up's), not powers of 2: the quotients round.
    halves = 2.0 ** -exponent * (1 + torch.rand(e, 2, generator=g))
    global_scale = halves.repeat_interleave(n // 2, dim=1) if n % 2 == 0 else halves[:, :1].expand(e, n).contiguous()
    dense = torch.stack([reference.dequantize_nvfp4(blocks[i], scales[i], global_scale[i], torch.float32)
                         for i in range(e)])
    return blocks, scales, global_scale, dense


def _int(e: int, n: int, k: int, bits: int, group: int, scale_dtype: torch.dtype, g: torch.Generator):
    """Random W4A16 / W8A16 experts [e, n, k] (uint8 values, zero points and scales per
    row and group), and their dequantized float32 weights."""
    groups = -(-k // group)
    q = torch.randint(0, 1 << bits, (e, n, k), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 1 << bits, (e, n, groups), generator=g, dtype=torch.uint8)
    scales = (torch.rand(e, n, groups, generator=g) / (4 << bits) + 1e-3).to(scale_dtype)
    qweight = torch.stack([reference.pack_int(q[i], bits) for i in range(e)])
    dense = torch.stack([reference.dequantize_int(qweight[i], scales[i], zeros[i], group, bits, None, k,
                                                  torch.float32) for i in range(e)])
    return fm.QuantizedExperts.int_groups(qweight, scales, zeros, bits, group, k), dense


def make_quant_moe(fmt, num_tokens, num_experts, top_k, hidden, inter, dtype, device, bias=False, block=(32, 32),
                   col0=0, seed=0):
    """(x, w13, w2 as QuantizedExperts, their dequantized weights in dtype, weights, ids, b13, b2).
    fp4's down projection keeps the groups covering columns [col0, col0 + inter), as a
    tensor-parallel rank whose units start mid-group does."""
    g = torch.Generator().manual_seed(seed)
    e = num_experts
    if fmt == "fp8":
        bn = block[0]
        rows = torch.arange(inter) // bn
        w13, d13 = _fp8(e, 2 * inter, hidden, block, torch.cat([rows, rows + -(-inter // bn)]), g)
        w2, d2 = _fp8(e, hidden, inter, block, torch.arange(hidden) // bn, g)
    elif fmt.startswith("int"):  # "int4", "int8"; block = (group, the scales' dtype or None for x's)
        bits, group, scale_dtype = int(fmt[3:]), block[0], block[1] or dtype
        w13, d13 = _int(e, 2 * inter, hidden, bits, group, scale_dtype, g)
        w2, d2 = _int(e, hidden, inter, bits, group, scale_dtype, g)
    else:
        group = 32 if fmt == "mxfp4" else 16
        make = fm.QuantizedExperts.mxfp4 if fmt == "mxfp4" else fm.QuantizedExperts.nvfp4
        b13, s13, gs13, d13 = _fp4(fmt, e, 2 * inter, hidden // group, g, -3)
        b2, s2, gs2, d2 = _fp4(fmt, e, hidden, -(-(col0 + inter) // group), g, -3)
        d2 = d2[:, :, col0 : col0 + inter]
        if fmt == "mxfp4":
            w13, w2 = make(b13, s13), make(b2, s2, col0=col0, k=inter)
        else:
            assert col0 == 0
            w13, w2 = make(b13, s13, gs13), make(b2, s2, gs2)
    x = torch.randn(num_tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=g), -1)
    biases = (torch.randn(e, 2 * inter, generator=g), torch.randn(e, hidden, generator=g)) if bias else (None, None)
    move = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    w13, w2 = (_to(w, device) for w in (w13, w2))
    return (move(x), w13, w2, move(d13), move(d2), weights.to(device), ids.to(device), *map(move, biases))


def _to(w, device):
    """QuantizedExperts with its tensors on device."""
    moved = {f: getattr(w, f) for f in w.__slots__}
    for f in ("data", "scales", "rows", "global_scale", "zeros"):
        moved[f] = None if moved[f] is None else moved[f].to(device)
    return type(w)(**moved)


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    scale = want.float().abs().max().clamp(min=1.0)
    assert torch.allclose(got.float() / scale, want.float() / scale, atol=tol, rtol=tol), (got - want).abs().max()


@pytest.mark.parametrize("fmt,num_tokens,num_experts,top_k,hidden,inter,dtype,bias,block,col0", [
    ("fp8", 37, 6, 3, 48, 40, torch.float32, False, (32, 32), 0),  # edge blocks, a scale per element
    ("fp8", 9, 8, 2, 192, 160, torch.bfloat16, False, (128, 128), 0),  # a scale per tile, edge blocks
    ("fp8", 3, 4, 2, 64, 32, torch.float32, True, (16, 32), 0),  # several grid rows per tile, biases
    ("mxfp4", 1, 8, 2, 64, 32, torch.float32, False, None, 0),  # decode: most experts idle
    ("mxfp4", 11, 4, 2, 64, 40, torch.bfloat16, True, None, 8),  # gpt-oss: biases, clamp, units from column 8
    ("mxfp4", 7, 4, 3, 96, 48, torch.float32, False, None, 16),
    ("nvfp4", 7, 4, 2, 48, 32, torch.float32, False, None, 0),
    ("nvfp4", 5, 6, 2, 32, 48, torch.bfloat16, True, None, 0),
    ("int4", 9, 4, 2, 48, 40, torch.float32, False, (16, None), 0),  # groups within a tile, odd groups in K
    ("int4", 6, 6, 2, 64, 50, torch.bfloat16, True, (32, None), 0),  # down's K odd: a padding nibble
    ("int8", 5, 4, 3, 48, 32, torch.float32, False, (48, torch.bfloat16), 0),  # per channel; products round to bf16
    ("int4", 7, 4, 2, 128, 64, torch.float32, False, (64, torch.float16), 0),  # a group per tile, fp16 scales
], ids=["fp8-edge", "fp8-bf16-tile", "fp8-bias", "mxfp4-decode", "mxfp4-bf16-tp", "mxfp4-ragged", "nvfp4",
        "nvfp4-bf16-bias", "int4-groups", "int4-bf16-ragged", "int8-channel", "int4-group-per-tile"])
def test_quantized_fused_moe_matches_reference(device, fmt, num_tokens, num_experts, top_k, hidden, inter, dtype,
                                               bias, block, col0):
    x, w13, w2, d13, d2, weights, ids, b13, b2 = make_quant_moe(
        fmt, num_tokens, num_experts, top_k, hidden, inter, dtype, device, bias, block or (32, 32), col0)
    act = clamped_glu if bias else silu_glu
    got = fm.fused_moe(x, w13, w2, weights, ids, act, b13, b2)
    _check(got, reference.fused_moe(x, d13, d2, weights, ids, act, b13, b2), dtype)


def test_quantized_experts_refuse_mismatched_layouts():
    blocks = torch.zeros(2, 4, 3, 16, dtype=torch.uint8)
    with pytest.raises(AssertionError, match="blocks"):
        fm.QuantizedExperts.mxfp4(blocks, torch.zeros(2, 4, 2, dtype=torch.uint8))
    with pytest.raises(AssertionError, match="columns"):
        fm.QuantizedExperts.mxfp4(blocks, torch.zeros(2, 4, 3, dtype=torch.uint8), col0=8, k=96)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,num_tokens,num_experts,top_k,hidden,inter,bias,block,col0", [
    ("fp8", 64, 128, 8, 2048, 768, False, (128, 128), 0),  # Qwen3-30B-A3B-FP8
    ("fp8", 1, 128, 8, 2048, 768, False, (128, 128), 0),
    ("mxfp4", 64, 32, 4, 2880, 2880, True, None, 0),  # gpt-oss-20b
    ("mxfp4", 16, 32, 4, 2880, 360, True, None, 8),  # its rank 1 of 8
    ("nvfp4", 64, 128, 8, 2048, 768, False, None, 0),
    ("int4", 64, 128, 8, 2048, 768, False, (128, None), 0),  # Qwen3-30B-A3B in W4A16
    ("int4", 1, 128, 8, 2048, 768, False, (128, None), 0),
])
def test_quantized_fused_moe_at_model_shapes(device, fmt, num_tokens, num_experts, top_k, hidden, inter, bias, block,
                                            col0):
    x, w13, w2, d13, d2, weights, ids, b13, b2 = make_quant_moe(
        fmt, num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, device, bias, block or (128, 128), col0)
    act = clamped_glu if bias else silu_glu
    got = fm.fused_moe(x, w13, w2, weights, ids, act, b13, b2)
    _check(got, fm.fused_moe(x, d13, d2, weights, ids, act, b13, b2), torch.bfloat16)


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_executor_fp8_experts_triton_path_matches_torch_loop(device, dtype):
    """FusedExperts holding FP8 blocks (use_fp8): the kernel, reading them as
    held, gives the torch loop's output, which dequantizes one expert at a time."""
    from executor_svc.model.model_config import MoESpec
    from executor_svc.model.moe import FusedExperts, use_triton_moe
    from executor_svc.model.sharding import Shard

    x, w13, w2, _, _, weights, ids, _, _ = make_quant_moe("fp8", 13, 8, 2, 48, 40, dtype, device, block=(32, 32))
    spec = MoESpec(num_experts=8, top_k=2, intermediate_size=40, sparse_layers=(True,))
    cfg = type("Cfg", (), {"hidden_size": 48, "hidden_act": "silu"})()
    experts = FusedExperts(cfg, spec, Shard())
    experts.use_fp8((32, 32))
    experts.w13, experts.w13_scale, experts.grid13 = _param(w13.data), _param(w13.scales), w13.rows
    experts.w2, experts.w2_scale, experts.grid2 = _param(w2.data), _param(w2.scales), w2.rows
    want = experts(x, weights, ids)
    assert use_triton_moe(experts) == 1 and experts.impl == "triton"
    _check(experts(x, weights, ids), want, dtype)


def test_executor_mxfp4_experts_triton_path_matches_torch_loop(device):
    """gpt-oss's packed experts on rank 1 of 2, whose 40 units start 8 columns
    into down's second group: the kernel reads the packed blocks and that
    window, with the biases and the clamped SwiGLU, as the torch loop does."""
    from executor_svc.model.families.gpt_oss import GptOssExperts
    from executor_svc.model.model_config import MoESpec, QuantSpec
    from executor_svc.model.moe import use_triton_moe
    from executor_svc.model.sharding import Shard

    dtype = torch.bfloat16
    x, w13, w2, _, _, weights, ids, b13, b2 = make_quant_moe("mxfp4", 11, 4, 2, 64, 40, dtype, device, bias=True,
                                                             col0=8)
    spec = MoESpec(num_experts=4, top_k=2, intermediate_size=80, sparse_layers=(True,), scoring="topk_softmax",
                   router_bias=True, expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702)
    cfg = type("Cfg", (), {"hidden_size": 64, "hidden_act": "silu", "quantization": QuantSpec("mxfp4")})()
    experts = GptOssExperts(cfg, spec, Shard(rank=1, size=2))
    assert experts.w2_offset == 8 and experts.w2_groups == (1, 3)
    experts.w13_blocks, experts.w13_scales = _param(w13.data), _param(w13.scales)
    experts.w2_blocks, experts.w2_scales = _param(w2.data), _param(w2.scales)
    experts.b13, experts.b2 = _param(b13), _param(b2)
    want = experts(x, weights, ids)
    assert use_triton_moe(experts) == 1
    _check(experts(x, weights, ids), want, dtype)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from tests.families import CASES, make_checkpoint

    return make_checkpoint(CASES["qwen3-moe"], tmp_path_factory.mktemp("qwen3-moe"))


FP8_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
FP8_TENSOR = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}
PER_TOKEN = {"strategy": "token", "dynamic": True, "symmetric": True}


@pytest.mark.parametrize("weights, activations", [
    (NVFP4, NVFP4_ACTIVATIONS),
    (NVFP4, None),
    (MXFP4, None),
    ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16, "symmetric": False}, None),
    ({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
     {"num_bits": 8, "type": "int"} | PER_TOKEN),
    (FP8_CHANNEL, {"num_bits": 8, "type": "float"} | PER_TOKEN),
    ({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [16, 16], "symmetric": True}, None),
    (FP8_TENSOR, FP8_TENSOR | {"dynamic": False}),
], ids=["nvfp4-w4a4", "nvfp4a16", "mxfp4a16", "w4a16-asymmetric", "int8-w8a8", "fp8-dynamic", "fp8-blocks-w8a16",
        "fp8-static"])
def test_executor_quantized_checkpoint_experts_triton_path_matches_torch_loop(qwen3_moe, weights, activations,
                                                                             tmp_path):
    """Qwen3-MoE's experts from a compressed-tensors checkpoint, loaded as
    one quantized linear per expert: use_triton_moe stacks them for the
    kernel (each expert's linears keep views, so the weights stay one copy),
    and the kernel, with the scheme's input quantization per (token,
    expert) pair, gives the torch loop's output. Static input scales are
    made to differ by expert, so each pair must be quantized by its own."""
    from executor_svc.loading import weight_bytes
    from executor_svc.model.moe import FusedExperts, use_triton_moe
    from tests.quantized import write_compressed_tensors
    from tests.unit.test_families_vs_hf import runner_for

    path = write_compressed_tensors(qwen3_moe, tmp_path / "ct", weights, activations,
                                    ignore=("lm_head", "re:.*mlp.gate$"))
    model = runner_for(str(path)).model
    layers = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert layers and all(m.per_expert is not None and m.stacked is None for m in layers)
    leaf = layers[0].per_expert[0].gate_up.scheme.activations
    leaf = leaf and leaf.checkpoint_leaf
    if leaf:
        for m in layers:
            for e, expert in enumerate(m.per_expert):
                getattr(expert.gate_up, leaf).mul_(1 + e / 8)
    g = torch.Generator().manual_seed(0)
    hidden, num_experts = layers[0].hidden, layers[0].spec.num_experts
    x = torch.randn(9, hidden, generator=g)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(9)])
    routing = torch.softmax(torch.randn(9, 2, generator=g), -1)
    with torch.no_grad():
        want = [m(x, routing, ids) for m in layers]
        before = weight_bytes(model)
        assert use_triton_moe(model) == len(layers)
        assert weight_bytes(model) == before  # the stacks replaced the experts' tensors
        for m, w in zip(layers, want):
            held = "weight" if weights["type"] == "float" and weights["num_bits"] == 8 else "qweight"
            assert m.impl == "triton" and (m.stacked_inputs is None) == (activations is None)
            assert getattr(m.per_expert[1].down, held).data_ptr() == m.stacked[1].data[1].data_ptr()
            _check(m(x, routing, ids), w, torch.float32)
            m.impl = "torch"  # the torch loop reads the views
            assert torch.equal(m(x, routing, ids), w)


def test_w4a16_experts_on_the_kernel_serve_hfs_greedy_tokens(qwen3_moe, tmp_path):
    """The oracle end to end: Qwen3-MoE in asymmetric W4A16 (compressed-
    tensors) with its experts on the fused-MoE kernel gives HF's greedy
    tokens on the weights compressed-tensors' own decompressor yields."""
    from executor_svc.model.moe import use_triton_moe
    from tests.families import hf_greedy, prompts
    from tests.quantized import decompress_compressed_tensors, write_compressed_tensors
    from tests.unit.test_families_vs_hf import runner_for
    from tests.unit.test_runner_vs_hf import generate

    w4a16 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16, "symmetric": False}
    path = write_compressed_tensors(qwen3_moe, tmp_path / "w4a16", w4a16, ignore=("lm_head", "re:.*mlp.gate$"))
    dense = decompress_compressed_tensors(path, tmp_path / "dense")
    runner = runner_for(str(path))
    assert use_triton_moe(runner.model) == 2  # layers 1 and 2 (layer 0 is dense: mlp_only_layers)
    batch = prompts(2)
    for prompt, tokens in zip(batch, generate(runner, batch, 10, chunk=7)):
        want = hf_greedy(str(dense), prompt, 10)
        assert want.min_margin > 1e-3, "the oracle's own greedy path is too close to a tie to compare"
        assert tokens == want.tokens, f"prompt {prompt}: got {tokens}, HF {want.tokens}"
