"""The multi-LoRA kernels (llmsched_kernels/lora.py) on a GPU, through the model's own
LoRA layer (executor_svc/model/lora.py's LoraLinear), at Llama-3-8B's fused
q/k/v projection (4096 -> 4096 + 1024 + 1024, bf16), 8 slots of rank 64
holding adapters of ranks 8, 16 and 64:

    python -m bench.lora_kernels [--out lora_kernels.json] [--quick]

Per batch size: the kernels' delta against the torch path (gather per
adapter) within bf16's tolerance, and the milliseconds of the bare base GEMM,
of the GEMM and LoRA layer on a batch of base-model tokens only (the layer
returns at once: what a request with no adapter pays) and on a batch of
mixed adapters with every
fourth token on the base model, through the kernels and through the torch
path. Exits 2 without CUDA, 1 when any check disagrees.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.cuda_timing import agree, time_ms

HIDDEN, PARTS = 4096, (4096, 1024, 1024)
RANKS = (8, 16, 64)  # slots 0-2; slots 3-7 stay empty
NUM_SLOTS, MAX_RANK = 8, 64
TOKENS = (1, 16, 64, 256, 1024)


def make_layer(device, dtype):
    """A LoraLinear of 8 slots with random adapters of RANKS in slots 0-2."""
    import torch

    from executor_svc.model.lora import LoraBatch, LoraLinear, LoraWeights

    lora = LoraLinear.make_empty(LoraBatch(NUM_SLOTS), list(PARTS), HIDDEN, MAX_RANK, device, dtype)
    g = torch.Generator().manual_seed(0)
    for slot, rank in enumerate(RANKS):
        weights = [LoraWeights(torch.randn(rank, HIDDEN, generator=g) / HIDDEN**0.5,
                               torch.randn(rows, rank, generator=g) / rank**0.5) for rows in PARTS]
        lora.write(slot, weights, 2.0)
    return lora


def bench_tokens(lora, weight, num_tokens: int, repeats: int) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F

    device, dtype = weight.device, weight.dtype
    x = torch.randn(num_tokens, HIDDEN, device=device, dtype=dtype)
    mixed = np.array([-1 if t % 4 == 3 else t % len(RANKS) for t in range(num_tokens)], dtype=np.int64)
    ms, out = {"no_lora_layer": time_ms(lambda: F.linear(x, weight), repeats)}, {}
    lora.batch.set(None, device)
    ms["base_only"] = time_ms(lambda: lora.add(x, F.linear(x, weight)), repeats)
    for impl in ("triton", "torch"):
        lora.batch.impl = impl
        lora.batch.set(mixed, device)
        out[impl] = lora.add(x, F.linear(x, weight))
        ms[f"mixed_{impl}"] = time_ms(lambda: lora.add(x, F.linear(x, weight)), repeats)
    return {"tokens": num_tokens, "ms": ms, "base_only_over_no_lora": ms["base_only"] / ms["no_lora_layer"],
            "mixed_triton_over_base": ms["mixed_triton"] / ms["base_only"],
            **agree(out["triton"], out["torch"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="JSON report")
    ap.add_argument("--quick", action="store_true", help="1 and 256 tokens, fewer repeats")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("lora_kernels: torch sees no CUDA device; the kernels are benchmarked on CUDA only", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), torch.bfloat16
    lora = make_layer(device, dtype)
    weight = torch.randn(sum(PARTS), HIDDEN, device=device, dtype=dtype) / HIDDEN**0.5
    repeats = 5 if args.quick else 20
    rows = [bench_tokens(lora, weight, n, repeats) for n in ((1, 256) if args.quick else TOKENS)]
    for r in rows:
        print(f"LoRA q/k/v {r['tokens']:5d} tokens: GEMM alone {r['ms']['no_lora_layer']:.3f} ms, base tokens only "
              f"{r['ms']['base_only']:.3f} ms, mixed adapters "
              f"triton {r['ms']['mixed_triton']:.3f} ms ({r['mixed_triton_over_base']:.2f}x), torch "
              f"{r['ms']['mixed_torch']:.3f} ms; agree={r['ok']} (max diff {r['max_abs_diff']:.3g})")
    report = {"device": torch.cuda.get_device_name(0), "hidden": HIDDEN, "parts": PARTS, "ranks": RANKS,
              "num_slots": NUM_SLOTS, "max_rank": MAX_RANK, "lora": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
