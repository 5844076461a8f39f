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

A linear layer of an FP8 checkpoint (use_fp8) keeps the checkpoint's FP8
weight and its block scales (weight_scale_inv), each rank its part of
both. On CUDA it runs the Triton FP8 GEMM (kernels/fp8_linear.py);
elsewhere it dequantizes its weight for each matmul (quantization.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.model.checkpoint import LazyTensor
from executor_svc.model.model_config import QuantSpec
from executor_svc.model.quantization import FP8, BlockSplitError, cdiv, dequantize_fp8_blocks
from executor_svc.model.sharding import valid_sizes


def materialize(module: nn.Module, leaf: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """module.leaf on device and dtype (allocated, uninitialised, on first
    call). A quantized leaf (FP8 weights, float32 scales) keeps its own dtype."""
    p = getattr(module, leaf)
    if p.is_meta:
        if p.dtype in (FP8, torch.float32) and getattr(module, "fp8_block", None) is not None and leaf != "bias":
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
    once use_fp8 ran, FP8 with its grid of block scales (weight_scale_inv)."""

    def __init__(self):
        super().__init__()
        # (block_n, block_k) once use_fp8 made the weight FP8; the grid row
        # of each weight row (stacked parts' grids for ColumnLinear) once loaded.
        self.fp8_block: tuple[int, int] | None = None
        self.grid_rows: torch.Tensor | None = None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight at the compute dtype: itself, or dequantized for this
        use (latent attention reads kv_b_proj's weight directly)."""
        if self.fp8_block is None:
            return self.weight
        return dequantize_fp8_blocks(self.weight, self.weight_scale_inv, self.grid_rows, self.fp8_block[1], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_block is not None and x.is_cuda:
            # The Triton GEMM that decodes FP8 in its load loop, so no
            # dequantized weight is ever written. Imported here: the CPU
            # path never loads Triton.
            from kernels.fp8_linear import fp8_block_linear

            y = fp8_block_linear(x, self.weight, self.weight_scale_inv, self.grid_rows, self.fp8_block[1])
            return y if self.bias is None else y + self.bias
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

    def use_fp8(self, block: tuple[int, int]) -> None:
        """Holds the weight in FP8 with the checkpoint's block scales. Each
        part's rows must start on a block, and end on one unless they end
        the checkpoint tensor (its edge block)."""
        bn, bk = block
        for p in self.parts:
            if p.start % bn or (p.rows % bn and p.start + p.rows != p.whole):
                raise BlockSplitError(f"rows [{p.start}, {p.start + p.rows}) of {p.name or 'the weight'}'s {p.whole} "
                                      f"are not whole blocks of {bn}")
        self.fp8_block = block
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(sum(cdiv(p.rows, bn) for p in self.parts), cdiv(self.in_features, bk)), requires_grad=False)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for p in self.parts:
            shapes[self._key(p, "weight")] = (p.whole, self.in_features)
            if self.bias is not None:
                shapes[self._key(p, "bias")] = (p.whole,)
            if self.fp8_block is not None:
                bn, bk = self.fp8_block
                shapes[self._key(p, "weight_scale_inv")] = (cdiv(p.whole, bn), cdiv(self.in_features, bk))
        return shapes

    def load_weight(self, name: str, weight: LazyTensor, device: torch.device, dtype: torch.dtype) -> None:
        offset = grid_offset = 0
        bn = self.fp8_block[0] if self.fp8_block is not None else 1
        for p in self.parts:
            if name == self._key(p, "weight_scale_inv"):
                first = p.start // bn
                value = weight.read(0, first, first + cdiv(p.rows, bn)).to(torch.float32)
                target = materialize(self, "weight_scale_inv", device, dtype)
                check_shape(name, value, (cdiv(p.rows, bn), target.shape[1]))
                target[grid_offset : grid_offset + value.shape[0]].copy_(value)
                self._set_grid_rows(device)
                return
            for leaf in ("weight", "bias"):
                if name == self._key(p, leaf):
                    value = weight.read(0, p.start, p.start + p.rows)
                    target = materialize(self, leaf, device, dtype)
                    check_shape(name, value, (p.rows, *target.shape[1:]))
                    check_fp8(name, value, target)
                    target[offset : offset + p.rows].copy_(value)  # a parameter without grad: copied in place
                    return
            offset += p.rows
            grid_offset += cdiv(p.rows, bn)
        raise KeyError(name)

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

    def use_fp8(self, block: tuple[int, int]) -> None:
        """As ColumnLinear.use_fp8; this rank's columns must be whole blocks."""
        bn, bk = block
        if self.start % bk or (self.cols % bk and self.start + self.cols != self.whole_in):
            raise BlockSplitError(f"columns [{self.start}, {self.start + self.cols}) of {self.whole_in} are not whole "
                                  f"blocks of {bk}")
        self.fp8_block = block
        self.weight = nn.Parameter(torch.empty(self.out_features, self.cols, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(cdiv(self.out_features, bn), cdiv(self.cols, bk)),
                                             requires_grad=False)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"weight": (self.out_features, self.whole_in)}
        if self.bias is not None:
            shapes["bias"] = (self.out_features,)
        if self.fp8_block is not None:
            bn, bk = self.fp8_block
            shapes["weight_scale_inv"] = (cdiv(self.out_features, bn), cdiv(self.whole_in, bk))
        return shapes

    def load_weight(self, name: str, weight: LazyTensor, device: torch.device, dtype: torch.dtype) -> None:
        target = materialize(self, name, device, dtype)
        if name == "weight":
            value = weight.read(1, self.start, self.start + self.cols)
            check_fp8(name, value, target)
        elif name == "weight_scale_inv":
            bn, bk = self.fp8_block
            value = weight.read(1, self.start // bk, self.start // bk + target.shape[1]).to(torch.float32)
            self.grid_rows = torch.arange(self.out_features, device=device) // bn
        elif self.rank == 0:
            value = weight.read()
        else:
            target.zero_()
            return
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
    def __init__(self, vocab_size: int, hidden: int, first: int, end: int):
        nn.Embedding.__init__(self, end - first, hidden)
        self._init_vocab(vocab_size, first, end)


class VocabHead(VocabParallel, nn.Linear):
    def __init__(self, vocab_size: int, hidden: int, first: int, end: int):
        nn.Linear.__init__(self, hidden, end - first, bias=False)
        self._init_vocab(vocab_size, first, end)


def replicated_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """A module without a loader of its own: its direct parameters load whole."""
    return {name: tuple(p.shape) for name, p in module.named_parameters(recurse=False)}


def load_replicated(module: nn.Module, name: str, weight: LazyTensor, device: torch.device,
                    dtype: torch.dtype) -> None:
    # Always a copy: safetensors hands out views of the mmapped file, which
    # would keep the served weights tied to files on disk.
    setattr(module, name, nn.Parameter(weight.read().to(device=device, dtype=dtype, copy=True), requires_grad=False))


def convert_to_fp8(model: nn.Module, spec: QuantSpec, tensor_parallel_size: int) -> None:
    """Turns every layer that the spec converts and that can hold FP8
    weights (use_fp8: ColumnLinear, RowLinear, moe.FusedExperts) into one
    that holds them with their block scales; call on the meta-device model
    before loading."""
    for name, module in model.named_modules():
        if not hasattr(module, "use_fp8"):
            continue
        if any(not spec.converts(m) for m in module.checkpoint_modules(name)):
            continue
        try:
            module.use_fp8(spec.weight_block)
        except BlockSplitError as exc:
            raise BlockSplitError(f"{name}: {exc}; tensor_parallel_size={tensor_parallel_size} cuts the checkpoint's "
                                  f"FP8 blocks of {list(spec.weight_block)}; sizes that work: "
                                  f"{', '.join(map(str, valid_sizes(model.cfg)))}") from None
