"""Quantized checkpoint layouts, each turned into the one layout a layer
holds (layers.py), so that the math, the kernels and tensor-parallel
splitting are written once.

What a layer holds, for a weight of N rows (outputs) by K columns (inputs):

  kind "fp8":  weight            float8_e4m3fn [N, K]
               weight_scale_inv  float32 [grid rows, grid columns]: one scale
                                 per block of the checkpoint tensor (edge blocks
                                 cropped), or one per row ([N, 1])
  kind "int":  qweight           uint8 [N, cdiv(K, 2)] for 4 bits (column 2j in
                                 the low nibble of byte j, 2j + 1 in the high),
                                 [N, K] for 8; unsigned values
               scales            [N, groups], the checkpoint's dtype
               zeros             uint8 [N, groups], unsigned zero points
               g_idx             int32 [K], each column's group (act-order only)

  kind "fp4":  qweight           uint8 [N, cdiv(K, 2)], E2M1 codes as int 4-bit
               scales            [N, groups]: NVFP4's float8_e4m3fn, MXFP4's E8M0 bytes
               global_scale      float32 [N], each row's tensor's (NVFP4)

  W[n, k] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)], computed in the
  scales' dtype as compressed-tensors, GPTQ and AWQ dequantize, then cast
  (llmsched_kernels.reference.dequantize_int; llmsched_kernels/int_linear.py on CUDA).

Checkpoint layouts (`LinearScheme.layout`):

  fp8       weight [N, K] e4m3, weight_scale_inv [cdiv(N, bn), cdiv(K, bk)]
            (quant_method fp8 with weight_block_size)
  fp8-row   weight [N, K] e4m3, weight_scale: one per tensor (quant_method fp8)
  ct-float  weight [N, K] e4m3, weight_scale per tensor [1], channel [N, 1]
            or block [cdiv(N, bn), cdiv(K, bk)] (compressed-tensors)
  ct-pack   weight_packed int32 [N, cdiv(K * bits, 32)]: element j of a row at
            bit j * bits of the row's words, stored plus 2^(bits-1);
            weight_scale [N, groups]; weight_zero_point int32 packed the same
            way down the rows [cdiv(N * bits, 32), groups] (asymmetric only);
            weight_shape [2]; weight_g_idx [K] (older act-order checkpoints)
  ct-int    weight int8 [N, K] (signed), weight_scale [N, 1] or [1]
  gptq      qweight int32 [K * bits / 32, N], packed down the columns;
            qzeros int32 [groups, N * bits / 32], stored minus one;
            scales [groups, N]; g_idx int32 [K]
  ct-nvfp4  weight_packed uint8 [N, K / 2] (E2M1, low nibble first),
            weight_scale float8_e4m3fn [N, K / 16], weight_global_scale [1]
  ct-mxfp4  weight_packed as NVFP4, weight_scale uint8 E8M0 [N, K / 32]
  modelopt-nvfp4
            weight uint8 [N, K / 2] and weight_scale as ct-nvfp4, and
            weight_scale_2 [] or [1]: compressed-tensors' global scale
            inverted (W = value * scale * weight_scale_2); the activations'
            input_scale likewise inverts input_global_scale. Held as
            ct-nvfp4 with global scales 1 / weight_scale_2 and 1 /
            input_scale, the math vLLM's NVFP4 kernels run for both layouts
  awq       qweight int32 [K, N / 8] and qzeros int32 [groups, N / 8], packed
            along the rows in the order 0 2 4 6 1 3 5 7; scales [groups, N]
"""

from __future__ import annotations

import torch

from executor_svc.model.model_config import LinearScheme
from executor_svc.model.mxfp4 import FP4_VALUES
from executor_svc.model.quantization import cdiv
from llmsched_kernels.reference import pack_int, unpack_int

# AWQ's GEMM layout puts output n of each group of 8 in nibble AWQ_NIBBLE[n % 8].
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)
# A checkpoint leaf whose shape the layer checks itself (per-tensor scales
# come as [] or [1]).
ANY_SHAPE = None


def num_groups(scheme: LinearScheme, cols: int) -> int:
    return 1 if scheme.group_size is None else cdiv(cols, scheme.group_size)


