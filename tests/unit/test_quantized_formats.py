"""Quantized checkpoint formats beyond FP8 blocks (test_fp8_checkpoints.py):
compressed-tensors, GPTQ, AWQ and per-tensor FP8, served at their own size
(executor_svc/model/quantization.py, quant_formats.py, layers.py).

Fixtures come from a tiny random Llama (tests/families.py): compressed-tensors
checkpoints written by the compressed-tensors package, GPTQ, AWQ and
per-tensor FP8 by hand in their documented layouts (tests/quantized.py).

Oracles:
- weight-only formats: HF transformers' greedy tokens, token for token, on
  the checkpoint itself where transformers reads it (compressed-tensors,
  symmetric), else on its weights dequantized by compressed-tensors' own
  decompressors (asymmetric zero points, which transformers 5 fails to
  load) or by the layout's definition (GPTQ, AWQ, per-tensor FP8);
- formats that quantize activations at run time (W8A8, NVFP4 W4A4): HF with
  compressed-tensors' fake-quantized forward, teacher-forced on HF's greedy
  tokens. Tolerance: top-1 agrees on at least 99% of positions, and on
  every position where HF's top-1 leads its top-2 by at least MARGIN (0.1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from executor_svc.loading import weight_bytes
from executor_svc.model.families import read_config
from executor_svc.model.model_config import UnsupportedConfig
from executor_svc.model.sharding import check_size
from executor_svc.step.runner import NewRequestData, StepPlan
from executor_svc.step.sampler import SamplingSettings
from llmsched.errors import StartupError
from tests.families import CASES, hf_greedy, hf_model, make_checkpoint, prompts
from tests.quantized import (
    MXFP4, NVFP4, NVFP4_ACTIVATIONS, as_modelopt, decompress_compressed_tensors, fake_quantized_hf, write_awq,
    write_compressed_tensors, write_fp8_per_tensor, write_gptq,
)
from tests.unit.test_families_vs_hf import runner_for
from tests.unit.test_fp8_checkpoints import assert_greedy_equal
from tests.unit.test_runner_vs_hf import BLOCK

# Logits of these models are O(1-10) and agree with HF's to ~1e-6 where no
# rounding of an activation flips; but a 1e-6 difference upstream can send
# one FP8 activation (3 mantissa bits) to the next value, 1/8 away, which
# moved a logit lead of 0.094 here. Only a lead this large is owed.
MARGIN = 0.1


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_checkpoint(CASES["llama3"], tmp_path_factory.mktemp("llama"))


def int_args(bits: int, strategy: str, symmetric: bool, group: int | None = None) -> dict:
    return {"num_bits": bits, "type": "int", "strategy": strategy, "symmetric": symmetric} | (
        {"group_size": group} if group else {})




@pytest.mark.parametrize("name, weights", [
    ("w4a16-group32", int_args(4, "group", True, 32)),
    ("w4a16-group32-asymmetric", int_args(4, "group", False, 32)),
    ("w8a16-channel-asymmetric", int_args(8, "channel", False)),
    ("nvfp4a16", NVFP4),
    ("mxfp4a16", MXFP4),
])
def test_compressed_tensors_packed_weights_serve_hfs_greedy_tokens(llama, name, weights, tmp_path):
    path = write_compressed_tensors(llama, tmp_path / name, weights)
    reads_itself = weights["type"] == "int" and weights["symmetric"]
    oracle = path if reads_itself else decompress_compressed_tensors(path, tmp_path / "dense")
    assert_greedy_equal(path, oracle)
    layer = runner_for(str(path)).model.model.layers[0].self_attn.qkv_proj
    bits = weights["num_bits"]
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (layer.out_features, 64 * bits // 8)


@pytest.mark.parametrize("family, weights", [
    ("qwen3-moe", int_args(4, "group", False, 16)),
    ("qwen3-moe", {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [16, 16],
                   "symmetric": True}),
    ("deepseek-v3", int_args(4, "group", True, 8)),  # latent attention's projections too; kv_b read whole
    ("qwen3-moe", NVFP4),
])
def test_moe_and_latent_attention_families_serve_compressed_tensors_at_their_size(family, weights, tmp_path):
    """Experts (each its own quantized gate/up and down), shared experts and
    DeepSeek-V3's latent projections; routers stay plain (ignored)."""
    plain = make_checkpoint(CASES[family], tmp_path / family)
    path = write_compressed_tensors(plain, tmp_path / "q", weights, ignore=("lm_head", "re:.*mlp.gate$"))
    assert_greedy_equal(path, decompress_compressed_tensors(path, tmp_path / "dense"), n=2, steps=12)
    experts = runner_for(str(path)).model.model.layers[1].mlp.experts
    held = experts.per_expert[0].gate_up
    assert experts.packed and (held.weight.dtype == torch.float8_e4m3fn if weights["num_bits"] == 8
                               and weights["type"] == "float" else held.qweight.dtype == torch.uint8)


