"""bfloat16 linears on a CPU with native bf16 instructions (AVX512-BF16,
AMX): each weight reordered once, at load, into oneDNN's blocked layout.

torch's bf16 F.linear calls oneDNN's inner product with the weight as it
is stored ([N, K], row-major), and oneDNN reorders it into its blocked
layout on every call: the whole weight read and written once more per
product. Reordered once (torch.ops.mkldnn._reorder_linear_weight, what
inductor's freezing pass does for the weights it may treat as constants)
the same kernel gives the same outputs bit for bit, faster at every row
count. Measured on two Zen 4 cores, the 113 products of a Qwen3-0.6B
shape's decode step: 66.6 -> 33.9 ms at one row, 103.7 -> 64.9 at 16,
232.6 -> 198.5 at 64.

The reordered weight is an opaque oneDNN tensor: it replaces the layer's
parameter (so the model holds one copy), and any plain use of it raises
(F.linear refuses a oneDNN tensor) rather than computing with a blocked
layout as if it were row-major. A weight shared with another module (a
head tied to the embedding, whose lookup reads rows) is not reordered.
Inside a compiled graph the product is one opaque operator (linear_op)
that finds the weight by a small handle tensor the layer holds, so that
the graph never takes a oneDNN tensor as an input and a layerwise graph's
calls take each layer's own handle (compiled_decode.py).
"""

from __future__ import annotations

import itertools
import logging
import weakref

import torch
from torch import nn

log = logging.getLogger(__name__)

# The batch size oneDNN picks its blocked layout for: decode steps of a
# few to a few dozen rows. Any row count runs on it.
ROWS_HINT = 16

_weights: dict[int, weakref.ref] = {}  # handle -> the layer's reordered parameter
_handles = itertools.count()


def available() -> bool:
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def reorder(layer: nn.Module) -> bool:
    """Replaces layer.weight (bf16, [N, K]) with its reordered copy, once
    the copy is seen to give F.linear's outputs bit for bit; False (the
    layer unchanged) otherwise."""
    weight, bias = layer.weight.detach(), layer.bias
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        same = torch.equal(_product(x, packed, bias), nn.functional.linear(x, weight, bias))
    except RuntimeError as exc:
        log.warning("oneDNN reorder of a [%d, %d] weight failed (%s); it keeps torch's GEMM", *weight.shape, exc)
        return False
    if not same:
        log.warning("oneDNN's reordered [%d, %d] weight does not give F.linear's outputs; it keeps torch's GEMM",
                    *weight.shape)
        return False
    handle = next(_handles)
    layer.weight = nn.Parameter(packed, requires_grad=False)
    _weights[handle] = weakref.ref(layer.weight)
    layer.onednn_handle = torch.tensor(handle)
    layer.onednn_rows = weight.shape[0]
    return True


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight, bias) for a reordered layer, x of any leading
    dims; inside a compiled graph through linear_op."""
    flat = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():
        y = torch.ops.llmsched.onednn_linear(flat, layer.onednn_handle, layer.bias, layer.onednn_rows)
    else:
        y = _product(flat, layer.weight, layer.bias)
    return y.view(*x.shape[:-1], y.shape[-1])


@torch.library.custom_op("llmsched::onednn_linear", mutates_args=())
def linear_op(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """A reordered layer's product inside a compiled graph: an operator
    dynamo does not look into, given the layer's handle, not its weight."""
    weight = _weights[int(handle)]()
    if weight is None:
        raise RuntimeError(f"oneDNN weight {int(handle)} was freed while a graph still calls it")
    return _product(x, weight, bias)


@linear_op.register_fake
def _(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], rows)


def shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters more than one module holds (a tied head)."""
    seen, shared = set(), set()
    for _, p in model.named_parameters(remove_duplicate=False):
        (shared if id(p) in seen else seen).add(id(p))
    return shared
