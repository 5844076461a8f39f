"""The shared MoE layer (executor_svc/model/moe.py) against HF's own router and
expert modules, on inputs where experts tie exactly: a zero hidden state
(every logit equal) and duplicated router rows. The executor must pick the
experts HF picks, in HF's order, with HF's weights, for every scoring rule;
and its vectorized experts must sum what HF's per-expert loop sums."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from executor_svc.model.model_config import MoESpec
from executor_svc.model.moe import FusedExperts, Router
from executor_svc.model.sharding import Shard

HIDDEN, EXPERTS = 16, 8


def _inputs(g: torch.Generator) -> torch.Tensor:
    x = torch.randn(12, HIDDEN, generator=g)
    x[0] = 0.0  # every expert's logit is equal (or equal to its bias)
    return x


def _tied_weight(g: torch.Generator) -> torch.Tensor:
    w = torch.randn(EXPERTS, HIDDEN, generator=g)
    w[2] = w[1]  # experts 1 and 2 always tie
    w[6] = w[5]
    return w


# name -> (HF router class, its config, our MoESpec)
ROUTERS = {
    "mixtral": ("MixtralTopKRouter", transformers.MixtralConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS,
                                                                num_experts_per_tok=2),
                MoESpec(EXPERTS, 2, 4, (True,), scoring="softmax", norm_topk_prob=True)),
    "qwen2-moe": ("Qwen2MoeTopKRouter", transformers.Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS,
                                                                    num_experts_per_tok=3, norm_topk_prob=False),
                  MoESpec(EXPERTS, 3, 4, (True,), scoring="softmax", norm_topk_prob=False)),
    "qwen3-moe": ("Qwen3MoeTopKRouter", transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS,
                                                                    num_experts_per_tok=3, norm_topk_prob=True),
                  MoESpec(EXPERTS, 3, 4, (True,), scoring="softmax", norm_topk_prob=True)),
    "gpt-oss": ("GptOssTopKRouter", transformers.GptOssConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS,
                                                              num_experts_per_tok=2),
                MoESpec(EXPERTS, 2, 4, (True,), scoring="topk_softmax", router_bias=True)),
    "deepseek-v3": ("DeepseekV3TopkRouter", transformers.DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=3, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5),
        MoESpec(EXPERTS, 3, 4, (True,), scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                n_group=4, topk_group=2, correction_bias=True, router_fp32=True)),
}


def _hf_router(name: str):
    cls_name, config, _ = ROUTERS[name]
    module = {"MixtralTopKRouter": "mixtral", "Qwen2MoeTopKRouter": "qwen2_moe", "Qwen3MoeTopKRouter": "qwen3_moe",
              "GptOssTopKRouter": "gpt_oss", "DeepseekV3TopkRouter": "deepseek_v3"}[cls_name]
    modeling = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=[cls_name])
    return getattr(modeling, cls_name)(config)


@pytest.mark.parametrize("name", ROUTERS)
def test_router_picks_hfs_experts_in_hfs_order_even_on_exact_ties(name):
    g = torch.Generator().manual_seed(0)
    hf, spec = _hf_router(name), ROUTERS[name][2]
    ours = Router(type("Cfg", (), {"hidden_size": HIDDEN})(), spec)
    weight = _tied_weight(g)
    with torch.no_grad():
        hf.weight.copy_(weight)
        ours.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        if spec.router_bias:
            bias = torch.randn(EXPERTS, generator=g)
            bias[2], bias[6] = bias[1], bias[5]
            hf.bias.copy_(bias)
            ours.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
        if spec.correction_bias:
            corr = 0.1 * torch.randn(EXPERTS, generator=g)
            corr[2], corr[6] = corr[1], corr[5]
            hf.e_score_correction_bias.copy_(corr)
            ours.e_score_correction_bias = torch.nn.Parameter(corr.clone(), requires_grad=False)
    x = _inputs(g)
    with torch.no_grad():
        _, want_weights, want_ids = hf(x)
        weights, ids = ours(x)
    assert torch.equal(ids, want_ids), f"{name}: experts differ from HF's\n{ids}\n{want_ids}"
    assert torch.equal(weights, want_weights.float()), f"{name}: weights differ from HF's"
    # The ties are real: row 0 sees every expert (or pair) equal.
    assert len(set(ids[0].tolist())) == ids.shape[1]


def test_group_limited_routing_changes_the_experts_that_win():
    """DeepSeek-V3's topk_group: without the group limit other experts win."""
    g = torch.Generator().manual_seed(1)
    spec = ROUTERS["deepseek-v3"][2]
    cfg = type("Cfg", (), {"hidden_size": HIDDEN})()
    limited, free = Router(cfg, spec), Router(cfg, dataclasses.replace(spec, n_group=1, topk_group=1))
    weight, corr = torch.randn(EXPERTS, HIDDEN, generator=g), torch.zeros(EXPERTS)
    for r in (limited, free):
        r.weight = torch.nn.Parameter(weight, requires_grad=False)
        r.e_score_correction_bias = torch.nn.Parameter(corr, requires_grad=False)
    x = torch.randn(64, HIDDEN, generator=g)
    with torch.no_grad():
        assert not torch.equal(limited(x)[1].sort(-1).values, free(x)[1].sort(-1).values)


def test_vectorized_experts_sum_what_hfs_loop_over_experts_sums():
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=3,
                                         moe_intermediate_size=8)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    g = torch.Generator().manual_seed(2)
    hf = Qwen3MoeExperts(config)
    spec = MoESpec(EXPERTS, 3, 8, (True,))
    ours = FusedExperts(type("Cfg", (), {"hidden_size": HIDDEN, "hidden_act": "silu"})(), spec, Shard())
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.randn(EXPERTS, 16, HIDDEN, generator=g))
        hf.down_proj.copy_(torch.randn(EXPERTS, HIDDEN, 8, generator=g))
    ours.w13 = torch.nn.Parameter(hf.gate_up_proj.detach().clone(), requires_grad=False)
    ours.w2 = torch.nn.Parameter(hf.down_proj.detach().clone(), requires_grad=False)
    x = torch.randn(20, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:3] for _ in range(20)])
    weights = torch.rand(20, 3, generator=g)
    with torch.no_grad():
        want = hf(x, ids, weights)
        got = ours(x, weights, ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_use_triton_moe_switches_plain_and_fp8_experts_and_leaves_unreadable_ones_on_the_torch_loop():
    """The fused-MoE kernel reads plain and FP8-block experts as held (and
    per-expert quantized linears once stacked, test_fused_moe_quant.py);
    experts it cannot read keep the torch loop."""
    from torch import nn

    from executor_svc.model.moe import use_triton_moe

    spec = MoESpec(num_experts=4, top_k=2, intermediate_size=32, sparse_layers=(True,))
    cfg = type("Cfg", (), {"hidden_size": 32, "hidden_act": "silu"})()
    plain, fp8, per_expert = (FusedExperts(cfg, spec, Shard()) for _ in range(3))
    fp8.use_fp8((16, 16))
    per_expert.per_expert = nn.ModuleList()  # per-expert linears without a scheme: nothing to stack
    assert use_triton_moe(nn.ModuleList([plain, fp8, per_expert])) == 2
    assert (plain.impl, fp8.impl, per_expert.impl) == ("triton", "triton", "torch")