def test_experts_quantized_unevenly_are_refused_by_name(tmp_path):
    """Targets and ignores name each expert's projections: one expert left
    plain cannot share the fused layer of quantized ones."""
    path = make_checkpoint(CASES["qwen3-moe"], tmp_path / "moe")
    hf = json.loads((path / "config.json").read_text())
    hf["quantization_config"] = CT | {"ignore": ["lm_head", "re:.*mlp.gate$", "re:.*experts[.]0[.]"]}
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedConfig, match=r"mlp.experts: the checkpoint quantizes the projections fused here "
                                                r"differently \(.*plain.*\)"):
        runner_for(str(path))


@pytest.mark.parametrize("bits, group, sym, desc_act", [(4, 32, False, True), (8, 64, True, False)])
def test_gptq_serves_hfs_greedy_tokens_on_its_dequantized_weights(llama, bits, group, sym, desc_act, tmp_path):
    path, dense = write_gptq(llama, tmp_path / "gptq", tmp_path / "dense", bits, group, sym, desc_act)
    assert_greedy_equal(path, dense)


def test_awq_gemm_with_its_interleaved_nibbles_serves_hfs_greedy_tokens(llama, tmp_path):
    path, dense = write_awq(llama, tmp_path / "awq", tmp_path / "dense", group=32)
    assert_greedy_equal(path, dense)


def as_legacy_file(path: Path, file: str, names: dict[str, str], **values) -> dict:
    """Moves config.json's quantization_config into `file` under AutoGPTQ's
    or AutoAWQ's own key names, without quant_method, as they wrote it."""
    hf = json.loads((path / "config.json").read_text())
    config = {names.get(k, k): v for k, v in hf.pop("quantization_config").items() if k != "quant_method"} | values
    (path / "config.json").write_text(json.dumps(hf))
    (path / file).write_text(json.dumps(config))
    return config


def test_autogptq_and_autoawq_files_serve_where_config_json_has_no_quantization_config(llama, tmp_path):
    gptq, dense = write_gptq(llama, tmp_path / "gptq", tmp_path / "dense", 4, 32, True, False)
    as_legacy_file(gptq, "quantize_config.json", {})
    assert_greedy_equal(gptq, dense, n=2, steps=8)
    awq, dense = write_awq(llama, tmp_path / "awq", tmp_path / "awq-dense", group=32)
    config = as_legacy_file(awq, "quant_config.json", {"bits": "w_bit", "group_size": "q_group_size"}, version="GEMM")
    assert config["w_bit"] == 4 and config["q_group_size"] == 32
    assert_greedy_equal(awq, dense, n=2, steps=8)
    (gptq / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32, "static_groups": True}))
    with pytest.raises(UnsupportedConfig, match=r"^llama quantize_config.json static_groups=true is not supported"):
        runner_for(str(gptq))


def test_per_tensor_fp8_serves_hfs_greedy_tokens_on_its_dequantized_weights(llama, tmp_path):
    path, dense = write_fp8_per_tensor(llama, tmp_path / "fp8", tmp_path / "dense")
    assert_greedy_equal(path, dense, steps=10)  # HF's 11th step on prompt 2 is a near tie


def test_w4a16_holds_half_a_byte_per_weight_and_its_group_scales(llama, tmp_path):
    path = write_compressed_tensors(llama, tmp_path / "w4", int_args(4, "group", True, 32))
    plain, packed = runner_for(str(llama)).model, runner_for(str(path)).model
    linears = sum(p.numel() for n, p in plain.named_parameters() if "proj" in n)
    # Per weight: half a byte, plus per group of 32 a float32 scale and a zero point.
    assert weight_bytes(plain) - weight_bytes(packed) == pytest.approx(linears * (4 - 0.5 - 5 / 32))


