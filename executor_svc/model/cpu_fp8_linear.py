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
once: the weight is read once, at one byte a value. Where the CPU has
AVX512F, a step of one row (a single stream) takes a GEMV instead, which
converts sixteen weights a register and multiplies them at once, 1.7x
faster than the buffered kernel on a [3072, 1024] weight here (265
against 450 us; bf16's F.linear on the same shape, through AVX512-BF16:
160 us).

Each weight it multiplies is the dequantizing path's, bit for bit: the FP8
byte through float16 (quantization.fp8_as_half: exact), times 256 times
its block's float32 scale, rounded to bfloat16 when the compute dtype is
bfloat16. Only the order of the sums differs from F.linear's (float32
rounding before the cast back), as with cpu_bf16_gemm.

Steps of more than MAX_ROWS rows (prefill) keep the dequantizing path,
whose GEMM is faster there: on a [3072, 1024] weight in bf16 here the
kernel takes 0.28 / 0.67 / 0.94 / 2.44 / 4.51 ms at 1 / 8 / 16 / 64 / 128
rows, dequantizing and F.linear 1.80 / 3.84 / 4.29 / 3.49 / 4.33.
Threads: an OpenMP loop over blocks of weight rows, on torch's own pool
(cpu_bf16_gemm's docstring says how).
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
MAX_ROWS = 64
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
   weight row n scaled by scales[grid_rows[n] * ldscale + k / bk] per
   column k (times 256, which fp8x8 divides by: exact, a power of two),
   each scaled weight rounded to bfloat16 when bf16 != 0. K % 8 == 0 and bk % 8 == 0; all contiguous. */
struct fp8_weight { const uint8_t *w; const float *scales; const int64_t *grid_rows; long ldscale, bk, K; int bf16; };

static void convert_fp8(const void *weight, long n, long k0, int kc, float *dst) {
    const struct fp8_weight *c = weight;
    const uint8_t *src = c->w + n * c->K + k0;
    const float *row_scales = c->scales + c->grid_rows[n] * c->ldscale;
    for (int k = 0; k < kc; k += 8) {
        __m256 v = _mm256_mul_ps(fp8x8(src + k), _mm256_set1_ps(row_scales[(k0 + k) / c->bk] * 256.0f));
        _mm256_store_ps(dst + k, c->bf16 ? round_bf16(v) : v);
    }
}

void llmsched_gemm_f32_fp8(const float *x, const uint8_t *w, const float *scales, const int64_t *grid_rows,
                           long ldscale, long bk, float *y, long M, long N, long K, int bf16) {
    struct fp8_weight c = {w, scales, grid_rows, ldscale, bk, K, bf16};
    blocked_gemm(x, y, M, N, K, convert_fp8, &c);
}
"""

FLAGS = [*cpu_bf16_gemm.FLAGS, "-mf16c"]

# One row (a single stream's decode step) where the CPU has AVX512F: sixteen
# weights a register, converted and multiplied at once without the buffer,
# eight weight rows at a time against one load of x. K and the scale blocks'
# width must be multiples of 16.
SOURCE_AVX512 = r"""
#include <immintrin.h>
#include <stdint.h>

static inline __m512 fp8x16(const uint8_t *p) {
    __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_cvtph_ps(h);
}

static inline __m512 round_bf16(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u)));
}

/* y[N] = x[K] (float32) times the FP8 weight w[N, K] transposed, scaled and
   rounded as llmsched_gemm_f32_fp8's. K % 16 == 0 and bk % 16 == 0. */
