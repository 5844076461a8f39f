"""Quantized checkpoints written by hand in their documented layouts, from
the tiny random checkpoints of tests/families.py.

FP8 with block scales (quant_method "fp8", weight_block_size; DeepSeek-V3's
and Qwen3-FP8's layout): each decoder linear weight in float8_e4m3fn, with
one float32 `weight_scale_inv` per block of rows x columns, blocks at the
edges included. GPTQ and AWQ likewise, by hand; compressed-tensors
checkpoints are written by the compressed-tensors package itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
# Decoder linears (experts and shared experts included; latent attention's
# too); routers, norms, embeddings and the head stay as they are.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
           "kv_a_proj_with_mqa", "kv_b_proj", "w1", "w2", "w3")
# compressed-tensors' FP4 weight schemes (QuantizationArgs), and NVFP4's
# activations in its NVFP4 preset (W4A4): group scales in FP8 over a global
# scale calibrated on a few sequences.
NVFP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
NVFP4_ACTIVATIONS = NVFP4 | {"dynamic": "local", "scale_dtype": "torch.float8_e4m3fn"}
MXFP4 = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
         "scale_dtype": "torch.uint8"}


def quantize(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout's definition: per block, scale = amax / 448 and q = w / scale in e4m3."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=FP8)
    scale = torch.empty(-(-rows // bn), -(-cols // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = block.abs().max().clamp(min=1e-12) / 448.0
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (block / s).to(FP8)
            scale[i, j] = s
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """The layout's definition the other way: each block times its scale (edge blocks cropped)."""
    rows, cols = q.shape
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:rows, :cols]
    return q.to(torch.float32) * full


