"""Quantized checkpoints: reading quantization_config into a QuantSpec, and
turning the decoder's linear layers into ones that keep the checkpoint's
quantized weights as they are (layers.py; the layouts in quant_formats.py).

Formats: quant_method "fp8" (block scales or one per tensor),
"compressed-tensors" (float-quantized FP8 by tensor, channel or block;
pack-quantized int4/int8 by group or channel, symmetric or not;
int-quantized int8; NVFP4 and MXFP4 weights; FP8 or int8 activations,
dynamic per token or group, or static per tensor, and NVFP4 activations;
an FP8 kv_cache_scheme), "gptq" (4 or 8 bits, any group size, desc_act
with g_idx), "awq" (version gemm) and "modelopt" (NVIDIA ModelOpt's FP8,
FP8_PER_CHANNEL_PER_TOKEN and NVFP4, with an FP8 KV cache's scales;
config.json's or hf_quant_config.json's). Schemes that quantize activations
(W8A8, NVFP4 W4A4) quantize them at run time as the scheme defines
(fake_quantize_activations), then run the same weight-only GEMM.

FP8 with block scales (quant_method "fp8" and weight_block_size: DeepSeek-V3
and R1, Kimi K2, the Qwen3 -FP8 releases): each linear weight is
float8_e4m3fn, and `weight_scale_inv` holds one float32 scale per block of
block_n rows by block_k columns, blocks at the edges included. The weights
stay FP8 in memory. On CUDA a linear layer runs llmsched_kernels/fp8_linear.py and
experts llmsched_kernels/fused_moe.py, which decode FP8 in their load loops;
on the CPU steps of a few rows run cpu_fp8_linear.py's kernel, which does
the same in L1; elsewhere a layer dequantizes its own weight for each
matmul (`dequantize_fp8_blocks`) and drops it after, so at most one layer's
weight is ever held at the compute dtype. Activations stay in the compute dtype
(W8A16), which is what transformers computes on the CPU for the same
checkpoint (it dequantizes on load), and what GPUs without FP8 tensor cores
run. activation_scheme "dynamic" describes how FP8 GPUs quantize
activations per token group; it does not change the stored weights.

Every key that changes the math is read or refused by name, as with the
rest of config.json; keys that only record how the checkpoint was made are
accepted. The layers themselves are in layers.py (ColumnLinear.use_scheme,
RowLinear.use_scheme, quantize_linears; experts: moe.FusedExperts.use_scheme).
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import torch

from executor_svc.model.model_config import ActivationQuant, LinearScheme, QuantSpec, UnsupportedConfig

FP8 = torch.float8_e4m3fn
# The keys of quant_method fp8 that are read (transformers' FineGrainedFP8Config
# writes them all); `dequantize` is transformers' load-time switch and
# changes nothing here.
FP8_KEYS = {"quant_method", "weight_block_size", "activation_scheme", "fmt", "modules_to_not_convert",
            "ignored_layers", "scale_fmt", "dequantize", "modules_to_convert", "expert_dtype"}
# GPTQ's and AWQ's keys; those in *_RECORD_KEYS only record how the
# checkpoint was made or how another engine loads it (transformers'
# GPTQConfig, AutoGPTQ and GPTQModel write them).
GPTQ_KEYS = {"quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format", "format", "pack_dtype",
             "static_groups", "modules_to_not_convert", "modules_in_block_to_quantize", "lm_head", "dynamic",
             "adapter", "rotation", "is_marlin_format"}
GPTQ_RECORD_KEYS = {"damp_percent", "true_sequential", "model_name_or_path", "model_file_base_name", "quantizer",
                    "meta", "damp_auto_increment", "mse", "v2", "v2_alpha", "act_group_aware", "hyb_act", "tokenizer",
                    "dataset", "use_cuda_fp16", "use_exllama", "disable_exllama", "exllama_config",
                    "max_input_length", "model_seqlen", "cache_block_outputs", "batch_size",
                    "module_name_preceding_first_block", "block_name_to_quantize", "pad_token_id", "backend",
                    "offload_to_disk", "offload_to_disk_path", "pack_impl", "mock_quantization", "fail_safe"}
# GPTQModel's keys that change the math unless empty: per-module overrides
# of bits and groups, an adapter (EoRA) added to every layer, rotated
# weights, and Marlin's own packing.
GPTQ_EMPTY_KEYS = {"dynamic": "per-module overrides", "adapter": "an adapter", "rotation": "rotated weights",
                   "is_marlin_format": "Marlin's packing"}
AWQ_KEYS = {"quant_method", "bits", "group_size", "zero_point", "version", "format", "desc_act",
            "modules_to_not_convert"}
# transformers 5's AwqConfig is a GPTQConfig and writes its keys too; `sym`
# is one of them, and means nothing beside AWQ's stored zero points.
AWQ_RECORD_KEYS = {"do_fuse", "fuse_max_seq_len", "modules_to_fuse", "sym",
                   "modules_in_block_to_quantize"} | GPTQ_RECORD_KEYS
CT_KEYS = {"quant_method", "format", "config_groups", "ignore", "kv_cache_scheme", "quantization_status",
           "global_compression_ratio", "version", "sparsity_config", "transform_config", "moe_sparsity_config"}
CT_GROUP_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
CT_ARGS_KEYS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
                "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}
# NVIDIA ModelOpt's exports (nvidia's -FP8 and -FP4 releases): quant_algo
# and its companions, in hf_quant_config.json under "quantization" (with a
# "producer" record), or at the top level of config.json's
# quantization_config, where newer exports name the exclusions "ignore" and
# the KV cache "kv_cache_scheme", and describe the algorithm again in
# compressed-tensors' "config_groups" (a record: quant_algo decides, as in
# vLLM).
MODELOPT_KEYS = {"quant_method", "quant_algo", "kv_cache_quant_algo", "kv_cache_scheme", "exclude_modules", "ignore",
                 "group_size", "producer", "config_groups", "quantization"}
MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "NVFP4")
# Methods served, and where (the refusal names them).
SUPPORTED = "'fp8', 'compressed-tensors', 'gptq', 'awq', 'modelopt', and 'mxfp4' (gpt-oss)"
CT_FORMATS = ("float-quantized", "pack-quantized", "int-quantized", "naive-quantized", "nvfp4-pack-quantized",
              "mxfp4-pack-quantized")


# Checkpoints made before transformers read GPTQ and AWQ keep their
# quantization config in a file of its own, as AutoGPTQ (quantize_config.json,
# often without quant_method) and AutoAWQ (quant_config.json, with its own
# key names) wrote it, and so do ModelOpt's exports (hf_quant_config.json);
# config.json's quantization_config wins where both are.
QUANTIZATION_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"),
                      ("hf_quant_config.json", "modelopt"))
AUTOAWQ_KEYS = {"w_bit": "bits", "q_group_size": "group_size"}
# Where a quantization config came from, kept in it for error messages.
SOURCE = "llmsched_source"


def legacy_quantization_config(config: dict[str, Any], file: str, method: str) -> dict[str, Any]:
    """AutoGPTQ's or AutoAWQ's own file (QUANTIZATION_FILES) in config.json's terms."""
    config = {AUTOAWQ_KEYS.get(k, k): v for k, v in config.items()}
    return {"quant_method": method} | config | {SOURCE: file}


