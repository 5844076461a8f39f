"""Integer-quantized linears on torch's CPU kernels (executor_svc/model/cpu_int_linear.py).

Checkpoints are written by compressed-tensors itself, and GPTQ and AWQ by
hand in their documented layouts (tests/quantized.py), from the tiny random
Llama of tests/families.py, and served in bfloat16 (the kernels' dtype).

Oracles:
- per layer: each moved layer's output against the same weights
  dequantized in float32 (the layout's definition) on float32 inputs,
  within twice the error of the dequantizing bf16 path it replaces, at
  1, 5 and 40 rows (int8 switches path past 16 rows);
- end to end: HF's bf16 forward on the same checkpoint (or on its
  dequantized weights, where transformers cannot read it), teacher-forced
  on HF's greedy tokens: top-1 agrees everywhere HF's lead is at least
  MARGIN, and on at least 95% of positions (bf16 rounds differently in
  each GEMM, and random tiny models have near-ties).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.attention import make_backend
from executor_svc.loading import weight_bytes
from executor_svc.model.checkpoint import load_checkpoint
from executor_svc.model.cpu_int_linear import CPU_INT8_KERNEL_MAX_ROWS, Int4Groups, Int8Rows, use_cpu_int_kernels
from executor_svc.model.families import build_model, read_config
from executor_svc.model.layers import _Linear
from executor_svc.step.kv_cache import KVCachePool
from executor_svc.step.runner import ModelRunner, NewRequestData, StepPlan
from executor_svc.step.sampler import SamplingSettings
from llmsched_kernels.reference import dequantize_int
from tests.families import CASES, hf_greedy, make_checkpoint, prompts
from tests.quantized import decompress_compressed_tensors, write_awq, write_compressed_tensors, write_gptq
from tests.unit.test_runner_vs_hf import BLOCK, generate

BF16 = torch.bfloat16
MARGIN = 0.1


def int_args(bits: int, strategy: str, symmetric: bool, group: int | None = None) -> dict:
    return {"num_bits": bits, "type": "int", "strategy": strategy, "symmetric": symmetric} | (
        {"group_size": group} if group else {})


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_checkpoint(CASES["llama3"], tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def checkpoints(llama, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (checkpoint, the oracle HF reads: itself or its dequantized weights)."""
    d = tmp_path_factory.mktemp("q")
    out = {}
    for name, weights in {"ct-w4a16-group32": int_args(4, "group", True, 32),
                          "ct-w4a16-group32-asymmetric": int_args(4, "group", False, 32),
                          "ct-w4a16-channel": int_args(4, "channel", True),
                          "ct-w8a16-channel": int_args(8, "channel", True)}.items():
        path = write_compressed_tensors(llama, d / name, weights)
        oracle = path if weights["symmetric"] else decompress_compressed_tensors(path, d / f"{name}-dense")
        out[name] = (path, oracle)
    out["gptq-int4-group64"] = write_gptq(llama, d / "gptq", d / "gptq-dense", 4, 64, False, False)
    out["awq-group32"] = write_awq(llama, d / "awq", d / "awq-dense", group=32)
    return out


def build(path: Path, dtype: torch.dtype = BF16, kernels: bool = True):
    ckpt = load_checkpoint(str(path))
    cfg = read_config(ckpt.hf_config)
    model = build_model(cfg, ckpt.lazy_tensors(), 256, torch.device("cpu"), dtype)
    if kernels:
        use_cpu_int_kernels(model, dtype)
    return cfg, model


def int_layers(model) -> list[tuple[str, _Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _Linear) and m.scheme is not None]


@pytest.mark.parametrize("name, form", [
    ("ct-w4a16-group32", Int4Groups), ("ct-w4a16-group32-asymmetric", Int4Groups), ("ct-w4a16-channel", Int4Groups),
    ("ct-w8a16-channel", Int8Rows), ("gptq-int4-group64", Int4Groups), ("awq-group32", Int4Groups),
])
def test_every_integer_layer_moves_onto_a_kernel_and_computes_its_dequantized_weights(checkpoints, name, form):
    path, _ = checkpoints[name]
    _, plain = build(path, kernels=False)
    _, moved = build(path)
    layers = dict(int_layers(plain))
    assert len(layers) == 8  # qkv, o, gate_up, down in each of 2 layers
    g = torch.Generator().manual_seed(0)
    for layer_name, layer in int_layers(moved):
        assert isinstance(layer.cpu_int, form), f"{layer_name}: {type(layer.cpu_int).__name__}"
        assert not hasattr(layer, "qweight"), f"{layer_name} kept the dequantizing form too"
        ref = layers[layer_name]
        w = dequantize_int(ref.qweight, ref.scales, ref.zeros, ref.scheme.group_size or ref.in_cols, ref.scheme.bits,
                           None, ref.in_cols, torch.float32)
        for rows in (1, 5, CPU_INT8_KERNEL_MAX_ROWS + 24):
            x = torch.randn(rows, ref.in_cols, generator=g).to(BF16)
            exact = x.float() @ w.t()
            with torch.no_grad():
                got, before = layer(x).float(), ref(x).float()
            err, err_before = (got - exact).abs().max().item(), (before - exact).abs().max().item()
            scale = exact.abs().max().item()
            assert err <= 2 * err_before + 1e-3 * scale, (
                f"{layer_name}, {rows} rows: off by {err:.3g} (dequantizing path {err_before:.3g}, outputs up to "
                f"{scale:.3g})")
        dense = layer.dense_weight(torch.float32)
        assert (dense - w).abs().max().item() <= 0.01 * w.abs().max().item(), f"{layer_name}: dense_weight"


