"""Phi-3: Llama with partial rotary dims and fused q/k/v and gate/up
tensors in its checkpoints (split at load)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from executor_svc.model.checkpoint import LazyTensor
from executor_svc.model.families.base import DROPOUT, Family, no_bias, silu_only, single_rope
from executor_svc.model.model_config import FULL, SLIDING, ConfigReader, ModelConfig


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


FAMILY = Family("phi3", ("Phi3ForCausalLM",), ("phi3",), read_phi3,
                defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
                ignored={"resid_pdrop": DROPOUT, "embd_pdrop": DROPOUT,
                         "original_max_position_embeddings": "used by longrope only, which is refused"},
                rename=split_phi3)
