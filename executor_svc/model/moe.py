"""The mixture-of-experts MLP every MoE family shares: a router, the routed
experts, and an optional shared expert (SGLang's and vLLM's fused MoE
layer, in the executor's terms).

  router   logits = x W_r^T (+ b), then per MoESpec.scoring:
             softmax       softmax over all experts, top-k of the probabilities
                           (Mixtral, Qwen2/3-MoE; renormalised with norm_topk_prob)
             topk_softmax  top-k of the logits, softmax over those k (gpt-oss)
             sigmoid       sigmoid scores; experts chosen on scores plus
                           e_score_correction_bias, within the topk_group best of
                           n_group groups; weighted by the scores, renormalised and
                           scaled by routed_scaling_factor (DeepSeek-V3)
  experts  each chosen expert's gated MLP on the token, weighted, summed
  shared   one more MLP every token takes, optionally times sigmoid(x w_g)

Routing repeats HF's own operations in HF's order (the same topk calls on
the same values), so ties between experts resolve as they do in HF.

Experts are stored fused, one tensor per projection over all experts
(w13: gate rows then up rows), split over tensor-parallel ranks along
their intermediate dim like a dense MLP; each rank sums its partial
output with the shared expert's and all-reduces once. The torch path sorts
the (token, expert) pairs by expert and runs one matmul per expert that
has tokens (a loop over experts, never over tokens); the triton path
(llmsched_kernels/fused_moe.py) runs one grouped GEMM per projection, and reads
quantized experts (FP8, integer, MXFP4, NVFP4) as they are held, decoding
them in its load loop.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.model.checkpoint import LazyTensor
from executor_svc.model.invariant_ops import pad_rows, tail_free
from executor_svc.model.layers import ColumnLinear, RowLinear, RowPart, check_fp8, check_shape, materialize
from executor_svc.model.model import ACTIVATIONS, MLP, CausalLM
from executor_svc.model.model_config import ActivationQuant, LinearScheme, ModelConfig, MoESpec, UnsupportedConfig
from executor_svc.model import cpu_fp8_linear
from executor_svc.model.quant_formats import groups_in_order
from executor_svc.model.quantization import (
    FP8, BlockSplitError, cdiv, dequantize_fp8_blocks, fake_quantize_activations,
)
from executor_svc.model.sharding import Shard

if TYPE_CHECKING:  # kernels import triton, which the CPU executor does without
    from llmsched_kernels.fused_moe import InputQuantizer, QuantizedExperts

log = logging.getLogger(__name__)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: MoESpec):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(spec.num_experts)) if spec.router_bias else None
        if spec.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(spec.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [num_tokens, hidden] -> (weights [num_tokens, top_k] fp32,
        expert ids [num_tokens, top_k] int64)."""
        spec = self.spec
        if spec.router_fp32:
            logits = F.linear(x.float(), self.weight.float())  # [num_tokens, num_experts]
        else:
            logits = F.linear(x, self.weight, self.bias)  # [num_tokens, num_experts]
        if spec.scoring == "topk_softmax":
            top, ids = torch.topk(logits, spec.top_k, dim=-1)
            return torch.softmax(top, dim=1, dtype=top.dtype).float(), ids
        if spec.scoring == "softmax":
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights, ids = torch.topk(probs, spec.top_k, dim=-1)
            if spec.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        elif spec.scoring == "sigmoid":
            weights, ids = self._grouped_sigmoid(logits)
        else:
            raise ValueError(f"unknown MoE scoring {spec.scoring!r}")
        if spec.routed_scaling_factor != 1.0:
            weights = weights * spec.routed_scaling_factor
        return weights, ids

    def _grouped_sigmoid(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's noaux_tc routing, step for step as HF's."""
        spec = self.spec
        scores = logits.sigmoid()  # [num_tokens, num_experts]
        choice = scores + self.e_score_correction_bias if spec.correction_bias else scores
        if spec.n_group > 1:
            n, per_group = choice.shape[0], spec.num_experts // spec.n_group
            group_scores = choice.view(n, spec.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)  # [n, n_group]
            group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(n, spec.n_group, per_group).reshape(n, -1)
            choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, ids


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: (up + 1) * gate * sigmoid(alpha * gate), with
    gate clamped above and up clamped both ways at limit."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class FusedExperts(nn.Module):
    """Every expert's gate/up and down projections, this rank's intermediate
    units of each. Checkpoints keep one tensor per expert and projection
    (`{e}.gate_proj.weight` ...); PROJECTIONS names them per family."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
    # Each expert's rows are padded to a multiple of it, and the Triton
    # kernel's combine adds in top-k order, when above 1 (batch_invariant.py).
    row_unit = 1

    def __init__(self, cfg: ModelConfig, spec: MoESpec, shard: Shard):
        super().__init__()
        self.spec, self.hidden = spec, cfg.hidden_size
        self.whole_inter = spec.intermediate_size
        self.inter = spec.intermediate_size // shard.size
        self.start, self.rank = shard.rank * self.inter, shard.rank
        e, h, i = spec.num_experts, cfg.hidden_size, self.inter
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))  # [experts, gate rows then up rows, hidden]
        self.w2 = nn.Parameter(torch.empty(e, h, i))  # [experts, hidden, this rank's units]
        if spec.expert_bias:
            self.b13 = nn.Parameter(torch.empty(e, 2 * i))
            self.b2 = nn.Parameter(torch.empty(e, h))  # rank 0 only: the all-reduce counts it once
        else:
            self.b13 = self.b2 = None
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.impl = "torch"  # or "triton": llmsched_kernels/fused_moe.py (set by use_triton_moe)
        # (block_n, block_k) once use_fp8 made the experts FP8; the grid row
        # of each w13 / w2 row once loaded.
        self.fp8_block: tuple[int, int] | None = None
        self.grid13 = self.grid2 = None
        # Per-expert quantized linears, once use_scheme made them (any scheme but FP8 blocks).
        self.per_expert: nn.ModuleList | None = None
        # per_expert's tensors stacked over the experts, as the fused-MoE
        # kernel reads them, and how it quantizes their inputs (stack_experts).
        self.stacked: tuple[QuantizedExperts, QuantizedExperts] | None = None
        self.stacked_inputs: tuple[InputQuantizer, InputQuantizer] | None = None

    def checkpoint_modules(self, name: str) -> list[str]:
        """Every expert's projections, as the checkpoint names them (a
        quantization config may target or ignore them by name)."""
        return [f"{name}.{e}.{proj}" for e in range(self.spec.num_experts) for proj in self.PROJECTIONS]

    @property
    def packed(self) -> bool:
        """The weights are held quantized: the torch loop dequantizes one
        routed expert at a time, and the triton path reads them through
        kernel_weights (FP8 blocks, and per_expert's once stack_experts stacked them)."""
        return self.fp8_block is not None or self.per_expert is not None

    def kernel_weights(self) -> tuple[torch.Tensor | QuantizedExperts, torch.Tensor | QuantizedExperts]:
        """w13 and w2 as llmsched_kernels/fused_moe.py reads them: plain tensors, the
        FP8 weights with their block scales, or per_expert's stacks."""
        if self.stacked is not None:
            return self.stacked
        if self.fp8_block is None:
            return self.w13, self.w2
        from llmsched_kernels.fused_moe import QuantizedExperts

        bk = self.fp8_block[1]
        return (QuantizedExperts.fp8_blocks(self.w13, self.w13_scale, self.grid13, bk),
                QuantizedExperts.fp8_blocks(self.w2, self.w2_scale, self.grid2, bk))

    def stack_experts(self) -> str | None:
        """Stacks per_expert's quantized tensors (FP8, integer or FP4) into
        the fused-MoE kernel's [experts, ...] layout, and sets how it
        quantizes each (token, expert) pair's inputs as that expert's own
        linears do. Each expert's linears then hold views of the stacks, so
        the weights stay one copy and the torch loop still reads them.
        Returns why the kernel cannot read these experts (they then keep
        the torch loop), or None. Imports Triton: the triton backend's step."""
        from llmsched_kernels.fused_moe import QuantizedExperts

        gate_up = [expert.gate_up for expert in self.per_expert]
        down = [expert.down for expert in self.per_expert]
        scheme = gate_up[0].scheme if gate_up else None
        if scheme is None:
            return "experts without a quantization scheme"
        if gate_up[0].cpu_int is not None:
            return "integer experts held in the CPU kernel's form"
        if scheme.kind == "int" and not all(groups_in_order(layer.g_idx, layer.in_cols, scheme.group_size or
                                                            layer.in_cols) for layer in gate_up + down):
            return "integer experts whose g_idx reorders columns into groups"
        if scheme.kind == "fp4" and (self.hidden % scheme.group_size or self.inter % scheme.group_size):
            return (f"hidden size {self.hidden} or this rank's {self.inter} units are not whole FP4 groups of "
                    f"{scheme.group_size}")
        inputs = _input_quantizers(scheme, gate_up, down)
        if isinstance(inputs, str):
            return inputs
        if scheme.kind == "fp8":
            stacked = tuple(QuantizedExperts.fp8_blocks(_stack(layers, "weight"), _stack(layers, "weight_scale_inv"),
                                                        layers[0].grid_rows, layers[0].fp8_block[1])
                            for layers in (gate_up, down))
        elif scheme.kind == "int":
            stacked = tuple(QuantizedExperts.int_groups(
                _stack(layers, "qweight"), _stack(layers, "scales"), _stack(layers, "zeros"), scheme.bits,
                scheme.group_size or layers[0].in_cols, layers[0].in_cols) for layers in (gate_up, down))
        elif scheme.layout == "ct-mxfp4":
            stacked = tuple(QuantizedExperts.mxfp4(_stack(layers, "qweight").unflatten(2, (-1, 16)),
                                                   _stack(layers, "scales")) for layers in (gate_up, down))
        else:  # NVFP4
            stacked = tuple(QuantizedExperts.nvfp4(_stack(layers, "qweight").unflatten(2, (-1, 8)),
                                                   _stack(layers, "scales"), _stack(layers, "global_scale"))
                            for layers in (gate_up, down))
        self.stacked, self.stacked_inputs = stacked, inputs
        return None

    def use_scheme(self, scheme: LinearScheme) -> None:
        """Holds every expert's weights quantized as the checkpoint stores
        them. FP8 blocks keep the fused tensors (use_fp8); any other scheme
        gives each expert a ColumnLinear (gate and up) and a RowLinear
        (down) of that scheme, which load, split and compute as dense layers
        of that scheme do (layers.py)."""
        if scheme.layout == "fp8":
            self.use_fp8(scheme.block)
            return
        if type(self).load_weight is not FusedExperts.load_weight or self.spec.expert_bias:
            raise UnsupportedConfig(f"{type(self).__name__}: experts with biases or in this family's own checkpoint "
                                    f"layout are not implemented as {scheme.describe()}")
        if scheme.act_order:
            raise UnsupportedConfig(f"{type(self).__name__}: act-order (g_idx) experts are not implemented")
        gate, up, _ = self.PROJECTIONS
        i, whole = self.inter, self.whole_inter
        experts = []
        for _ in range(self.spec.num_experts):
            expert = nn.Module()
            expert.gate_up = ColumnLinear(self.hidden, [RowPart(gate, whole, self.start, i),
                                                        RowPart(up, whole, self.start, i)], bias=False)
            expert.down = RowLinear(whole, self.hidden, self.start, i, bias=False, rank=self.rank)
            for layer in (expert.gate_up, expert.down):
                layer.use_scheme(scheme)
                layer.loaded_by_parent = True  # its checkpoint tensors are routed through load_weight below
            experts.append(expert)
        del self.w13, self.w2
        self.per_expert = nn.ModuleList(experts)

    def use_fp8(self, block: tuple[int, int]) -> None:
        """Holds every expert's weights in FP8 with the checkpoint's block
        scales (layers.py's ColumnLinear.use_fp8, per expert: gate and up
        stack their grids)."""
        if type(self).load_weight is not FusedExperts.load_weight:
            raise UnsupportedConfig(f"{type(self).__name__}: FP8 experts in this family's checkpoint layout are not "
                                    "implemented")
        bn, bk = block
        e, h, i, lo = self.spec.num_experts, self.hidden, self.inter, self.start
        ends = lo + i == self.whole_inter
        if lo % bn or (i % bn and not ends) or lo % bk or (i % bk and not ends):
            raise BlockSplitError(f"expert units [{lo}, {lo + i}) of {self.whole_inter} are not whole blocks of "
                                  f"{bn} rows (gate/up) and {bk} columns (down)")
        self.fp8_block = block
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=FP8), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=FP8), requires_grad=False)
        self.w13_scale = nn.Parameter(torch.empty(e, 2 * cdiv(i, bn), cdiv(h, bk)), requires_grad=False)
        self.w2_scale = nn.Parameter(torch.empty(e, cdiv(h, bn), cdiv(i, bk)), requires_grad=False)

    # -- loading ------------------------------------------------------------

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        gate, up, down = self.PROJECTIONS
        shapes = {}
        if self.per_expert is not None:
            for e, expert in enumerate(self.per_expert):
                shapes |= {f"{e}.{key}": shape for key, shape in expert.gate_up.checkpoint_shapes().items()}
                shapes |= {f"{e}.{down}.{key}": shape for key, shape in expert.down.checkpoint_shapes().items()}
            return shapes
        for e in range(self.spec.num_experts):
            shapes[f"{e}.{gate}.weight"] = shapes[f"{e}.{up}.weight"] = (self.whole_inter, self.hidden)
            shapes[f"{e}.{down}.weight"] = (self.hidden, self.whole_inter)
            if self.fp8_block is not None:
                bn, bk = self.fp8_block
                shapes[f"{e}.{gate}.weight_scale_inv"] = shapes[f"{e}.{up}.weight_scale_inv"] = (
                    cdiv(self.whole_inter, bn), cdiv(self.hidden, bk))
                shapes[f"{e}.{down}.weight_scale_inv"] = (cdiv(self.hidden, bn), cdiv(self.whole_inter, bk))
        return shapes

    def load_weight(self, name: str, weight: LazyTensor, device: torch.device, dtype: torch.dtype) -> None:
        expert, proj, leaf = name.split(".")
        e, (gate, _, down) = int(expert), self.PROJECTIONS
        if self.per_expert is not None:
            if proj == down:
                self.per_expert[e].down.load_weight(leaf, weight, device, dtype)
            else:
                self.per_expert[e].gate_up.load_weight(f"{proj}.{leaf}", weight, device, dtype)
            return
        lo, hi = self.start, self.start + self.inter
        if leaf == "weight_scale_inv":
            self._load_scale(e, proj == down, proj == gate, weight, device)
            return
        if proj == down:
            value, target = weight.read(1, lo, hi), materialize(self, "w2", device, dtype)[e]
        else:
            w13 = materialize(self, "w13", device, dtype)[e]
            value, target = weight.read(0, lo, hi), (w13[: self.inter] if proj == gate else w13[self.inter :])
        check_shape(name, value, tuple(target.shape))
        check_fp8(name, value, target)
        target.copy_(value)

    def _load_scale(self, e: int, is_down: bool, is_gate: bool, weight: LazyTensor, device: torch.device) -> None:
        """This rank's part of one projection's grid of block scales."""
        bn, bk = self.fp8_block
        if is_down:  # columns [start, start + inter) of [hidden, units]
            first = self.start // bk
            value = weight.read(1, first, first + cdiv(self.inter, bk))
            target = materialize(self, "w2_scale", device, torch.float32)[e]
        else:  # rows of [units, hidden]; gate's grid, then up's
            first, n = self.start // bn, cdiv(self.inter, bn)
            value = weight.read(0, first, first + n)
            grid = materialize(self, "w13_scale", device, torch.float32)[e]
            target = grid[:n] if is_gate else grid[n:]
        check_shape(f"{e}.weight_scale_inv", value, tuple(target.shape))
        target.copy_(value.to(torch.float32))
        if self.grid13 is None:
            rows = torch.arange(self.inter, device=device) // bn
            self.grid13 = torch.cat([rows, rows + cdiv(self.inter, bn)])
            self.grid2 = torch.arange(self.hidden, device=device) // bn

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's w13 and w2 at the compute dtype (dequantized for this use when FP8)."""
        if self.fp8_block is None:
            return self.w13[e], self.w2[e]
        bk = self.fp8_block[1]
        return (dequantize_fp8_blocks(self.w13[e], self.w13_scale[e], self.grid13, bk, dtype),
                dequantize_fp8_blocks(self.w2[e], self.w2_scale[e], self.grid2, bk, dtype))

    # -- compute ------------------------------------------------------------

    # Set where FP8 experts' products of a few rows run cpu_fp8_linear's
    # kernel (cpu_fp8_linear.use_cpu_fp8_kernel).
    cpu_fp8 = False

    def _cpu_fp8_expert(self, e: int, x: torch.Tensor, b13: torch.Tensor | None,
                        b2: torch.Tensor | None) -> torch.Tensor:
        """Expert e on x [rows, hidden] through the CPU FP8 kernel: the
        dequantized weights' products, each rounded to x's dtype as
        F.linear's would be."""
        bk, bf16 = self.fp8_block[1], x.dtype == torch.bfloat16
        gate_up = cpu_fp8_linear.matmul(x.float(), self.w13[e], self.w13_scale[e], self.grid13, bk, bf16)
        h = self.activation((gate_up if b13 is None else gate_up + b13.float()).to(x.dtype))
        y = cpu_fp8_linear.matmul(h.float(), self.w2[e], self.w2_scale[e], self.grid2, bk, bf16)
        return (y if b2 is None else y + b2.float()).to(x.dtype)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * inter] -> [rows, inter]."""
        gate, up = gate_up.chunk(2, dim=-1)
        if self.spec.swiglu_limit is not None:
            return swiglu_clamped(gate, up, self.spec.swiglu_alpha, self.spec.swiglu_limit)
        return self.act(gate) * up

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden]; weights, ids: [num_tokens, top_k] ->
        [num_tokens, hidden], this rank's partial sum."""
        if self.impl == "triton":
            from llmsched_kernels.fused_moe import fused_moe

            w13, w2 = self.kernel_weights()
            return fused_moe(x, w13, w2, weights, ids, self.activation, self.b13, self.b2,
                             ordered_combine=self.row_unit > 1, quantize_inputs=self.stacked_inputs)
        return self._torch(x, weights, ids)

    def _torch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n, k = ids.shape
        flat = ids.reshape(-1)  # [n * k]
        # (token, expert) pairs grouped by expert, tokens in order within each.
        order = torch.argsort(flat, stable=True)  # [n * k]
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()  # one host sync per layer
        tokens = order // k  # [n * k]: the token of each sorted pair
        xs = x.index_select(0, tokens)  # [n * k, hidden]
        out = torch.empty_like(xs)  # [n * k, hidden]
        start = 0
        for e, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                if self.per_expert is not None:  # quantized linears: their own dequantization or kernel
                    expert = self.per_expert[e]
                    out[rows] = expert.down(self.activation(expert.gate_up(xs[rows])))
                    start += count
                    continue
                b13 = None if self.b13 is None else self.b13[e]
                b2 = None if self.b2 is None else self.b2[e]
                if self.cpu_fp8 and count <= cpu_fp8_linear.MAX_ROWS:
                    out[rows] = self._cpu_fp8_expert(e, xs[rows], b13, b2)
                    start += count
                    continue
                w13, w2 = self.expert_weights(e, xs.dtype)
                # An expert's row count is its tokens': padded, under batch
                # invariance, so a token's result does not depend on how many share its expert.
                h = self.activation(F.linear(pad_rows(xs[rows], self.row_unit), w13, b13))  # [count, inter]
                out[rows] = F.linear(h, w2, b2)[:count]
                start += count
        out = out * weights.reshape(-1)[order].to(out.dtype)[:, None]
        # Each token's experts add in ascending expert order, as in HF: an
        # order fixed by the token's own experts, whatever the batch (the
        # combine batch-invariant mode needs).
        return torch.zeros_like(x).index_add_(0, tokens, out)


