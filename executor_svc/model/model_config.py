"""The hyper-parameters the shared decoder needs, read from an HF config.json.

Reading is strict: every key of config.json is either read, listed as
deliberately ignored (with the reason), or refused by name. A key the
executor does not know may change the forward pass, so serving the
checkpoint anyway could produce wrong tokens without any sign of it.
What differs per family (which keys exist, their defaults, which values are
allowed) lives in the executor_svc/families package, which reads config.json
into a ModelConfig (families.read_config).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

FULL, SLIDING = "full_attention", "sliding_attention"


class UnsupportedConfig(ValueError):
    """config.json asks for something the executor does not implement."""


# Keys every transformers config may carry that do not change inference.
COMMON_IGNORED: dict[str, str] = {
    "_name_or_path": "informational",
    "architectures": "read to pick the family",
    "model_type": "read to pick the family",
    "transformers_version": "informational",
    "dtype": "the executor's dtype is EXECUTOR_DTYPE; weights are cast on load",
    "torch_dtype": "the executor's dtype is EXECUTOR_DTYPE; weights are cast on load",
    "use_cache": "the executor always uses its paged KV cache",
    "initializer_range": "training only: weight initialisation",
    "attention_dropout": "training only: dropout is off at inference",
    "output_hidden_states": "HF forward() output option",
    "output_attentions": "HF forward() output option",
    "return_dict": "HF forward() output option",
    "chunk_size_feed_forward": "HF memory option; same result",
    "id2label": "sequence-classification heads only",
    "label2id": "sequence-classification heads only",
    "problem_type": "sequence-classification heads only",
    "pad_token_id": "padding is never attended: batches are unpadded",
    "auto_map": "remote-code class names; the executor never runs remote code",
    "pretraining_tp": "a training-time matmul split; HF >= 4.x computes the same product without it",
    "cache_implementation": "HF generate() cache choice; the executor uses its paged cache",
}


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One RoPE variant: the base, how frequencies are rescaled, and how many
    leading dims of each head it rotates."""

    rope_type: str  # default | linear | llama3 | yarn
    theta: float
    rotary_dim: int
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    # YaRN: the band between beta_fast and beta_slow rotations is blended
    # from interpolated to original frequencies (bounds rounded out to whole
    # dims with truncate), and cos/sin are scaled by attention_factor.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        """[rotary_dim / 2] fp32 inverse frequencies, computed as HF does."""
        d = self.rotary_dim
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            # Llama 3.1: long wavelengths are slowed by `factor`, short ones
            # kept, and the band between interpolated smoothly.
            old_len = self.original_max_position_embeddings
            low_wavelen, high_wavelen = old_len / self.low_freq_factor, old_len / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        if self.rope_type == "yarn":
            return self._yarn_inv_freq(device)
        return inv

    def _yarn_inv_freq(self, device: torch.device | None) -> torch.Tensor:
        """As transformers' _compute_yarn_parameters, operation for operation."""
        d, base, old_len = self.rotary_dim, self.theta, self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (d * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # as HF: no zero-width ramp
        pos_freqs = base ** (torch.arange(0, d, 2).to(device=device, dtype=torch.float) / d)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp.to(device=device, dtype=torch.float)
        return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor

    def describe(self) -> str:
        return self.rope_type if self.rope_type == "default" else f"{self.rope_type}(factor={self.factor:g})"


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `scale` times longer."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True, slots=True)
class MoESpec:
    """A mixture-of-experts MLP (executor_svc/model/moe.py): a router picks top_k
    of num_experts per token; their outputs, weighted, are summed, plus an
    optional shared expert. Each field says how one family's router
    differs, so one layer serves all of them."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    # Which layers have experts (the others keep the dense MLP of intermediate_size).
    sparse_layers: tuple[bool, ...]
    # softmax: softmax over all experts, then top-k (Mixtral, Qwen-MoE);
    # topk_softmax: top-k of the logits, then softmax over those (gpt-oss);
    # sigmoid: sigmoid scores, top-k chosen on scores + correction bias (DeepSeek-V3).
    scoring: str = "softmax"
    norm_topk_prob: bool = False  # renormalise the top-k weights to sum to 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    # Group-limited routing (DeepSeek-V3): experts in n_group groups; only
    # experts of the topk_group groups with the best top-2 sums compete.
    n_group: int = 1
    topk_group: int = 1
    router_bias: bool = False  # gpt-oss: the router's linear layer has a bias
    correction_bias: bool = False  # DeepSeek-V3: e_score_correction_bias, for choosing only
    router_fp32: bool = False  # DeepSeek-V3: router logits computed in fp32 whatever the dtype
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output times sigmoid(linear(x))
    expert_bias: bool = False  # gpt-oss: biases on the experts' projections
    # gpt-oss's SwiGLU: gate clamped above, up clamped both ways at swiglu_limit,
    # out = (up + 1) * gate * sigmoid(alpha * gate). None: silu(gate) * up.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702


@dataclass(frozen=True, slots=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3, executor_svc/model/mla.py):
    keys and values are decompressed per head from one latent per token,
    which is all the KV cache holds."""

    q_lora_rank: int | None  # None: q is one projection of the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # RoPE over interleaved (even, odd) pairs rather than the two halves
    # Softmax scale: qk_head_dim^-1/2, times YaRN's mscale(factor, mscale_all_dim)^2.
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class ActivationQuant:
    """Activations quantized at run time to FP8 e4m3 (type "float"), int8
    (type "int") or NVFP4 (type "fp4"): dynamic, per token (group_size
    None) or per group of columns, with a scale computed from each row's
    values; or static, one scale per tensor from the checkpoint
    (`input_scale`). NVFP4 is dynamic per group of 16 with FP8 group
    scales over a static global scale (`input_global_scale`)."""

    type: str
    group_size: int | None = None
    dynamic: bool = True

    @property
    def checkpoint_leaf(self) -> str | None:
        """The per-layer tensor these activations' scales need, if any."""
        if self.type == "fp4":
            return "input_global_scale"
        return None if self.dynamic else "input_scale"

    def describe(self) -> str:
        if self.type == "fp4":
            return f"nvfp4 per group {self.group_size} over a static global scale"
        what = "fp8" if self.type == "float" else "int8"
        if not self.dynamic:
            return f"{what} per tensor, static"
        return f"{what} per {'token' if self.group_size is None else f'group {self.group_size}'}"


@dataclass(frozen=True, slots=True)
class LinearScheme:
    """How one linear layer's weight is stored, as the layers hold it
    (layers.py) and as its checkpoint lays it out (quant_formats.py).

    kind "fp8": the weight in float8_e4m3fn and float32 scales, one per
    block of rows x columns (`block`), or one per row (block None: a
    checkpoint's per-channel or per-tensor scales). kind "int": unsigned
    `bits`-bit integers packed into bytes, with one scale and zero point
    per `group_size` columns of a row (None: the whole row), and, with
    act_order, a g_idx naming each column's group. kind "fp4": E2M1 values
    two to a byte, with one scale per `group_size` columns (NVFP4: FP8 over
    a global scale; MXFP4: a power of two)."""

    kind: str  # "fp8" | "int" | "fp4"
    # The checkpoint's: "fp8", "fp8-row", "ct-float", "ct-pack", "ct-int", "gptq", "awq", "ct-nvfp4",
    # "ct-mxfp4", "modelopt-nvfp4" (quant_formats.py).
    layout: str
    bits: int = 8
    block: tuple[int, int] | None = None
    group_size: int | None = None
    symmetric: bool = True
    act_order: bool = False
    activations: ActivationQuant | None = None

    def split_units(self) -> tuple[int, int]:
        """The rows and columns a tensor-parallel rank's part of such a
        weight must be a multiple of: FP8 blocks; for packed values, whole
        bytes of 4 bits and, split by columns, whole groups (act-order keeps
        every group on every rank)."""
        if self.kind == "fp8":
            return self.block or (1, 1)
        cols = 2 if self.bits == 4 else 1
        if self.group_size is not None and not self.act_order:
            cols = math.lcm(cols, self.group_size)
        return 1, cols

    def describe(self) -> str:
        if self.kind == "fp8":
            weights = f"fp8 blocks {list(self.block)}" if self.block else "fp8 per channel"
        elif self.kind == "fp4":
            weights = "mxfp4" if self.layout == "ct-mxfp4" else "nvfp4"
        else:
            groups = "per channel" if self.group_size is None else f"group {self.group_size}"
            weights = f"int{self.bits} {groups}{'' if self.symmetric else ' asymmetric'}"
            weights += " act-order" if self.act_order else ""
        return weights + (f", activations {self.activations.describe()}" if self.activations else "")


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """How a checkpoint stores its weights, from quantization_config
    (executor_svc/model/quantization.py reads it).

    Each scheme applies to the linear layers its targets match ("Linear",
    a checkpoint module name, or "re:" and a regex matched from the start),
    unless `not_converted` names them (modules_to_not_convert,
    ignored_layers, compressed-tensors' ignore). mxfp4: gpt-oss's experts,
    kept packed (families/gpt_oss.py)."""

    method: str  # "fp8" | "compressed-tensors" | "gptq" | "awq" | "modelopt" | "mxfp4"
    schemes: tuple[tuple[tuple[str, ...], LinearScheme], ...] = ()
    not_converted: tuple[str, ...] = ()

    @property
    def weight_block(self) -> tuple[int, int] | None:
        """The FP8 block of a quant_method fp8 checkpoint (experts read it)."""
        if self.method == "fp8" and self.schemes:
            return self.schemes[0][1].block
        return None

    def describe(self) -> str:
        """For the start-up log and ServerInfo: "fp8 blocks [128, 128]", "mxfp4"."""
        if not self.schemes:
            return self.method
        kinds = sorted({s.describe() for _, s in self.schemes})
        return kinds[0] if self.method == "fp8" and len(kinds) == 1 else f"{self.method}: {'; '.join(kinds)}"

    def scheme_for(self, module_name: str) -> LinearScheme | None:
        """The scheme of one checkpoint linear, or None when it is kept plain."""
        if _matches(self.not_converted, module_name, suffix=self.method != "compressed-tensors"):
            return None
        for targets, scheme in self.schemes:
            if _matches(targets, module_name, suffix=False):
                return scheme
        return None


def _matches(patterns: tuple[str, ...], module_name: str, suffix: bool) -> bool:
    """HF's and compressed-tensors' rules: "Linear" (every linear here), "re:"
    and a regex matched from the start, or a name; HF's modules_to_not_convert
    match a prefix at a module boundary, or a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for p in patterns:
        if p == "Linear" or p == module_name:
            return True
        if p.startswith("re:"):
            if re.match(p[3:], module_name):
                return True
        elif suffix and (re.match(f"(?:{p}){boundary}", module_name) or module_name.endswith(p)):
            return True
    return False


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Per layer: FULL or SLIDING; SLIDING layers attend to the last
    # `sliding_window` positions only (a query at i sees keys i-W < j <= i).
    layer_types: tuple[str, ...]
    rope: dict[str, RopeSpec]  # by layer type
    sliding_window: int | None = None
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh
    qkv_bias: bool = False  # Qwen2, gpt-oss: biases on q, k and v
    o_bias: bool = False  # gpt-oss: a bias on o_proj too
    norm_unit_offset: bool = False  # Gemma: RMSNorm scales by (1 + w)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power, not head_dim's
    attn_softcap: float | None = None  # Gemma 2: scores = c * tanh(scores / c)
    final_softcap: float | None = None  # Gemma 2: logits = c * tanh(logits / c)
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    # How the checkpoint stores weights, when not plainly (quantization.py).
    quantization: QuantSpec | None = None
    # What reading config.json did with each key, for the log and the tests.
    read_keys: frozenset[str] = field(default=frozenset(), compare=False)
    ignored: dict[str, str] = field(default_factory=dict, compare=False)  # key -> why

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def rope_description(self) -> str:
        kinds = {t: self.rope[t].describe() for t in sorted(set(self.layer_types))}
        if len(set(kinds.values())) == 1 and len(set(self.rope[t].theta for t in kinds)) == 1:
            return next(iter(kinds.values()))
        return ",".join(f"{t}={k}(theta={self.rope[t].theta:g})" for t, k in kinds.items())


class ConfigReader:
    """config.json as a dict that remembers which keys were read, so that
    whatever is left can be refused by name."""

    def __init__(self, cfg: dict[str, Any], family: str):
        self.cfg, self.family = cfg, family
        self.used: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        value = self.cfg.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        self.used.add(key)
        if self.cfg.get(key) is None:
            raise UnsupportedConfig(f"{self.family} config.json lacks {key!r}")
        return self.cfg[key]

    def refuse_unless(self, key: str, allowed: Any, why: str) -> None:
        """Reads `key` and refuses any value but `allowed` (absent or null counts as allowed)."""
        value = self.get(key)
        if value is not None and value != allowed:
            raise UnsupportedConfig(f"{self.family} config.json: {key}={value!r} is not supported; {why}")

    def leftover(self, ignored: dict[str, str]) -> list[str]:
        return sorted(k for k in self.cfg if k not in self.used and k not in ignored)


# RoPE parameters each implemented type reads; anything else in the dict is refused.
ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta", "partial_rotary_factor"},
    "linear": {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor"},
    "llama3": {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "low_freq_factor",
               "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
             "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"},
}
REFUSED_ROPE_TYPES = ("dynamic", "longrope")


def rope_spec(params: dict[str, Any], family: str, *, theta: float, head_dim: int, max_position_embeddings: int,
              partial_rotary_factor: float = 1.0, allow_partial: bool = False) -> RopeSpec:
    """One RoPE dict (either layout) -> RopeSpec. `theta` and
    `partial_rotary_factor` are the fallbacks from the top level of config.json."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_KEYS:
        known = rope_type in REFUSED_ROPE_TYPES
        extra = f" ({', '.join(REFUSED_ROPE_TYPES)} are known but not implemented)" if known else ""
        raise UnsupportedConfig(
            f"{family}: RoPE type {rope_type!r} is not supported{extra}; supported: {', '.join(ROPE_KEYS)}"
        )
    unknown = sorted(set(params) - ROPE_KEYS[rope_type])
    if unknown:
        raise UnsupportedConfig(
            f"{family}: RoPE parameters {unknown} are not read for rope_type {rope_type!r}; "
            f"supported: {sorted(ROPE_KEYS[rope_type])}"
        )
    partial = params.get("partial_rotary_factor", partial_rotary_factor)
    if partial != 1.0 and not allow_partial:
        raise UnsupportedConfig(f"{family}: partial_rotary_factor={partial} is not supported for this family "
                                "(only Phi-3 rotates part of each head)")
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise UnsupportedConfig(f"{family}: partial_rotary_factor={partial} gives an odd rotary dim {rotary_dim}")
    spec = RopeSpec(rope_type=rope_type, theta=float(params.get("rope_theta", theta)), rotary_dim=rotary_dim)
    if rope_type == "linear":
        return RopeSpec(rope_type, spec.theta, rotary_dim, factor=float(params["factor"]))
    if rope_type == "llama3":
        return RopeSpec(
            rope_type, spec.theta, rotary_dim,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings",
                                                            max_position_embeddings)),
        )
    if rope_type == "yarn":
        return yarn_spec(params, spec.theta, rotary_dim, max_position_embeddings)
    return spec


def yarn_spec(params: dict[str, Any], theta: float, rotary_dim: int, max_position_embeddings: int) -> RopeSpec:
    """HF's reading of a yarn dict: an absent original length is
    max_position_embeddings; an absent factor, their ratio; an absent
    attention_factor comes from mscale and mscale_all_dim when both are
    set (DeepSeek), else from the factor alone."""
    old_len = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    factor = params.get("factor")
    factor = float(max_position_embeddings / old_len if factor is None else factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return RopeSpec("yarn", theta, rotary_dim, factor=factor, original_max_position_embeddings=old_len,
                    beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                    truncate=bool(params.get("truncate", True)), attention_factor=float(attention_factor))


def eos_ids(*values: Any) -> tuple[int, ...]:
    """Union of eos_token_id values (int, list or None), first-seen order."""
    out: list[int] = []
    for v in values:
        for i in (v if isinstance(v, list) else [] if v is None else [v]):
            if i not in out:
                out.append(int(i))
    return tuple(out)
