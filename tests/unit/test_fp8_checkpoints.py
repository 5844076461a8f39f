"""FP8 checkpoints with block scales (quant_method "fp8", weight_block_size:
DeepSeek-V3's and Qwen3-FP8's layout), served at their own size
(executor_svc/model/quantization.py, layers.py).

The fixtures are written by hand in that layout from a tiny random Llama:
each linear weight in float8_e4m3fn with one float32 `weight_scale_inv` per
block, blocks at the edges included. Oracles:
- blocks that tile every weight: HF transformers loading the same FP8
  checkpoint (on the CPU it dequantizes at load), greedy token for token;
- blocks that leave edge tiles, which transformers cannot read (it guesses
  the block size from the scale grid): HF on the weights dequantized by the
  layout's definition, written out here on its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor_svc.model.checkpoint import load_checkpoint
from executor_svc.model.families import build_model, read_config
from executor_svc.model.model_config import UnsupportedConfig
from executor_svc.model.quantization import BlockSplitError, dequantize_fp8_blocks, fp8_as_half
from llmsched.errors import StartupError
from executor_svc.model.sharding import Shard, check_size
from tests.families import CASES, hf_greedy, make_checkpoint, prompts
from tests.quantized import FP8, dequantize, quantize, write_dequantized, write_fp8
from tests.unit.test_families_vs_hf import runner_for
from tests.unit.test_runner_vs_hf import generate

@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    # hidden 64, q/o 64 rows, k/v 32, gate/up 128, down 64 columns of 128.
    return make_checkpoint(CASES["llama3"], tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def aligned(llama, tmp_path_factory) -> Path:
    return write_fp8(llama, tmp_path_factory.mktemp("fp8") / "aligned", (32, 32))


@pytest.fixture(scope="module")
def edges(llama, tmp_path_factory) -> Path:
    # 48 x 40 blocks leave edge tiles on every weight (64 = 48 + 16, 32 < 48, 128 = 3 x 40 + 8).
    return write_fp8(llama, tmp_path_factory.mktemp("fp8") / "edges", (48, 40))


def assert_greedy_equal(path: Path, oracle: Path, n: int = 3, steps: int = 16) -> None:
    """Our runner on `path` (the prompts batched, prefill in chunks of 7)
    against HF's greedy tokens on `oracle`."""
    batch = prompts(n)
    got = generate(runner_for(str(path)), batch, steps, chunk=7)
    for prompt, tokens in zip(batch, got):
        want = hf_greedy(str(oracle), prompt, steps)
        assert want.min_margin > 1e-3, "the oracle's own greedy path is too close to a tie to compare"
        assert tokens == want.tokens, f"prompt {prompt}: got {tokens}, HF {want.tokens}"


def test_fp8_blocks_serve_hfs_greedy_tokens_when_transformers_reads_the_checkpoint_itself(aligned):
    assert_greedy_equal(aligned, aligned)


def test_fp8_edge_blocks_serve_the_greedy_tokens_of_the_weights_they_define(edges, tmp_path):
    assert_greedy_equal(edges, write_dequantized(edges, tmp_path / "dequantized", (48, 40)))


def test_fp8_weights_stay_fp8_in_memory_at_about_half_the_bytes(aligned, llama):
    quantized = runner_for(str(aligned)).model
    plain = runner_for(str(llama)).model
    layer = quantized.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == FP8 and layer.mlp.down_proj.weight.dtype == FP8
    linear = lambda m: sum(p.numel() * p.element_size() for n, p in m.named_parameters()  # noqa: E731
                           if "proj" in n)
    # fp32 here: FP8 plus one fp32 scale per 32 x 32 block is 1 + 4/1024 bytes a weight against 4.
    assert linear(quantized) / linear(plain) < 0.26


def test_dequantize_matches_the_layouts_definition_on_edge_tiles():
    torch.manual_seed(0)
    w = torch.randn(70, 90)
    q, s = quantize(w, 32, 64)
    grid_rows = torch.arange(70) // 32
    got = dequantize_fp8_blocks(q, s, grid_rows, 64, torch.float32)
    assert torch.equal(got, dequantize(q, s, 32, 64))
    assert torch.equal(dequantize_fp8_blocks(q, s, grid_rows, 64, torch.bfloat16),
                       dequantize(q, s, 32, 64).to(torch.bfloat16)), "bf16: the product in fp32, then cast"