def _stack(layers: list[nn.Module], leaf: str) -> torch.Tensor:
    """The layers' `leaf` tensors stacked along a new first dim; each layer
    then holds its slice of the stack (a view) in place of its own tensor."""
    tensors = [getattr(layer, leaf).detach() for layer in layers]
    if tensors[0].dtype == FP8:  # stacked as bytes: concatenation kernels need not know FP8
        stacked = torch.stack([t.view(torch.uint8) for t in tensors]).view(FP8)
    else:
        stacked = torch.stack(tensors)
    for layer, held in zip(layers, stacked):
        setattr(layer, leaf, nn.Parameter(held, requires_grad=False))
    return stacked


def _input_quantizers(scheme: LinearScheme, gate_up: list[nn.Module],
                      down: list[nn.Module]) -> tuple[InputQuantizer, InputQuantizer] | None | str:
    """fused_moe's quantize_inputs for experts whose scheme quantizes
    activations: dynamic scales come from each row, static ones (and
    NVFP4's global scales) are each expert's. None when only weights are
    quantized; a reason where the kernel cannot follow the linears."""
    act = scheme.activations
    if act is None:
        return None
    if not act.checkpoint_leaf:
        return (partial(_quantize_rows, act=act, scales=None),) * 2
    scales13 = torch.stack([getattr(layer, act.checkpoint_leaf).detach() for layer in gate_up])  # [E, 2]: gate, up
    if not torch.equal(scales13[:, 0], scales13[:, 1]):
        return "gate and up quantize their input with different static scales"
    scales2 = torch.cat([getattr(layer, act.checkpoint_leaf).detach() for layer in down])  # [E]
    return (partial(_quantize_rows, act=act, scales=scales13[:, 0].contiguous()),
            partial(_quantize_rows, act=act, scales=scales2))


