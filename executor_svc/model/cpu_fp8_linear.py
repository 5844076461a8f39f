"""FP8 (e4m3) linears on the CPU without a dequantized copy of the weight
(EXECUTOR_CPU_FP8_KERNEL).

Without it an FP8 layer dequantized its whole weight for every product
(quantization.dequantize_fp8_blocks: FP8 to float32, times the block
scales, cast to the compute dtype) and then multiplied: a one-row decode
step wrote and read a bf16 copy of every weight, 4.8x slower than the
bf16 model itself (docs/performance.md, P20). This C kernel (AVX2, FMA and
F16C, built at start-up like cpu_bf16_gemm's and sharing its micro-kernels)
decodes NB weight rows of KC columns at a time into float32 in a buffer
that stays in L1, and multiplies them there by up to three rows of x at
once: the weight is read once, at one byte a value.

Each weight it multiplies is the dequantizing path's, bit for bit: the FP8
byte through float16 (quantization.fp8_as_half: exact), times 256 times
its block's float32 scale, rounded to bfloat16 when the compute dtype is
bfloat16. Only the order of the sums differs from F.linear's (float32
rounding before the cast back), as with cpu_bf16_gemm.

Steps of more than MAX_ROWS rows (prefill) keep the dequantizing path,
whose GEMM is faster there. Threads: an OpenMP loop over blocks of weight
rows, on torch's own pool (cpu_bf16_gemm's docstring says how).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess

import torch
from torch import nn

from executor_svc.model import cpu_bf16_gemm

log = logging.getLogger(__name__)

# Rows past which a product dequantizes and runs the GEMM instead.
MAX_ROWS = 16
# The kernel reads x and the weight eight columns at a time, each eight
# under one scale, so K and the scale blocks' width are multiples of 8.
K_MULTIPLE = 8

SOURCE = cpu_bf16_gemm.MICRO_SOURCE + r"""
/* Eight float8_e4m3fn bytes to float32 / 256, exactly: sign, exponent and
   mantissa moved into a float16's bits (the exponent bias 15 against 7),
   which F16C converts, subnormals included. */
static inline __m256 fp8x8(const uint8_t *p) {
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                             _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
    return _mm256_cvtph_ps(h);
}

/* float32 to the nearest bfloat16 (ties to even), kept as float32. */
static inline __m256 round_bf16(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xffff0000u)));
}

/* y[M, N] = x[M, K] (float32) times the FP8 weight w[N, K] transposed,
   weight row n scaled by scales[grid_rows[n] * ldscale + k / bk] (already
   times 256) per column k, each scaled weight rounded to bfloat16 when
   bf16 != 0. K % 8 == 0 and bk % 8 == 0; all contiguous. */
