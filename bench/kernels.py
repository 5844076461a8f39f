"""Kernel benchmark (P8): paged attention on the GPU, against torch and FlashInfer.

    python -m bench.kernels [--out bench_kernels.json] [--dtype bf16] [--quick]

* Decode: achieved memory bandwidth (bytes of K/V read + q read + out written, per
  second) as a share of the device's peak, for batch sizes {1, 16, 64, 256} x context
  lengths {512, 2048, 8192}. Decode is memory bound, so this share is the figure of merit.
* Prefill: causal attention TFLOP/s for a few prompt lengths (one request each).
* Peers: "torch" gathers each request's K/V out of the paged cache with the block table
  and runs dense ``scaled_dot_product_attention`` (the vectorised form of
  llmsched_kernels/reference.py; the gather is part of its time). "flashinfer" is its paged
  decode wrapper when the package is importable, otherwise reported as skipped.

Shapes are Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128), block
size 16. Times are medians of triton.testing.do_bench (L2 flushed between repeats).
Needs CUDA: on a machine without it this prints why and exits 0. A full run takes
about a minute on an H100.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (512, 2048, 8192)
PREFILL_LENGTHS = (512, 2048, 8192)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Peak HBM bandwidth in TB/s, by a substring of torch.cuda.get_device_name(); the first
# match wins, so the more specific names come first. Vendor datasheet figures.
PEAK_BANDWIDTH_TBPS = (
    ("H200", 4.8),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),  # SXM reports as "NVIDIA H100 80GB HBM3"
    ("H800", 3.35),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),  # 40 GB parts
    ("L40S", 0.864),
    ("L4", 0.3),
)
# Dense fp16/bf16 tensor-core peak in TFLOP/s (no sparsity), same matching rule.
PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)


@dataclass
class Row:
    kind: str  # "decode" | "prefill"
    impl: str  # "triton" | "torch" | "flashinfer"
    batch: int
    context: int  # decode: context length per request; prefill: prompt length
    ms: float | None = None
    bytes_moved: int | None = None
    flops: float | None = None
    tbps: float | None = None
    peak_share: float | None = None  # of bandwidth (decode) or tensor-core peak (prefill)
    tflops: float | None = None
    note: str = ""


@dataclass
class Report:
    device: str
    dtype: str
    peak_bandwidth_tbps: float | None
    peak_bandwidth_source: str
    peak_tflops: float | None
    triton_version: str
    torch_version: str
    flashinfer: str
    rows: list[Row] = field(default_factory=list)


def _lookup(table, name: str) -> float | None:
    return next((value for key, value in table if key in name), None)


def peak_bandwidth(device_name: str) -> tuple[float | None, str]:
    """Peak TB/s: the datasheet table, else bus width x memory clock, else unknown."""
    known = _lookup(PEAK_BANDWIDTH_TBPS, device_name)
    if known is not None:
        return known, "datasheet table"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        # Double data rate: two transfers per memory clock.
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e12, "memory clock x bus width"
    return None, "unknown"


@dataclass
class PagedProblem:
    query: torch.Tensor  # [num_tokens, NUM_HEADS, HEAD_DIM]
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    v_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    cu_query_lens: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32
    block_tables: torch.Tensor  # [batch, blocks_per_req] int32
    scale: float

    def args(self):
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.cu_query_lens,
            self.seq_lens,
            self.block_tables,
            self.scale,
        )


def make_problem(batch: int, context: int, q_len: int, dtype: torch.dtype, device: str = "cuda") -> PagedProblem:
    """``batch`` requests, each ``context`` tokens long including its ``q_len`` new ones,
    in randomly scattered cache blocks (as after a while of serving)."""
    blocks_per_req = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_req
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=device, dtype=torch.int64).to(torch.int32)
    return PagedProblem(
        query=torch.randn(batch * q_len, NUM_HEADS, HEAD_DIM, device=device, dtype=dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        cu_query_lens=torch.arange(0, batch * q_len + 1, q_len, device=device, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, device=device, dtype=torch.int32),
        block_tables=block_tables.view(batch, blocks_per_req),
        scale=HEAD_DIM**-0.5,
    )


def torch_paged_attention(problem: PagedProblem, context: int, q_len: int) -> torch.Tensor:
    """Gather K/V through the block table, then dense SDPA (same-length requests)."""
    batch = problem.seq_lens.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS

    def gather(cache):  # -> [batch, NUM_KV_HEADS, context, HEAD_DIM]
        blocks = cache[problem.block_tables.long()]  # [batch, blocks_per_req, BLOCK_SIZE, kvh, d]
        return blocks.flatten(1, 2)[:, :context].transpose(1, 2)

    k, v = gather(problem.k_cache), gather(problem.v_cache)
    if q_len == 1:
        # Decode sees the whole context: fold each KV head's query group into the
        # "query length" axis so no K/V is repeated per query head.
        q = problem.query.view(batch, NUM_KV_HEADS, group, HEAD_DIM)  # [batch, kvh, group, d]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=problem.scale)
        return out.reshape(batch, NUM_HEADS, HEAD_DIM)
    q = problem.query.view(batch, q_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)  # [batch, heads, q_len, d]
    # Prefill of a whole prompt (q_len == context): plain causal mask.
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=problem.scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(batch * q_len, NUM_HEADS, HEAD_DIM)


def flashinfer_decode_fn(problem: PagedProblem, context: int):
    """A zero-argument callable running FlashInfer's paged decode, or raise."""
    import flashinfer  # noqa: PLC0415 - optional peer

    batch, blocks_per_req = problem.block_tables.shape
    device = problem.query.device
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    indptr = torch.arange(0, batch * blocks_per_req + 1, blocks_per_req, device=device, dtype=torch.int32)
    indices = problem.block_tables.reshape(-1).contiguous()
    last_page_len = torch.full((batch,), context - (blocks_per_req - 1) * BLOCK_SIZE, device=device, dtype=torch.int32)
    kv_cache = (problem.k_cache, problem.v_cache)
    if hasattr(wrapper, "plan"):
        wrapper.plan(
            indptr, indices, last_page_len, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
            q_data_type=problem.query.dtype, kv_data_type=problem.k_cache.dtype,
        )  # fmt: skip
        return lambda: wrapper.run(problem.query, kv_cache)
    wrapper.begin_forward(  # older releases
        indptr, indices, last_page_len, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, data_type=problem.query.dtype
    )
    return lambda: wrapper.forward(problem.query, kv_cache)