def _quantize_rows(rows: torch.Tensor, experts: torch.Tensor, act: ActivationQuant,
                   scales: torch.Tensor | None) -> torch.Tensor:
    """rows [pairs, K] quantized and dequantized as their experts' linears
    do: row i by scales[experts[i]] if static, else by its own values."""
    if scales is None:
        return fake_quantize_activations(rows, act)
    per_row = scales[experts].view(-1, 1, 1) if act.type == "fp4" else scales[experts].view(-1, 1)
    return fake_quantize_activations(rows, act, per_row)


class SparseMoE(nn.Module):
    """Router + experts (+ shared expert), one all-reduce at the end."""

    row_unit = 1  # above 1: batch-invariant mode (batch_invariant.py)

    def __init__(self, cfg: ModelConfig, spec: MoESpec, shard: Shard, comm,
                 experts_cls: type[FusedExperts] = FusedExperts):
        super().__init__()
        self.gate = Router(cfg, spec)
        self.experts = experts_cls(cfg, spec, shard)
        if spec.shared_intermediate_size:
            self.shared_expert = MLP(cfg, shard, comm, spec.shared_intermediate_size, reduce=False)
        if spec.shared_gate:
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]
        weights, ids = self.gate(x)  # [num_tokens, top_k] each
        out = self.experts(x, weights, ids)  # [num_tokens, hidden], this rank's share
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(x)
            if hasattr(self, "shared_expert_gate"):
                gate = self.shared_expert_gate(x)  # [num_tokens, 1]
                # A sigmoid over [num_tokens, 1] is one flat loop whose tail depends on the batch.
                gate = tail_free(torch.sigmoid, gate) if self.row_unit > 1 else torch.sigmoid(gate)
                shared = gate * shared
            out = out + shared
        return out if self.comm is None else self.comm.all_reduce(out)