def read_quantization(config: dict[str, Any] | None, family: str) -> QuantSpec | None:
    """quantization_config of a family that has none of its own (gpt-oss
    reads its MXFP4 in families/gpt_oss.py)."""
    if config is None:
        return None
    config = dict(config)
    where = f"{family} {config.pop(SOURCE, 'config.json: quantization_config')}"
    method = config.get("quant_method")
    readers = {"fp8": _read_fp8, "compressed-tensors": _read_compressed_tensors, "gptq": _read_gptq,
               "awq": _read_awq, "modelopt": _read_modelopt}
    if method not in readers:
        raise UnsupportedConfig(f"{where} quant_method={method!r} is not supported; supported: {SUPPORTED}")
    return readers[method](config, where)


def _refuse_unknown(config: dict[str, Any], keys: set[str], where: str, what: str) -> None:
    unknown = sorted(set(config) - keys)
    if unknown:
        raise UnsupportedConfig(f"{where} keys {unknown} are not implemented for {what}; it reads {sorted(keys)}")


def _read_fp8(config: dict[str, Any], where: str) -> QuantSpec:
    _refuse_unknown(config, FP8_KEYS, where, "quant_method 'fp8'")
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedConfig(f"{where} fmt={fmt!r} is not supported; FP8 weights are read as e4m3 "
                                "(float8_e4m3fn)")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UnsupportedConfig(f"{where} activation_scheme={scheme!r} is not supported; only 'dynamic' (no "
                                "activation scales in the checkpoint)")
    # ue8m0: the scales are powers of two (DeepSeek-V3.1); stored as float32
    # or as float8_e8m0fnu, both read exactly as float32. "float":
    # transformers' name for float32 scales.
    scale_fmt = config.get("scale_fmt")
    if scale_fmt not in (None, "float", "ue8m0"):
        raise UnsupportedConfig(f"{where} scale_fmt={scale_fmt!r} is not supported; supported: absent or 'float' "
                                "(float32 scales), or 'ue8m0'")
    if config.get("expert_dtype", "fp8") != "fp8":
        raise UnsupportedConfig(f"{where} expert_dtype={config['expert_dtype']!r} is not supported; supported: "
                                "'fp8' (experts in FP8 blocks like the other linears)")
    if config.get("modules_to_convert"):
        raise UnsupportedConfig(f"{where} modules_to_convert={config['modules_to_convert']!r} (FP8 embedding "
                                "tables) is not supported; only linear layers are read in FP8")
    not_converted = tuple(config.get("modules_to_not_convert") or ()) + tuple(config.get("ignored_layers") or ())
    block = config.get("weight_block_size")
    if block is None:
        # Per-tensor FP8 (AutoFP8, vLLM's online FP8): one `weight_scale` per
        # tensor, held as one scale per row so that fused q/k/v keep theirs.
        linear = LinearScheme("fp8", "fp8-row")
    else:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise UnsupportedConfig(f"{where} weight_block_size={block!r} must be two positive integers "
                                    "[block_n, block_k]")
        linear = LinearScheme("fp8", "fp8", block=(block[0], block[1]))
    return QuantSpec("fp8", schemes=((("Linear",), linear),), not_converted=not_converted)