def write_fp8(plain: Path, out: Path, block: tuple[int, int], **config) -> Path:
    """`plain` (a bf16/fp32 checkpoint) with every decoder linear in FP8 blocks."""
    shutil.copytree(plain, out)
    tensors = {}
    for f in plain.glob("*.safetensors"):
        tensors.update(load_file(f))
        (out / f.name).unlink()
    quantized = {}
    for name, t in tensors.items():
        if any(f".{p}.weight" in name for p in LINEARS):
            q, s = quantize(t.float(), *block)
            quantized[name], quantized[name.replace(".weight", ".weight_scale_inv")] = q, s
        else:
            quantized[name] = t
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)} | config
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def write_dequantized(fp8: Path, out: Path, block: tuple[int, int]) -> Path:
    """The FP8 checkpoint's weights dequantized to fp32 by the definition, as a plain checkpoint."""
    shutil.copytree(fp8, out)
    tensors = load_file(fp8 / "model.safetensors")
    plain = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = tensors.get(name.replace(".weight", ".weight_scale_inv"))
        plain[name] = dequantize(t, scale, *block) if scale is not None else t
    save_file(plain, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


# -- compressed-tensors, written by the compressed-tensors package ---------

def _copy_side_files(plain: Path, out: Path) -> None:
    for f in plain.glob("*.json"):
        if f.name != "config.json" and not (out / f.name).exists():
            shutil.copy(f, out / f.name)


def _qparams(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Scale, zero point and (NVFP4's tensor_group) global scale of w from
    its min and max, per the scheme's strategy (compressed-tensors' README
    recipe)."""
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    if args.strategy == "tensor_group":
        global_scale = generate_gparam(w.amin().reshape(1), w.amax().reshape(1))
        groups = w.unflatten(-1, (-1, args.group_size))
        return (*calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=global_scale),
                global_scale)
    if args.strategy == "group":
        w = w.unflatten(-1, (-1, args.group_size))
        low, high = w.amin(-1), w.amax(-1)
    elif args.strategy == "channel":
        low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif args.strategy == "block":
        bh, bw = args.block_structure
        padded = torch.nn.functional.pad(w, (0, -w.shape[1] % bw, 0, -w.shape[0] % bh))
        blocks = padded.unflatten(0, (-1, bh)).unflatten(-1, (-1, bw))
        low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
    else:
        low, high = torch.aminmax(w)
    return (*calculate_qparams(low, high, args), None)


def _input_ranges(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each linear's input min and max over a few token sequences: the
    calibration a static activation scale comes from."""
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(name):
        def hook(module, args):
            low, high = args[0].amin().reshape(1), args[0].amax().reshape(1)
            if name in ranges:
                low, high = torch.minimum(low, ranges[name][0]), torch.maximum(high, ranges[name][1])
            ranges[name] = (low, high)
        return hook

    def record_experts(name, module):
        """transformers 5's fused experts (3-D gate_up_proj, down_proj):
        each expert's projections under their checkpoint names, gate and up
        over every token, down over what each token would give it."""
        def hook(_, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            for e, gate_up in enumerate(module.gate_up_proj):
                gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
                for proj, value in (("gate_proj", x), ("up_proj", x), ("down_proj", module.act_fn(gate) * up)):
                    record(f"{name}.{e}.{proj}")(None, (value,))
        return hook

    handles = [m.register_forward_pre_hook(record(n)) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)]
    handles += [m.register_forward_pre_hook(record_experts(n, m)) for n, m in model.named_modules()
                if isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter)]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model(torch.randint(3, model.config.vocab_size, (4, 24), generator=gen))
    for h in handles:
        h.remove()
    return ranges


def write_compressed_tensors(plain: Path, out: Path, weights: dict, activations: dict | None = None,
                             ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """`plain` quantized by compressed-tensors (its README's recipe: scales
    from each weight's min and max, no calibration data) and saved in the
    format it picks for the scheme. transformers 5 fuses MoE experts into
    3-D parameters, which the package's model pass does not reach; their
    per-expert tensors are compressed after, by the package's compressor
    for the format, as llm-compressor's MoE recipes leave them."""
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization import (
        QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=QuantizationArgs(**activations) if activations else None)
    # Static activation scales, and NVFP4's global scale over its dynamic
    # ("local") group scales, are calibrated on a few sequences.
    ranges = _input_ranges(model) if activations and activations.get("dynamic") is not True else {}
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    for name, module in model.named_modules():
        if name in ranges and hasattr(module, "input_scale"):
            scale, _ = calculate_qparams(*ranges[name], scheme.input_activations)
            update_offload_parameter(module, "input_scale", scale.reshape(1))
        if name in ranges and hasattr(module, "input_global_scale"):
            update_offload_parameter(module, "input_global_scale", generate_gparam(*ranges[name]))
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        scale, zero, global_scale = _qparams(module.weight.data, args)
        update_offload_parameter(module, "weight_scale", scale)
        if hasattr(module, "weight_zero_point"):
            update_offload_parameter(module, "weight_zero_point", zero)
        if global_scale is not None:
            update_offload_parameter(module, "weight_global_scale", global_scale)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    _copy_side_files(plain, out)
    tensors = load_file(out / "model.safetensors")
    experts = [n for n in tensors if ".experts." in n and n.endswith(".weight") and tensors[n].is_floating_point()]
    if experts:
        fmt = json.loads((out / "config.json").read_text())["quantization_config"]["format"]
        scheme.format = fmt
        for name in experts:
            w = tensors.pop(name)
            scale, zero, global_scale = _qparams(w, scheme.weights)
            state = {"weight": w, "weight_scale": scale} | ({} if scheme.weights.symmetric else
                                                            {"weight_zero_point": zero})
            if global_scale is not None:
                state["weight_global_scale"] = global_scale
            prefix = name[: -len("weight")]
            compressed = BaseCompressor.load_from_registry(fmt).compress(state, scheme)
            tensors |= {prefix + leaf: t for leaf, t in compressed.items()}
            if prefix[:-1] in ranges and activations.get("dynamic") == "local":
                tensors[prefix + "input_global_scale"] = generate_gparam(*ranges[prefix[:-1]])
            elif prefix[:-1] in ranges:  # static: a calibrated scale per tensor
                scale, _ = calculate_qparams(*ranges[prefix[:-1]], scheme.input_activations)
                tensors[prefix + "input_scale"] = scale.reshape(1)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def decompress_compressed_tensors(path: Path, out: Path) -> Path:
    """A compressed-tensors checkpoint's weights dequantized by the package's
    own decompressors, as a plain checkpoint: the oracle where transformers
    cannot load the layout itself (packed asymmetric zero points)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = json.loads((path / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config.pop("quantization_config"))
    scheme = next(iter(qc.config_groups.values()))
    compressor = BaseCompressor.load_from_registry(qc.format)
    tensors = load_file(path / "model.safetensors")
    modules = {n.rpartition(".")[0] for n in tensors if n.endswith(".weight_scale")}
    plain = {n: t for n, t in tensors.items() if n.rpartition(".")[0] not in modules or n.endswith(".bias")}
    for m in modules:
        local = {n.rpartition(".")[2]: t for n, t in tensors.items() if n.rpartition(".")[0] == m}
        plain[f"{m}.weight"] = compressor.decompress(local, scheme)["weight"].to(torch.float32)
    shutil.copytree(path, out)
    save_file(plain, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def fake_quantized_hf(path: Path, dense: Path) -> torch.nn.Module:
    """HF on a compressed-tensors checkpoint's dequantized weights (`dense`,
    decompress_compressed_tensors) with the checkpoint's input activation
    scheme applied by compressed-tensors' own forward, which quantizes and
    dequantizes each linear's input as the scheme says: the oracle for NVFP4
    W4A4, whose checkpoint transformers decompresses to bfloat16 weights
    that a float32 model cannot multiply."""
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config

    from tests.families import hf_model

    qc = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    model = hf_model(str(dense))
    groups = {name: QuantizationScheme(targets=g.targets, input_activations=g.input_activations)
              for name, g in qc.config_groups.items()}
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=qc.ignore))
    tensors = load_file(path / "model.safetensors")
    for name, module in model.named_modules():
        for leaf in ("input_global_scale", "input_scale"):
            if hasattr(module, leaf):
                update_offload_parameter(module, leaf, tensors[f"{name}.{leaf}"])
        if f"{name}.0.gate_proj.input_global_scale" in tensors:
            args = next(iter(groups.values())).input_activations
            scales = [[tensors[f"{name}.{e}.{p}.input_global_scale"] for p in ("gate_proj", "up_proj", "down_proj")]
                      for e in range(module.num_experts)]
            module.forward = _fake_quantized_experts(module, args, scales)
    return model


def _fake_quantized_experts(module: torch.nn.Module, args, scales: list[list[torch.Tensor]]):
    """transformers 5's fused experts' forward, with each expert's gate, up
    and down inputs quantized and dequantized by compressed-tensors, as its
    own linears would be (the package's model pass reaches only
    nn.Linear)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    def fq(x, global_scale):
        scale, zero = compute_dynamic_scales_and_zp(x, args, module, global_scale=global_scale)
        return fake_quantize(x, scale, zero, args, global_scale=global_scale)

    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(module.num_experts):
            token, slot = torch.where(top_k_index == e)
            if len(token) == 0:
                continue
            x, (g, u, d) = hidden_states[token], scales[e]
            w_gate, w_up = module.gate_up_proj[e].chunk(2, dim=0)
            linear = torch.nn.functional.linear
            h = module.act_fn(linear(fq(x, g), w_gate)) * linear(fq(x, u), w_up)
            y = linear(fq(h, d), module.down_proj[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    return forward


# -- GPTQ and AWQ, written by hand in their documented layouts -------------

def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """32 / bits values per int32 word along dim, value i of each run at bit
    i * bits; `order` names which of the run sits at nibble i (AWQ)."""
    per = 32 // bits
    v = (values.to(torch.int64) & (2**bits - 1)).movedim(dim, -1).unflatten(-1, (-1, per))
    if order is not None:
        v = v[..., list(order)]
    words = sum(v[..., i] << (bits * i) for i in range(per))
    return _int32(words).movedim(-1, dim).contiguous()


def quantize_int(w: torch.Tensor, bits: int, group: int | None, sym: bool, g_idx: torch.Tensor | None = None):
    """GPTQ's and AWQ's min-max quantization of w [N, K] per group of
    columns (g_idx: each column's group): returns (q [N, K], scales
    [N, groups] fp16, zeros [N, groups], dense [N, K] = (q - zero) * scale)."""
    maxq = 2**bits - 1
    cols = w.shape[1]
    if g_idx is None:
        g_idx = torch.arange(cols) // (group or cols)
    groups = int(g_idx.max()) + 1
    scales = torch.empty(w.shape[0], groups, dtype=torch.float16)
    zeros = torch.empty(w.shape[0], groups, dtype=torch.int64)
    for g in range(groups):
        part = w[:, g_idx == g]
        low, high = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
        if sym:
            high = torch.maximum(low.abs(), high)
            s = (2 * high / maxq).clamp(min=1e-6)
            zeros[:, g] = (maxq + 1) // 2
        else:
            s = ((high - low) / maxq).clamp(min=1e-6)
            zeros[:, g] = torch.round(-low / s).clamp(0, maxq).to(torch.int64)
        scales[:, g] = s.to(torch.float16)
    s_cols, z_cols = scales[:, g_idx], zeros[:, g_idx]
    q = torch.clamp(torch.round(w / s_cols.float()) + z_cols, 0, maxq).to(torch.int64)
    dense = ((q - z_cols).to(torch.float16) * s_cols).to(torch.float32)
    return q, scales, zeros, dense


def _write_quantized(plain: Path, out: Path, dense_out: Path, write_leaves, quantization_config: dict) -> tuple[Path, Path]:
    shutil.copytree(plain, out)
    shutil.copytree(plain, dense_out)
    tensors = {}
    for f in plain.glob("*.safetensors"):
        tensors.update(load_file(f))
        (out / f.name).unlink()
    quantized, dense = {}, dict(tensors)
    for name, t in tensors.items():
        if any(f".{p}.weight" in name for p in LINEARS):
            module = name[: -len(".weight")]
            leaves, dense[name] = write_leaves(module, t.float())
            quantized.update({f"{module}.{leaf}": v for leaf, v in leaves.items()})
        else:
            quantized[name] = t
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    save_file(dense, dense_out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out, dense_out


def write_gptq(plain: Path, out: Path, dense_out: Path, bits: int, group: int, sym: bool, desc_act: bool,
               seed: int = 0) -> tuple[Path, Path]:
    """GPTQ (AutoGPTQ's v1 layout): qweight int32 [K * bits / 32, N] packed
    down the columns, qzeros int32 [groups, N * bits / 32] holding zero - 1,
    scales fp16 [groups, N], g_idx int32 [K]; desc_act orders the groups by
    a column permutation, as act-order does. Returns the checkpoint and its
    weights dequantized by the definition."""
    def leaves(module, w):
        cols = w.shape[1]
        g_idx = torch.arange(cols) // group
        if desc_act:
            # The order follows the input's activations, so projections of
            # one input (q/k/v, gate/up) share it.
            layer, _, proj = module.rpartition(".")
            shared = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
            key = f"{layer}.{shared.get(proj, proj)}"
            gen = torch.Generator().manual_seed(seed + sum(map(ord, key)) * 7919)
            g_idx = g_idx[torch.argsort(torch.randperm(cols, generator=gen))]
        q, scales, zeros, dense = quantize_int(w, bits, group, sym, g_idx)
        return {"qweight": _pack(q.T, bits, 0), "qzeros": _pack((zeros - 1).T, bits, 1), "scales": scales.T.contiguous(),
                "g_idx": g_idx.to(torch.int32)}, dense

    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
              "damp_percent": 0.01, "true_sequential": True, "checkpoint_format": "gptq"}
    return _write_quantized(plain, out, dense_out, leaves, config)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output AWQ_ORDER[i] of its 8


def write_awq(plain: Path, out: Path, dense_out: Path, group: int) -> tuple[Path, Path]:
    """AWQ GEMM: qweight int32 [K, N / 8] and qzeros int32 [groups, N / 8],
    packed along the outputs in AWQ's interleaved order, scales fp16
    [groups, N]; asymmetric 4-bit."""
    def leaves(module, w):
        q, scales, zeros, dense = quantize_int(w, 4, group, sym=False)
        return {"qweight": _pack(q.T, 4, 1, AWQ_ORDER), "qzeros": _pack(zeros.T, 4, 1, AWQ_ORDER),
                "scales": scales.T.contiguous()}, dense

    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return _write_quantized(plain, out, dense_out, leaves, config)


def write_fp8_per_tensor(plain: Path, out: Path, dense_out: Path) -> tuple[Path, Path]:
    """quant_method fp8 without weight_block_size (AutoFP8's layout): each
    linear weight in e4m3 with one float32 `weight_scale` (a 0-d tensor)
    of amax / 448."""
    def leaves(module, w):
        scale = w.abs().max().clamp(min=1e-12) / 448.0
        q = (w / scale).to(FP8)
        return {"weight": q, "weight_scale": scale.reshape(())}, q.to(torch.float32) * scale

    config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    return _write_quantized(plain, out, dense_out, leaves, config)


# -- NVIDIA ModelOpt's exports ------------------------------------------------

def as_modelopt(ct: Path, out: Path, algo: str, in_config_json: bool = False,
                kv_scales: tuple[float, float] | None = None) -> Path:
    """A compressed-tensors checkpoint of the scheme ModelOpt's quant_algo
    names, rewritten in ModelOpt's export layout: the same FP8 tensors, with
    scalar scales 0-d; NVFP4's packed weight named `weight` and its global
    scales inverted (weight_scale_2 = 1 / weight_global_scale, input_scale =
    1 / input_global_scale). The config goes to hf_quant_config.json as
    ModelOpt's exporter writes it, or (in_config_json) to config.json's
    quantization_config as newer exports do. kv_scales: ModelOpt's FP8 KV
    cache scales (self_attn.k_proj.k_scale / v_proj.v_scale) on every layer."""
    shutil.copytree(ct, out)
    renames = {"weight_packed": "weight", "weight_global_scale": "weight_scale_2",
               "input_global_scale": "input_scale"}
    tensors = {}
    for name, t in load_file(ct / "model.safetensors").items():
        module, _, leaf = name.rpartition(".")
        if leaf in ("weight_global_scale", "input_global_scale"):
            t = 1.0 / t.float()
        if leaf in ("weight_scale", "input_scale", "weight_global_scale", "input_global_scale") and t.numel() == 1:
            t = t.reshape(())
        tensors[f"{module}.{renames.get(leaf, leaf)}"] = t
    if kv_scales is not None:
        for name in [n for n in tensors if n.endswith(".self_attn.k_proj.weight")]:
            layer = name[: -len(".k_proj.weight")]
            tensors[f"{layer}.k_proj.k_scale"] = torch.tensor(kv_scales[0])
            tensors[f"{layer}.v_proj.v_scale"] = torch.tensor(kv_scales[1])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((out / "config.json").read_text())
    ct_config = hf.pop("quantization_config")
    # compressed-tensors' regex ignores as ModelOpt's shell-style wildcards.
    exclude = [p.replace("re:.*", "*").rstrip("$") for p in ct_config.get("ignore", [])]
    producer = {"name": "modelopt", "version": "0.37.0"}
    kv = "FP8" if kv_scales is not None else None
    if in_config_json:
        hf["quantization_config"] = {"quant_method": "modelopt", "quant_algo": algo, "producer": producer,
                                     "ignore": exclude, "config_groups": ct_config["config_groups"],
                                     "kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": False} if kv
                                     else None} | ({"group_size": 16} if algo == "NVFP4" else {})
    else:
        quantization = {"quant_algo": algo, "kv_cache_quant_algo": kv, "exclude_modules": exclude}
        (out / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": quantization
                                                              | ({"group_size": 16} if algo == "NVFP4" else {})}))
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    return out
