"""gpt-oss: Llama with

- attention sinks: one learned logit per head joins the softmax and weighs
  no value;
- q/k/v and o biases, sliding and full layers alternating, YaRN RoPE;
- a MoE on every layer: a router with a bias, top-k of its logits then a
  softmax over those k; experts with biases and a clamped SwiGLU
  ((up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit).

Checkpoints keep all experts in one tensor per projection, [experts, in,
out], gate and up interleaved (gate at even columns); the released ones
hold them in MXFP4, kept packed: dequantized one routed expert at a time
(executor_svc/model/mxfp4.py) on the torch path, decoded inside the fused-MoE
kernel on the triton path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from executor_svc.model.checkpoint import LazyTensor
from executor_svc.model.families.base import Family, layer_types, single_rope
from executor_svc.model.families.moe_common import MOE_IGNORED, num_experts
from executor_svc.model.layers import check_shape, materialize
from executor_svc.model.model import Attention
from executor_svc.model.model_config import FULL, SLIDING, ConfigReader, ModelConfig, MoESpec, QuantSpec, UnsupportedConfig
from executor_svc.model.moe import FusedExperts, MoECausalLM
from executor_svc.model.mxfp4 import dequantize
from executor_svc.model.sharding import Shard

# transformers' GptOssConfig default when config.json names no RoPE.
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
QUANTIZATION_KEYS = {"quant_method", "modules_to_not_convert"}


class SinkAttention(Attention):
    """Attention whose softmax has one more logit per head (this rank's heads)."""

    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard, comm):
        super().__init__(cfg, layer, shard, comm)
        self.whole_heads, self.first_head = cfg.num_heads, shard.rank * self.num_heads
        self.sinks = nn.Parameter(torch.empty(self.num_heads))  # [this rank's heads]

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"sinks": (self.whole_heads,)}

    def load_weight(self, name: str, weight: LazyTensor, device: torch.device, dtype: torch.dtype) -> None:
        value = weight.read(0, self.first_head, self.first_head + self.num_heads)
        materialize(self, name, device, dtype).copy_(value)

    def attend(self, q, k_cache, v_cache, meta, backend) -> torch.Tensor:
        return backend.attend(q, k_cache, v_cache, meta, self.scale, sliding_window=self.sliding_window,
                              sinks=self.sinks, k_scale=self.k_scale, v_scale=self.v_scale)