void llmsched_gemm_f32_fp8(const float *x, const uint8_t *w, const float *scales, const int64_t *grid_rows,
                           long ldscale, long bk, float *y, long M, long N, long K, int bf16) {
    long nblocks = (N + NB - 1) / NB;
    #pragma omp parallel for schedule(static)
    for (long b = 0; b < nblocks; b++) {
        float wf[NB * KC] __attribute__((aligned(32)));
        long n0 = b * NB;
        int nvalid = (int)(N - n0 < NB ? N - n0 : NB);
        for (long k0 = 0; k0 < K; k0 += KC) {
            int kc = (int)(K - k0 < KC ? K - k0 : KC);
            for (int j = 0; j < NB; j++) {
                if (j >= nvalid) {
                    memset(wf + j * KC, 0, sizeof(float) * kc);  /* past N: multiplied, never stored */
                    continue;
                }
                const uint8_t *src = w + (n0 + j) * K + k0;
                const float *row_scales = scales + grid_rows[n0 + j] * ldscale;
                for (int k = 0; k < kc; k += 8) {
                    __m256 v = _mm256_mul_ps(fp8x8(src + k), _mm256_set1_ps(row_scales[(k0 + k) / bk]));
                    _mm256_store_ps(wf + j * KC + k, bf16 ? round_bf16(v) : v);
                }
            }
            all_rows(x, M, K, k0, wf, kc, y, N, n0, nvalid);
        }
    }
}
"""

FLAGS = [*cpu_bf16_gemm.FLAGS, "-mf16c"]

_kernel = None  # the ctypes function once built and checked; False when it cannot be


def load() -> bool:
    """Builds and loads the kernel where the CPU has AVX2 (with FMA and
    F16C, which every AVX2 CPU has), and checks it against the
    dequantizing path once; False (logged) where it cannot serve."""
    global _kernel
    if _kernel is not None:
        return bool(_kernel)
    _kernel = False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("CPU FP8 kernel: not built (needs AVX2; torch reports %s)", torch.backends.cpu.get_cpu_capability())
        return False
    try:
        fn = cpu_bf16_gemm.load_library("fp8_gemm", SOURCE, FLAGS).llmsched_gemm_f32_fp8
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU FP8 kernel: not built (%s); FP8 layers dequantize per matmul", exc)
        return False
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_int]
    fn.restype = None
    _kernel = fn
    # Tails in every loop: 7 and 1 rows, 10 weight rows over two grid rows,
    # 1040 columns (1024 + 16) in blocks of 48, the last one partial.
    from executor_svc.model.quantization import dequantize_fp8_blocks, quantize_fp8_blocks

    gen = torch.Generator().manual_seed(0)
    weight, scales = quantize_fp8_blocks(torch.randn(10, 1040, generator=gen), (8, 48))
    grid_rows = torch.arange(10) // 8
    for rows in (7, 1):
        x = torch.randn(rows, 1040, generator=gen)
        want = x @ dequantize_fp8_blocks(weight, scales, grid_rows, 48, torch.float32).T
        got = matmul(x, weight, scales, grid_rows, 48, bf16=False)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-3):
            _kernel = False
            log.warning("CPU FP8 kernel: wrong sums on this machine (max error %.3g at %d rows); not used",
                        (got - want).abs().max().item(), rows)
            return False
    return True


def fits(weight: torch.Tensor, block_k: int) -> bool:
    return weight.is_contiguous() and weight.shape[1] % K_MULTIPLE == 0 and block_k % K_MULTIPLE == 0


def matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, grid_rows: torch.Tensor, block_k: int,
           bf16: bool) -> torch.Tensor:
    """x [M, K] float32 times the FP8 weight [N, K] (with its float32 block
    scales [grid rows, cdiv(K, block_k)] and each row's grid row) transposed:
    [M, N] float32, each weight rounded to bfloat16 first when bf16. Needs
    load() and fits()."""
    x = x.contiguous()
    m, k = x.shape
    assert x.dtype == torch.float32 and k == weight.shape[1] and fits(weight, block_k), (x.dtype, x.shape, weight.shape)
    scaled = (scales * 256.0).contiguous()  # fp8x8 gives value / 256; exact (a power of two)
    rows = grid_rows.to(torch.int64).contiguous()
    out = torch.empty(m, weight.shape[0], dtype=torch.float32)
    _kernel(x.data_ptr(), weight.data_ptr(), scaled.data_ptr(), rows.data_ptr(), scaled.shape[1], block_k,
            out.data_ptr(), m, weight.shape[0], k, int(bf16))
    return out


def use_cpu_fp8_kernel(model: nn.Module, setting: str = "auto", batch_invariant: bool = False) -> int:
    """EXECUTOR_CPU_FP8_KERNEL: marks every FP8 linear whose shape the
    kernel takes (layers.py then runs products of up to MAX_ROWS rows
    through it), and logs what it did. Returns the layers marked."""
    layers = [m for m in model.modules() if getattr(m, "scheme", None) is not None and m.scheme.kind == "fp8"
              and hasattr(m, "fp8_block")]
    if not layers:
        return 0
    if setting == "off" or batch_invariant:
        log.info("CPU FP8 kernel: off (%s); %d FP8 layers dequantize per matmul",
                 "EXECUTOR_CPU_FP8_KERNEL=off" if setting == "off" else "batch-invariant mode", len(layers))
        return 0
    if not load():
        return 0
    marked = [layer for layer in layers if fits(layer.weight, layer.fp8_block[1])]
    for layer in marked:
        layer.cpu_fp8 = True
    log.info("CPU FP8 kernel: %d of %d FP8 layers (products of up to %d rows)%s", len(marked), len(layers), MAX_ROWS,
             "" if len(marked) == len(layers) else f"; {len(layers) - len(marked)} not: columns or scale blocks not "
             f"a multiple of {K_MULTIPLE}")
    return len(marked)
