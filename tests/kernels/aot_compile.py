"""Compile every kernel variant the launchers pick, for NVIDIA GPUs, on a machine without one.

The Triton interpreter accepts programs the real compiler rejects (loop-carried type
changes, unsupported dot shapes, ...), and says nothing about registers or shared memory.
The Triton wheel ships ptxas, so the launchers' real launch arguments can be compiled
ahead of time down to a cubin. Run as a script (a separate process, because
TRITON_INTERPRET must be off when triton is imported):

    python tests/kernels/aot_compile.py --arch 90 --out resources.json

It prints and writes, per launch, the registers, local memory (spills) and shared memory.
This uses Triton internals (the JIT binder); test_kernels_compile.py skips if they move.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence the 3.9 default-change warning
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Exit status when this Triton's internals differ from what this script drives.
EXIT_UNSUPPORTED = 3

import torch  # noqa: E402
import triton  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
except ImportError as exc:  # pragma: no cover - depends on the Triton version
    print(f"unsupported triton {triton.__version__}: {exc}", file=sys.stderr)
    sys.exit(EXIT_UNSUPPORTED)

from llmsched_kernels import fp8_linear as fl  # noqa: E402
from llmsched_kernels import fused_moe as fm  # noqa: E402
from llmsched_kernels import int_linear as il  # noqa: E402
from llmsched_kernels import invariant_linear as inv  # noqa: E402
from llmsched_kernels import kv_write  # noqa: E402
from llmsched_kernels import lora as kl  # noqa: E402
from llmsched_kernels import mla_decode as mla  # noqa: E402
from llmsched_kernels import paged_attention as pa  # noqa: E402


class _Recorder:
    """Stands in for a @triton.jit kernel: records ``kernel[grid](*args, **kwargs)``."""

    def __init__(self, jit_fn, sink: list, label: str):
        self.jit_fn, self.sink, self.label = jit_fn, sink, label

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append((self.label, self.jit_fn, args, kwargs))

        return launch


def _compile(jit_fn, args, kwargs, target: GPUTarget):
    """What JITFunction.run does before launching, minus the driver."""
    backend = make_backend(target)
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit_fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(jit_fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def _resource_usage(ptx: str, arch: int, workdir: Path) -> dict:
    """Registers and spills as ``ptxas -v`` reports them for the kernel's PTX."""
    ptx_path, cubin_path = workdir / "kernel.ptx", workdir / "kernel.cubin"
    ptx_path.write_text(ptx)
    ptxas = get_ptxas(arch).path  # the binary Triton itself uses for this arch
    arch_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    cmd = [ptxas, f"-arch={arch_name}", "-v", str(ptx_path), "-o", str(cubin_path)]
    report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    numbers = {
        "regs": r"Used (\d+) registers",
        "spill_stores": r"(\d+) bytes spill stores",
        "spill_loads": r"(\d+) bytes spill loads",
        "stack": r"(\d+) bytes stack frame",
    }
    return {key: int(re.search(pattern, report).group(1)) for key, pattern in numbers.items()}