class GptOssExperts(FusedExperts):
    """Experts from gpt-oss's fused tensors (plain or MXFP4), each rank
    reading its intermediate units: a contiguous range of the interleaved
    gate/up columns, and of down's rows.

    MXFP4 experts stay packed (4-bit values and one scale byte per group of
    32, about 0.27x their bf16 bytes). The torch loop dequantizes an expert
    when a token is routed to it (expert_weights), as FP8 experts are; the
    triton path's kernel decodes the blocks in its load loop (kernel_weights). gate/up's rows are
    reordered at load, gate rows then up rows, as the dense w13 holds them.
    Down's groups run along this rank's units: when the units split a group,
    the rank keeps the groups that cover them and cuts after dequantizing."""

    def __init__(self, cfg: ModelConfig, spec: MoESpec, shard: Shard):
        super().__init__(cfg, spec, shard)
        self.mxfp4 = cfg.quantization is not None and cfg.quantization.method == "mxfp4"
        if self.mxfp4:
            self.w13 = self.w2 = None  # packed instead: w13_blocks, w13_scales, w2_blocks, w2_scales
            lo, hi = self.start, self.start + self.inter
            self.w2_groups = (lo // 32, -(-hi // 32))  # down's groups that cover this rank's units
            self.w2_offset = lo - self.w2_groups[0] * 32  # where the units start in them

    @property
    def packed(self) -> bool:
        return self.mxfp4 or super().packed

    def kernel_weights(self):
        """The packed blocks as the fused-MoE kernel reads them: down's K
        columns start w2_offset into the groups this rank keeps."""
        if not self.mxfp4:
            return super().kernel_weights()
        from llmsched_kernels.fused_moe import QuantizedExperts

        return (QuantizedExperts.mxfp4(self.w13_blocks, self.w13_scales),
                QuantizedExperts.mxfp4(self.w2_blocks, self.w2_scales, col0=self.w2_offset, k=self.inter))

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.mxfp4:
            return super().expert_weights(e, dtype)
        w2 = dequantize(self.w2_blocks[e], self.w2_scales[e], dtype)  # [hidden, covering groups * 32]
        return (dequantize(self.w13_blocks[e], self.w13_scales[e], dtype),
                w2[:, self.w2_offset : self.w2_offset + self.inter])

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        e, h, i = self.spec.num_experts, self.hidden, self.whole_inter
        shapes = {"gate_up_proj_bias": (e, 2 * i), "down_proj_bias": (e, h)}
        if self.mxfp4:
            return shapes | {"gate_up_proj_blocks": (e, 2 * i, h // 32, 16), "gate_up_proj_scales": (e, 2 * i, h // 32),
                             "down_proj_blocks": (e, h, i // 32, 16), "down_proj_scales": (e, h, i // 32)}
        return shapes | {"gate_up_proj": (e, h, 2 * i), "down_proj": (e, i, h)}

    def load_weight(self, name: str, weight: LazyTensor, device: torch.device, dtype: torch.dtype) -> None:
        lo, hi = self.start, self.start + self.inter
        if name == "gate_up_proj":  # [experts, hidden, 2 * inter], gate at even columns
            self._set_gate_up(weight.read(2, 2 * lo, 2 * hi).transpose(1, 2), device, dtype)
        elif name == "down_proj":  # [experts, inter, hidden]
            self._set("w2", weight.read(1, lo, hi).transpose(1, 2), device, dtype)
        elif name == "gate_up_proj_bias":  # [experts, 2 * inter], interleaved
            part = weight.read(1, 2 * lo, 2 * hi)
            self._set("b13", torch.cat([part[:, 0::2], part[:, 1::2]], dim=1), device, dtype)
        elif name == "down_proj_bias":  # added once: rank 0 holds it, the others zeros
            value = weight.read()
            self._set("b2", value if self.rank == 0 else torch.zeros_like(value), device, dtype)
        else:
            self._load_mxfp4(name, weight, device, dtype)

    def _load_mxfp4(self, name: str, weight: LazyTensor, device: torch.device, dtype: torch.dtype) -> None:
        proj, _, part = name.rpartition("_")  # gate_up_proj | down_proj, blocks | scales
        lo, hi = self.start, self.start + self.inter
        if proj == "gate_up_proj":  # [experts, 2 * inter interleaved, groups(, 16)]: this rank's rows
            rows = weight.read(1, 2 * lo, 2 * hi)
            self._keep(f"w13_{part}", torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=1), device)  # gate, then up
        else:  # down: [experts, hidden, groups(, 16)], the groups covering this rank's units
            self._keep(f"w2_{part}", weight.read(2, *self.w2_groups), device)

    def _keep(self, leaf: str, value: torch.Tensor, device: torch.device) -> None:
        """A packed tensor, as stored (uint8), copied off the mmapped file."""
        setattr(self, leaf, nn.Parameter(value.to(device=device, dtype=torch.uint8, copy=True), requires_grad=False))

    def _set_gate_up(self, rows: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        """rows: [experts, 2 * inter, hidden], gate and up interleaved."""
        self._set("w13", torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=1), device, dtype)

    def _set(self, leaf: str, value: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        target = materialize(self, leaf, device, dtype)
        check_shape(leaf, value, tuple(target.shape))
        target.copy_(value)


class GptOssForCausalLM(MoECausalLM):
    attention_cls = SinkAttention
    experts_cls = GptOssExperts


def read_gpt_oss(r: ConfigReader, c: dict[str, Any]) -> dict[str, Any]:
    n = c["num_layers"]
    bias = r.get("attention_bias", True)
    rope = single_rope(r, c, default=DEFAULT_ROPE, theta=150000.0)
    experts = num_experts(r, "num_local_experts", "num_experts")
    top_k = r.get("num_experts_per_tok", 4)
    if r.get("experts_per_token", top_k) != top_k:  # the original release's name for it
        raise UnsupportedConfig(f"gpt_oss config.json: experts_per_token={r.get('experts_per_token')} differs from "
                                f"num_experts_per_tok={top_k}")
    quantization = r.get("quantization_config")
    if quantization is not None:
        unknown = sorted(set(quantization) - QUANTIZATION_KEYS)
        if quantization.get("quant_method") != "mxfp4" or unknown:
            raise UnsupportedConfig(f"gpt_oss config.json: quantization_config {quantization} is not supported; "
                                    f"only quant_method 'mxfp4' (with {sorted(QUANTIZATION_KEYS)}) is, kept "
                                    "packed")
        if c["hidden_size"] % 32 or c["intermediate_size"] % 32:
            raise UnsupportedConfig("gpt_oss: MXFP4 needs hidden and intermediate sizes that are multiples of 32")
    moe = MoESpec(num_experts=experts, top_k=top_k, intermediate_size=c["intermediate_size"], sparse_layers=(True,) * n,
                  scoring="topk_softmax", router_bias=True, expert_bias=True,
                  swiglu_limit=float(r.get("swiglu_limit", 7.0)), swiglu_alpha=float(r.get("swiglu_alpha", 1.702)))
    return dict(layer_types=layer_types(r, n, lambda i: SLIDING if (i + 1) % 2 else FULL),
                sliding_window=r.get("sliding_window", 128), qkv_bias=bias, o_bias=bias,
                rope={FULL: rope, SLIDING: rope}, moe=moe,
                quantization=None if quantization is None else QuantSpec("mxfp4"))


def rename_gpt_oss(name: str, t: LazyTensor, cfg: ModelConfig) -> Iterator[tuple[str, LazyTensor]]:
    """mlp.router -> mlp.gate, the name the shared MoE layer gives its router."""
    yield name.replace(".mlp.router.", ".mlp.gate."), t


FAMILY = Family("gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",), read_gpt_oss,
                defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "head_dim": 64},
                ignored=MOE_IGNORED | {
                    "hidden_act": "not read by transformers' gpt-oss: its experts use the clamped SwiGLU",
                    "initial_context_length": "the original release's copy of the RoPE's "
                                              "original_max_position_embeddings",
                },
                rename=rename_gpt_oss, model_cls=GptOssForCausalLM)