def test_a_tensor_parallel_size_that_cuts_a_block_is_refused_naming_the_sizes_that_work(edges):
    ckpt = load_checkpoint(str(edges))
    cfg = read_config(ckpt.hf_config)
    with pytest.raises(BlockSplitError, match=r"tensor_parallel_size=2 cuts .* sizes that work: 1$"):
        build_model(cfg, {}, 64, torch.device("cpu"), torch.float32, Shard(0, 2))


def test_the_start_up_size_check_names_the_fp8_blocks_a_size_would_cut(edges, aligned):
    with pytest.raises(StartupError, match=r"does not divide .*blocks or groups of 48 \(q rows per rank: 32\).*sizes that work: 1$"):
        check_size(read_config(load_checkpoint(str(edges)).hf_config), 2)
    # 32 x 32 blocks: one KV head of 16 rows per rank would cut them; 16 x 16 blocks stay whole.
    hf = load_checkpoint(str(aligned)).hf_config
    with pytest.raises(StartupError, match=r"blocks or groups of 32 \(k/v rows per rank: 16\)"):
        check_size(read_config(hf), 2)
    check_size(read_config(hf | {"quantization_config": BASE | {"weight_block_size": [16, 16]}}), 2)


def test_modules_to_not_convert_keep_their_weights_plain(llama, tmp_path):
    path = write_fp8(llama, tmp_path / "ignored", (32, 32), modules_to_not_convert=["model.layers.1.mlp"])
    tensors = load_file(path / "model.safetensors")
    for proj in ("gate_proj", "up_proj", "down_proj"):  # written plain, as the list says
        name = f"model.layers.1.mlp.{proj}"
        tensors[f"{name}.weight"] = load_file(next(llama.glob("*.safetensors")))[f"{name}.weight"]
        del tensors[f"{name}.weight_scale_inv"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = runner_for(str(path)).model
    assert model.model.layers[1].mlp.gate_up_proj.weight.dtype == torch.float32
    assert model.model.layers[1].self_attn.qkv_proj.weight.dtype == FP8
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == FP8


BASE = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "awq"}, r"keys \['activation_scheme', 'weight_block_size'\] are not implemented for "
                              r"quant_method 'awq'"),
    ({"fmt": "e5m2"}, r"fmt='e5m2' is not supported"),
    ({"activation_scheme": "static"}, r"activation_scheme='static' is not supported"),
    ({"scale_fmt": "e4m3"}, r"scale_fmt='e4m3' is not supported"),
    ({"weight_block_size": [128]}, r"weight_block_size=\[128\] must be two positive integers"),
    ({"kv_cache_scheme": {"num_bits": 8}}, r"keys \['kv_cache_scheme'\] are not implemented"),
])
def test_quantization_config_that_changes_the_math_is_refused_by_name(llama, change, message):
    hf = json.loads((llama / "config.json").read_text())
    with pytest.raises(UnsupportedConfig, match=message):
        read_config(hf | {"quantization_config": BASE | change})


def test_scale_fmt_ue8m0_is_read_as_the_float32_scales_it_stores(llama):
    hf = json.loads((llama / "config.json").read_text())
    cfg = read_config(hf | {"quantization_config": BASE | {"scale_fmt": "ue8m0"}})
    assert cfg.quantization.weight_block == (128, 128)


@pytest.mark.parametrize("family, block", [("mixtral", (16, 16)), ("qwen3-moe", (16, 16)), ("deepseek-v3", (8, 8))])
def test_fp8_experts_and_latent_attention_serve_hfs_greedy_tokens(family, block, tmp_path):
    """Every expert's projections, the shared expert's, and DeepSeek-V3's
    latent projections (q_a, kv_a, q_b, kv_b: its kv_b weight is read
    whole for the latent attention) in FP8 blocks; routers stay plain."""
    path = write_fp8(make_checkpoint(CASES[family], tmp_path / family), tmp_path / "fp8", block)
    assert_greedy_equal(path, path, n=2, steps=12)
    model = runner_for(str(path)).model
    experts = model.model.layers[1].mlp.experts
    assert experts.w13.dtype == FP8 and experts.w2.dtype == FP8


def test_fp8_as_half_is_exact_for_every_finite_e4m3_value():
    every = torch.arange(256, dtype=torch.uint8).view(FP8)
    finite = ~torch.isnan(every.float())
    got = fp8_as_half(every).float() * 256
    assert torch.equal(got[finite], every.float()[finite]), "e4m3 / 256 must be exact in float16"
