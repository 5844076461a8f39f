"""Layers that load their own checkpoint tensors, each narrowed to this
tensor-parallel rank's part as it is read (nano-vllm's layers/linear.py).

A module that owns checkpoint tensors says which ones, by name and whole
(unsplit) shape, in `checkpoint_shapes()`, and fills its parameters from
them in `load_weight()`; model.build_model routes every checkpoint tensor
to the module that declared it. The split rules therefore live with the
layer that knows them, which is what lets a layer holding many experts, or
one matmul standing for several checkpoint tensors, split correctly:

  ColumnLinear   output rows split (q/k/v heads, gate/up units); several
                 checkpoint tensors may stack into one matmul (q/k/v)
  RowLinear      input columns split (o, down); the parent sums the ranks'
                 outputs; a bias is held by rank 0 only, so it counts once
  VocabEmbedding vocabulary rows split, padded to a multiple of the size
  anything else  replicated: its direct parameters load whole (norms,
                 routers, sinks)

Parameters start on the meta device and are materialised on first load,
on the target device and dtype, so the host never holds a second copy.

A linear layer of a quantized checkpoint (use_scheme) keeps the weight
quantized, as quant_formats.py holds it whatever the checkpoint's layout:
FP8 with its scales, or packed integers with group scales and zero points,
each rank its part of each. On CUDA it runs a Triton GEMM that decodes the
weight as it loads it (llmsched_kernels/fp8_linear.py, llmsched_kernels/int_linear.py);
on the CPU an integer one that fits runs torch's int8/int4 kernel
(cpu_int_linear.py); elsewhere it dequantizes its weight for each matmul
and drops it after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.model.checkpoint import LazyTensor
from executor_svc.model import cpu_bf16_vnni, cpu_fp8_linear, cpu_prepack
from executor_svc.model.cpu_gemv import marked_linear
from executor_svc.model.cpu_int_linear import CpuIntWeights
from executor_svc.model.model_config import LinearScheme, QuantSpec, UnsupportedConfig
from executor_svc.model.quant_formats import (
    canonical, checkpoint_leaves, dequantize_fp4, num_groups, symmetric_zeros,
)
from executor_svc.model.quantization import (
    FP8, BlockSplitError, cdiv, dequantize_fp8_blocks, fake_quantize_activations,
)
from executor_svc.model.sharding import valid_sizes
from llmsched_kernels.reference import dequantize_int


def materialize(module: nn.Module, leaf: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """module.leaf on device and dtype (allocated, uninitialised, on first
    call). A quantized layer's leaves (FP8 or packed weights, their scales
    and zero points) keep the dtype they were declared with; its `scales`
    take the checkpoint's, which the caller passes."""
    p = getattr(module, leaf)
    if p.is_meta:
        quantized = getattr(module, "fp8_block", None) is not None or getattr(module, "scheme", None) is not None
        if quantized and leaf not in ("bias", "scales"):
            dtype = p.dtype
        p = nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype), requires_grad=False)
        setattr(module, leaf, p)
    return p