def _read_modelopt(config: dict[str, Any], where: str) -> QuantSpec:
    """ModelOpt's FP8 (e4m3 weights with one scale per tensor, activations
    static per tensor: `input_scale`), FP8_PER_CHANNEL_PER_TOKEN (a scale
    per row, activations dynamic per token) and NVFP4 (W4A4: E2M1 weights
    and activations per group of 16, over global scales). The tensors are
    compressed-tensors' for the same schemes, but for NVFP4's global
    scales, stored inverted (quant_formats.py's modelopt-nvfp4 layout)."""
    _refuse_unknown(config, MODELOPT_KEYS, where, "quant_method 'modelopt'")
    nested = config.get("quantization")
    if nested is not None:  # hf_quant_config.json: {"producer": ..., "quantization": {...}}
        if not isinstance(nested, dict):
            raise UnsupportedConfig(f"{where} quantization={nested!r} must be an object")
        outer = sorted(set(config) - {"quant_method", "producer", "quantization"})
        if outer:
            raise UnsupportedConfig(f"{where} keys {outer} beside 'quantization' are not implemented for "
                                    "quant_method 'modelopt'")
        config = {"quant_method": "modelopt"} | nested
        _refuse_unknown(config, MODELOPT_KEYS - {"quantization"}, f"{where} quantization", "quant_method 'modelopt'")
    algo = str(config.get("quant_algo") or "").upper()
    if algo not in MODELOPT_ALGOS:
        raise UnsupportedConfig(f"{where} quant_algo={config.get('quant_algo')!r} is not supported; supported: "
                                f"{list(MODELOPT_ALGOS)}")
    kv = config.get("kv_cache_quant_algo")
    scheme = config.get("kv_cache_scheme")
    if scheme:
        if isinstance(scheme, dict):
            _refuse_unknown(scheme, CT_ARGS_KEYS, f"{where} kv_cache_scheme", "a ModelOpt KV-cache scheme")
        got = (scheme.get("num_bits"), scheme.get("type"), scheme.get("strategy") or "tensor",
               bool(scheme.get("dynamic")), scheme.get("symmetric", True)) if isinstance(scheme, dict) else scheme
        if got != (8, "float", "tensor", False, True):
            raise UnsupportedConfig(f"{where} kv_cache_scheme={scheme!r} is not supported; supported: FP8 with "
                                    "static scales per tensor (num_bits 8, type 'float', dynamic false)")
        kv = kv or "FP8"
    if kv is not None and str(kv).upper() != "FP8":
        # FP8: the checkpoint's self_attn.k_proj.k_scale / v_proj.v_scale
        # (model.set_kv_scales), read by an FP8 cache (EXECUTOR_KV_CACHE_DTYPE).
        raise UnsupportedConfig(f"{where} kv_cache_quant_algo={kv!r} is not supported; supported: absent or 'FP8'")
    group = config.get("group_size")
    if algo == "NVFP4":
        if group not in (None, 16):
            raise UnsupportedConfig(f"{where} group_size={group!r} is not supported for NVFP4; supported: 16")
        linear = LinearScheme("fp4", "modelopt-nvfp4", bits=4, group_size=16, activations=ActivationQuant("fp4", 16))
    else:
        if group is not None:
            raise UnsupportedConfig(f"{where} group_size={group!r} is not supported for quant_algo {algo!r}, "
                                    "which has no groups")
        static = algo == "FP8"
        linear = LinearScheme("fp8", "ct-float", activations=ActivationQuant("float", dynamic=not static))
    _check_modelopt_groups(config.get("config_groups"), algo, where)
    # Exclusions are shell-style wildcards ("lm_head", "model.layers.0.mlp*",
    # "*.mlp.gate"), matched against whole module names.
    excluded = tuple(config.get("exclude_modules") or ()) + tuple(config.get("ignore") or ())
    not_converted = tuple(f"re:{fnmatch.translate(p)}" for p in excluded)
    return QuantSpec("modelopt", schemes=((("Linear",), linear),), not_converted=not_converted)


