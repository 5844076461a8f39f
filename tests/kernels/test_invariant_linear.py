"""llmsched_kernels.invariant_linear (batch-invariant mode's GEMM on CUDA) against
F.linear, and its promise: a row's bits do not depend on the rows beside
it. Without CUDA through the Triton interpreter, whose dots are fixed-shape
numpy products: the tiles, not the batch, decide each row's sums there too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

il = pytest.importorskip("llmsched_kernels.invariant_linear")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m, n, k, bias", [(1, 64, 64, False), (5, 96, 100, True), (37, 40, 72, True)])
def test_invariant_linear_matches_f_linear(m, n, k, bias):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, k, generator=g).to(DEVICE), torch.randn(n, k, generator=g).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    torch.testing.assert_close(il.invariant_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_a_row_gets_the_same_bits_alone_and_among_70_rows():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(70, 100, generator=g).to(DEVICE), torch.randn(72, 100, generator=g).to(DEVICE)
    among = il.invariant_linear(x, w)
    for i in (0, 3, 33, 69):
        alone = il.invariant_linear(x[i:i + 1], w)[0]
        assert torch.equal(alone, among[i]), f"row {i} alone differs from row {i} among 70"
        assert torch.equal(il.invariant_linear(x[i:i + 5], w)[0], among[i]), f"row {i} in a batch of 5 differs"


def test_batch_invariant_mode_routes_a_models_linear_layers_through_the_kernel(stories_path):
    """make_batch_invariant(triton_gemm=True), as on CUDA: the model's
    logits stay F.linear's within fp32 rounding, and a token's logits are
    the same bits alone and among others."""
    from executor_svc.model.batch_invariant import make_batch_invariant
    from executor_svc.model.checkpoint import load_checkpoint
    from executor_svc.model.families import build_model, read_config

    ckpt = load_checkpoint(str(stories_path))
    cfg = read_config(ckpt.hf_config)
    plain = build_model(cfg, ckpt.state_dict, 64, torch.device(DEVICE), torch.float32)
    model = build_model(cfg, ckpt.state_dict, 64, torch.device(DEVICE), torch.float32)
    assert make_batch_invariant(model, triton_gemm=True) == 5 * 4 + 1  # qkv, o, gate_up, down per layer; lm_head
    hidden = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits, plain.compute_logits(hidden), rtol=1e-5, atol=1e-4)
    assert torch.equal(model.compute_logits(hidden[4:5])[0], logits[4])
    down = model.model.layers[0].mlp.down_proj
    x = torch.randn(6, down.weight.shape[1], generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert torch.equal(down(x)[2], down(x[2:3])[0])