void llmsched_gemv_f32_fp8(const float *x, const uint8_t *w, const float *scales, const int64_t *grid_rows,
                           long ldscale, long bk, float *y, long N, long K, int bf16) {
    #pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N; n0 += 8) {
        int nvalid = (int)(N - n0 < 8 ? N - n0 : 8);
        __m512 acc[8];
        const float *row_scales[8];
        for (int j = 0; j < 8; j++) {
            acc[j] = _mm512_setzero_ps();
            row_scales[j] = scales + grid_rows[n0 + (j < nvalid ? j : 0)] * ldscale;
        }
        for (long k0 = 0; k0 < K; k0 += bk) {
            long kend = k0 + bk < K ? k0 + bk : K;
            __m512 s[8];
            for (int j = 0; j < nvalid; j++) s[j] = _mm512_set1_ps(row_scales[j][k0 / bk] * 256.0f);
            for (long k = k0; k < kend; k += 16) {
                __m512 xv = _mm512_loadu_ps(x + k);
                for (int j = 0; j < nvalid; j++) {
                    __m512 v = _mm512_mul_ps(fp8x16(w + (n0 + j) * K + k), s[j]);
                    acc[j] = _mm512_fmadd_ps(xv, bf16 ? round_bf16(v) : v, acc[j]);
                }
            }
        }
        for (int j = 0; j < nvalid; j++) y[n0 + j] = _mm512_reduce_add_ps(acc[j]);
    }
}
"""

FLAGS_AVX512 = [*FLAGS, "-mavx512f"]

_kernel = None  # the ctypes GEMM once built and checked; False when it cannot be
_gemv = None  # the AVX512 GEMV likewise; None where the CPU has no AVX512F


def load() -> bool:
    """Builds and loads the kernel where the CPU has AVX2 (with FMA and
    F16C, which every AVX2 CPU has), and checks it against the
    dequantizing path once; False (logged) where it cannot serve."""
    global _kernel, _gemv
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
    _kernel = _declare(fn, 3)
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        try:
            _gemv = _declare(cpu_bf16_gemm.load_library("fp8_gemv512", SOURCE_AVX512, FLAGS_AVX512)
                             .llmsched_gemv_f32_fp8, 2)
        except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as exc:
            log.warning("CPU FP8 kernel: the AVX512 GEMV not built (%s); one row takes the AVX2 kernel", exc)
    # Tails in every loop: 7 and 1 rows, 10 weight rows over two grid rows,
    # 1040 columns (1024 + 16) in blocks of 48 (the last one partial), and
    # of 16 for the GEMV.
    from executor_svc.model.quantization import dequantize_fp8_blocks, quantize_fp8_blocks

    gen = torch.Generator().manual_seed(0)
    for rows, bk in ((7, 48), (1, 48), (1, 16)):
        weight, scales = quantize_fp8_blocks(torch.randn(10, 1040, generator=gen), (8, bk))
        grid_rows = torch.arange(10) // 8
        x = torch.randn(rows, 1040, generator=gen)
        want = x @ dequantize_fp8_blocks(weight, scales, grid_rows, bk, torch.float32).T
        got = matmul(x, weight, scales, grid_rows, bk, bf16=False)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-3):
            _kernel, _gemv = False, None
            log.warning("CPU FP8 kernel: wrong sums on this machine (max error %.3g at %d rows); not used",
                        (got - want).abs().max().item(), rows)
            return False
    return True


def _declare(fn, sizes: int):
    """x, w, scales, grid_rows, ldscale, bk, y, then the sizes (M, N, K or N, K), then bf16."""
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_void_p] + [ctypes.c_long] * sizes \
        + [ctypes.c_int]
    fn.restype = None
    return fn


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
    scales, rows = scales.contiguous(), grid_rows.to(torch.int64).contiguous()  # as held: no copies
    out = torch.empty(m, weight.shape[0], dtype=torch.float32)
    args = (x.data_ptr(), weight.data_ptr(), scales.data_ptr(), rows.data_ptr(), scales.shape[1], block_k,
            out.data_ptr())
    if m == 1 and _gemv is not None and k % 16 == 0 and block_k % 16 == 0:
        _gemv(*args, weight.shape[0], k, int(bf16))
    else:
        _kernel(*args, m, weight.shape[0], k, int(bf16))
    return out


@torch.library.custom_op("llmsched::cpu_fp8_linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, grid_rows: torch.Tensor, block_k: int,
              bf16: bool) -> torch.Tensor:
    """matmul() as an operator of a compiled graph (the compiled CPU decode
    step), which dynamo does not trace into (a ctypes call would break the
    graph): float32 [M, N] for up to MAX_ROWS rows, else the dequantizing
    path's product, chosen when the graph runs, as eager steps choose."""
    if x.shape[0] <= MAX_ROWS:
        return matmul(x, weight, scales, grid_rows, block_k, bf16)
    from executor_svc.model.quantization import dequantize_fp8_blocks

    dtype = torch.bfloat16 if bf16 else torch.float32
    return torch.nn.functional.linear(x.to(dtype), dequantize_fp8_blocks(weight, scales, grid_rows, block_k,
                                                                          dtype)).float()


@linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, grid_rows: torch.Tensor, block_k: int,
      bf16: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def use_cpu_fp8_kernel(model: nn.Module, setting: str = "auto", batch_invariant: bool = False) -> int:
    """EXECUTOR_CPU_FP8_KERNEL: marks every FP8 linear, and every block of
    FP8 experts (moe.FusedExperts), whose shapes the kernel takes; their
    products of up to MAX_ROWS rows then run through it. Logs what it did
    and returns the modules marked."""
    fp8 = [m for m in model.modules() if getattr(m, "fp8_block", None) is not None
           and (getattr(m, "scheme", None) is not None or hasattr(m, "w13_scale"))]
    if not fp8:
        return 0
    if setting == "off" or batch_invariant:
        log.info("CPU FP8 kernel: off (%s); %d FP8 layers dequantize per matmul",
                 "EXECUTOR_CPU_FP8_KERNEL=off" if setting == "off" else "batch-invariant mode", len(fp8))
        return 0
    if not load():
        return 0
    marked = [m for m in fp8 if all(fits(w, m.fp8_block[1]) for w in _weights(m))]
    for m in marked:
        m.cpu_fp8 = True
    log.info("CPU FP8 kernel: %d of %d FP8 layers or expert blocks (products of up to %d rows)%s", len(marked),
             len(fp8), MAX_ROWS, "" if len(marked) == len(fp8) else f"; {len(fp8) - len(marked)} not: columns or "
             f"scale blocks not a multiple of {K_MULTIPLE}")
    return len(marked)


def _weights(module: nn.Module) -> list[torch.Tensor]:
    """A linear's FP8 weight, or one expert's of each projection of an experts block."""
    return [module.w13[0], module.w2[0]] if hasattr(module, "w13_scale") else [module.weight]
