"""bfloat16 weights packed once, at load (EXECUTOR_CPU_BF16_PREPACK): into
the layout of cpu_bf16_vnni.py's kernels on CPUs with AVX512-BF16 and no
AMX, or with no native bf16 but AVX512F or AVX2; into oneDNN's blocked
layout on CPUs with other native bf16 (AMX).

torch's bf16 F.linear calls oneDNN's inner product with the weight as it
is stored ([N, K], row-major), and oneDNN reorders it into its blocked
layout on every call: the whole weight read and written once more per
product. Reordered once (torch.ops.mkldnn._reorder_linear_weight, what
inductor's freezing pass does for the weights it may treat as constants)
the same kernel gives the same outputs bit for bit, faster at every row
count. Measured on two Zen 4 cores, the 113 products of a Qwen3-0.6B
shape's decode step: 66.6 -> 33.9 ms at one row, 103.7 -> 64.9 at 16,
232.6 -> 198.5 at 64. On those cores the AVX512-BF16 kernel is faster
still at one row and as fast at many (cpu_bf16_vnni.py), so `auto` packs
for it where the CPU has AVX512-BF16 but no AMX.

Either packed weight replaces the layer's parameter (so the model holds
one copy), and a plain use of it raises rather than computing with a
packed layout as if it were row-major: F.linear refuses a oneDNN tensor,
and the AVX512-BF16 layout is 4-D. A weight shared with another module is
not packed, except a head tied to the embedding for the AVX512-BF16
kernel, whose layout the embedding reads rows from (cpu_gemv.prepack_bf16).
Inside a compiled graph the product is one opaque operator (linear_op)
that finds the weight by a small handle tensor the layer holds, so that
the graph never takes a packed weight as an input and a layerwise graph's
calls take each layer's own handle (compiled_decode.py).
"""

from __future__ import annotations

import itertools
import logging
import weakref

import torch
from torch import nn

from executor_svc.model import cpu_bf16_vnni

log = logging.getLogger(__name__)

# The batch size oneDNN picks its blocked layout for: decode steps of a few
# to a few dozen rows. Any row count runs on it.
ROWS_HINT = 16

# handle -> (the layer's packed parameter, its kind); an entry goes when its parameter is freed
_weights: dict[int, tuple[weakref.ref, str]] = {}
_handles = itertools.count()


def onednn_available() -> bool:
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


PAIR_KINDS = ("avx512bf16", "avx512", "avx2")  # cpu_bf16_vnni.py's layout, a plain tensor


def choose(setting: str, native_bf16: bool) -> str | None:
    """The kind EXECUTOR_CPU_BF16_PREPACK asks for on this CPU, or None
    (logged) where none can serve. auto: avx512bf16 where the CPU has
    AVX512-BF16 and no AMX, onednn where it has other native bf16 (AMX),
    else avx512 where it has AVX512F, else avx2 where it has AVX2 and FMA;
    each where its kernel builds."""
    if setting == "off":
        return None
    if setting == "auto":
        if cpu_bf16_vnni.cpu_has_it() and cpu_bf16_vnni.load("avx512bf16"):
            return "avx512bf16"
        if native_bf16:
            return "onednn" if onednn_available() else None
        return next((kind for kind in ("avx512", "avx2") if cpu_bf16_vnni.load(kind)), None)
    if setting in PAIR_KINDS:
        if cpu_bf16_vnni.load(setting):
            return setting
        log.warning("EXECUTOR_CPU_BF16_PREPACK=%s: its kernel cannot serve on this CPU (logged above); weights keep "
                    "their stored layout", setting)
        return None
    if native_bf16 and onednn_available():
        return "onednn"
    log.warning("EXECUTOR_CPU_BF16_PREPACK=onednn: %s; weights keep their stored layout",
                "this torch has no oneDNN weight reorder" if native_bf16 else "the CPU has no native bf16")
    return None


def prepack(layer: nn.Module, kind: str) -> bool:
    """Replaces layer.weight (bf16, [N, K]) with its packed copy of this
    kind, once the copy is seen to give F.linear's outputs (bit for bit for
    oneDNN's, to float32 rounding for cpu_bf16_vnni's kernels); False (the
    layer unchanged) otherwise."""
    weight, bias = layer.weight.detach(), layer.bias
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    want = nn.functional.linear(x, weight, bias)
    try:
        if kind == "onednn":
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)
            same = torch.equal(_product(x, packed, bias, kind, weight.shape[0]), want)
        elif not cpu_bf16_vnni.fits(weight):
            return False
        else:
            packed = cpu_bf16_vnni.pack(weight)
            same = torch.allclose(_product(x, packed, bias, kind, weight.shape[0]).float(), want.float(),
                                  rtol=2 ** -6, atol=1e-2)
    except RuntimeError as exc:
        log.warning("packing a [%d, %d] weight for %s failed (%s); it keeps torch's GEMM", *weight.shape, kind, exc)
        return False
    if not same:
        log.warning("the [%d, %d] weight packed for %s does not give F.linear's outputs; it keeps torch's GEMM",
                    *weight.shape, kind)
        return False
    handle = next(_handles)
    layer.weight = nn.Parameter(packed, requires_grad=False)
    _weights[handle] = (weakref.ref(layer.weight, lambda _, handle=handle: _weights.pop(handle, None)), kind)
    layer.prepack_handle = torch.tensor(handle)
    layer.prepack_kind = kind
    layer.prepack_rows = weight.shape[0]
    return True


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, kind: str,
             rows: int) -> torch.Tensor:
    if kind in PAIR_KINDS:
        return cpu_bf16_vnni.linear(x, packed, bias, rows, kind)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight, bias) for a packed layer, x of any leading dims;
    inside a compiled graph through linear_op."""
    flat = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():
        y = torch.ops.llmsched.prepacked_linear(flat, layer.prepack_handle, layer.bias, layer.prepack_rows)
    else:
        y = _product(flat, layer.weight, layer.bias, layer.prepack_kind, layer.prepack_rows)
    return y.view(*x.shape[:-1], y.shape[-1])


@torch.library.custom_op("llmsched::prepacked_linear", mutates_args=())
def linear_op(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """A packed layer's product inside a compiled graph: an operator dynamo
    does not look into, given the layer's handle, not its weight."""
    ref, kind = _weights.get(int(handle), (lambda: None, ""))
    weight = ref()
    if weight is None:
        raise RuntimeError(f"packed weight {int(handle)} was freed while a graph still calls it")
    return _product(x, weight, bias, kind, rows)


@linear_op.register_fake
def _(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], rows)


def shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters more than one module holds (a tied head)."""
    seen, shared = set(), set()
    for _, p in model.named_parameters(remove_duplicate=False):
        (shared if id(p) in seen else seen).add(id(p))
    return shared
