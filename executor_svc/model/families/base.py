"""What every family module is made of, and the config-reading pieces
several families share.

A family module (llama.py, qwen3.py, ...) defines one `Family`: which
config.json keys it reads (with HF's defaults for absent ones), which it
ignores and why, how its checkpoint names map onto the decoder's, and which
model class it builds (CausalLM unless its layers differ from Llama's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from executor_svc.model.model import CausalLM, Rename
from executor_svc.model.model_config import FULL, SLIDING, ConfigReader, RopeSpec, UnsupportedConfig, rope_spec


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
    # One checkpoint tensor -> the decoder's parameters it fills (without reading it).
    rename: Rename | None = None
    # Multimodal architectures whose text model is this family: served text-only.
    multimodal: tuple[str, ...] = ()
    # The decoder: CausalLM, or a subclass whose attention or MLP differs.
    model_cls: type[CausalLM] = CausalLM


DROPOUT = "training only: dropout is off at inference"
ROUTER_TRAINING = "training only: the router's auxiliary loss"


def single_rope(r: ConfigReader, c: dict[str, Any], *, allow_partial: bool = False, rotary_dim: int | None = None,
                default: dict[str, Any] | None = None, theta: float = 10000.0) -> RopeSpec:
    """transformers 4 (rope_theta + rope_scaling) or 5 (rope_parameters).
    As in HF, rope_scaling wins when both are present; `default` and `theta`
    are the family's config class defaults when config.json has neither."""
    scaling, params = r.get("rope_scaling"), r.get("rope_parameters")
    params = dict(scaling or params or default or {})
    return rope_spec(
        params, r.family, theta=r.get("rope_theta", theta), head_dim=rotary_dim or c["head_dim"],
        max_position_embeddings=c["max_position_embeddings"],
        partial_rotary_factor=r.get("partial_rotary_factor", 1.0), allow_partial=allow_partial,
    )


def silu_only(r: ConfigReader) -> None:
    r.refuse_unless("hidden_act", "silu", "this family's MLP is implemented with silu only")


def no_bias(r: ConfigReader) -> None:
    r.refuse_unless("attention_bias", False, "q/k/v/o projection biases are implemented for Qwen2 and gpt-oss only")


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
