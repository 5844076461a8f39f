"""The model families the executor serves, each written as its difference
from Llama: which config.json keys it reads (with HF's defaults for absent
ones), which it ignores and why, and how its checkpoint names map onto the
shared decoder in executor_svc/model.py.

A family is chosen from `architectures` (falling back to `model_type`);
anything else is refused with the list of what is served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from executor_svc.checkpoint import LazyTensor
from executor_svc.model_config import (
    COMMON_IGNORED, FULL, SLIDING, ConfigReader, ModelConfig, RopeSpec, UnsupportedConfig, eos_ids, rope_spec,
)


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    # config.json -> the ModelConfig fields this family sets beyond the
    # common ones (layer_types and rope at least).
    read: Callable[[ConfigReader, dict[str, Any]], dict[str, Any]]
    # HF's class defaults for common keys that config.json may omit.
    defaults: dict[str, Any] = field(default_factory=dict)
    # Family keys that do not change inference, and why.
    ignored: dict[str, str] = field(default_factory=dict)
    # One checkpoint tensor -> the decoder's parameters it fills.
    rename: Callable[[str, LazyTensor, ModelConfig], Iterator[tuple[str, LazyTensor]]] | None = None
    # Multimodal architectures whose text model is this family: served text-only.
    multimodal: tuple[str, ...] = ()


# --- pieces several families share -----------------------------------------

def single_rope(r: ConfigReader, c: dict[str, Any], *, allow_partial: bool = False) -> RopeSpec:
    """transformers 4 (rope_theta + rope_scaling) or 5 (rope_parameters).
    As in HF, rope_scaling wins when both are present."""
    scaling, params = r.get("rope_scaling"), r.get("rope_parameters")
    params = dict(scaling or params or {})
    return rope_spec(
        params, r.family, theta=r.get("rope_theta", 10000.0), head_dim=c["head_dim"],
        max_position_embeddings=c["max_position_embeddings"],
        partial_rotary_factor=r.get("partial_rotary_factor", 1.0), allow_partial=allow_partial,
    )


def silu_only(r: ConfigReader) -> None:
    r.refuse_unless("hidden_act", "silu", "this family's MLP is implemented with silu only")


def no_bias(r: ConfigReader) -> None:
    r.refuse_unless("attention_bias", False, "q/k/v/o projection biases are implemented for Qwen2 only")


def qwen_window(r: ConfigReader, n: int) -> tuple[tuple[str, ...], int | None]:
    """Qwen2/3: a window only with use_sliding_window, and then (unless
    layer_types says otherwise) only on layers from max_window_layers on."""
    use_window, window = r.get("use_sliding_window", False), r.get("sliding_window")
    window = window if use_window else None
    max_window_layers = r.get("max_window_layers", 28)
    types = layer_types(r, n, lambda i: SLIDING if window is not None and i >= max_window_layers else FULL)
    if window is None:  # HF: sliding layers without a window attend to everything
        types = (FULL,) * n
    return types, window


def layer_types(r: ConfigReader, n: int, default: Callable[[int], str]) -> tuple[str, ...]:
    types = tuple(r.get("layer_types") or [default(i) for i in range(n)])
    if len(types) != n or set(types) - {FULL, SLIDING}:
        raise UnsupportedConfig(f"{r.family}: layer_types must list {FULL!r}/{SLIDING!r} for each of {n} layers, "
                                f"got {types!r}")
    return types


# --- the families -----------------------------------------------------------

def read_llama(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    silu_only(r)
    no_bias(r)
    r.refuse_unless("mlp_bias", False, "MLP biases are not implemented")
    return dict(layer_types=(FULL,) * c["num_layers"], rope={FULL: single_rope(r, c)})


def read_mistral(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    silu_only(r)
    no_bias(r)
    window = r.get("sliding_window")
    kind = FULL if window is None else SLIDING
    return dict(layer_types=(kind,) * c["num_layers"], sliding_window=window, rope={kind: single_rope(r, c)})


def read_qwen2(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    silu_only(r)
    r.refuse_unless("use_mrope", False, "multimodal RoPE (Qwen2-VL) is not implemented")
    types, window = qwen_window(r, c["num_layers"])
    rope = single_rope(r, c)
    return dict(layer_types=types, sliding_window=window, qkv_bias=True, rope={FULL: rope, SLIDING: rope})


def read_qwen3(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    silu_only(r)
    no_bias(r)
    types, window = qwen_window(r, c["num_layers"])
    rope = single_rope(r, c)
    return dict(layer_types=types, sliding_window=window, qk_norm=True, rope={FULL: rope, SLIDING: rope})


def gemma_common(r: ConfigReader) -> dict[str, Any]:
    """What Gemma 2 and 3 share: (1+w) norms, sandwich norms, scaled
    embeddings, GeGLU, query_pre_attn_scalar."""
    no_bias(r)
    r.refuse_unless("hidden_activation", "gelu_pytorch_tanh", "Gemma's MLP is implemented with gelu_pytorch_tanh")
    r.refuse_unless("use_bidirectional_attention", False, "only causal attention is implemented")
    return dict(hidden_act="gelu_pytorch_tanh", norm_unit_offset=True, sandwich_norms=True, embed_scale=True,
                query_pre_attn_scalar=float(r.get("query_pre_attn_scalar", 256)))


def read_gemma2(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    out = gemma_common(r)
    rope = single_rope(r, c)
    return out | dict(
        layer_types=layer_types(r, c["num_layers"], lambda i: SLIDING if (i + 1) % 2 else FULL),
        sliding_window=r.get("sliding_window", 4096),
        rope={FULL: rope, SLIDING: rope},
        attn_softcap=r.get("attn_logit_softcapping", 50.0),
        final_softcap=r.get("final_logit_softcapping", 30.0),
    )


def read_gemma3(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    out = gemma_common(r)
    pattern = r.get("sliding_window_pattern", 6)
    # Two RoPE bases: rope_parameters nested by layer type (transformers 5),
    # or rope_theta + rope_scaling for global layers and
    # rope_local_base_freq for sliding ones (transformers 4).
    nested, scaling = r.get("rope_parameters") or {}, r.get("rope_scaling")
    if FULL in nested or SLIDING in nested:
        unknown = set(nested) - {FULL, SLIDING}
        if unknown:
            raise UnsupportedConfig(f"gemma3: rope_parameters for layer types {sorted(unknown)} are not supported")
        full, local = dict(nested.get(FULL) or {}) | (scaling or {}), dict(nested.get(SLIDING) or {})
    else:
        full, local = dict(scaling or nested), {}
    kw = dict(head_dim=c["head_dim"], max_position_embeddings=c["max_position_embeddings"])
    rope = {
        FULL: rope_spec(full, "gemma3 full_attention", theta=r.get("rope_theta", 1_000_000.0), **kw),
        SLIDING: rope_spec(local, "gemma3 sliding_attention", theta=r.get("rope_local_base_freq", 10_000.0), **kw),
    }
    return out | dict(
        layer_types=layer_types(r, c["num_layers"], lambda i: SLIDING if (i + 1) % pattern else FULL),
        sliding_window=r.get("sliding_window", 4096),
        rope=rope,
        qk_norm=True,
        attn_softcap=r.get("attn_logit_softcapping"),
        final_softcap=r.get("final_logit_softcapping"),
    )


def read_phi3(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    silu_only(r)
    no_bias(r)
    rope = single_rope(r, c, allow_partial=True)
    window = r.get("sliding_window")
    kind = FULL if window is None else SLIDING
    return dict(layer_types=(kind,) * c["num_layers"], sliding_window=window, rope={kind: rope})


def split_phi3(name: str, t: LazyTensor, cfg: ModelConfig) -> Iterator[tuple[str, LazyTensor]]:
    """Phi-3 stores q/k/v and gate/up fused; the decoder keeps them apart.
    Split without reading, so a tensor-parallel rank still reads only its
    own rows of each part."""
    if name.endswith("self_attn.qkv_proj.weight"):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        prefix = name.removesuffix("qkv_proj.weight")
        yield prefix + "q_proj.weight", t.rows(0, q)
        yield prefix + "k_proj.weight", t.rows(q, kv)
        yield prefix + "v_proj.weight", t.rows(q + kv, kv)
    elif name.endswith("mlp.gate_up_proj.weight"):
        prefix = name.removesuffix("gate_up_proj.weight")
        half = t.shape[0] // 2
        yield prefix + "gate_proj.weight", t.rows(0, half)
        yield prefix + "up_proj.weight", t.rows(half, half)
    else:
        yield name, t


def text_model_config(cfg: dict[str, Any], arch: str, model_type: str) -> dict[str, Any]:
    """A multimodal config.json -> its text model's, as a text-only config.
    Keys of the outer config are vision-only (ignored: text prompts never
    reach the vision tower), merged in, or refused."""
    merged = {"text_config", "eos_token_id", "bos_token_id", "tie_word_embeddings", "is_encoder_decoder"}
    outer = set(cfg) - set(COMMON_IGNORED) - set(VISION_IGNORED) - merged
    if outer:
        raise UnsupportedConfig(f"{arch} config.json has keys the executor does not implement: {sorted(outer)}")
    text = dict(cfg.get("text_config") or {})
    text.update(architectures=[arch], model_type=text.get("model_type", model_type))
    if "tie_word_embeddings" in cfg:  # HF ties the head by the outer config's flag
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    text["eos_token_id"] = list(eos_ids(text.get("eos_token_id"), cfg.get("eos_token_id")))
    for key in ("bos_token_id", "is_encoder_decoder"):
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    return text


def text_weights_only(name: str, t: LazyTensor, cfg: ModelConfig) -> Iterator[tuple[str, LazyTensor]]:
    """Multimodal checkpoints keep the text model under language_model
    (transformers 5: model.language_model.*, 4: language_model.model.*);
    the vision tower and projector are not loaded."""
    if cfg.architecture not in family_of(cfg).multimodal:
        yield name, t
        return
    for prefix, to in (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.lm_head.", "lm_head.")):
        if name.startswith(prefix):
            yield to + name.removeprefix(prefix), t
            return
    if name.startswith("lm_head."):
        yield name, t
        return
    if not name.startswith(VISION_PREFIXES):
        yield name, t  # unknown: build_model reports it as unexpected


VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")
VISION_IGNORED = {
    "vision_config": "vision tower: served text-only",
    "mm_tokens_per_image": "vision tower: served text-only",
    "boi_token_index": "vision tower: served text-only",
    "eoi_token_index": "vision tower: served text-only",
    "image_token_index": "vision tower: served text-only",
}
GEMMA_IGNORED = {"hidden_act": "Gemma's modeling reads hidden_activation; hidden_act is a legacy duplicate"}
DROPOUT = "training only: dropout is off at inference"

FAMILIES = (
    Family("llama", ("LlamaForCausalLM",), ("llama",), read_llama, defaults={"rms_norm_eps": 1e-6}),
    Family("mistral", ("MistralForCausalLM",), ("mistral",), read_mistral,
           defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32}),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), read_qwen2,
           defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768}),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), read_qwen3,
           defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 128}),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), read_gemma2,
           defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "head_dim": 256,
                     "tie_word_embeddings": True},
           ignored=GEMMA_IGNORED),
    Family("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), ("gemma3_text",), read_gemma3,
           defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "head_dim": 256,
                     "tie_word_embeddings": True},
           ignored=GEMMA_IGNORED | {"_sliding_window_pattern": "transformers 5's copy of sliding_window_pattern"},
           rename=text_weights_only, multimodal=("Gemma3ForConditionalGeneration",)),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), read_phi3,
           defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
           ignored={"resid_pdrop": DROPOUT, "embd_pdrop": DROPOUT,
                    "original_max_position_embeddings": "used by longrope only, which is refused"},
           rename=split_phi3),
)

REFUSED_ARCHITECTURES = {
    "Phi3SmallForCausalLM": "Phi-3-small uses block-sparse attention, which is not implemented",
    "MixtralForCausalLM": "mixture-of-experts MLPs are not implemented",
}


def supported() -> str:
    return ", ".join(a for f in FAMILIES for a in f.architectures)


def family_for(cfg: dict[str, Any]) -> tuple[Family, str]:
    """The family serving this config.json, and the architecture name."""
    archs = cfg.get("architectures") or []
    if len(archs) > 1:
        raise UnsupportedConfig(f"config.json names several architectures {archs}; expected one of {supported()}")
    for arch in archs:
        if arch in REFUSED_ARCHITECTURES:
            raise UnsupportedConfig(f"architecture {arch} is not supported: {REFUSED_ARCHITECTURES[arch]}")
        for fam in FAMILIES:
            if arch in fam.architectures:
                return fam, arch
        raise UnsupportedConfig(f"architecture {arch} is not supported; supported: {supported()}")
    model_type = cfg.get("model_type")
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam, fam.architectures[0]
    raise UnsupportedConfig(
        f"config.json names no architecture and model_type {model_type!r} is not supported; supported: {supported()}"
    )


def read_config(cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    fam, arch = family_for(cfg)
    if arch in fam.multimodal:
        cfg = text_model_config(cfg, arch, fam.model_types[0])
    r = ConfigReader(cfg, fam.name)
    d = fam.defaults
    r.refuse_unless("is_encoder_decoder", False, "the served families are decoder-only")
    hidden, heads = r.require("hidden_size"), r.require("num_attention_heads")
    common: dict[str, Any] = dict(
        vocab_size=r.require("vocab_size"),
        hidden_size=hidden,
        intermediate_size=r.require("intermediate_size"),
        num_layers=r.require("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=r.get("num_key_value_heads", heads),
        head_dim=r.get("head_dim", d.get("head_dim", hidden // heads)),
        max_position_embeddings=r.get("max_position_embeddings", d.get("max_position_embeddings", 2048)),
        rms_norm_eps=r.get("rms_norm_eps", d["rms_norm_eps"]),
        tie_word_embeddings=r.get("tie_word_embeddings", d.get("tie_word_embeddings", False)),
        bos_token_id=r.get("bos_token_id"),
        # generation_config.json is where instruct models list their
        # turn-end tokens; HF generate() stops on those.
        eos_token_ids=eos_ids(r.get("eos_token_id"), (generation_config or {}).get("eos_token_id")),
    )
    specific = fam.read(r, common)
    ignored = COMMON_IGNORED | fam.ignored
    leftover = r.leftover(ignored)
    if leftover:
        raise UnsupportedConfig(
            f"{fam.name} config.json has keys the executor does not implement and that may change the forward "
            f"pass: {leftover}; it reads {sorted(r.used)} and ignores {sorted(ignored)}"
        )
    window = specific.get("sliding_window")
    if window is not None and window < 1:
        raise UnsupportedConfig(f"{fam.name}: sliding_window={window} must be at least 1")
    return ModelConfig(architecture=arch, family=fam.name, **common, **specific, read_keys=frozenset(r.used),
                       ignored={k: ignored[k] for k in cfg if k in ignored})


def family_of(cfg: ModelConfig) -> Family:
    return next(f for f in FAMILIES if f.name == cfg.family)