def _attention_launch(
    reqs, num_heads, num_kv_heads, head_dim, block_size, dtype, max_blocks=None, sliding_window=None, softcap=None,
    sinks=False, cache_dtype=None,
):
    """Call the real launcher on small CPU tensors of the given shape (cache_dtype: an FP8 cache)."""
    cache_dtype = cache_dtype or dtype
    num_tokens = sum(q for q, _ in reqs)
    seq_lens = [q + c for q, c in reqs]
    width = max_blocks or max(-(-s // block_size) for s in seq_lens)
    cu = [0]
    for q, _ in reqs:
        cu.append(cu[-1] + q)
    pa.paged_attention(
        torch.zeros(num_tokens, num_heads, head_dim, dtype=dtype),
        torch.zeros(width * len(reqs), block_size, num_kv_heads, head_dim, dtype=cache_dtype),
        torch.zeros(width * len(reqs), block_size, num_kv_heads, head_dim, dtype=cache_dtype),
        torch.tensor(cu, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.zeros(len(reqs), width, dtype=torch.int32),
        head_dim**-0.5,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=torch.zeros(num_heads) if sinks else None,
    )


def _moe_launch(tokens, num_experts, top_k, hidden, inter, dtype, bias=False):
    """fused_moe's two grouped GEMMs (the activation between them runs in torch)."""
    bias13 = torch.zeros(num_experts, 2 * inter, dtype=dtype) if bias else None
    bias2 = torch.zeros(num_experts, hidden, dtype=dtype) if bias else None
    fm.fused_moe(torch.zeros(tokens, hidden, dtype=dtype), torch.zeros(num_experts, 2 * inter, hidden, dtype=dtype),
                 torch.zeros(num_experts, hidden, inter, dtype=dtype), torch.ones(tokens, top_k),
                 torch.arange(tokens * top_k).view(tokens, top_k) % num_experts, lambda h: h[:, :inter], bias13, bias2)


def _quant_moe_launch(fmt, tokens, num_experts, top_k, hidden, inter, dtype, bias=False, block_k=128, col0=0):
    """fused_moe on quantized experts (fm.QuantizedExperts): FP8 blocks, MXFP4 (down's
    columns from col0, a tensor-parallel rank's units), NVFP4, or "int4" / "int8" in
    groups of block_k with scales in the activations' dtype."""
    e = num_experts

    def weight(n, k):
        if fmt.startswith("int"):
            bits, groups = int(fmt[3:]), -(-k // block_k)
            return fm.QuantizedExperts.int_groups(torch.zeros(e, n, -(-k * bits // 8), dtype=torch.uint8),
                                                  torch.ones(e, n, groups, dtype=dtype),
                                                  torch.zeros(e, n, groups, dtype=torch.uint8), bits, block_k, k)
        if fmt == "fp8":
            return fm.QuantizedExperts.fp8_blocks(torch.zeros(e, n, k, dtype=torch.float8_e4m3fn),
                                                  torch.ones(e, -(-n // 128), -(-k // block_k)),
                                                  torch.arange(n) // 128, block_k)
        group = 32 if fmt == "mxfp4" else 16
        groups = -(-(k + col0) // group)
        blocks = torch.zeros(e, n, groups, group // 2, dtype=torch.uint8)
        if fmt == "mxfp4":
            return fm.QuantizedExperts.mxfp4(blocks, torch.full((e, n, groups), 127, dtype=torch.uint8), col0, k)
        return fm.QuantizedExperts.nvfp4(blocks, torch.ones(e, n, groups).to(torch.float8_e4m3fn), torch.ones(e))

    fm.fused_moe(torch.zeros(tokens, hidden, dtype=dtype), weight(2 * inter, hidden), weight(hidden, inter),
                 torch.ones(tokens, top_k), torch.arange(tokens * top_k).view(tokens, top_k) % num_experts,
                 lambda h: h[:, :inter], torch.zeros(e, 2 * inter, dtype=dtype) if bias else None,
                 torch.zeros(e, hidden, dtype=dtype) if bias else None)


def _mla_launch(batch, num_heads, kv_lora_rank, rope_dim, block_size, dtype, cache_dtype=None):
    latent = kv_lora_rank + rope_dim
    mla.mla_decode(torch.zeros(batch, num_heads, latent, dtype=dtype),
                   torch.zeros(8, block_size, 1, latent, dtype=cache_dtype or dtype),
                   torch.full((batch,), 100, dtype=torch.int32), torch.zeros(batch, 8, dtype=torch.int32),
                   latent**-0.5, kv_lora_rank)


def _fp8_linear_launch(m, n, k, block_k, dtype):
    """An FP8 block-scaled linear: weight [n, k] in e4m3, 128-wide scale blocks."""
    scale_cols = -(-k // block_k)
    fl.fp8_block_linear(torch.zeros(m, k, dtype=dtype), torch.zeros(n, k, dtype=torch.float8_e4m3fn),
                        torch.ones(-(-n // 128), scale_cols), torch.arange(n) // 128, block_k)


def _int_linear_launch(m, n, k, group_size, bits, dtype, act_order=False, bias=False):
    """An integer weight-only linear: weight [n, k] packed at bits, scales in x's dtype."""
    groups = -(-k // group_size)
    packed_k = -(-k // 2) if bits == 4 else k
    il.int_weight_linear(torch.zeros(m, k, dtype=dtype), torch.zeros(n, packed_k, dtype=torch.uint8),
                         torch.ones(n, groups, dtype=dtype), torch.zeros(n, groups, dtype=torch.uint8), group_size,
                         bits, torch.arange(k, dtype=torch.int32) // group_size if act_order else None,
                         torch.zeros(n, dtype=dtype) if bias else None)


def _fp4_linear_launch(m, n, k, fmt, dtype, bias=False):
    """An NVFP4 or MXFP4 weight-only linear: weight [n, k] packed two a byte."""
    group = 16 if fmt == "nvfp4" else 32
    scales = torch.ones(n, -(-k // group)).to(torch.float8_e4m3fn) if fmt == "nvfp4" else torch.full(
        (n, -(-k // group)), 127, dtype=torch.uint8)
    il.fp4_weight_linear(torch.zeros(m, k, dtype=dtype), torch.zeros(n, -(-k // 2), dtype=torch.uint8), scales,
                         torch.ones(n) if fmt == "nvfp4" else None, group,
                         torch.zeros(n, dtype=dtype) if bias else None)


def _lora_launch(tokens, k, part_rows, num_slots, max_rank, dtype):
    """Multi-LoRA shrink then expand on one fused projection: every slot at max_rank."""
    token_slots = torch.arange(tokens) % num_slots
    order, starts = kl.sort_by_slot(token_slots, num_slots)
    ranks = torch.full((num_slots,), max_rank, dtype=torch.int32)
    s = kl.lora_shrink(torch.zeros(tokens, k, dtype=dtype), torch.zeros(num_slots, len(part_rows), max_rank, k,
                       dtype=dtype), order, starts, ranks)
    kl.lora_expand(torch.zeros(tokens, sum(part_rows), dtype=dtype), s,
                   torch.zeros(num_slots, max_rank, sum(part_rows), dtype=dtype), order, starts, ranks,
                   torch.ones(num_slots), tuple(part_rows))


def _record_all_launches(arch: int) -> list:
    launches: list = []
    pa._paged_attention_kernel = _Recorder(pa._paged_attention_kernel, launches, "attention")
    pa._merge_splits_kernel = _Recorder(pa._merge_splits_kernel, launches, "merge_splits")
    kv_write._write_kv_cache_kernel = _Recorder(kv_write._write_kv_cache_kernel, launches, "write_kv")
    fm._grouped_gemm_kernel = _Recorder(fm._grouped_gemm_kernel, launches, "fused_moe")
    mla._mla_decode_kernel = _Recorder(mla._mla_decode_kernel, launches, "mla_decode")
    fl._fp8_block_linear_kernel = _Recorder(fl._fp8_block_linear_kernel, launches, "fp8_linear")
    il._int_weight_linear_kernel = _Recorder(il._int_weight_linear_kernel, launches, "int_linear")
    inv._invariant_linear_kernel = _Recorder(inv._invariant_linear_kernel, launches, "invariant_linear")
    kl._lora_shrink_kernel = _Recorder(kl._lora_shrink_kernel, launches, "lora_shrink")
    kl._lora_expand_kernel = _Recorder(kl._lora_expand_kernel, launches, "lora_expand")
    pa._num_sms = lambda device: 132  # choose tiles as on an H100/H200
    pa._compute_capability = lambda device: divmod(arch, 10)

    decode, prefill = ((1, 100),) * 4, ((100, 0), (30, 40))
    for label_dtype in (torch.float16, torch.bfloat16, torch.float32):
        # Llama-3-8B shapes: 32 heads, 8 KV heads, head_dim 128.
        _attention_launch(decode, 32, 8, 128, 16, label_dtype)
        _attention_launch(prefill, 32, 8, 128, 16, label_dtype)
    _attention_launch(((1, 100),), 32, 8, 128, 16, torch.bfloat16, max_blocks=512)  # split-KV decode
    _attention_launch(prefill, 16, 16, 256, 32, torch.float32)  # widest rows
    _attention_launch(prefill, 16, 16, 256, 32, torch.bfloat16)
    _attention_launch(prefill, 16, 2, 80, 32, torch.float16)  # padded head_dim, GQA 8
    _attention_launch(decode, 4, 2, 8, 16, torch.float16)  # tiny head_dim padded to 16
    # Sliding window (Mistral: 32/8/128, W 4096), with split-KV over the window.
    _attention_launch(decode, 32, 8, 128, 16, torch.bfloat16, sliding_window=4096)
    _attention_launch(prefill, 32, 8, 128, 16, torch.bfloat16, sliding_window=4096)
    _attention_launch(((1, 100),), 32, 8, 128, 16, torch.bfloat16, max_blocks=512, sliding_window=4096)
    # Gemma 2 (8/4/256): soft-capped global layers and windowed soft-capped layers.
    _attention_launch(decode, 8, 4, 256, 16, torch.bfloat16, softcap=50.0)
    _attention_launch(prefill, 8, 4, 256, 16, torch.bfloat16, softcap=50.0)
    _attention_launch(prefill, 8, 4, 256, 16, torch.bfloat16, sliding_window=4096, softcap=50.0)
    _attention_launch(prefill, 32, 8, 128, 16, torch.float32, sliding_window=4096, softcap=50.0)

    for dtype, kvh, hd in ((torch.float16, 8, 128), (torch.bfloat16, 3, 80), (torch.float32, 1, 8)):
        kv_write.write_kv_cache(
            torch.zeros(4, kvh, hd, dtype=dtype),
            torch.zeros(4, kvh, hd, dtype=dtype),
            torch.zeros(2, 16, kvh, hd, dtype=dtype),
            torch.zeros(2, 16, kvh, hd, dtype=dtype),
            torch.zeros(4, dtype=torch.int64),
        )
    # An FP8 KV cache (EXECUTOR_KV_CACHE_DTYPE), decoded from int8 bits: Llama-3-8B shapes, decode and prefill.
    for cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        _attention_launch(decode, 32, 8, 128, 16, torch.bfloat16, cache_dtype=cache_dtype)
        _attention_launch(prefill, 32, 8, 128, 16, torch.bfloat16, cache_dtype=cache_dtype)
        kv_write.write_kv_cache(
            torch.zeros(4, 8, 128, dtype=torch.bfloat16), torch.zeros(4, 8, 128, dtype=torch.bfloat16),
            torch.zeros(2, 16, 8, 128, dtype=cache_dtype), torch.zeros(2, 16, 8, 128, dtype=cache_dtype),
            torch.zeros(4, dtype=torch.int64), k_scale=0.5, v_scale=2.0,
        )
    _attention_launch(prefill, 32, 8, 128, 16, torch.float16, cache_dtype=torch.float8_e4m3fn)
    _attention_launch(((1, 100),), 32, 8, 128, 16, torch.bfloat16, max_blocks=512, cache_dtype=torch.float8_e4m3fn)
    _mla_launch(4, 128, 512, 64, 64, torch.bfloat16, cache_dtype=torch.float8_e4m3fn)
    # gpt-oss (64/8/64, W 128): sinks in the epilogue and in the split-KV merge.
    _attention_launch(decode, 64, 8, 64, 16, torch.bfloat16, sliding_window=128, sinks=True)
    _attention_launch(prefill, 64, 8, 64, 16, torch.bfloat16, sinks=True)
    _attention_launch(((1, 100),), 64, 8, 64, 16, torch.bfloat16, max_blocks=512, sinks=True)
    # Qwen3-30B-A3B's experts (2048 hidden, 128 experts, 8 active, width 768); gpt-oss-20b's with biases.
    _moe_launch(64, 128, 8, 2048, 768, torch.bfloat16)
    _moe_launch(16, 32, 4, 2880, 2880, torch.bfloat16, bias=True)
    _moe_launch(4, 8, 2, 64, 32, torch.float32)
    # Quantized experts decoded in the load loop: Qwen3-30B-A3B-FP8 (128 x 128 blocks, a scale per tile),
    # gpt-oss-20b's MXFP4 (whole, and rank 1 of 8 whose down columns start 8 into a group), NVFP4;
    # small fp32 ones with a scale per element.
    for dtype in (torch.bfloat16, torch.float16):
        _quant_moe_launch("fp8", 64, 128, 8, 2048, 768, dtype)
    _quant_moe_launch("fp8", 4, 8, 2, 96, 40, torch.float32, block_k=32)
    _quant_moe_launch("mxfp4", 16, 32, 4, 2880, 2880, torch.bfloat16, bias=True)
    _quant_moe_launch("mxfp4", 16, 32, 4, 2880, 360, torch.bfloat16, bias=True, col0=8)
    _quant_moe_launch("mxfp4", 4, 8, 2, 64, 32, torch.float32)
    _quant_moe_launch("nvfp4", 64, 128, 8, 2048, 768, torch.bfloat16)
    _quant_moe_launch("nvfp4", 4, 8, 2, 64, 32, torch.float32)
    # Qwen3-30B-A3B in W4A16 (GPTQ, AWQ, compressed-tensors; groups of 128, and of 32: a scale and a zero
    # per element) and W8A8 int8 (per channel).
    for dtype in (torch.bfloat16, torch.float16):
        _quant_moe_launch("int4", 64, 128, 8, 2048, 768, dtype)
    _quant_moe_launch("int4", 64, 128, 8, 2048, 768, torch.bfloat16, block_k=32)
    _quant_moe_launch("int8", 64, 128, 8, 2048, 768, torch.bfloat16, block_k=2048)
    _quant_moe_launch("int4", 4, 8, 2, 64, 40, torch.float32, block_k=16)
    # DeepSeek-V3's MLA decode: 128 heads (one device) and 16 (TP=8); a tiny fp32 latent.
    _mla_launch(4, 128, 512, 64, 64, torch.bfloat16)
    _mla_launch(4, 16, 512, 64, 64, torch.bfloat16)
    _mla_launch(2, 4, 16, 8, 4, torch.float32)
    # FP8 block-scaled linears: DeepSeek-V3's shared-expert gate/up (7168 -> 2 x 2048), decode and prefill.
    for dtype in (torch.bfloat16, torch.float16):
        _fp8_linear_launch(1, 4096, 7168, 128, dtype)
        _fp8_linear_launch(100, 4096, 7168, 128, dtype)
    _fp8_linear_launch(4, 96, 80, 32, torch.float32)
    # W4A16 / W8A16 (GPTQ, AWQ, compressed-tensors): Llama-3-8B's o_proj, group 128, decode and prefill;
    # GPTQ act-order (a group gathered per column); a per-channel fp32 one with a bias.
    for bits in (4, 8):
        for dtype in (torch.bfloat16, torch.float16):
            _int_linear_launch(1, 4096, 4096, 128, bits, dtype)
            _int_linear_launch(100, 4096, 4096, 128, bits, dtype)
        _int_linear_launch(1, 4096, 4096, 128, bits, torch.bfloat16, act_order=True)
        _int_linear_launch(100, 4096, 4096, 128, bits, torch.bfloat16, act_order=True)
        _int_linear_launch(4, 96, 80, 80, bits, torch.float32, bias=True)
    # NVFP4 and MXFP4 (compressed-tensors, ModelOpt): Llama-3-8B's o_proj, decode and prefill; a small fp32 one.
    for fmt in ("nvfp4", "mxfp4"):
        for dtype in (torch.bfloat16, torch.float16):
            _fp4_linear_launch(1, 4096, 4096, fmt, dtype)
            _fp4_linear_launch(100, 4096, 4096, fmt, dtype)
        _fp4_linear_launch(4, 96, 80, fmt, torch.float32, bias=True)
    # Batch-invariant mode's GEMM: Llama-3-8B's o_proj in 16-bit, with a bias; a small fp32 one.
    for dtype in (torch.bfloat16, torch.float16):
        inv.invariant_linear(torch.zeros(3, 4096, dtype=dtype), torch.zeros(4096, 4096, dtype=dtype),
                             torch.zeros(4096, dtype=dtype))
    inv.invariant_linear(torch.zeros(3, 64, dtype=torch.float32), torch.zeros(192, 64, dtype=torch.float32))
    # Multi-LoRA: Llama-3-8B's q/k/v (three parts) and down_proj (one), 8 slots of rank 64, decode and prefill;
    # a small fp32 one.
    for dtype in (torch.bfloat16, torch.float16):
        for tokens in (1, 256):
            _lora_launch(tokens, 4096, (4096, 1024, 1024), 8, 64, dtype)
            _lora_launch(tokens, 14336, (4096,), 8, 64, dtype)
    _lora_launch(4, 64, (48, 16, 16), 4, 64, torch.float32)
    return launches


def _describe(label: str, kwargs: dict, args: tuple) -> str:
    dtype = args[0].dtype  # every kernel's first argument holds the data dtype
    keys = ("BLOCK_M", "BLOCK_Q", "TILE_N", "HEAD_DIM", "GROUP", "NUM_SPLITS", "NUM_KV_HEADS", "num_warps")
    keys += ("USE_WINDOW", "USE_SOFTCAP", "USE_SINKS", "BLOCK_N", "BLOCK_K", "A_ROWS_PER", "HAS_BIAS", "MUL_WEIGHT")
    keys += ("BLOCK_H", "V_PAD", "R_PAD", "SCALE_K", "BITS", "GROUP_SIZE", "HAS_G_IDX", "GROUP_PER_TILE", "KV_FP8")
    keys += ("FORMAT", "SCALE_PER_TILE", "BLOCK_R")
    shape = ",".join(f"{k}={kwargs[k]}" for k in keys if k in kwargs)
    return f"{label}[{str(dtype).removeprefix('torch.')}:{shape}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 or 90")
    parser.add_argument("--out", type=Path, default=None)
    opts = parser.parse_args()

    target = GPUTarget("cuda", opts.arch, 32)
    ptxas = get_ptxas(opts.arch).path
    if not (ptxas and os.path.exists(ptxas)) or not hasattr(triton.runtime.jit.JITFunction, "_pack_args"):
        print(f"unsupported triton {triton.__version__}: no ptxas or JIT internals moved", file=sys.stderr)
        return EXIT_UNSUPPORTED
    results = {}
    workdir = Path(tempfile.mkdtemp(prefix="aot_compile_"))
    for label, jit_fn, args, kwargs in _record_all_launches(opts.arch):
        name = _describe(label, kwargs, args)
        if name in results:
            continue
        compiled = _compile(jit_fn, args, kwargs, target)
        usage = _resource_usage(compiled.asm["ptx"], opts.arch, workdir)
        usage["shared"] = compiled.metadata.shared
        results[name] = usage
        print(f"sm_{opts.arch} {name}: {usage}", flush=True)
    if opts.out:
        opts.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
