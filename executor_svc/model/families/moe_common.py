"""Config reading the MoE families share: expert counts under either name,
which layers have experts, and the router keys that only train."""

from __future__ import annotations

from typing import Any

from executor_svc.model.families.base import ROUTER_TRAINING
from executor_svc.model.model_config import ConfigReader, UnsupportedConfig

MOE_IGNORED = {
    "router_aux_loss_coef": ROUTER_TRAINING,
    "output_router_logits": "HF forward() output option (router logits for the auxiliary loss)",
}


def num_experts(r: ConfigReader, *keys: str) -> int:
    """transformers renames keys between versions (Qwen3-MoE's num_experts
    is saved as num_local_experts by transformers 5): read whichever is set,
    and refuse two that disagree."""
    values = {k: r.get(k) for k in keys}
    found = {v for v in values.values() if v is not None}
    if len(found) != 1:
        raise UnsupportedConfig(f"{r.family} config.json: expected one expert count in {list(keys)}, got {values}")
    return int(found.pop())


def sparse_layers(r: ConfigReader, c: dict[str, Any], experts: int) -> tuple[bool, ...]:
    """Qwen-MoE: experts on every decoder_sparse_step-th layer (1-based)
    except those in mlp_only_layers."""
    step = r.get("decoder_sparse_step", 1)
    dense = set(r.get("mlp_only_layers") or [])
    return tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(c["num_layers"]))