def test_moe_experts_quantized_linears_move_onto_the_kernel_with_the_same_outputs(tmp_path):
    """Qwen3-MoE: each expert's own quantized gate_up and down (the torch
    loop's per-expert layers) and the attention's move, compute what the
    dequantizing path does, and the model serves steps on them."""
    plain = make_checkpoint(CASES["qwen3-moe"], tmp_path / "moe")
    path = write_compressed_tensors(plain, tmp_path / "q", int_args(4, "group", False, 32),
                                    ignore=("lm_head", "re:.*mlp.gate$"))
    _, before = build(path, kernels=False)
    cfg, after = build(path)
    moved = [n for n, m in int_layers(after) if m.cpu_int is not None]
    assert len(moved) == len(int_layers(after)) and any(".experts." in n for n in moved), moved
    dequantizing = dict(int_layers(before))
    g = torch.Generator().manual_seed(1)
    for name, layer in int_layers(after):
        x = torch.randn(3, layer.in_cols, generator=g).to(BF16)
        with torch.no_grad():
            got, want = layer(x).float(), dequantizing[name](x).float()
        assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item() + 1e-3, name
    runner = ModelRunner(after, KVCachePool(cfg, 128, BLOCK, torch.device("cpu"), BF16), make_backend("torch"),
                         torch.device("cpu"))
    greedy = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=0)
    out = runner.execute(StepPlan(0, new_requests=[NewRequestData(1, prompts(1)[0], [0, 1], 0, 5, greedy, 0)]))
    assert out.error is None and len(out.sampled_token_ids) == 1


def test_weights_stay_at_their_quantized_size_on_the_kernels(checkpoints):
    for name in ("ct-w4a16-group32", "ct-w8a16-channel"):
        path, _ = checkpoints[name]
        before, after = weight_bytes(build(path, kernels=False)[1]), weight_bytes(build(path)[1])
        assert after <= before, f"{name}: {after} bytes on the kernels, {before} before"


def test_layers_that_fit_no_kernel_keep_dequantizing_and_say_why(checkpoints, llama, tmp_path, caplog):
    asym8 = write_compressed_tensors(llama, tmp_path / "w8-asym", int_args(8, "channel", False))
    act_order, _ = write_gptq(llama, tmp_path / "gptq-act", tmp_path / "gptq-act-dense", 4, 32, False, True)
    grouped8, _ = write_gptq(llama, tmp_path / "gptq8", tmp_path / "gptq8-dense", 8, 32, True, False)
    cases = [(asym8, BF16, "asymmetric int8 zero points"), (act_order, BF16, "act-order"),
             (grouped8, BF16, "8-bit groups of 32 columns"),
             (checkpoints["ct-w4a16-group32"][0], torch.float32, "compute dtype torch.float32")]
    for path, dtype, why in cases:
        caplog.clear()
        with caplog.at_level("INFO", logger="executor_svc.model.cpu_int_linear"):
            _, model = build(path, dtype)
        assert all(m.cpu_int is None and hasattr(m, "qweight") for _, m in int_layers(model)), path.name
        assert f"0 of 8 integer layers on torch's int8/int4 kernels; 8 not: {why}" in caplog.text, caplog.text
    _, model = build(checkpoints["ct-w4a16-group32"][0], BF16, kernels=False)
    assert use_cpu_int_kernels(model, BF16, "off") == 0 and use_cpu_int_kernels(model, BF16, "auto", True) == 0