def check_shape(name: str, value: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(value.shape) != tuple(want):
        raise ValueError(f"{name}: this rank's part has shape {tuple(value.shape)}, expected {tuple(want)}")


def check_fp8(name: str, value: torch.Tensor, target: torch.Tensor) -> None:
    """An FP8 layer's weight must come as FP8: anything else would be cast,
    and then scaled as if it were."""
    if target.dtype == FP8 and value.dtype != FP8:
        raise ValueError(f"{name}: the checkpoint holds {value.dtype}, but quantization_config says FP8 "
                         "(float8_e4m3fn)")


@dataclass(frozen=True, slots=True)
class RowPart:
    """One checkpoint tensor's share of a ColumnLinear on this rank: rows
    [start, start + rows) of a tensor with `whole` rows."""

    name: str  # checkpoint name of the projection ("q_proj"), or "" for the layer's own
    whole: int
    start: int
    rows: int


class _Linear(nn.Module):
    """What ColumnLinear and RowLinear share: y = x W^T (+ b), W plain or,
    once use_scheme ran, quantized as quant_formats.py holds it: FP8 with a
    grid of scales (weight_scale_inv), packed integers with group scales
    and zero points (qweight, scales, zeros, g_idx), or packed FP4 with
    group scales (qweight, scales, global_scale)."""

    def __init__(self):
        super().__init__()
        self.scheme: LinearScheme | None = None
        # kind fp8: (block_n, block_k) of the held scale grid ((1, columns)
        # for one scale per row), and the grid row of each weight row once loaded.
        self.fp8_block: tuple[int, int] | None = None
        self.grid_rows: torch.Tensor | None = None
        self.g_idx: torch.Tensor | None = None
        # An integer weight moved onto a CPU kernel's form (hold_cpu_int).
        self.cpu_int: CpuIntWeights | None = None

    def _use_scheme(self, scheme: LinearScheme, rows: int, cols: int, grid_rows: int, parts: int = 1) -> None:
        """Declares the held leaves of a quantized weight of [rows, cols]
        on this rank (meta tensors, filled as the checkpoint is read), of
        `parts` checkpoint tensors."""
        act = scheme.activations
        if act is not None and act.group_size is not None and cols % act.group_size:
            raise BlockSplitError(f"{cols} input columns are not whole activation groups of {act.group_size}")
        self.scheme = scheme
        del self.weight
        if act is not None and act.checkpoint_leaf:
            # Each checkpoint tensor's own input_scale or input_global_scale
            # (q, k and v quantize the same x, each with its scale).
            setattr(self, act.checkpoint_leaf, nn.Parameter(torch.empty(parts), requires_grad=False))
        if scheme.kind == "fp8":
            self.fp8_block = scheme.block or (1, cols)
            self.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8), requires_grad=False)
            self.weight_scale_inv = nn.Parameter(torch.empty(grid_rows, cdiv(cols, self.fp8_block[1])),
                                                 requires_grad=False)
            return
        groups = self._held_groups(cols)
        packed = cdiv(cols, 2) if scheme.bits == 4 else cols
        self.qweight = nn.Parameter(torch.empty(rows, packed, dtype=torch.uint8), requires_grad=False)
        self.scales = nn.Parameter(torch.empty(rows, groups), requires_grad=False)
        if scheme.kind == "int":
            self.zeros = nn.Parameter(torch.empty(rows, groups, dtype=torch.uint8), requires_grad=False)
        elif scheme.layout in ("ct-nvfp4", "modelopt-nvfp4"):
            self.global_scale = nn.Parameter(torch.empty(rows), requires_grad=False)

    def _held_groups(self, cols: int) -> int:
        """Scale groups held: all of them with act-order (any column may be in any group)."""
        whole = getattr(self, "whole_in", cols)
        return num_groups(self.scheme, whole if self.scheme.act_order else cols)

    def _leaves(self) -> tuple[str, ...]:
        if self.scheme is None:
            return ("weight", "bias")
        return (*checkpoint_leaves(self.scheme, 1, 1), "bias")

    def _set_g_idx(self, name: str, value: torch.Tensor, device: torch.device) -> None:
        value = value.to(device)
        if self.g_idx is not None and not torch.equal(self.g_idx, value):
            raise ValueError(f"{name}: act-order g_idx differs from the other projections fused with it "
                             "(q/k/v or gate/up), which one matmul cannot serve")
        self.g_idx = nn.Parameter(value, requires_grad=False)  # a parameter: counted and moved with the weights

    def hold_cpu_int(self, weights: CpuIntWeights) -> None:
        """Serves from a CPU kernel's form of the weight, dropping the
        checkpoint's (qweight, scales, zeros): the layer holds one copy."""
        del self.qweight, self.scales, self.zeros
        self.cpu_int = weights
        for i, t in enumerate(weights.tensors()):  # parameters: counted by weight_bytes like the others
            self.register_parameter(f"cpu_int_{i}", nn.Parameter(t, requires_grad=False))

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight at the compute dtype: itself, or dequantized for this
        use (latent attention reads kv_b_proj's weight directly)."""
        if self.scheme is None:
            return self.weight
        if self.cpu_int is not None:
            return self.cpu_int.dense(dtype)
        if self.scheme.kind == "fp8":
            return dequantize_fp8_blocks(self.weight, self.weight_scale_inv, self.grid_rows, self.fp8_block[1], dtype)
        if self.scheme.kind == "fp4":
            return dequantize_fp4(self.qweight, self.scales, getattr(self, "global_scale", None),
                                  self.scheme.group_size, self.in_cols, dtype)
        return dequantize_int(self.qweight, self.scales, self.zeros, self.scheme.group_size or self.in_cols,
                              self.scheme.bits, self.g_idx, self.in_cols, dtype)

    def _static_input_scales(self) -> list[torch.Tensor]:
        """The parts' static input scales (NVFP4: global scales), one if
        they are all equal (read once: they are fixed after loading)."""
        if not hasattr(self, "_input_scales"):
            scales = list(getattr(self, self.scheme.activations.checkpoint_leaf).unbind())
            self._input_scales = scales if any(not torch.equal(s, scales[0]) for s in scales) else scales[:1]
        return self._input_scales

    # The LoRA adapters' deltas on this layer (lora.LoraLinear), or None:
    # a model without adapters runs exactly the base layer.
    lora = None
    # Products of up to cpu_gemv_rows rows through cpu_gemv.linear (both set
    # by cpu_gemv.use_cpu_gemv; cpu_gemv.marked_linear dispatches).
    use_cpu_gemv = False
    cpu_gemv_rows = 1
    # Set where the weight is packed for the CPU's bf16 instructions
    # (cpu_prepack.py, by cpu_gemv.use_cpu_gemv): every product then goes
    # through it.
    prepack_handle: torch.Tensor | None = None
    # Set on FP8 layers whose products of a few rows run cpu_fp8_linear's
    # kernel (cpu_fp8_linear.use_cpu_fp8_kernel).
    cpu_fp8 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_forward(x)
        return y if self.lora is None else self.lora.add(x, y)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        scheme = self.scheme
        if scheme is None:
            if self.prepack_handle is not None:
                return cpu_prepack.linear(self, x)
            if self.use_cpu_gemv and x.dim() == 2:
                return marked_linear(x, self.weight, self.bias, self.cpu_gemv_rows)
            return F.linear(x, self.weight, self.bias)
        act = scheme.activations
        if act is not None and act.checkpoint_leaf:
            scales = self._static_input_scales()
            if len(scales) > 1:  # fused parts with scales of their own: each its rows, as separate layers would
                w, rows = self.dense_weight(x.dtype), [p.rows for p in self.parts]
                y = torch.cat([F.linear(fake_quantize_activations(x, act, s), part)
                               for s, part in zip(scales, w.split(rows))], dim=-1)
                return y if self.bias is None else y + self.bias
            x = fake_quantize_activations(x, act, scales[0])
        elif act is not None:
            x = fake_quantize_activations(x, act)
        if self.cpu_int is not None:
            y = self.cpu_int.linear(x)
            return y if self.bias is None else y + self.bias
        if x.is_cuda:
            # Triton GEMMs that decode the weight in their load loops, so no
            # dequantized weight is ever written. Imported here: the CPU
            # path never loads Triton.
            if scheme.kind == "fp8":
                from llmsched_kernels.fp8_linear import fp8_block_linear

                y = fp8_block_linear(x, self.weight, self.weight_scale_inv, self.grid_rows, self.fp8_block[1])
            elif scheme.kind == "fp4":
                from llmsched_kernels.int_linear import fp4_weight_linear

                y = fp4_weight_linear(x, self.qweight, self.scales, getattr(self, "global_scale", None),
                                      scheme.group_size)
            else:
                from llmsched_kernels.int_linear import int_weight_linear

                y = int_weight_linear(x, self.qweight, self.scales, self.zeros, scheme.group_size or self.in_cols,
                                      scheme.bits, self.g_idx)
            return y if self.bias is None else y + self.bias
        # In a compiled graph the operator chooses by row count when the graph runs.
        compiling = torch.compiler.is_compiling()
        if (self.cpu_fp8 and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16)
                and (compiling or x.shape[0] <= cpu_fp8_linear.MAX_ROWS)):
            args = (x.float(), self.weight, self.weight_scale_inv, self.grid_rows, self.fp8_block[1],
                    x.dtype == torch.bfloat16)
            y = torch.ops.llmsched.cpu_fp8_linear(*args) if compiling else cpu_fp8_linear.matmul(*args)
            return (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        return F.linear(x, self.dense_weight(x.dtype), self.bias)


class ColumnLinear(_Linear):
    """y = x W^T (+ b), W holding this rank's rows of one or more checkpoint
    projections stacked in `parts` order: q/k/v (or gate/up) run as one
    matmul. Named parts are checkpoint tensors beside this module
    (`self_attn.q_proj` next to `self_attn.qkv_proj`), so their names are
    relative to its parent."""

    def __init__(self, in_features: int, parts: list[RowPart], bias: bool):
        super().__init__()
        self.in_features, self.parts = in_features, parts
        self.out_features = sum(p.rows for p in parts)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self.names_from_parent = any(p.name for p in parts)

    @classmethod
    def split(cls, in_features: int, whole: int, rank: int, size: int, bias: bool = False) -> ColumnLinear:
        """One checkpoint tensor, its rows split evenly over the ranks."""
        rows = whole // size
        return cls(in_features, [RowPart("", whole, rank * rows, rows)], bias)

    def _key(self, part: RowPart, leaf: str) -> str:
        return f"{part.name}.{leaf}" if part.name else leaf

    def checkpoint_modules(self, name: str) -> list[str]:
        """The checkpoint's modules this layer stands for, given its own name."""
        if not self.names_from_parent:
            return [name]
        parent = name.rpartition(".")[0]
        return [f"{parent}.{p.name}" if parent else p.name for p in self.parts]

    @property
    def in_cols(self) -> int:
        return self.in_features

    def use_scheme(self, scheme: LinearScheme) -> None:
        """Holds the weight quantized as the checkpoint stores it. With FP8
        blocks, each part's rows must start on a block, and end on one
        unless they end the checkpoint tensor (its edge block)."""
        bn = scheme.split_units()[0]
        for p in self.parts:
            if p.start % bn or (p.rows % bn and p.start + p.rows != p.whole):
                raise BlockSplitError(f"rows [{p.start}, {p.start + p.rows}) of {p.name or 'the weight'}'s {p.whole} "
                                      f"are not whole blocks of {bn}")
        self._use_scheme(scheme, self.out_features, self.in_features, sum(cdiv(p.rows, bn) for p in self.parts),
                         len(self.parts))

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...] | None]:
        shapes = {}
        for p in self.parts:
            leaves = {"weight": (p.whole, self.in_features)} if self.scheme is None else checkpoint_leaves(
                self.scheme, p.whole, self.in_features)
            for leaf, shape in leaves.items():
                shapes[self._key(p, leaf)] = shape
            if self.bias is not None:
                shapes[self._key(p, "bias")] = (p.whole,)
        return shapes

    def load_weight(self, name: str, weight: LazyTensor, device: torch.device, dtype: torch.dtype) -> None:
        offset = grid_offset = 0
        bn = self.fp8_block[0] if self.fp8_block is not None else 1
        for i, p in enumerate(self.parts):
            for leaf in self._leaves():
                if name != self._key(p, leaf):
                    continue
                if leaf in ("weight", "bias", "weight_packed"):  # rows first in the checkpoint: read this rank's
                    held, value = leaf, weight.read(0, p.start, p.start + p.rows)
                    if self.scheme is not None and leaf != "bias":
                        held, value = canonical(self.scheme, leaf, value, p.rows, self.in_features)
                    self._fill(held, name, value, offset, device, dtype)
                    return
                held, value = canonical(self.scheme, leaf, weight.read(), p.whole, self.in_features)
                if held == "g_idx":
                    self._set_g_idx(name, value, device)
                elif held in ("input_scale", "input_global_scale"):
                    materialize(self, held, device, dtype)[i : i + 1].copy_(value)
                elif held == "weight_scale_inv":
                    first = p.start // bn
                    self._fill(held, name, value[first : first + cdiv(p.rows, bn)], grid_offset, device, dtype)
                    self._set_grid_rows(device)
                elif held:
                    self._fill(held, name, value[p.start : p.start + p.rows], offset, device, dtype)
                    zeros = symmetric_zeros(self.scheme, p.rows, self.in_features, device)
                    if held == "scales" and zeros is not None:
                        self._fill("zeros", name, zeros, offset, device, dtype)
                return
            offset += p.rows
            grid_offset += cdiv(p.rows, bn)
        raise KeyError(name)

    def _fill(self, held: str, name: str, value: torch.Tensor, offset: int, device: torch.device,
              dtype: torch.dtype) -> None:
        """Rows [offset, offset + len(value)) of the held leaf."""
        target = materialize(self, held, device, value.dtype if held == "scales" else dtype)
        check_shape(name, value, (value.shape[0], *target.shape[1:]))
        check_fp8(name, value, target)
        target[offset : offset + value.shape[0]].copy_(value)  # a parameter without grad: copied in place

    def _set_grid_rows(self, device: torch.device) -> None:
        if self.grid_rows is None:
            bn, rows, first = self.fp8_block[0], [], 0
            for p in self.parts:
                rows.append(first + torch.arange(p.rows, device=device) // bn)
                first += cdiv(p.rows, bn)
            self.grid_rows = torch.cat(rows)


class RowLinear(_Linear):
    """y = x W^T (+ b) over this rank's columns [start, start + cols) of W:
    a partial sum, which the parent all-reduces. The bias is added by rank
    0 only (the others hold zeros), so the sum counts it once."""

    def __init__(self, whole_in: int, out_features: int, start: int, cols: int, bias: bool, rank: int = 0):
        super().__init__()
        self.whole_in, self.out_features, self.start, self.cols, self.rank = whole_in, out_features, start, cols, rank
        self.weight = nn.Parameter(torch.empty(out_features, cols))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def split(cls, whole_in: int, out_features: int, rank: int, size: int, bias: bool = False) -> RowLinear:
        cols = whole_in // size
        return cls(whole_in, out_features, rank * cols, cols, bias, rank)

    def checkpoint_modules(self, name: str) -> list[str]:
        return [name]

    @property
    def in_cols(self) -> int:
        return self.cols

    def use_scheme(self, scheme: LinearScheme) -> None:
        """As ColumnLinear.use_scheme; this rank's columns must be whole
        blocks (FP8) or whole groups (packed ints, unless act-order keeps
        every group), and whole bytes of 4-bit values."""
        bn, unit = scheme.split_units()
        if self.start % unit or (self.cols % unit and self.start + self.cols != self.whole_in):
            what = "FP8 blocks" if scheme.kind == "fp8" else "quantization groups"
            raise BlockSplitError(f"columns [{self.start}, {self.start + self.cols}) of {self.whole_in} are not whole "
                                  f"{what} of {unit}")
        self._use_scheme(scheme, self.out_features, self.cols, cdiv(self.out_features, bn))

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...] | None]:
        shapes = ({"weight": (self.out_features, self.whole_in)} if self.scheme is None
                  else checkpoint_leaves(self.scheme, self.out_features, self.whole_in))
        if self.bias is not None:
            shapes["bias"] = (self.out_features,)
        return shapes

    def load_weight(self, name: str, weight: LazyTensor, device: torch.device, dtype: torch.dtype) -> None:
        lo, hi = self.start, self.start + self.cols
        if name == "bias":
            target = materialize(self, name, device, dtype)
            if self.rank != 0:
                target.zero_()
                return
            value = weight.read()
        elif self.scheme is None or name == "weight" and self.scheme.kind == "fp8":
            target = materialize(self, "weight", device, dtype)
            value = weight.read(1, lo, hi)
            check_fp8(name, value, target)
        else:
            held, value = canonical(self.scheme, name, weight.read(), self.out_features, self.whole_in)
            if not held:
                return
            if held == "g_idx":
                self._set_g_idx(name, value[lo:hi], device)
                return
            if held == "weight_scale_inv":
                bn, bk = self.fp8_block
                if self.scheme.block:  # a grid over the columns too: this rank's
                    value = value[:, lo // bk : lo // bk + cdiv(self.cols, bk)]
                self.grid_rows = torch.arange(self.out_features, device=device) // bn
            elif held == "qweight":
                value = value[:, lo // 2 : cdiv(hi, 2)] if self.scheme.bits == 4 else value[:, lo:hi]
            elif held in ("scales", "zeros") and not self.scheme.act_order and self.scheme.group_size is not None:
                g = self.scheme.group_size
                value = value[:, lo // g : cdiv(hi, g)]
            target = materialize(self, held, device, value.dtype if held == "scales" else dtype)
            zeros = symmetric_zeros(self.scheme, self.out_features, self.whole_in if self.scheme.act_order
                                    else self.cols, device)
            if held == "scales" and zeros is not None:
                materialize(self, "zeros", device, dtype).copy_(zeros[:, : target.shape[1]])
        check_shape(name, value, tuple(target.shape))
        target.copy_(value)


class VocabParallel:
    """Rows [first, end) of a [vocab, hidden] matrix: the vocabulary padded
    to a multiple of the size; padding rows are zero (embeddings of ids
    never seen, logits cut off before sampling)."""

    def _init_vocab(self, vocab_size: int, first: int, end: int) -> None:
        self.vocab_size, self.first, self.end = vocab_size, first, end

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.vocab_size, self.weight.shape[1])}

    def load_weight(self, name: str, weight: LazyTensor, device: torch.device, dtype: torch.dtype) -> None:
        target = materialize(self, name, device, dtype)
        stop = min(self.end, self.vocab_size)
        value = weight.read(0, self.first, stop)
        target[: stop - self.first].copy_(value)
        target[stop - self.first :].zero_()


class VocabEmbedding(VocabParallel, nn.Embedding):
    # Set where the weight is a tied head's, packed for cpu_bf16_vnni's
    # kernels (cpu_gemv.prepack_bf16): lookups gather its rows there.
    packed_rows = False

    def __init__(self, vocab_size: int, hidden: int, first: int, end: int):
        # An empty weight, not nn.Embedding's random one: on the meta device
        # that initialisation runs torch's Python reference of normal_, which
        # imports torch._dynamo, 1.8 s of every executor's start.
        nn.Embedding.__init__(self, end - first, hidden, _weight=torch.empty(end - first, hidden))
        self._init_vocab(vocab_size, first, end)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed_rows:
            return cpu_bf16_vnni.rows(self.weight, ids)
        return super().forward(ids)


class VocabHead(VocabParallel, nn.Linear):
    use_cpu_gemv = False  # as _Linear's
    cpu_gemv_rows = 1
    prepack_handle: torch.Tensor | None = None

    def __init__(self, vocab_size: int, hidden: int, first: int, end: int):
        nn.Linear.__init__(self, hidden, end - first, bias=False)
        self._init_vocab(vocab_size, first, end)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepack_handle is not None:
            return cpu_prepack.linear(self, x)
        if self.use_cpu_gemv and x.dim() == 2:
            return marked_linear(x, self.weight, None, self.cpu_gemv_rows)
        return super().forward(x)


def replicated_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """A module without a loader of its own: its direct parameters load whole."""
    return {name: tuple(p.shape) for name, p in module.named_parameters(recurse=False)}


def load_replicated(module: nn.Module, name: str, weight: LazyTensor, device: torch.device,
                    dtype: torch.dtype) -> None:
    # Always a copy: safetensors hands out views of the mmapped file, which
    # would keep the served weights tied to files on disk.
    setattr(module, name, nn.Parameter(weight.read().to(device=device, dtype=dtype, copy=True), requires_grad=False))


def quantize_linears(model: nn.Module, spec: QuantSpec, tensor_parallel_size: int) -> None:
    """Turns every layer that the spec's schemes cover and that can hold
    quantized weights (use_scheme: ColumnLinear, RowLinear, moe.FusedExperts)
    into one that holds them as the checkpoint stores them; call on the
    meta-device model before loading."""
    for name, module in list(model.named_modules()):  # a snapshot: experts add layers of their own
        if not hasattr(module, "use_scheme"):
            continue
        schemes = {spec.scheme_for(m) for m in module.checkpoint_modules(name)}
        if schemes == {None}:
            continue
        if len(schemes) > 1:
            raise UnsupportedConfig(f"{name}: the checkpoint quantizes the projections fused here differently "
                                    f"({', '.join('plain' if s is None else s.describe() for s in schemes)}), "
                                    "which one matmul cannot serve")
        scheme = schemes.pop()
        try:
            module.use_scheme(scheme)
        except BlockSplitError as exc:
            raise BlockSplitError(f"{name}: {exc}; tensor_parallel_size={tensor_parallel_size} cuts the checkpoint's "
                                  f"{scheme.describe()} quantization; sizes that work: "
                                  f"{', '.join(map(str, valid_sizes(model.cfg)))}") from None
