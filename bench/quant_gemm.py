"""The quantized-weight GEMMs on CUDA (part of make gpu-check): the FP8
block-scaled kernel (llmsched_kernels.fp8_linear, 128 x 128 blocks), the int4
weight-only kernel (llmsched_kernels.int_linear, group 128, asymmetric zeros) and the
NVFP4 one (llmsched_kernels.int_linear.fp4_weight_linear, an FP8 scale per 16 over a
global scale per row) against torch's bf16 GEMM (F.linear) of the same shape.

    python -m bench.quant_gemm [--out bench_results/gpu/quant_gemm.json] [--repeats 20]

Shapes [N, K]: Llama-3-8B's o_proj (4096 x 4096) and gate/up (14336 x 4096),
at batch 1 (decode: the weight's bytes bound the time) and 64. Activations
and outputs in bf16. For each kernel the JSON has the median time (CUDA
events, after warm-up, with L2 flushed before each repeat so the weight is
read from memory), TFLOP/s (2 M N K), GB/s (the weight's bytes as stored,
scales and zeros included, plus activations read and output written), and
its time relative to bf16 (vs_bf16 < 1: faster). Each kernel's output is
checked against its torch reference (bf16 tolerance). Exits 2 without CUDA,
1 when a kernel disagrees with its reference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.cuda_timing import agree, time_ms

SHAPES = ((4096, 4096), (14336, 4096))  # [N, K]
BATCHES = (1, 64)
FP8_BLOCK = 128
INT4_GROUP = 128
L2_FLUSH_BYTES = 256 * 1024 * 1024  # over any GPU's L2 (H100/H200: 50 MB)


def gemm_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def weight_bytes(kind: str, n: int, k: int) -> int:
    """The weight as stored: bf16 [N, K]; FP8 [N, K] and float32 block scales; int4 packed two a byte,
    bf16 scales and uint8 zeros per row and group."""
    if kind == "bf16":
        return 2 * n * k
    if kind == "fp8_block":
        return n * k + 4 * -(-n // FP8_BLOCK) * -(-k // FP8_BLOCK)
    if kind == "int4_g128":
        groups = -(-k // INT4_GROUP)
        return n * -(-k // 2) + n * groups * (2 + 1)
    if kind == "nvfp4":
        return n * -(-k // 2) + n * -(-k // 16) + 4 * n
    raise ValueError(f"unknown weight kind {kind!r}: bf16, fp8_block, int4_g128 or nvfp4")


def gemm_bytes(kind: str, m: int, n: int, k: int) -> int:
    """Weight as stored + bf16 activations read + bf16 output written."""
    return weight_bytes(kind, n, k) + 2 * m * k + 2 * m * n


def bench_shape(m: int, n: int, k: int, repeats: int, flush) -> dict:
    import torch
    import torch.nn.functional as F

    from executor_svc.model.quantization import quantize_fp8_blocks
    from llmsched_kernels import reference
    from llmsched_kernels.fp8_linear import fp8_block_linear
    from llmsched_kernels.int_linear import fp4_weight_linear, int_weight_linear

    dev, dtype = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
    dense = torch.randn(n, k, device=dev, generator=g) / k**0.5  # [N, K] float32
    w_bf16 = dense.to(dtype)
    w_fp8, fp8_scales = quantize_fp8_blocks(dense, (FP8_BLOCK, FP8_BLOCK))
    grid_rows = torch.arange(n, device=dev) // FP8_BLOCK
    groups = -(-k // INT4_GROUP)
    q = torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8, generator=g)
    qweight = reference.pack_int(q, 4)  # [N, K / 2]
    int_scales = (torch.rand(n, groups, device=dev, generator=g) * 0.02 + 0.01).to(dtype)
    zeros = torch.randint(0, 16, (n, groups), device=dev, dtype=torch.uint8, generator=g)
    fp4_codes = torch.randint(0, 256, (n, k // 2), device=dev, dtype=torch.uint8, generator=g)
    fp4_scales = (torch.rand(n, k // 16, device=dev, generator=g) + 0.5).to(torch.float8_e4m3fn)
    fp4_global = torch.full((n,), 6.0 * k**0.5, device=dev)

    kernels = {
        "bf16": lambda: F.linear(x, w_bf16),
        "fp8_block": lambda: fp8_block_linear(x, w_fp8, fp8_scales, grid_rows, FP8_BLOCK),
        "int4_g128": lambda: int_weight_linear(x, qweight, int_scales, zeros, INT4_GROUP, 4),
        "nvfp4": lambda: fp4_weight_linear(x, fp4_codes, fp4_scales, fp4_global, 16),
    }
    with torch.inference_mode():
        agreement = {
            "fp8_block": agree(kernels["fp8_block"](), reference.fp8_block_linear(x, w_fp8, fp8_scales, grid_rows,
                                                                                   FP8_BLOCK)),
            "int4_g128": agree(kernels["int4_g128"](), reference.int_weight_linear(x, qweight, int_scales, zeros,
                                                                                     INT4_GROUP, 4)),
            "nvfp4": agree(kernels["nvfp4"](), reference.fp4_weight_linear(x, fp4_codes, fp4_scales, fp4_global, 16)),
        }
        times = {name: time_ms(fn, repeats, flush) for name, fn in kernels.items()}
    rows = {}
    for name, ms in times.items():
        rows[name] = {"ms": ms, "tflops": gemm_flops(m, n, k) / (ms * 1e-3) / 1e12,
                      "gb_per_s": gemm_bytes(name, m, n, k) / (ms * 1e-3) / 1e9,
                      "vs_bf16": ms / times["bf16"], **agreement.get(name, {})}
    return {"m": m, "n": n, "k": k, "kernels": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="JSON report")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per kernel and shape (the median is kept)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("quant_gemm: torch sees no CUDA device; the GEMMs are benchmarked on CUDA only", file=sys.stderr)
        return 2
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    results = [bench_shape(m, n, k, args.repeats, flush) for n, k in SHAPES for m in BATCHES]
    report = {"device": torch.cuda.get_device_name(0), "fp8_block": FP8_BLOCK, "int4_group": INT4_GROUP,
              "dtype": "bfloat16", "gemms": results}
    for r in results:
        cells = ", ".join(f"{name} {row['ms'] * 1e3:.0f} us {row['tflops']:.1f} TFLOP/s {row['gb_per_s']:.0f} GB/s "
                          f"({row['vs_bf16']:.2f}x bf16)" for name, row in r["kernels"].items())
        print(f"GEMM M={r['m']} N={r['n']} K={r['k']}: {cells}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    ok = all(row.get("ok", True) for r in results for row in r["kernels"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
