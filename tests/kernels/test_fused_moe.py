"""llmsched_kernels.fused_moe (two grouped GEMMs over tokens sorted by expert) against
llmsched_kernels.reference.fused_moe, through the Triton interpreter without CUDA:
tiny shapes, decode-sized and prefill-sized batches, experts with no tokens,
biases and the clamped SwiGLU, and the torch path the executor runs on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmsched_kernels import reference

fm = pytest.importorskip("llmsched_kernels.fused_moe")


def silu_glu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_glu(h: torch.Tensor) -> torch.Tensor:
    from executor_svc.model.moe import swiglu_clamped

    gate, up = h.chunk(2, dim=-1)
    return swiglu_clamped(gate, up, 1.702, 0.8)


def make_moe(num_tokens, num_experts, top_k, hidden, inter, dtype, device, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = rand(num_tokens, hidden)
    w13, w2 = rand(num_experts, 2 * inter, hidden) / hidden**0.5, rand(num_experts, hidden, inter) / inter**0.5
    # Distinct experts per token, and (with few tokens) some experts get none.
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.softmax(rand(num_tokens, top_k), -1)
    b13, b2 = (rand(num_experts, 2 * inter), rand(num_experts, hidden)) if bias else (None, None)
    move = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return move(x), move(w13), move(w2), weights.to(device), ids.to(device), move(b13), move(b2)


TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter,dtype,bias,act", [
    (1, 8, 2, 32, 16, torch.float32, False, silu_glu),  # decode: most experts idle
    (5, 4, 2, 64, 32, torch.float32, True, clamped_glu),  # gpt-oss's biases and clamp
    (37, 6, 3, 48, 40, torch.float32, False, silu_glu),  # prefill: runs longer than a tile, ragged dims
    (9, 8, 2, 32, 16, torch.bfloat16, False, silu_glu),
], ids=["decode", "bias-clamp", "prefill", "bf16"])
def test_fused_moe_matches_reference(device, num_tokens, num_experts, top_k, hidden, inter, dtype, bias, act):
    x, w13, w2, weights, ids, b13, b2 = make_moe(num_tokens, num_experts, top_k, hidden, inter, dtype, device, bias)
    got = fm.fused_moe(x, w13, w2, weights, ids, act, b13, b2)
    want = reference.fused_moe(x, w13, w2, weights, ids, act, b13, b2)
    tol = TOLERANCE[dtype]
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (got - want).abs().max()


def test_align_by_expert_pads_each_expert_to_whole_tiles(device):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]], device=device)  # expert 2 gets nothing
    sorted_pairs, block_expert, num_padded = fm.align_by_expert(ids, 4, block_m=4)
    pad = ids.numel()
    # expert 0: pairs 1, 4; expert 1: pair 3; expert 3: pairs 0, 2, 5 (pair = token * top_k + slot)
    assert sorted_pairs[:12].tolist() == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    assert int(num_padded) == 12 and block_expert[:3].tolist() == [0, 1, 3]
    assert (sorted_pairs[12:] == pad).all()  # worst-case tail, never read


def test_executor_experts_torch_and_triton_paths_agree(device):
    """The executor's FusedExperts on the same weights: the vectorized torch
    path and the kernel give the reference's output."""
    from executor_svc.model.model_config import MoESpec
    from executor_svc.model.moe import FusedExperts
    from executor_svc.model.sharding import Shard

    x, w13, w2, weights, ids, _, _ = make_moe(11, 8, 2, 32, 16, torch.float32, device)
    spec = MoESpec(num_experts=8, top_k=2, intermediate_size=16, sparse_layers=(True,))
    cfg = type("Cfg", (), {"hidden_size": 32, "hidden_act": "silu"})()
    experts = FusedExperts(cfg, spec, Shard())
    experts.w13, experts.w2 = torch.nn.Parameter(w13, False), torch.nn.Parameter(w2, False)
    want = reference.fused_moe(x, w13, w2, weights, ids, silu_glu)
    assert torch.allclose(experts(x, weights, ids), want, atol=1e-5)
    experts.impl = "triton"
    assert torch.allclose(experts(x, weights, ids), want, atol=1e-4)


def test_ordered_combine_gives_a_token_the_same_bits_alone_and_among_others(device, row_invariant_dot):
    """Batch-invariant mode's fused MoE: the grouped GEMMs' tiles depend on the
    weights' shapes only and the experts add in top-k slot order, so a token's
    output is the same bits alone and among 37 tokens (its experts shared with others).
    (On the CPU interpreter torch's sum over the k slots would pass too: the order
    matters where a GPU reduction picks it from the batch's size.)"""
    x, w13, w2, weights, ids, _, _ = make_moe(37, 6, 3, 48, 40, torch.float32, device)
    among = fm.fused_moe(x, w13, w2, weights, ids, silu_glu, ordered_combine=True)
    want = reference.fused_moe(x, w13, w2, weights, ids, silu_glu)
    assert torch.allclose(among, want, atol=1e-4, rtol=1e-4)
    for t in (0, 17, 36):
        alone = fm.fused_moe(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1], silu_glu, ordered_combine=True)
        assert torch.equal(alone[0], among[t]), f"token {t} alone differs from token {t} among 37"
