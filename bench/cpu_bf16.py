"""The bf16 layer products of a Qwen3-0.6B shape's decode step, in process,
through each way this CPU can run them (EXECUTOR_CPU_BF16_PREPACK and
EXECUTOR_CPU_GEMV): torch's F.linear on the stored layout (the baseline),
the inductor GEMV on it (one row), oneDNN's reordered layout, the
avx512bf16 and avx2 kernels' packed layout (cpu_bf16_vnni.py), and the AVX2
C kernels on the stored layout that serve without native bf16 when packing
is off (cpu_bf16_gemm.py). Each layer has weights of its own, as
in a model, so that they stream from memory rather than sit in cache.

    python -m bench.cpu_bf16                       # 1 and 16 rows, 5 rounds
    python -m bench.cpu_bf16 --rows 1,16,64 --rounds 7 --layers 28

Rounds interleave the paths; each figure is the median over rounds of the
time for all the products of one step at that row count, and each ratio
is the baseline's median over the path's. Every path's outputs are checked
against F.linear first (to bf16 rounding); a path that differs exits 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from executor_svc.model import cpu_bf16_gemm, cpu_bf16_vnni, cpu_gemv, cpu_prepack

# [N, K] of one decoder layer of Qwen3-0.6B: q/k/v fused, o, gate/up fused, down.
LAYER_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]


def inductor_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """cpu_gemv's inductor GEMV itself: cpu_gemv.gemv takes the C GEMV of
    cpu_bf16_gemm.py instead once that is loaded, as it is here."""
    return cpu_gemv._call(cpu_gemv._compiled, weight.dtype, f"CPU GEMV ({weight.dtype})", cpu_gemv._gemv_body,
                          x.float().contiguous(), weight, True).to(x.dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16", help="comma-separated row counts (default: 1,16)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=28, help="decoder layers, each with its own weights")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).bfloat16() for n, k in LAYER_SHAPES * args.layers]
    packed: dict[str, list] = {}
    if cpu_prepack.onednn_available() and cpu_gemv.native_bf16_gemm():
        packed["onednn"] = [torch.ops.mkldnn._reorder_linear_weight(w, cpu_prepack.ROWS_HINT) for w in weights]
    pairs = [kind for kind in cpu_prepack.PAIR_KINDS if cpu_bf16_vnni.load(kind)]
    if pairs:
        packed["pairs"] = [cpu_bf16_vnni.pack(w) for w in weights]  # one layout for both kernels
    stored_c = cpu_bf16_gemm.load()
    print(f"{len(weights)} products, {sum(w.numel() for w in weights) * 2 / 1e9:.2f} GB of bf16 weights, "
          f"{args.threads} threads; CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16 GEMM "
          f"{cpu_gemv.native_bf16_gemm()}, pair kernels {pairs}", flush=True)

    def paths(xs: dict[int, torch.Tensor], rows: int) -> dict:
        found = {"F.linear, stored": lambda: [F.linear(xs[w.shape[1]], w) for w in weights]}
        if rows == 1:
            found["inductor GEMV, stored"] = lambda: [inductor_gemv(xs[w.shape[1]], w) for w in weights]
        if "onednn" in packed:
            found["oneDNN, reordered"] = lambda: [
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                for w, p in zip(weights, packed["onednn"])]
        for kind in pairs:
            found[f"{kind} kernel, packed"] = (lambda kind: lambda: [
                cpu_bf16_vnni.linear(xs[w.shape[1]], p, None, w.shape[0], kind)
                for w, p in zip(weights, packed["pairs"])])(kind)
        if stored_c:
            found["AVX2 C kernels, stored"] = lambda: [
                cpu_bf16_gemm.matmul(xs[w.shape[1]].float(), w).bfloat16() for w in weights]
        return found

    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {k for _, k in LAYER_SHAPES}}
            found = paths(xs, rows)
            want = found["F.linear, stored"]()
            for name, fn in found.items():
                for got, ref in zip(fn(), want):
                    scale = ref.float().abs().max().item()
                    if not torch.allclose(got.float(), ref.float(), rtol=2 ** -6, atol=2 ** -6 * scale):
                        print(f"{name} at {rows} rows: outputs differ from F.linear's", file=sys.stderr)
                        return 1
            times: dict[str, list[float]] = {name: [] for name in found}
            for _ in range(args.rounds):
                for name, fn in found.items():
                    started = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - started)
            base = statistics.median(times["F.linear, stored"])
            for name, samples in times.items():
                median = statistics.median(samples)
                print(f"{rows:4d} rows  {name:26s} {median * 1e3:8.1f} ms  {base / median:5.2f}x the baseline  "
                      f"(rounds {min(samples) * 1e3:.1f}-{max(samples) * 1e3:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