# What each served quant_algo's config_groups record says of the weights
# and inputs: (num_bits, type, group_size).
MODELOPT_GROUPS = {"FP8": (8, "float", None), "FP8_PER_CHANNEL_PER_TOKEN": (8, "float", None),
                   "NVFP4": (4, "float", 16)}


def _check_modelopt_groups(groups: Any, algo: str, where: str) -> None:
    """Newer ModelOpt exports describe their scheme again in compressed-
    tensors' config_groups. The math follows quant_algo, so a record
    that says otherwise (other bits, type or group size, or targets
    beyond Linear) is refused rather than served one way or the other."""
    if not groups:
        return
    if not isinstance(groups, dict):
        raise UnsupportedConfig(f"{where} config_groups={groups!r} must be an object of groups")
    want = MODELOPT_GROUPS[algo]
    for name, group in groups.items():
        at = f"{where} config_groups.{name}"
        if not isinstance(group, dict):
            raise UnsupportedConfig(f"{at}={group!r} must be an object")
        if group.get("targets", ["Linear"]) != ["Linear"]:
            raise UnsupportedConfig(f"{at}.targets={group.get('targets')!r} is not supported; supported: ['Linear']")
        for part in ("weights", "input_activations"):
            args = group.get(part)
            if args is None:
                continue
            got = (args.get("num_bits"), args.get("type"), args.get("group_size"))
            if got != want:
                raise UnsupportedConfig(f"{at}.{part} (num_bits, type, group_size)={got} disagrees with "
                                        f"quant_algo {algo!r}, which is {want}")


def _int_arg(config: dict[str, Any], key: str, where: str, allowed: tuple[int, ...] | None = None) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or (allowed and value not in allowed):
        raise UnsupportedConfig(f"{where} {key}={value!r} is not supported; supported: "
                                f"{list(allowed) if allowed else 'an integer'}")
    return value


def _group(config: dict[str, Any], where: str) -> int | None:
    size = _int_arg(config, "group_size", where)
    if size == -1:
        return None
    if size <= 0:
        raise UnsupportedConfig(f"{where} group_size={size} must be positive, or -1 (one group per row)")
    return size


def _read_gptq(config: dict[str, Any], where: str) -> QuantSpec:
    _refuse_unknown(config, GPTQ_KEYS | GPTQ_RECORD_KEYS, where, "quant_method 'gptq'")
    for key, what in GPTQ_EMPTY_KEYS.items():
        if config.get(key):
            raise UnsupportedConfig(f"{where} {key}={config[key]!r} ({what}) is not supported; supported: absent, "
                                    "null or empty")
    bits = _int_arg(config, "bits", where, (4, 8))
    # transformers writes checkpoint_format, GPTQModel format: gptq_v2 stores
    # zero points as they are, which the v1 reading would shift by one.
    for key in ("checkpoint_format", "format"):
        fmt = config.get(key, "gptq")
        if fmt != "gptq":
            raise UnsupportedConfig(f"{where} {key}={fmt!r} is not supported; supported: 'gptq' (zero points "
                                    "stored minus one)")
    if config.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise UnsupportedConfig(f"{where} pack_dtype={config['pack_dtype']!r} is not supported; supported: "
                                "'int32'")
    if config.get("lm_head"):
        raise UnsupportedConfig(f"{where} lm_head=true (a quantized head) is not supported; only decoder "
                                "linears are read quantized")
    if config.get("static_groups"):
        raise UnsupportedConfig(f"{where} static_groups=true is not supported")
    linear = LinearScheme("int", "gptq", bits=bits, group_size=_group(config, where),
                          symmetric=bool(config.get("sym", True)), act_order=bool(config.get("desc_act", False)))
    return QuantSpec("gptq", schemes=((_gptq_targets(config), linear),),
                     not_converted=tuple(config.get("modules_to_not_convert") or ()))