def decode_bytes(batch: int, context: int, dtype: torch.dtype) -> int:
    elem = torch.finfo(dtype).bits // 8
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * elem
    q_and_out = 2 * batch * NUM_HEADS * HEAD_DIM * elem
    return kv + q_and_out


def causal_prefill_flops(length: int) -> float:
    # QK^T and PV: 2 matmuls x 2 flops per MAC over the visible (causal) pairs.
    visible_pairs = length * (length + 1) / 2
    return 4.0 * NUM_HEADS * HEAD_DIM * visible_pairs


def _median_ms(fn) -> float:
    import triton.testing  # noqa: PLC0415

    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def _agrees(out: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.allclose(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def bench_decode(report: Report, dtype: torch.dtype, batches, contexts, paged_attention) -> None:
    peak = report.peak_bandwidth_tbps
    for context in contexts:
        for batch in batches:
            problem = make_problem(batch, context, 1, dtype)
            moved = decode_bytes(batch, context, dtype)
            expected = paged_attention(*problem.args())
            impls = {
                "triton": lambda: paged_attention(*problem.args()),
                "torch": lambda: torch_paged_attention(problem, context, 1),
            }
            try:
                impls["flashinfer"] = flashinfer_decode_fn(problem, context)
            except Exception as exc:  # noqa: BLE001 - any failure only skips the peer
                if not report.flashinfer.startswith("skipped"):
                    report.flashinfer = f"skipped: {type(exc).__name__}: {exc}"[:200]
            for impl, fn in impls.items():
                row = Row("decode", impl, batch, context, bytes_moved=moved)
                try:
                    note = "" if impl == "triton" or _agrees(fn(), expected) else "MISMATCH vs triton"
                    row.ms = _median_ms(fn)
                    row.tbps = moved / (row.ms * 1e-3) / 1e12
                    row.peak_share = row.tbps / peak if peak else None
                    row.note = note
                except torch.cuda.OutOfMemoryError:
                    row.note = "out of memory"
                report.rows.append(row)
                _print_row(row)
            del problem, impls, expected
            torch.cuda.empty_cache()


def bench_prefill(report: Report, dtype: torch.dtype, lengths, paged_attention) -> None:
    for length in lengths:
        problem = make_problem(1, length, length, dtype)
        flops = causal_prefill_flops(length)
        expected = paged_attention(*problem.args())
        impls = {
            "triton": lambda: paged_attention(*problem.args()),
            "torch": lambda: torch_paged_attention(problem, length, length),
        }
        for impl, fn in impls.items():
            row = Row("prefill", impl, 1, length, flops=flops)
            try:
                note = "" if impl == "triton" or _agrees(fn(), expected) else "MISMATCH vs triton"
                row.ms = _median_ms(fn)
                row.tflops = flops / (row.ms * 1e-3) / 1e12
                row.peak_share = row.tflops / report.peak_tflops if report.peak_tflops else None
                row.note = note
            except torch.cuda.OutOfMemoryError:
                row.note = "out of memory"
            report.rows.append(row)
            _print_row(row)
        del problem, impls, expected
        torch.cuda.empty_cache()


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_header() -> None:
    print(f"{'kind':<8}{'impl':<11}{'batch':>6}{'ctx':>7}{'ms':>10}{'TB/s':>8}{'TFLOP/s':>9}{'%peak':>7}  note")


def _print_row(row: Row) -> None:
    share = None if row.peak_share is None else 100 * row.peak_share
    print(
        f"{row.kind:<8}{row.impl:<11}{row.batch:>6}{row.context:>7}{_fmt(row.ms, '.3f'):>10}"
        f"{_fmt(row.tbps, '.2f'):>8}{_fmt(row.tflops, '.1f'):>9}{_fmt(share, '.1f'):>7}  {row.note}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_kernels.json"), help="JSON results path")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--quick", action="store_true", help="one batch size and context per section")
    opts = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench.kernels: no CUDA device, nothing to measure (this benchmark runs on a GPU only).")
        return 0

    import triton  # noqa: PLC0415 - imported only when there is a GPU to run on

    from llmsched_kernels.paged_attention import paged_attention  # noqa: PLC0415

    dtype = DTYPES[opts.dtype]
    name = torch.cuda.get_device_name()
    peak_bw, peak_source = peak_bandwidth(name)
    try:
        import flashinfer  # noqa: F401, PLC0415

        flashinfer_status = f"flashinfer {getattr(flashinfer, '__version__', '?')}"
    except ImportError:
        flashinfer_status = "skipped: flashinfer is not installed"
    report = Report(
        device=name,
        dtype=opts.dtype,
        peak_bandwidth_tbps=peak_bw,
        peak_bandwidth_source=peak_source,
        peak_tflops=_lookup(PEAK_TFLOPS, name),
        triton_version=triton.__version__,
        torch_version=torch.__version__,
        flashinfer=flashinfer_status,
    )
    print(f"device: {name}; peak bandwidth: {_fmt(peak_bw, '.2f')} TB/s ({peak_source}); "
          f"peak tensor-core: {_fmt(report.peak_tflops, '.0f')} TFLOP/s; dtype {opts.dtype}")  # fmt: skip
    print(f"shapes: {NUM_HEADS} heads, {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, block size {BLOCK_SIZE}")
    _print_header()

    batches = DECODE_BATCHES[1:2] if opts.quick else DECODE_BATCHES
    contexts = DECODE_CONTEXTS[1:2] if opts.quick else DECODE_CONTEXTS
    bench_decode(report, dtype, batches, contexts, paged_attention)
    bench_prefill(report, dtype, PREFILL_LENGTHS[:1] if opts.quick else PREFILL_LENGTHS, paged_attention)
    if report.flashinfer.startswith("skipped"):
        print(f"flashinfer peer {report.flashinfer}")

    opts.out.write_text(json.dumps(asdict(report), indent=1))
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
