"""gpt-oss's MXFP4 experts, kept packed (about 0.27x their bf16 bytes) and
dequantized per routed expert: the values equal
transformers' own dequantization; a checkpoint holding them serves HF's
greedy tokens on the same weights stored unquantized; and a tensor-parallel
rank reads its part of the packed tensors, whether or not its units fill
whole groups of 32."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor_svc.model.checkpoint import LazyTensor
from executor_svc.model.model_config import QuantSpec
from executor_svc.model.mxfp4 import dequantize
from tests.families import CASES, hf_greedy, make_checkpoint
from tests.unit.test_families_vs_hf import MAX_NEW, PROMPTS, runner_for
from tests.unit.test_runner_vs_hf import generate


def _packed(shape: tuple[int, ...], g: torch.Generator, exponent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [..., groups, 16] and scales [..., groups] near 2^exponent."""
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = (127 + exponent + torch.randint(-1, 2, shape, generator=g)).to(torch.uint8)
    return blocks, scales


def test_dequantize_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks, scales = _packed((3, 10, 4), g, 0)
    for dtype in (torch.float32, torch.bfloat16):
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [3, 4 * 32, 10]: transformers transposes
        assert torch.equal(dequantize(blocks, scales, dtype).transpose(1, 2), want)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The gpt-oss case twice: experts in MXFP4 (with quantization_config),
    and the same values stored plainly, for HF."""
    case = CASES["gpt-oss"]
    plain = make_checkpoint(case, tmp_path_factory.mktemp("gpt-oss-plain"))
    packed = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    shutil.copytree(plain, packed, dirs_exist_ok=True)
    tensors = load_file(plain / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    hidden, inter, experts = 64, case.config["intermediate_size"], case.config["num_local_experts"]
    quantized = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows, cols = (2 * inter, hidden) if name.endswith("gate_up_proj") else (hidden, inter)
        blocks, scales = _packed((experts, rows, cols // 32), g, -4)  # about 1/sqrt(fan-in), as the redraw
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        tensors[name] = dequantize(blocks, scales, torch.float32).transpose(1, 2).contiguous()
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    packed_tensors = {n: t for n, t in tensors.items() if not n.endswith(("gate_up_proj", "down_proj"))} | quantized
    save_file(packed_tensors, packed / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((packed / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (packed / "config.json").write_text(json.dumps(cfg))
    return str(plain), str(packed)


def test_an_mxfp4_checkpoint_serves_hfs_tokens_on_its_dequantized_weights(checkpoints):
    plain, packed = checkpoints
    runner = runner_for(packed)
    assert runner.model.cfg.quantization.method == "mxfp4"
    experts = runner.model.model.layers[0].mlp.experts
    packed_bytes = sum(getattr(experts, f"{w}_{part}").numel() for w in ("w13", "w2") for part in ("blocks", "scales"))
    dense = runner_for(plain).model.model.layers[0].mlp.experts
    dense_bytes = (dense.w13.numel() + dense.w2.numel()) * 2  # at bf16
    # 4 bits a value and a scale byte per 32: 0.53 bytes against bf16's 2.
    assert packed_bytes / dense_bytes < 0.27, (packed_bytes, dense_bytes)
    for prompt, got in zip(PROMPTS, generate(runner, PROMPTS, MAX_NEW, chunk=5)):
        want = hf_greedy(plain, prompt, MAX_NEW)
        assert want.min_margin > 1e-3
        assert got == want.tokens


@pytest.mark.parametrize("inter", [64, 96], ids=["whole-groups", "groups-split-between-ranks"])
def test_each_rank_reads_its_units_of_the_packed_experts(inter):
    from executor_svc.model.families.gpt_oss import GptOssExperts
    from executor_svc.model.model_config import MoESpec
    from executor_svc.model.sharding import Shard

    g = torch.Generator().manual_seed(1)
    experts, hidden = 2, 64
    spec = MoESpec(experts, 1, inter, (True,), scoring="topk_softmax", expert_bias=True, swiglu_limit=7.0)
    cfg = type("Cfg", (), {"hidden_size": hidden, "hidden_act": "silu", "quantization": QuantSpec("mxfp4")})()
    gate_up = _packed((experts, 2 * inter, hidden // 32), g, 0)
    down = _packed((experts, hidden, inter // 32), g, 0)
    whole_gate_up = dequantize(*gate_up, torch.float32)  # [experts, 2 * inter interleaved, hidden]
    whole_down = dequantize(*down, torch.float32)  # [experts, hidden, inter]
    for rank in range(2):
        with torch.device("meta"):
            layer = GptOssExperts(cfg, spec, Shard(rank, 2))
        for name, t in (("gate_up_proj_blocks", gate_up[0]), ("gate_up_proj_scales", gate_up[1]),
                        ("down_proj_scales", down[1]), ("down_proj_blocks", down[0])):
            layer.load_weight(name, LazyTensor.of(t), torch.device("cpu"), torch.float32)
        half = inter // 2
        units = slice(rank * half, (rank + 1) * half)
        for e in range(experts):
            w13, w2 = layer.expert_weights(e, torch.float32)
            assert torch.equal(w13[:half], whole_gate_up[e, 0::2][units])  # gate at even rows
            assert torch.equal(w13[half:], whole_gate_up[e, 1::2][units])
            assert torch.equal(w2, whole_down[e, :, units])
        assert layer.w13_blocks.dtype == torch.uint8 and layer.w13 is None, "the experts stay packed"