def _gptq_targets(config: dict[str, Any]) -> tuple[str, ...]:
    """Every linear, or only those modules_in_block_to_quantize names (lists
    of names within a decoder layer, such as "self_attn.q_proj"; optimum
    writes them where a model leaves some linears plain)."""
    names = [n for group in config.get("modules_in_block_to_quantize") or () for n in group]
    return tuple(f"re:(?:.*\\.)?{re.escape(n)}$" for n in names) or ("Linear",)


def _read_awq(config: dict[str, Any], where: str) -> QuantSpec:
    _refuse_unknown(config, AWQ_KEYS | AWQ_RECORD_KEYS, where, "quant_method 'awq'")
    bits = _int_arg(config, "bits", where, (4,))
    # `format` is transformers 5's name for AutoAWQ's `version`; it writes both.
    for key in ("version", "format"):
        if str(config.get(key, "gemm")).lower() != "gemm":
            raise UnsupportedConfig(f"{where} {key}={config.get(key)!r} is not supported; supported: 'gemm'")
    if config.get("desc_act"):
        raise UnsupportedConfig(f"{where} desc_act=true is not supported for AWQ, which has no act-order")
    if config.get("zero_point", True) is not True:
        raise UnsupportedConfig(f"{where} zero_point=false is not supported; AWQ GEMM checkpoints carry zero points")
    linear = LinearScheme("int", "awq", bits=bits, group_size=_group(config, where), symmetric=False)
    return QuantSpec("awq", schemes=((("Linear",), linear),),
                     not_converted=tuple(config.get("modules_to_not_convert") or ()))


def _read_compressed_tensors(config: dict[str, Any], where: str) -> QuantSpec:
    _refuse_unknown(config, CT_KEYS, where, "quant_method 'compressed-tensors'")
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise UnsupportedConfig(f"{where} quantization_status={status!r} is not supported; supported: 'compressed'")
    for key in ("sparsity_config", "transform_config", "moe_sparsity_config"):
        if config.get(key):
            raise UnsupportedConfig(f"{where} {key} is not supported; sparse and transformed (rotated) weights are "
                                    "not implemented, only an empty or null one")
    kv = config.get("kv_cache_scheme")
    if kv:
        # FP8 per tensor: the checkpoint's self_attn.k_scale / v_scale load
        # onto each layer (model.set_kv_scales); an FP8 cache
        # (EXECUTOR_KV_CACHE_DTYPE) stores value / scale, one in the
        # compute dtype ignores them, as vLLM's does.
        _refuse_unknown(kv, CT_ARGS_KEYS, f"{where} kv_cache_scheme", "a compressed-tensors KV-cache scheme")
        got = (kv.get("num_bits"), kv.get("type"), kv.get("strategy"), bool(kv.get("dynamic")), kv.get("symmetric", True))
        if got != (8, "float", "tensor", False, True):
            raise UnsupportedConfig(f"{where} kv_cache_scheme (num_bits, type, strategy, dynamic, symmetric)={got} is "
                                    "not supported; supported: (8, 'float', 'tensor', False, True), FP8 with one "
                                    "scale per layer for keys and one for values")
    groups = config.get("config_groups") or {}
    if not groups:
        raise UnsupportedConfig(f"{where} has no config_groups")
    schemes = []
    for name, group in groups.items():
        at = f"{where} config_groups.{name}"
        _refuse_unknown(group, CT_GROUP_KEYS, at, "a compressed-tensors scheme")
        if group.get("output_activations"):
            raise UnsupportedConfig(f"{at}.output_activations is not supported; only weights and input activations")
        fmt = group.get("format") or config.get("format")
        targets = tuple(group.get("targets") or ())
        schemes.append((targets, _ct_scheme(group.get("weights"), group.get("input_activations"), fmt, at)))
    return QuantSpec("compressed-tensors", schemes=tuple(schemes), not_converted=tuple(config.get("ignore") or ()))