def test_a_tensor_parallel_size_that_cuts_a_group_is_refused_naming_the_sizes_that_work(llama):
    hf = json.loads((llama / "config.json").read_text())
    cfg = read_config(hf | {"quantization_config": CT | group(weights=int_args(4, "group", True, 64))})
    with pytest.raises(StartupError, match=r"blocks or groups of 64 \(o columns per rank: 32\).*sizes that work: 1$"):
        check_size(cfg, 2)
    check_size(read_config(hf | {"quantization_config": CT | group(weights=int_args(4, "group", True, 32))}), 2)
    # Act-order keeps every group on every rank: nothing to cut.
    check_size(read_config(hf | {"quantization_config": GPTQ | {"group_size": 64, "desc_act": True}}), 2)


def teacher_forced_top1(path: str, oracle: str | torch.nn.Module, n: int = 6,
                        steps: int = 20) -> tuple[float, list[str]]:
    """Our top-1 after every prefix of HF's greedy sequences against HF's
    logits on the whole sequence: (the share that agrees, the positions
    that disagree although HF's lead there is at least MARGIN). `oracle`:
    a checkpoint HF loads, or an HF model."""
    runner = runner_for(path)
    model = hf_model(oracle) if isinstance(oracle, str) else oracle
    settings = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=1)
    agree, total, owed, handle = 0, 0, [], 0
    for prompt in prompts(n):
        if isinstance(oracle, str):
            seq = prompt + hf_greedy(oracle, prompt, steps).tokens
        else:
            with torch.no_grad():
                seq = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=0,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0].float()
        # Every prefix writes the same keys and values at the same
        # positions (attention is causal), so they share one block table.
        plan, blocks, previous = StepPlan(handle), list(range(-(-len(seq) // BLOCK))), list(range(handle))
        for end in range(len(prompt), len(seq) + 1):
            plan.new_requests.append(NewRequestData(handle, seq[:end], blocks, 0, end, settings, 0))
            handle += 1
        plan.finished_handles = previous
        out = runner.execute(plan)
        for req, got in zip(plan.new_requests, out.sampled_token_ids):
            top2 = logits[len(req.token_ids) - 1].topk(2)
            total += 1
            agree += got == int(top2.indices[0])
            if got != int(top2.indices[0]):
                print(f"  differs where HF leads by {float(top2.values[0] - top2.values[1]):.4f}")
            if got != int(top2.indices[0]) and float(top2.values[0] - top2.values[1]) >= MARGIN:
                owed.append(f"position {len(req.token_ids)}: ours {got}, HF {int(top2.indices[0])} leading by "
                            f"{float(top2.values[0] - top2.values[1]):.3f}")
    return agree / total, owed


@pytest.mark.parametrize("name, weights, activations", [
    ("fp8-dynamic-per-channel", {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
     {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}),
    # Blocks of 48 x 40 leave edge tiles on every weight; activations per group of 32.
    ("fp8-blocks-with-edges", {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [48, 40],
                               "symmetric": True},
     {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "dynamic": True, "symmetric": True}),
    ("int8-w8a8", int_args(8, "channel", True),
     {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}),
    # llm-compressor's "FP8": per-tensor weights and calibrated per-tensor input scales; q, k and v keep theirs.
    ("fp8-static", {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
     {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}),
])
def test_activation_quantized_formats_agree_with_compressed_tensors_fake_quantized_forward(
        llama, name, weights, activations, tmp_path):
    path = str(write_compressed_tensors(llama, tmp_path / name, weights, activations))
    share, owed = teacher_forced_top1(path, path)
    print(f"{name}: top-1 agrees with compressed-tensors' forward on {share:.1%} of positions")
    assert share >= 0.99 and not owed, f"{share:.1%} agree; {owed}"



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_activations_round_as_compressed_tensors_does_bit_for_bit(dtype):
    """Groups at several magnitudes, an all-zero group, groups whose FP8
    scale underflows to zero, and values on E2M1's midpoints (round half
    to even)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from executor_svc.model.quantization import fake_quantize_nvfp4

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 128, generator=g) * torch.logspace(-6, 2, 8)[:, None]
    x[0, :16] = 0
    x[1, 16:32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * torch.tensor([1.0, -1.0]).repeat(8)
    x = x.to(dtype)
    args = QuantizationArgs(**NVFP4_ACTIVATIONS)
    # 448: the scale of a group whose amax is 6 is exactly 1, so the midpoints stay midpoints.
    for global_scale in (torch.tensor([448.0]), torch.tensor([3.7e4])):
        scale, zero = compute_dynamic_scales_and_zp(x, args, None, global_scale=global_scale)
        want = fake_quantize(x, scale, zero, args, global_scale=global_scale)
        assert torch.equal(fake_quantize_nvfp4(x, global_scale), want)


@pytest.mark.parametrize("family", ["llama3", "qwen3-moe"])
def test_nvfp4_w4a4_agrees_with_compressed_tensors_fake_quantized_forward(llama, family, tmp_path):
    """NVFP4 activations, quantized at run time per group of 16 against
    each layer's input_global_scale (q, k and v each their own); experts
    through their own linears."""
    plain = llama if family == "llama3" else make_checkpoint(CASES[family], tmp_path / family)
    path = write_compressed_tensors(plain, tmp_path / "w4a4", NVFP4, NVFP4_ACTIVATIONS,
                                    ignore=("lm_head", "re:.*mlp.gate$"))
    oracle = fake_quantized_hf(path, decompress_compressed_tensors(path, tmp_path / "dense"))
    share, owed = teacher_forced_top1(str(path), oracle)
    print(f"nvfp4 w4a4 {family}: top-1 agrees with compressed-tensors' forward on {share:.1%} of positions")
    assert share >= 0.99 and not owed, f"{share:.1%} agree; {owed}"
    layer = runner_for(str(path)).model.model.layers[0].self_attn.qkv_proj
    assert layer.scheme.activations.describe() == "nvfp4 per group 16 over a static global scale"
    assert layer.input_global_scale.shape == (3,) and bool((layer.input_global_scale > 0).all())


FP8_STATIC = ({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
              {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True})
FP8_PER_CHANNEL_PER_TOKEN = ({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                             {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                              "symmetric": True})


@pytest.mark.parametrize("algo, family, scheme, in_config_json", [
    ("FP8", "llama3", FP8_STATIC, False),
    ("FP8_PER_CHANNEL_PER_TOKEN", "llama3", FP8_PER_CHANNEL_PER_TOKEN, True),
    ("NVFP4", "qwen3-moe", (NVFP4, NVFP4_ACTIVATIONS), True),  # experts through their own linears
    ("NVFP4", "llama3", (NVFP4, NVFP4_ACTIVATIONS), False),
])
def test_modelopt_exports_agree_with_compressed_tensors_fake_quantized_forward(
        llama, algo, family, scheme, in_config_json, tmp_path):
    """NVIDIA ModelOpt's FP8, FP8_PER_CHANNEL_PER_TOKEN and NVFP4 (W4A4)
    exports, made from compressed-tensors checkpoints of the same schemes
    (tests/quantized.as_modelopt: NVFP4's global scales inverted), with
    their config in hf_quant_config.json or config.json, and an FP8 KV
    cache's scales under ModelOpt's names. Oracle and tolerance as for the
    compressed-tensors checkpoints above."""
    plain = llama if family == "llama3" else make_checkpoint(CASES[family], tmp_path / family)
    ct = write_compressed_tensors(plain, tmp_path / "ct", *scheme, ignore=("lm_head", "re:.*mlp.gate$"))
    path = as_modelopt(ct, tmp_path / "modelopt", algo, in_config_json, kv_scales=(0.5, 0.25))
    oracle = fake_quantized_hf(ct, decompress_compressed_tensors(ct, tmp_path / "dense")) if algo == "NVFP4" \
        else str(ct)
    share, owed = teacher_forced_top1(str(path), oracle)
    print(f"modelopt {algo} {family}: top-1 agrees with compressed-tensors' forward on {share:.1%} of positions")
    assert share >= 0.99 and not owed, f"{share:.1%} agree; {owed}"
    attention = runner_for(str(path)).model.model.layers[0].self_attn
    assert (attention.k_scale, attention.v_scale) == (0.5, 0.25), "ModelOpt's k_proj.k_scale / v_proj.v_scale"
    if algo == "NVFP4":
        want = "nvfp4, activations nvfp4 per group 16 over a static global scale"
        assert attention.qkv_proj.scheme.describe() == want


CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": int_args(4, "group", True, 128)}},
      "ignore": ["lm_head"], "version": "0.20.1", "transform_config": {}, "sparsity_config": None}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "damp_percent": 0.01, "true_sequential": True}


# Qwen2.5-*-GPTQ-Int4's quantization_config, verbatim (optimum's writer).
QWEN_GPTQ = {"batch_size": 1, "bits": 4, "block_name_to_quantize": None, "cache_block_outputs": True,
             "damp_percent": 0.01, "dataset": None, "desc_act": False, "exllama_config": {"version": 1},
             "group_size": 128, "max_input_length": None, "model_seqlen": None,
             "module_name_preceding_first_block": None, "modules_in_block_to_quantize": None, "pad_token_id": None,
             "quant_method": "gptq", "sym": True, "tokenizer": None, "true_sequential": True, "use_cuda_fp16": False,
             "use_exllama": True}
# GPTQModel's quantize_config (2.x: the records under meta).
GPTQMODEL = {"bits": 4, "dynamic": None, "group_size": 128, "desc_act": True, "sym": True, "lm_head": False,
             "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32",
             "meta": {"quantizer": ["gptqmodel:2.2.0"], "damp_percent": 0.01, "static_groups": False}}


def group(**change) -> dict:
    return {"config_groups": {"group_0": CT["config_groups"]["group_0"] | change}}


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes"}, r"quant_method='bitsandbytes' is not supported; supported: 'fp8', "
                                       r"'compressed-tensors', 'gptq', 'awq'"),
    (CT | {"format": "marlin-24"}, r"format='marlin-24' is not supported; supported: "),
    (CT | {"format": "mxfp4-pack-quantized"} | group(weights=MXFP4, input_activations=MXFP4 | {"dynamic": True}),
     r"input_activations \(num_bits, type, strategy, group_size, dynamic, symmetric\)=\(4, 'float', 'group', 32, "
     r"True, True\) is not supported with format 'mxfp4-pack-quantized'; FP4 activations are supported as NVFP4"),
    (CT | {"format": "nvfp4-pack-quantized"} | group(weights=NVFP4, input_activations=NVFP4_ACTIVATIONS
                                                     | {"scale_dtype": "torch.bfloat16"}),
     r"input_activations scale_dtype='torch.bfloat16' is not supported; NVFP4 activation group scales are FP8"),
    (CT | {"format": "mxfp4-pack-quantized"} | group(weights=MXFP4 | {"group_size": 16}),
     r"is not supported for format 'mxfp4-pack-quantized'; supported: \(4, 'float', 32, True\)"),
    (CT | group(weights=int_args(4, "tensor_group", True, 16)), r"strategy='tensor_group' is not supported"),
    (CT | group(weights=int_args(2, "group", True, 128)), r"num_bits=2 is not supported; supported: 4, 8"),
    (CT | group(input_activations={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}),
     r"static activation scales by 'token' are not supported"),
    (CT | group(input_activations={"num_bits": 8, "type": "float", "strategy": "group", "dynamic": "local"}),
     r"dynamic='local' is not supported"),
    (CT | {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False}},
     r"kv_cache_scheme \(num_bits, type, strategy, dynamic, symmetric\)=\(8, 'float', 'attn_head', False, True\) "
     r"is not supported"),
    (CT | {"transform_config": {"config_groups": {"u": {}}}}, r"transform_config is not supported"),
    (CT | {"quantization_status": "frozen"}, r"quantization_status='frozen' is not supported"),
    (GPTQ | {"bits": 3}, r"bits=3 is not supported; supported: \[4, 8\]"),
    (GPTQ | {"checkpoint_format": "gptq_v2"}, r"checkpoint_format='gptq_v2' is not supported"),
    (GPTQ | {"format": "gptq_v2"}, r"format='gptq_v2' is not supported"),
    (GPTQ | {"pack_dtype": "int16"}, r"pack_dtype='int16' is not supported"),
    (GPTQ | {"group_size": 0}, r"group_size=0 must be positive, or -1"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"version='gemv' is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "format": "gemv_fast", "version": "gemv_fast"},
     r"version='gemv_fast' is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "desc_act": True},
     r"desc_act=true is not supported for AWQ"),
    (GPTQMODEL | {"dynamic": {"-:.*down_proj": {}}}, r"dynamic=\{'-:.\*down_proj': \{\}\} \(per-module overrides\) is "
                                                     r"not supported; supported: absent, null or empty"),
    (GPTQMODEL | {"adapter": {"name": "eora", "rank": 64}}, r"adapter=.* \(an adapter\) is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"},
     r"expert_dtype='fp4' is not supported; supported: 'fp8'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_convert": ["model.embed_tokens"]},
     r"modules_to_convert=\['model.embed_tokens'\] \(FP8 embedding tables\) is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "scale_fmt": "e4m3"}, r"scale_fmt='e4m3' is not"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"},
     r"quant_algo='W4A8_AWQ' is not supported; supported: \['FP8', 'FP8_PER_CHANNEL_PER_TOKEN', 'NVFP4'\]"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}},
     r"kv_cache_quant_algo='NVFP4' is not supported; supported: absent or 'FP8'"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": {"num_bits": 8, "type": "float",
                                                                           "strategy": "attn_head"}},
     r"kv_cache_scheme=.* is not supported; supported: FP8 with static scales per tensor"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32},
     r"group_size=32 is not supported for NVFP4; supported: 16"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "pre_quant_scale": True}},
     r"quantization keys \['pre_quant_scale'\] are not implemented for quant_method 'modelopt'"),
    # config_groups that say another scheme than quant_algo (here W4A16 weights under NVFP4).
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "group_size": 128}}}},
     r"config_groups.group_0.weights \(num_bits, type, group_size\)=\(4, 'int', 128\) disagrees with "
     r"quant_algo 'NVFP4', which is \(4, 'float', 16\)"),
])
def test_quantization_configs_that_change_the_math_are_refused_by_name(llama, config, message):
    hf = json.loads((llama / "config.json").read_text())
    with pytest.raises(UnsupportedConfig, match=message):
        read_config(hf | {"quantization_config": config})


@pytest.mark.parametrize("config, described", [
    (CT, "compressed-tensors: int4 group 128"),
    # Its per-layer k_scale / v_scale serve an FP8 KV cache (tests/unit/test_fp8_kv_cache.py).
    (CT | {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                               "symmetric": True}}, "compressed-tensors: int4 group 128"),
    (GPTQ | {"desc_act": True, "sym": False, "model_name_or_path": None}, "gptq: int4 group 128 asymmetric act-order"),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "GEMM"},
     "awq: int4 group 64 asymmetric"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8 per channel"),
    # hf_quant_config.json's shape, as nvidia's -FP8 releases ship it.
    ({"quant_method": "modelopt", "producer": {"name": "modelopt", "version": "0.19.0"},
      "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}},
     "modelopt: fp8 per channel, activations fp8 per tensor, static"),
])
def test_keys_that_only_record_how_a_checkpoint_was_made_are_accepted(llama, config, described):
    hf = json.loads((llama / "config.json").read_text())
    assert read_config(hf | {"quantization_config": config}).quantization.describe() == described


def test_gptq_modules_in_block_to_quantize_leaves_the_linears_it_does_not_name_plain(llama):
    hf = json.loads((llama / "config.json").read_text())
    listed = [["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    spec = read_config(hf | {"quantization_config": GPTQ | {"modules_in_block_to_quantize": listed}}).quantization
    assert spec.scheme_for("model.layers.0.self_attn.q_proj") is None
    assert spec.scheme_for("model.layers.1.mlp.down_proj").describe() == "int4 group 128"
    assert spec.scheme_for("model.layers.1.mlp.xdown_proj") is None
    assert read_config(hf | {"quantization_config": GPTQ | {"modules_in_block_to_quantize": None}}).quantization \
        .scheme_for("model.layers.0.self_attn.q_proj") is not None


def test_modelopt_exclude_modules_are_shell_wildcards_over_whole_module_names(llama):
    hf = json.loads((llama / "config.json").read_text())
    spec = read_config(hf | {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": [
        "lm_head", "model.layers.0.mlp*", "*self_attn.o_proj"]}}).quantization
    assert spec.scheme_for("model.layers.0.mlp.down_proj") is None
    assert spec.scheme_for("model.layers.1.self_attn.o_proj") is None
    assert spec.scheme_for("model.layers.1.mlp.down_proj").describe().startswith("nvfp4")
    assert spec.scheme_for("model.layers.0.self_attn.q_proj") is not None


def test_quantization_configs_as_transformers_and_the_quantizers_write_them_are_read(llama):
    """Every key transformers 5's GPTQConfig, AwqConfig (a GPTQConfig, with
    `format` beside `version`) and FineGrainedFP8Config write, at their
    defaults, as a config.json holds them."""
    from transformers import AwqConfig, FineGrainedFP8Config, GPTQConfig

    hf = json.loads((llama / "config.json").read_text())
    for config, described in [
        (GPTQConfig(bits=4, group_size=128).to_dict(), "gptq: int4 group 128"),
        (AwqConfig(bits=4, group_size=64).to_dict(), "awq: int4 group 64 asymmetric"),
        (FineGrainedFP8Config(weight_block_size=(32, 32)).to_dict(), "fp8 blocks [32, 32]"),
        (QWEN_GPTQ, "gptq: int4 group 128"),
        (GPTQMODEL, "gptq: int4 group 128 act-order"),
    ]:
        config = json.loads(json.dumps(config))
        assert read_config(hf | {"quantization_config": config}).quantization.describe() == described, config