def moe_or_dense(cfg: ModelConfig, layer: int, shard: Shard, comm,
                 experts_cls: type[FusedExperts] = FusedExperts) -> nn.Module:
    """Layer `layer`'s MLP: experts where MoESpec.sparse_layers says so, else
    the dense MLP (decoder_sparse_step, mlp_only_layers, first_k_dense_replace)."""
    if cfg.moe.sparse_layers[layer]:
        return SparseMoE(cfg, cfg.moe, shard, comm, experts_cls)
    return MLP(cfg, shard, comm)


class MoECausalLM(CausalLM):
    """Llama's decoder with experts in place of the MLP on MoE layers."""

    experts_cls: type[FusedExperts] = FusedExperts

    @classmethod
    def make_layer(cls, cfg: ModelConfig, layer: int, shard: Shard, comm) -> nn.Module:
        return cls.layer_cls(cfg, layer, shard, comm, attention=cls.attention_cls(cfg, layer, shard, comm),
                             mlp=moe_or_dense(cfg, layer, shard, comm, cls.experts_cls))


def use_triton_moe(model: nn.Module, on: bool = True) -> int:
    """Experts run llmsched_kernels/fused_moe.py (the triton attention backend's
    choice): plain, FP8 blocks, or per_expert's quantized linears once
    stack_experts stacked them; returns how many expert layers switched.
    Experts it cannot stack stay on the torch loop, and the log says why."""
    switched, refusals = 0, set()
    for module in model.modules():
        if not isinstance(module, FusedExperts):
            continue
        if module.per_expert is not None and module.stacked is None:
            refusal = module.stack_experts()
            if refusal is not None:
                refusals.add(refusal)
                continue
        module.impl = "triton" if on else "torch"
        switched += 1
    for refusal in sorted(refusals):
        log.info("experts stay on the torch loop, which the fused-MoE kernel cannot replace: %s", refusal)
    return switched


def experts_on_torch_loop(model: nn.Module) -> int:
    """Expert layers that run the torch loop (one host sync a layer: no
    CUDA graph can hold them), rather than the triton fused-MoE kernel."""
    return sum(isinstance(m, FusedExperts) and m.impl != "triton" for m in model.modules())