def _ct_scheme(weights: dict[str, Any] | None, inputs: dict[str, Any] | None, fmt: str | None,
               at: str) -> LinearScheme:
    if fmt not in CT_FORMATS:
        raise UnsupportedConfig(f"{at} format={fmt!r} is not supported; supported: {list(CT_FORMATS)}")
    if not weights:
        raise UnsupportedConfig(f"{at} quantizes no weights; activation-only schemes are not supported")
    _refuse_unknown(weights, CT_ARGS_KEYS, f"{at}.weights", "compressed-tensors weights")
    kind, bits = weights.get("type", "int"), weights.get("num_bits", 8)
    strategy, symmetric = weights.get("strategy"), weights.get("symmetric", True)
    if weights.get("dynamic"):
        raise UnsupportedConfig(f"{at}.weights.dynamic=true is not supported; weights are read with their scales")
    if fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        return _ct_fp4(weights, inputs, fmt, at)
    actorder = weights.get("actorder")
    if actorder not in (None, False, "weight", "static", "group", "dynamic"):
        raise UnsupportedConfig(f"{at}.weights.actorder={actorder!r} is not supported")
    activations = _ct_activations(inputs, f"{at}.input_activations")
    if kind == "float":
        if bits != 8:
            raise UnsupportedConfig(f"{at}.weights num_bits={bits} with type 'float' is not supported; supported: 8 "
                                    "(FP8 e4m3)")
        if fmt not in ("float-quantized", "naive-quantized") or not symmetric:
            raise UnsupportedConfig(f"{at}: FP8 weights need format 'float-quantized' and symmetric scales")
        if strategy in ("tensor", "channel"):
            return LinearScheme("fp8", "ct-float", activations=activations)
        if strategy == "block":
            block = weights.get("block_structure")
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise UnsupportedConfig(f"{at}.weights block_structure={block!r} must be two positive integers")
            return LinearScheme("fp8", "ct-float", block=(block[0], block[1]), activations=activations)
        raise UnsupportedConfig(f"{at}.weights strategy={strategy!r} is not supported for FP8 weights; supported: "
                                "'tensor', 'channel', 'block'")
    if kind != "int":
        raise UnsupportedConfig(f"{at}.weights type={kind!r} is not supported; supported: 'int', 'float'")
    if fmt == "pack-quantized":
        if bits not in (4, 8):
            raise UnsupportedConfig(f"{at}.weights num_bits={bits} is not supported; supported: 4, 8")
        if strategy not in ("group", "channel"):
            raise UnsupportedConfig(f"{at}.weights strategy={strategy!r} is not supported for packed int weights; "
                                    "supported: 'group', 'channel'")
        group = weights.get("group_size") if strategy == "group" else None
        if strategy == "group" and not (isinstance(group, int) and group > 0):
            raise UnsupportedConfig(f"{at}.weights group_size={group!r} must be a positive integer")
        return LinearScheme("int", "ct-pack", bits=bits, group_size=group, symmetric=bool(symmetric),
                            act_order=actorder in ("group", "dynamic"), activations=activations)
    if bits != 8 or strategy not in ("channel", "tensor") or not symmetric:
        raise UnsupportedConfig(f"{at}: int weights in format {fmt!r} are supported as 8-bit, symmetric, per "
                                f"channel or tensor; got num_bits={bits}, strategy={strategy!r}, "
                                f"symmetric={symmetric}")
    return LinearScheme("int", "ct-int", bits=8, activations=activations)


def _ct_fp4(weights: dict[str, Any], inputs: dict[str, Any] | None, fmt: str, at: str) -> LinearScheme:
    """NVFP4 (E2M1 weights, an FP8 scale per 16 over a global scale) and
    MXFP4 (an E8M0 power of two per 32), weights only."""
    group = 16 if fmt == "nvfp4-pack-quantized" else 32
    got = (weights.get("num_bits"), weights.get("type"), weights.get("group_size"), weights.get("symmetric", True))
    if got != (4, "float", group, True):
        raise UnsupportedConfig(f"{at}.weights (num_bits, type, group_size, symmetric)={got} is not supported for "
                                f"format {fmt!r}; supported: (4, 'float', {group}, True)")
    activations = _ct_fp4_activations(inputs, fmt, f"{at}.input_activations") if inputs else None
    return LinearScheme("fp4", "ct-nvfp4" if group == 16 else "ct-mxfp4", bits=4, group_size=group,
                        activations=activations)


# NVFP4's activations (compressed-tensors' NVFP4 preset, llm-compressor's
# W4A4): E2M1 per group of 16, each group's scale computed at run time and
# stored as FP8 e4m3 over the layer's calibrated input_global_scale.
NVFP4_ACTIVATIONS = (4, "float", "tensor_group", 16, "local", True)
FP8_SCALES = (None, "torch.float8_e4m3fn", "float8_e4m3fn")


