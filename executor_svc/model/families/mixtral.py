"""Mixtral: Mistral with a mixture of experts in place of every MLP:
softmax over all experts, top-k, the k weights renormalised."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from executor_svc.model.checkpoint import LazyTensor
from executor_svc.model.families.base import Family, no_bias, silu_only
from executor_svc.model.families.mistral import read_mistral
from executor_svc.model.families.moe_common import MOE_IGNORED, num_experts
from executor_svc.model.model_config import ConfigReader, ModelConfig, MoESpec
from executor_svc.model.moe import MoECausalLM


def read_mixtral(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    silu_only(r)
    no_bias(r)
    experts = num_experts(r, "num_local_experts", "num_experts")
    moe = MoESpec(num_experts=experts, top_k=r.get("num_experts_per_tok", 2),
                  intermediate_size=c["intermediate_size"], sparse_layers=(True,) * c["num_layers"],
                  scoring="softmax", norm_topk_prob=True)
    return read_mistral(r, c) | dict(moe=moe)


def rename_mixtral(name: str, t: LazyTensor, cfg: ModelConfig) -> Iterator[tuple[str, LazyTensor]]:
    """block_sparse_moe.experts.{e}.w1/w3/w2 (gate, up, down) -> mlp.experts.{e}.gate_proj/up_proj/down_proj."""
    if ".block_sparse_moe." in name:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for old, new in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
            name = name.replace(old, new)
    yield name, t


FAMILY = Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), read_mixtral,
                defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32},
                ignored=MOE_IGNORED | {"router_jitter_noise": "training only: the router's input jitter"},
                rename=rename_mixtral, model_cls=MoECausalLM)
