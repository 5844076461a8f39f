"""The fused-MoE and MLA-decode Triton kernels on CUDA (part of make gpu-check),
each against the executor's torch path for the same op and a dense GEMM of the
same FLOPs (the roofline a grouped or paged kernel is measured against).

    python -m bench.moe_kernels [--out bench_results/gpu/moe_kernels.json] [--quick]

Shapes (bf16):

* fused MoE: Qwen3-30B-A3B's experts (hidden 2048, 128 experts, 8 active per
  token, width 768) at 1 to 512 tokens. The torch path is the executor's
  (executor_svc.model.moe.FusedExperts: pairs sorted by expert, one matmul per
  expert with tokens); the dense GEMM multiplies the tokens by one
  [hidden, 8 x 2 x 768] and one [8 x 768, hidden] matrix (the active FLOPs).
* quantized experts: the same experts held as W4A16 (int4, groups of 128, as
  GPTQ/AWQ/compressed-tensors load) and NVFP4, decoded in the kernel's load
  loop, against the kernel on the same weights dequantized to bf16 (the
  bytes a decode step reads shrink ~3.6x), at 1 and 64 tokens.
* MLA decode: DeepSeek-V3's latent (kv_lora_rank 512 + qk_rope_head_dim 64)
  with 16 heads (128 heads over 8 ranks), contexts of 1,024 and 4,096 tokens
  in 64-token blocks, 1 to 64 requests. The torch path is the torch
  attention backend's attend_latent; the dense GEMM is two batched matmuls
  of the same FLOPs over contiguous latents (no paging, no softmax).

Each kernel's output is checked against its torch path (bf16 tolerance) and
the JSON records both and the times (medians of CUDA-event timings).
Exits 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.cuda_timing import agree, time_ms

MOE = dict(hidden=2048, num_experts=128, top_k=8, inter=768)
MOE_TOKENS = (1, 16, 64, 256, 512)
MLA = dict(num_heads=16, kv_lora_rank=512, rope_dim=64, block_size=64)
MLA_CONTEXTS = (1024, 4096)
MLA_BATCHES = (1, 16, 64)


def moe_flops(tokens: int, hidden: int, top_k: int, inter: int, **_) -> int:
    """Active FLOPs: each token's k experts, gate/up (2 x inter) then down."""
    return 2 * tokens * top_k * (hidden * 2 * inter + inter * hidden)


def mla_flops(batch: int, context: int, num_heads: int, kv_lora_rank: int, rope_dim: int, **_) -> int:
    """Scores over latent + RoPE dims, then the weighted sum of latents."""
    return 2 * batch * num_heads * context * ((kv_lora_rank + rope_dim) + kv_lora_rank)