def _ct_fp4_activations(inputs: dict[str, Any], fmt: str, at: str) -> ActivationQuant:
    _refuse_unknown(inputs, CT_ARGS_KEYS, at, "compressed-tensors activations")
    got = tuple(inputs.get(k) for k in ("num_bits", "type", "strategy", "group_size", "dynamic")) + (
        inputs.get("symmetric", True),)
    if fmt != "nvfp4-pack-quantized" or got != NVFP4_ACTIVATIONS:
        raise UnsupportedConfig(f"{at} (num_bits, type, strategy, group_size, dynamic, symmetric)={got} is not "
                                f"supported with format {fmt!r}; FP4 activations are supported as NVFP4 "
                                f"(format 'nvfp4-pack-quantized'): {NVFP4_ACTIVATIONS}")
    # Absent in checkpoints made before compressed-tensors had the key:
    # their group scales were FP8 too, as NVFP4 kernels read them.
    if inputs.get("scale_dtype") not in FP8_SCALES:
        raise UnsupportedConfig(f"{at} scale_dtype={inputs['scale_dtype']!r} is not supported; NVFP4 activation "
                                "group scales are FP8 e4m3 ('torch.float8_e4m3fn', or absent)")
    return ActivationQuant("fp4", 16)


def _ct_activations(inputs: dict[str, Any] | None, at: str) -> ActivationQuant | None:
    if not inputs:
        return None
    _refuse_unknown(inputs, CT_ARGS_KEYS, at, "compressed-tensors activations")
    kind, bits, strategy = inputs.get("type", "int"), inputs.get("num_bits", 8), inputs.get("strategy")
    dynamic = inputs.get("dynamic", False)
    if dynamic not in (True, False):
        raise UnsupportedConfig(f"{at}: dynamic={dynamic!r} is not supported; supported: true (per token or group) "
                                "or false (one scale per tensor, input_scale)")
    if bits != 8 or kind not in ("float", "int") or not inputs.get("symmetric", True):
        raise UnsupportedConfig(f"{at}: num_bits={bits}, type={kind!r}, symmetric={inputs.get('symmetric', True)} "
                                "is not supported; supported: 8-bit symmetric 'float' (FP8) or 'int'")
    if not dynamic:
        if strategy != "tensor":
            raise UnsupportedConfig(f"{at}: static activation scales by {strategy!r} are not supported; supported: "
                                    "'tensor' (one input_scale per layer)")
        return ActivationQuant(kind, dynamic=False)
    if strategy == "token":
        return ActivationQuant(kind)
    if strategy == "group" and isinstance(inputs.get("group_size"), int) and inputs["group_size"] > 0:
        return ActivationQuant(kind, inputs["group_size"])
    raise UnsupportedConfig(f"{at}: strategy={strategy!r} is not supported for dynamic activations; supported: "
                            "'token', 'group' with a group_size")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# e4m3 values times 2^-8 are exactly the half-precision numbers whose bits
# are e4m3's sign, then a zero, then its 7 exponent and mantissa bits: both
# formats put the exponent before the mantissa, and e4m3's bias (7) is 8 less
# than half precision's (15); subnormals map onto subnormals alike. Shifting
# the bits this way is several times faster on the CPU than torch's
# float8 -> float32 conversion, which goes one element at a time.
FP8_AS_HALF_SCALE = 256.0
_HALF_SIGN_AND_LOW_BITS = -16512  # 0xBF80 as int16: the sign bit and bits 13..7


def fp8_as_half(weight: torch.Tensor) -> torch.Tensor:
    """weight (float8_e4m3fn) / 256 in float16, exactly, for every finite value."""
    return ((weight.view(torch.int8).to(torch.int16) << 7) & _HALF_SIGN_AND_LOW_BITS).view(torch.float16)