def groups_in_order(g_idx: torch.Tensor | None, cols: int, group: int) -> bool:
    """Column k is in group k // group: no g_idx, or one saying so (GPTQ
    checkpoints carry g_idx even without act-order)."""
    if g_idx is None:
        return True
    return torch.equal(g_idx.to(torch.int64), torch.arange(cols, device=g_idx.device) // group)


def checkpoint_leaves(scheme: LinearScheme, rows: int, cols: int) -> dict[str, tuple[int, ...] | None]:
    """The checkpoint tensors of one quantized linear of whole shape [rows,
    cols] (bias aside), by leaf name, with their shapes."""
    leaves = _weight_leaves(scheme, rows, cols)
    if scheme.activations is not None and scheme.activations.checkpoint_leaf:
        leaf = "input_scale" if scheme.layout == "modelopt-nvfp4" else scheme.activations.checkpoint_leaf
        leaves[leaf] = ANY_SHAPE  # [1] or []
    return leaves


def _weight_leaves(scheme: LinearScheme, rows: int, cols: int) -> dict[str, tuple[int, ...] | None]:
    layout, bits, g = scheme.layout, scheme.bits, num_groups(scheme, cols)
    if layout == "fp8":
        bn, bk = scheme.block
        return {"weight": (rows, cols), "weight_scale_inv": (cdiv(rows, bn), cdiv(cols, bk))}
    if layout in ("fp8-row", "ct-float", "ct-int"):
        scale = ANY_SHAPE if scheme.block is None else (cdiv(rows, scheme.block[0]), cdiv(cols, scheme.block[1]))
        return {"weight": (rows, cols), "weight_scale": scale}
    if layout == "ct-pack":
        leaves = {"weight_packed": (rows, cdiv(cols * bits, 32)), "weight_scale": (rows, g), "weight_shape": (2,)}
        if not scheme.symmetric:
            leaves["weight_zero_point"] = (cdiv(rows * bits, 32), g)
        if scheme.act_order:
            leaves["weight_g_idx"] = (cols,)
        return leaves
    if layout == "ct-nvfp4":
        return {"weight_packed": (rows, cdiv(cols, 2)), "weight_scale": (rows, g), "weight_global_scale": (1,)}
    if layout == "ct-mxfp4":
        return {"weight_packed": (rows, cdiv(cols, 2)), "weight_scale": (rows, g)}
    if layout == "modelopt-nvfp4":
        return {"weight": (rows, cdiv(cols, 2)), "weight_scale": (rows, g), "weight_scale_2": ANY_SHAPE}
    if layout == "gptq":
        return {"qweight": (cols * bits // 32, rows), "qzeros": (g, rows * bits // 32), "scales": (g, rows),
                "g_idx": (cols,)}
    if layout == "awq":
        return {"qweight": (cols, rows // 8), "qzeros": (g, rows // 8), "scales": (g, rows)}
    raise ValueError(f"unknown layout {layout}")


def unpack_words(words: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits values each, value j at bit (j % per
    word) * bits of word j // per word, along `dim` -> int32 values along
    `dim`, `count` of them."""
    per = 32 // bits
    w = words.to(torch.int32).movedim(dim, -1)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=w.device)
    values = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per]
    values = values.flatten(-2)[..., :count]
    assert per * w.shape[-1] >= count
    return values.movedim(-1, dim).contiguous()


def canonical(scheme: LinearScheme, leaf: str, t: torch.Tensor, rows: int, cols: int) -> tuple[str, torch.Tensor]:
    """One whole checkpoint tensor -> (the leaf the layer holds, the tensor
    in the held layout: rows first, whole); ("", the tensor) for a leaf
    that is only checked (weight_shape)."""
    layout, bits = scheme.layout, scheme.bits
    if layout == "modelopt-nvfp4":
        inverted = {"input_scale": "input_global_scale", "weight_scale_2": "global_scale"}
        if leaf in inverted:
            value = 1.0 / t.to(torch.float32).reshape(1)
            return inverted[leaf], value.expand(rows) if leaf == "weight_scale_2" else value
        return {"weight": "qweight", "weight_scale": "scales"}[leaf], t
    if leaf in ("input_scale", "input_global_scale"):
        return leaf, t.to(torch.float32).reshape(1)
    if layout in ("fp8", "fp8-row", "ct-float"):
        if leaf == "weight":
            return "weight", t
        t = t.to(torch.float32)
        if scheme.block is None:  # one scale per tensor or per row -> one per row
            t = t.reshape(-1, 1).expand(rows, 1) if t.numel() == 1 else t.reshape(rows, 1)
        return "weight_scale_inv", t
    if layout == "ct-int":
        if leaf == "weight":
            return "qweight", (t.to(torch.int16) + 128).to(torch.uint8)
        return "scales", t.reshape(-1, 1).expand(rows, 1) if t.numel() == 1 else t.reshape(rows, 1)
    if layout == "ct-pack":
        if leaf == "weight_packed":
            return "qweight", pack_int(unpack_words(t, bits, cols, 1), bits)
        if leaf == "weight_scale":
            return "scales", t
        if leaf == "weight_zero_point":
            return "zeros", unpack_words(t, bits, rows, 0).to(torch.uint8)
        if leaf == "weight_g_idx":
            return "g_idx", t.to(torch.int32)
        if leaf == "weight_shape":
            if t.tolist() != [rows, cols]:
                raise ValueError(f"weight_shape {t.tolist()}, config implies {[rows, cols]}")
            return "", t
    if layout in ("ct-nvfp4", "ct-mxfp4"):
        held = {"weight_packed": "qweight", "weight_scale": "scales", "weight_global_scale": "global_scale"}[leaf]
        return held, t.to(torch.float32).reshape(1).expand(rows) if held == "global_scale" else t
    if layout == "gptq":
        if leaf == "qweight":
            return "qweight", pack_int(unpack_words(t, bits, cols, 0).T, bits)
        if leaf == "qzeros":  # stored minus one (GPTQ v1 checkpoints)
            return "zeros", ((unpack_words(t, bits, rows, 1) + 1) & ((1 << bits) - 1)).T.to(torch.uint8)
        if leaf == "scales":
            return "scales", t.T
        if leaf == "g_idx":
            return "g_idx", t.to(torch.int32)
    if layout == "awq":
        if leaf in ("qweight", "qzeros"):
            values = unpack_words(t, 4, t.shape[1] * 8, 1)  # [.., N] in nibble order within each 8
            values = values.unflatten(1, (-1, 8))[:, :, list(AWQ_NIBBLE)].flatten(1)
            return ("qweight", pack_int(values.T, 4)) if leaf == "qweight" else ("zeros", values.T.to(torch.uint8))
        if leaf == "scales":
            return "scales", t.T
    raise KeyError(f"{leaf} is not a tensor of the {layout} layout")


def symmetric_zeros(scheme: LinearScheme, rows: int, cols: int, device: torch.device) -> torch.Tensor | None:
    """The zero points a layout leaves implicit: 2^(bits-1) (symmetric)."""
    if scheme.kind == "int" and scheme.layout in ("ct-pack", "ct-int") and scheme.symmetric:
        return torch.full((rows, num_groups(scheme, cols)), 1 << (scheme.bits - 1), dtype=torch.uint8, device=device)
    return None


def dequantize_fp4(qweight: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None, group_size: int,
                   cols: int, dtype: torch.dtype) -> torch.Tensor:
    """The held fp4 layout -> W [N, cols] in dtype, as compressed-tensors
    decompresses: each E2M1 value times its group's scale (NVFP4: the FP8
    scale over the row's global scale, in float32; MXFP4: 2^(e - 127)),
    rounded to bfloat16, then cast."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=qweight.device)
    values = lut[unpack_int(qweight, 4, cols).long()]  # [N, cols]
    if global_scale is None:  # E8M0
        s = torch.exp2(scales.to(torch.float32) - 127)
    else:
        s = scales.to(torch.float32) / global_scale[:, None]
    groups = s.shape[1]
    values = torch.nn.functional.pad(values, (0, groups * group_size - cols)).view(-1, groups, group_size)
    w = (values * s[:, :, None]).flatten(1)[:, :cols].to(torch.bfloat16)
    return w if w.dtype == dtype else w.to(dtype)