def bench_moe(tokens: int, repeats: int) -> dict:
    import torch

    from executor_svc.model.model_config import MoESpec
    from executor_svc.model.moe import FusedExperts
    from executor_svc.model.sharding import Shard

    dev, dtype = torch.device("cuda"), torch.bfloat16
    h, e, k, i = MOE["hidden"], MOE["num_experts"], MOE["top_k"], MOE["inter"]
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, h, device=dev, dtype=dtype, generator=g)
    cfg = type("Cfg", (), {"hidden_size": h, "hidden_act": "silu"})()
    experts = FusedExperts(cfg, MoESpec(e, k, i, (True,)), Shard())
    experts.w13 = torch.nn.Parameter(torch.randn(e, 2 * i, h, device=dev, dtype=dtype, generator=g) / h**0.5, False)
    experts.w2 = torch.nn.Parameter(torch.randn(e, h, i, device=dev, dtype=dtype, generator=g) / i**0.5, False)
    logits = torch.randn(tokens, e, device=dev, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    dense_1 = torch.randn(h, 2 * i * k, device=dev, dtype=dtype, generator=g) / h**0.5
    dense_2 = torch.randn(i * k, h, device=dev, dtype=dtype, generator=g) / (i * k) ** 0.5

    def triton_path():
        experts.impl = "triton"
        return experts(x, weights, ids)

    def torch_path():
        experts.impl = "torch"
        return experts(x, weights, ids)

    def dense():
        return (x @ dense_1)[:, : i * k] @ dense_2

    with torch.inference_mode():
        agreement = agree(triton_path(), torch_path())
        times = {name: time_ms(fn, repeats) for name, fn in
                 (("triton", triton_path), ("torch", torch_path), ("dense_gemm", dense))}
    flops = moe_flops(tokens, **MOE)
    return {"tokens": tokens, "ms": times, "tflops": {n: flops / (t * 1e-3) / 1e12 for n, t in times.items()},
            "triton_vs_dense": times["triton"] / times["dense_gemm"], **agreement}


def quantized_experts(fmt: str, e: int, n: int, k: int, dev, g):
    """Random experts [e, n, k] as fm.QuantizedExperts, and the same weights in bf16."""
    import torch

    from llmsched_kernels import reference
    from llmsched_kernels.fused_moe import QuantizedExperts

    if fmt == "int4":
        groups = k // 128
        qweight = torch.randint(0, 256, (e, n, k // 2), device=dev, dtype=torch.uint8, generator=g)
        scales = (torch.rand(e, n, groups, device=dev, generator=g) / (8 * k**0.5)).to(torch.bfloat16)
        zeros = torch.full((e, n, groups), 8, device=dev, dtype=torch.uint8)
        dense = torch.stack([reference.dequantize_int(qweight[i], scales[i], zeros[i], 128, 4, None, k, torch.bfloat16)
                             for i in range(e)])
        return QuantizedExperts.int_groups(qweight, scales, zeros, 4, 128, k), dense
    blocks = torch.randint(0, 256, (e, n, k // 16, 8), device=dev, dtype=torch.uint8, generator=g)
    scales = (torch.rand(e, n, k // 16, device=dev, generator=g) + 0.5).to(torch.float8_e4m3fn)
    global_scale = torch.full((e,), 6.0 * k**0.5, device=dev)
    dense = torch.stack([reference.dequantize_nvfp4(blocks[i], scales[i], global_scale[i], torch.bfloat16)
                         for i in range(e)])
    return QuantizedExperts.nvfp4(blocks, scales, global_scale), dense


def bench_quantized_moe(fmt: str, tokens: int, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    from llmsched_kernels.fused_moe import fused_moe

    dev = torch.device("cuda")
    h, e, k, i = MOE["hidden"], MOE["num_experts"], MOE["top_k"], MOE["inter"]
    g = torch.Generator(device=dev).manual_seed(2)
    w13, d13 = quantized_experts(fmt, e, 2 * i, h, dev, g)
    w2, d2 = quantized_experts(fmt, e, h, i, dev, g)
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16, generator=g)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, e, device=dev, generator=g), -1), k, dim=-1)

    def act(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    with torch.inference_mode():
        agreement = agree(fused_moe(x, w13, w2, weights, ids, act), fused_moe(x, d13, d2, weights, ids, act))
        times = {name: time_ms(lambda a=a, b=b: fused_moe(x, a, b, weights, ids, act), repeats)
                 for name, a, b in ((fmt, w13, w2), ("bf16", d13, d2))}
    return {"format": fmt, "tokens": tokens, "ms": times, "vs_bf16": times[fmt] / times["bf16"], **agreement}


def bench_mla(batch: int, context: int, repeats: int) -> dict:
    import torch

    from executor_svc.attention import AttentionMetadata, TorchAttentionBackend
    from llmsched_kernels.mla_decode import mla_decode

    dev, dtype = torch.device("cuda"), torch.bfloat16
    heads, lora, rope, bs = MLA["num_heads"], MLA["kv_lora_rank"], MLA["rope_dim"], MLA["block_size"]
    latent = lora + rope
    g = torch.Generator(device=dev).manual_seed(1)
    blocks_per_req = -(-context // bs)
    num_blocks = batch * blocks_per_req + 1
    cache = torch.randn(num_blocks, bs, 1, latent, device=dev, dtype=dtype, generator=g)
    tables = torch.randperm(num_blocks - 1, device=dev, generator=g)[: batch * blocks_per_req]
    tables = tables.view(batch, blocks_per_req).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    query = torch.randn(batch, heads, latent, device=dev, dtype=dtype, generator=g)
    scale = (128 + rope) ** -0.5
    meta = AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.long, device=dev),
                             cu_query_lens=torch.arange(batch + 1, dtype=torch.int32, device=dev), seq_lens=seq_lens,
                             block_tables=tables, query_lens_host=[1] * batch, seq_lens_host=[context] * batch)
    torch_backend = TorchAttentionBackend()
    dense_k = torch.randn(batch, latent, context, device=dev, dtype=dtype, generator=g)
    dense_v = torch.randn(batch, context, lora, device=dev, dtype=dtype, generator=g)

    def triton_path():
        return mla_decode(query, cache, seq_lens, tables, scale, lora)

    def torch_path():
        meta.cache.clear()  # plan the step each time, as every step does
        return torch_backend.attend_latent(query, cache, meta, scale, lora)

    def dense():
        return torch.bmm(torch.bmm(query, dense_k), dense_v)

    with torch.inference_mode():
        agreement = agree(triton_path(), torch_path())
        times = {name: time_ms(fn, repeats) for name, fn in
                 (("triton", triton_path), ("torch", torch_path), ("dense_gemm", dense))}
    flops = mla_flops(batch, context, **MLA)
    latent_bytes = batch * context * latent * 2
    return {"batch": batch, "context": context, "ms": times,
            "tflops": {n: flops / (t * 1e-3) / 1e12 for n, t in times.items()},
            "triton_gb_per_s": latent_bytes / (times["triton"] * 1e-3) / 1e9,
            "triton_vs_dense": times["triton"] / times["dense_gemm"], **agreement}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="JSON report")
    ap.add_argument("--quick", action="store_true", help="the smallest and largest size of each sweep, fewer repeats")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("moe_kernels: torch sees no CUDA device; the kernels are benchmarked on CUDA only", file=sys.stderr)
        return 2
    repeats = 5 if args.quick else 20
    tokens = (MOE_TOKENS[0], MOE_TOKENS[-1]) if args.quick else MOE_TOKENS
    batches = (MLA_BATCHES[0], MLA_BATCHES[-1]) if args.quick else MLA_BATCHES
    report = {"device": torch.cuda.get_device_name(0), "moe_shapes": MOE, "mla_shapes": MLA,
              "fused_moe": [bench_moe(n, repeats) for n in tokens],
              "quantized_moe": [bench_quantized_moe(f, n, repeats) for f in ("int4", "nvfp4") for n in (1, 64)],
              "mla_decode": [bench_mla(b, c, repeats) for c in MLA_CONTEXTS for b in batches]}
    for r in report["fused_moe"]:
        print(f"fused MoE {r['tokens']:4d} tokens: triton {r['ms']['triton']:.3f} ms, torch {r['ms']['torch']:.3f} ms, "
              f"dense GEMM {r['ms']['dense_gemm']:.3f} ms; agree={r['ok']} (max diff {r['max_abs_diff']:.3g})")
    for r in report["quantized_moe"]:
        print(f"fused MoE {r['tokens']:4d} tokens, {r['format']} experts: {r['ms'][r['format']]:.3f} ms against "
              f"{r['ms']['bf16']:.3f} ms in bf16 ({r['vs_bf16']:.2f}x); agree={r['ok']} (max diff "
              f"{r['max_abs_diff']:.3g})")
    for r in report["mla_decode"]:
        print(f"MLA decode {r['batch']:3d} x {r['context']:5d}: triton {r['ms']['triton']:.3f} ms "
              f"({r['triton_gb_per_s']:.0f} GB/s of latents), torch {r['ms']['torch']:.3f} ms, dense GEMM "
              f"{r['ms']['dense_gemm']:.3f} ms; agree={r['ok']} (max diff {r['max_abs_diff']:.3g})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0 if all(r["ok"] for r in report["fused_moe"] + report["quantized_moe"] + report["mla_decode"]) else 1


if __name__ == "__main__":
    sys.exit(main())