def teacher_forced(path: Path, oracle: Path, n: int = 4, steps: int = 16) -> tuple[int, int, list[str]]:
    """Our bf16 top-1 after every prefix of HF's greedy sequences against
    HF's bf16 logits: (agreeing, total, positions owed that disagree)."""
    import transformers

    cfg, model = build(path)
    runner = ModelRunner(model, KVCachePool(cfg, 128, BLOCK, torch.device("cpu"), BF16), make_backend("torch"),
                         torch.device("cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(oracle), dtype=BF16).eval()
    settings = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=0)
    agree = total = handle = 0
    owed = []
    for prompt in prompts(n):
        seq = prompt + hf_greedy(str(oracle), prompt, steps).tokens
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0].float()
        plan, blocks = StepPlan(handle, finished_handles=list(range(handle))), list(range(-(-len(seq) // BLOCK)))
        for end in range(len(prompt), len(seq) + 1):
            plan.new_requests.append(NewRequestData(handle, seq[:end], blocks, 0, end, settings, 0))
            handle += 1
        out = runner.execute(plan)
        for req, got in zip(plan.new_requests, out.sampled_token_ids):
            top2 = logits[len(req.token_ids) - 1].topk(2)
            lead, want = float(top2.values[0] - top2.values[1]), int(top2.indices[0])
            total += 1
            agree += got == want
            if got != want and lead >= MARGIN:
                owed.append(f"position {len(req.token_ids)}: ours {got}, HF {want} leading by {lead:.3f}")
    return agree, total, owed


@pytest.mark.parametrize("name", ["ct-w4a16-group32-asymmetric", "ct-w8a16-channel", "gptq-int4-group64"])
def test_bf16_serving_on_the_kernels_agrees_with_hfs_bf16_forward(checkpoints, name):
    path, oracle = checkpoints[name]
    agree, total, owed = teacher_forced(path, oracle)
    print(f"{name}: top-1 agrees with HF's bf16 forward on {agree} of {total} positions")
    assert agree >= 0.95 * total and not owed, f"{agree}/{total} agree; {owed}"


def test_int4_is_converted_in_place_a_few_row_blocks_at_a_time_as_one_conversion_would(monkeypatch):
    """336 rows (21 blocks of 16: the last of torch's 32- or 64-row blocks
    is partial), converted 64 rows at a time over the checkpoint's bytes."""
    from types import SimpleNamespace

    from executor_svc.model import cpu_int_linear
    from executor_svc.model.model_config import LinearScheme

    monkeypatch.setattr(cpu_int_linear, "PACK_ROWS", 64)
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (336, 128), generator=g, dtype=torch.uint8)
    qweight = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()  # our layout: column 2j low nibble, 2j + 1 high
    layer = SimpleNamespace(scheme=LinearScheme("int", "ct-pack", bits=4, group_size=32), in_cols=128,
                            qweight=torch.nn.Parameter(qweight, requires_grad=False), g_idx=None,
                            scales=torch.rand(336, 4, generator=g), zeros=torch.full((336, 4), 8, dtype=torch.uint8))
    storage = layer.qweight.data_ptr()
    held = cpu_int_linear.pack(layer, BF16)
    assert held.packed.data_ptr() == storage, "converted into a new buffer, not over the checkpoint's bytes"
    assert torch.equal(held.packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))


def test_compiled_layerwise_decode_reads_each_layers_own_kernel_weights(checkpoints, monkeypatch):
    """Layers of one kind share one compiled graph, called with each
    layer's tensors (compiled_decode._module_tensors). The int kernels'
    weights live in a dataclass beside the layer's parameters; left out,
    every layer ran the first one's weights, the start-up check caught it,
    and int checkpoints never decoded compiled."""
    from executor_svc.step import compiled_decode
    from executor_svc.step.compiled_decode import STEPS

    monkeypatch.setattr(compiled_decode, "LAYERWISE_HIDDEN", 0)
    path, _ = checkpoints["ct-w4a16-group32"]
    cfg, model = build(path)
    runners = [ModelRunner(model, KVCachePool(cfg, 64, BLOCK, torch.device("cpu"), BF16), make_backend("torch"),
                           torch.device("cpu"), torch_compile=compile) for compile in (True, False)]
    try:
        assert runners[0].compiled is not None and runners[0].compiled.layerwise, "the warm-up's check failed"
        assert len({id(direct) for direct, *_ in runners[0].compiled._layer_calls}) == 1, "one graph for both layers"
        before = STEPS._value.get()
        got = [generate(runner, prompts(2, min_len=5, max_len=12), 6, chunk=16) for runner in runners]
        assert STEPS._value.get() - before > 0, "no decode step ran compiled"
    finally:
        torch._dynamo.reset()
    assert got[0] == got[1], "compiled decode steps part from eager ones"


def test_compiled_graphs_call_the_int8_operator_which_chooses_by_rows_as_eager_steps_do():
    """A compiled decode graph calls llmsched::cpu_int8_linear rather than
    tracing Int8Rows.linear, whose dequantize + GEMM past the kernel's rows
    inductor compiled slower than eager; the operator gives the eager
    result at the kernel's row counts and past them."""
    g = torch.Generator().manual_seed(5)
    held = Int8Rows(torch.randint(-128, 128, (48, 64), generator=g, dtype=torch.int8),
                    (torch.rand(48, generator=g) / 64).to(BF16))
    for rows in (3, CPU_INT8_KERNEL_MAX_ROWS + 24):
        x = torch.randn(rows, 64, generator=g).to(BF16)
        assert torch.equal(torch.ops.llmsched.cpu_int8_linear(x, held.weight, held.scales), held.linear(x)), rows
    graphs = []

    def capture(gm, _):
        graphs.append(str(gm.graph))
        return gm.forward

    x = torch.randn(2, 3, 64, generator=g).to(BF16)
    try:
        got = torch.compile(held.linear, backend=capture, fullgraph=True)(x)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, held.linear(x))
    assert "cpu_int8_linear" in graphs[0] and "_weight_int8pack_mm" not in graphs[0], graphs[0]
