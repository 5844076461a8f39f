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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.model.checkpoint import LazyTensor


def materialize(module: nn.Module, leaf: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """module.leaf on device and dtype (allocated, uninitialised, on first call)."""
    p = getattr(module, leaf)
    if p.is_meta:
        p = nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype), requires_grad=False)
        setattr(module, leaf, p)
    return p


def check_shape(name: str, value: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(value.shape) != tuple(want):
        raise ValueError(f"{name}: this rank's part has shape {tuple(value.shape)}, expected {tuple(want)}")


@dataclass(frozen=True, slots=True)
class RowPart:
    """One checkpoint tensor's share of a ColumnLinear on this rank: rows
    [start, start + rows) of a tensor with `whole` rows."""

    name: str  # checkpoint name of the projection ("q_proj"), or "" for the layer's own
    whole: int
    start: int
    rows: int


class ColumnLinear(nn.Module):
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

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for p in self.parts:
            shapes[self._key(p, "weight")] = (p.whole, self.in_features)
            if self.bias is not None:
                shapes[self._key(p, "bias")] = (p.whole,)
        return shapes

    def load_weight(self, name: str, weight: LazyTensor, device: torch.device, dtype: torch.dtype) -> None:
        offset = 0
        for p in self.parts:
            for leaf in ("weight", "bias"):
                if name == self._key(p, leaf):
                    value = weight.read(0, p.start, p.start + p.rows)
                    target = materialize(self, leaf, device, dtype)
                    check_shape(name, value, (p.rows, *target.shape[1:]))
                    target[offset : offset + p.rows].copy_(value)  # a parameter without grad: copied in place
                    return
            offset += p.rows
        raise KeyError(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowLinear(nn.Module):
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

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"weight": (self.out_features, self.whole_in)}
        if self.bias is not None:
            shapes["bias"] = (self.out_features,)
        return shapes

    def load_weight(self, name: str, weight: LazyTensor, device: torch.device, dtype: torch.dtype) -> None:
        target = materialize(self, name, device, dtype)
        if name == "weight":
            value = weight.read(1, self.start, self.start + self.cols)
        elif self.rank == 0:
            value = weight.read()
        else:
            target.zero_()
            return
        check_shape(name, value, tuple(target.shape))
        target.copy_(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