def dequantize_fp8_blocks(weight: torch.Tensor, scales: torch.Tensor, grid_rows: torch.Tensor, block_k: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """weight [rows, cols] in FP8 times its block scales, in dtype.

    scales: [grid rows, cdiv(cols, block_k)] float32; grid_rows: [rows], the
    grid row of each weight row (a layer standing for several checkpoint
    tensors stacks their grids). The product is taken in float32 and then
    cast, as transformers does, so that a bf16 model gets the same weights.
    On the CPU the FP8 values come through fp8_as_half, and the scales take
    its factor of 256: the same products, bit for bit."""
    rows, cols = weight.shape
    s = scales.index_select(0, grid_rows)  # [rows, cdiv(cols, block_k)]
    if weight.device.type == "cpu":
        w = fp8_as_half(weight).to(torch.float32)
        s = s * FP8_AS_HALF_SCALE
    else:
        w = weight.to(torch.float32)
    full = cols // block_k * block_k
    if full:
        w[:, :full].unflatten(1, (full // block_k, block_k)).mul_(s[:, : full // block_k, None])
    if full < cols:
        w[:, full:].mul_(s[:, -1:])
    return w if dtype == torch.float32 else w.to(dtype)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout's definition, for writing FP8 checkpoints (bench/quantized.py):
    per block of block_n x block_k (edge blocks cropped), scale = amax / 448,
    the largest e4m3 value, and the weight divided by it in e4m3. Returns
    (weight in FP8, scales [cdiv(rows, block_n), cdiv(cols, block_k)])."""
    bn, bk = block
    rows, cols = weight.shape
    grid = (cdiv(rows, bn), cdiv(cols, bk))
    padded = weight.new_zeros(grid[0] * bn, grid[1] * bk, dtype=torch.float32)
    padded[:rows, :cols] = weight
    blocks = padded.view(grid[0], bn, grid[1], bk)
    scales = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(FP8).max
    quantized = (blocks / scales[:, None, :, None]).view(grid[0] * bn, grid[1] * bk)[:rows, :cols]
    return quantized.to(FP8).contiguous(), scales


def fake_quantize_activations(x: torch.Tensor, act: ActivationQuant, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x quantized and dequantized as the scheme does at run time
    (compressed-tensors' definition): with the checkpoint's `scale`
    (static), or per token or group of columns with scale = amax / the
    format's half range (dynamic); values rounded to FP8 e4m3 or to int8
    and multiplied back. Weight-only GEMMs then see exactly the activations
    a W8A8 kernel would. NVFP4 (type "fp4"): `scale` is the layer's global
    scale (fake_quantize_nvfp4)."""
    if act.type == "fp4":
        return fake_quantize_nvfp4(x, scale, act.group_size)
    groups = x if act.group_size is None else x.unflatten(-1, (-1, act.group_size))
    if scale is None:
        amax = groups.abs().amax(dim=-1, keepdim=True).to(torch.float32)
        half_range = torch.finfo(FP8).max if act.type == "float" else 127.5
        scale = (amax / half_range).clamp(min=torch.finfo(torch.float32).eps)
    if act.type == "float":
        limit = torch.finfo(FP8).max
        q = (groups.to(torch.float32) / scale).clamp(-limit, limit).to(FP8).to(torch.float32)
    else:
        q = torch.round((groups.to(torch.float32) / scale).clamp(-128, 127))
    out = (q * scale).to(x.dtype)
    return out if act.group_size is None else out.flatten(-2)


class BlockSplitError(UnsupportedConfig):
    """A tensor-parallel size that cuts a quantization block."""


# E2M1's values, and the midpoints between them; a value on a midpoint goes
# to the value with an even mantissa (round half to even, as the FP4
# conversions of compressed-tensors and of NVIDIA's hardware do).
E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
E2M1_UP = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float32 x, already within [-6, 6], rounded to the nearest E2M1 value."""
    a, out = x.abs(), torch.zeros_like(x)
    for (mid, inclusive), value in zip(E2M1_MIDPOINTS, E2M1_UP):
        out = torch.where(a >= mid if inclusive else a > mid, value, out)
    return out.copysign(x)


def fake_quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, group: int = 16) -> torch.Tensor:
    """x through NVFP4 and back, as compressed-tensors' NVFP4 activations
    and NVFP4 GEMM kernels quantize them: per group of `group` columns, a
    scale amax / 6 (E2M1's largest value) times the global scale, rounded
    to FP8 e4m3 (zero becomes 0.125, compressed-tensors' guard), then
    x / (scale / global_scale) rounded to E2M1 and multiplied back."""
    groups = x.unflatten(-1, (-1, group))
    # amax / 6 in x's dtype, as compressed-tensors computes it.
    local = (groups.abs().amax(dim=-1, keepdim=True) / 6).to(torch.float32) * global_scale
    local = local.clamp(max=torch.finfo(FP8).max).to(FP8).to(torch.float32)
    scale = torch.where(local == 0, 0.125, local) / global_scale
    q = round_to_e2m1((groups.to(torch.float32) / scale).clamp(-6.0, 6.0))
    return (q * scale).to(x.dtype).flatten(-2)
