"""bfloat16 products through weights packed once at load into pairs of
columns, and one C kernel per instruction set for every row count, built
at start-up with the system's C compiler and called through ctypes:
VDPBF16PS where the CPU has AVX512-BF16 but no AMX (AMD Zen 4 and later,
Intel Cooper Lake; kind `avx512bf16`), float32 FMAs where it has no
native bf16: in 512-bit registers with AVX512F (Intel Skylake-SP to Ice
Lake; kind `avx512`, SOURCE_AVX512 below), else in 256-bit ones with AVX2
and FMA (AMD Zen 3 and earlier, Intel before Skylake-SP; kind `avx2`,
SOURCE_AVX2). cpu_prepack.py chooses; with AMX oneDNN's tile kernels are
another class, and keep those CPUs.

On the AVX512-BF16 CPUs oneDNN's bf16 inner product runs on the same
instruction, but its one-row product is slow: the 112 layer products of a
Qwen3-0.6B shape's decode step on two Zen 4 cores, distinct weights, took
31.5-32.6 ms at one row through oneDNN's reordered layout against 18.3
here, and the inductor GEMV on the stored layout 21.3-21.6 (so oneDNN's
layout cost a single stream what it gave 16 of them). At several rows the
kernel keeps pace with oneDNN: 16 rows 42.8 against 47.9 ms, and 4 of
those layers at 64, 256 and 1,024 rows 19.7, 74.2 and 296.4 against 20.0,
74.1 and 289.3 (`python -m bench.cpu_bf16` prints the first two).

Layout: [N/16, K/2, 16, 2] (N padded to a multiple of 64 with zero rows):
16 weight rows by one pair of columns, 64 bytes, is one cache line and one
VDPBF16PS operand, the pair of x's values broadcast against it. A
micro-kernel keeps R rows (1 to 6) by 4 blocks of 16 outputs in 24 or
fewer of the 32 registers, so each weight line loaded feeds R of them;
threads share out strips of 64 outputs (one output block each, for one
row, where strips would leave threads idle) and groups of 48 rows. Every
output is summed in one float32 accumulator over the column pairs in
order, whatever the row count, the rows beside it, or the thread count:
a row's outputs do not depend on its batch. They differ from F.linear's
(whose order is oneDNN's) by float32 rounding before the cast to bf16.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess

import torch

from executor_svc.model import cpu_bf16_gemm

log = logging.getLogger(__name__)

BLOCK = 16  # outputs a VDPBF16PS produces: one 512-bit register of float32
STRIP = 64  # outputs a micro-kernel keeps (4 blocks); N is padded to it

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#define GROUP 48  /* rows a task takes: 8 passes of the 6-row micro-kernel */

static inline __m512bh pair(const uint16_t *x) { return (__m512bh)_mm512_set1_epi32(*(const int32_t *)x); }

/* Block j's 16 sums (plus bias) to bf16, rounded to nearest even, the outputs past N dropped. */
static inline void store(uint16_t *y, const uint16_t *bias, __m512 v, long n, long N) {
    if (n >= N) return;
    int valid = N - n < 16 ? (int)(N - n) : 16;
    __mmask16 m = (__mmask16)(valid == 16 ? 0xffff : (1u << valid) - 1);
    if (bias)
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias + n)), 16)));
    _mm256_mask_storeu_epi16(y + n, m, (__m256i)_mm512_cvtneps_pbh(v));
}

/* R rows of x times JB blocks of 16 weight rows (w: the first block), all K columns. */
#define MICRO(R, JB)                                                                              \
static inline void micro_##R##_##JB(const uint16_t *x, long K, const uint16_t *w, uint16_t *y,    \
                                    long N, const uint16_t *bias, long n0) {                      \
    long KP = K / 2;                                                                              \
    __m512 acc[R][JB];                                                                            \
    for (int r = 0; r < R; r++)                                                                   \
        for (int j = 0; j < JB; j++) acc[r][j] = _mm512_setzero_ps();                             \
    for (long kp = 0; kp < KP; kp++) {                                                            \
        __m512bh wv[JB];                                                                          \
        for (int j = 0; j < JB; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + (j * KP + kp) * 32); \
        for (int r = 0; r < R; r++) {                                                             \
            __m512bh b = pair(x + r * K + 2 * kp);                                                \
            for (int j = 0; j < JB; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], b, wv[j]);       \
        }                                                                                         \
    }                                                                                             \
    for (int r = 0; r < R; r++)                                                                   \
        for (int j = 0; j < JB; j++) store(y + r * N, bias, acc[r][j], n0 + 16 * j, N);           \
}
MICRO(1, 1)
MICRO(1, 4)
MICRO(2, 4)
MICRO(3, 4)
MICRO(4, 4)
MICRO(5, 4)
MICRO(6, 4)

/* y[M, N] = x[M, K] wp^T (+ bias): x, y, bias bf16, contiguous; wp packed
   [NP/16, K/2, 16, 2], NP = N rounded up to 64; K even. */
void llmsched_vnni_linear(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                          long M, long N, long K) {
    long strips = (N + 63) / 64;
    if (M == 1 && strips < 4L * omp_get_max_threads()) {
        long blocks = (N + 15) / 16;
        #pragma omp parallel for schedule(static)
        for (long b = 0; b < blocks; b++) micro_1_1(x, K, wp + b * 16 * K, y, N, bias, 16 * b);
        return;
    }
    long groups = (M + GROUP - 1) / GROUP;
    #pragma omp parallel for collapse(2) schedule(static)
    for (long s = 0; s < strips; s++) {
        for (long g = 0; g < groups; g++) {
            const uint16_t *w = wp + s * 64 * K;
            long n0 = 64 * s, m = g * GROUP, end = m + GROUP < M ? m + GROUP : M;
            for (; m + 6 <= end; m += 6) micro_6_4(x + m * K, K, w, y + m * N, N, bias, n0);
            switch (end - m) {
                case 5: micro_5_4(x + m * K, K, w, y + m * N, N, bias, n0); break;
                case 4: micro_4_4(x + m * K, K, w, y + m * N, N, bias, n0); break;
                case 3: micro_3_4(x + m * K, K, w, y + m * N, N, bias, n0); break;
                case 2: micro_2_4(x + m * K, K, w, y + m * N, N, bias, n0); break;
                case 1: micro_1_4(x + m * K, K, w, y + m * N, N, bias, n0); break;
            }
        }
    }
}
"""

FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]

# The float32 kernels' (avx2, avx512) shared driver: x converted to float32
# once, then tasks of one strip of `width` outputs by a group of GROUP rows,
# each group in passes of the widest micro-kernel and one of the rows left.
# Each source defines its micro-kernels and passes them in (micro[r]: r
# rows); each call runs a whole K loop, beside which calling through the
# table costs nothing.
FLOAT32_DRIVER = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define GROUP 48  /* rows a task takes */

typedef void (*micro_fn)(const float *x, long K, const uint16_t *w, uint16_t *y, long N, const uint16_t *bias,
                         long n0);

/* Returns -1 if x's float32 copy cannot be allocated (nothing computed), else 0. */
static int run_float32(const uint16_t *xb, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                       long M, long N, long K, long width, long most, const micro_fn *micro) {
    float *x = malloc(sizeof(float) * (size_t)(M * K));
    if (!x) return -1;
    for (long i = 0; i < M * K; i++) {
        uint32_t bits = (uint32_t)xb[i] << 16;
        __builtin_memcpy(x + i, &bits, 4);
    }
    long strips = (N + width - 1) / width, groups = (M + GROUP - 1) / GROUP;
    #pragma omp parallel for collapse(2) schedule(static)
    for (long s = 0; s < strips; s++) {
        for (long g = 0; g < groups; g++) {
            const uint16_t *w = wp + s * width * K;
            long n0 = width * s, m = g * GROUP, end = m + GROUP < M ? m + GROUP : M;
            for (; m < end; m += most) {
                long rows = end - m < most ? end - m : most;
                micro[rows](x + m * K, K, w, y + m * N, N, bias, n0);
            }
        }
    }
    free(x);
    return 0;
}
"""

# The same layout on a CPU with AVX2 and FMA but no native bf16 (AMD Zen 3,
# Intel before Cooper Lake): each 64-byte line is split into the float32
# weights of its even and its odd column (a shift and a mask: bf16 is a
# float32's top half), each multiplied by that column's value of x. x is
# converted to float32 once per call. A micro-kernel keeps R rows (1 to 4)
# by one block of 16 outputs (two 8-wide registers) in 8 of the 16
# registers. Against cpu_bf16_gemm.py's kernel on the stored layout, the
# 112 layer products of a Qwen3-0.6B shape on two Zen 4 cores limited to
# AVX2: 25.2 against 37.7 ms at one row, 97.1 against 127.0 at 16 rows; 4
# layers' at 64 and 256 rows 45.4 and 170.7 against 47.7 and 189.7 (and
# 70.4 and 204.4 converting to float32 for MKL's GEMM).
SOURCE_AVX2 = FLOAT32_DRIVER + r"""
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* float32 to bf16, rounded to nearest even (a NaN stays a quiet NaN). */
static inline __m128i to_bf16(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline void store(uint16_t *y, const uint16_t *bias, __m256 lo, __m256 hi, long n, long N) {
    uint16_t t[16];
    int valid = N - n < 16 ? (int)(N - n) : 16;
    if (bias) {
        uint16_t b[16] = {0};
        for (int i = 0; i < valid; i++) b[i] = bias[n + i];
        lo = _mm256_add_ps(lo, bf16x8(b));
        hi = _mm256_add_ps(hi, bf16x8(b + 8));
    }
    _mm_storeu_si128((__m128i *)t, to_bf16(lo));
    _mm_storeu_si128((__m128i *)(t + 8), to_bf16(hi));
    for (int i = 0; i < valid; i++) y[n + i] = t[i];
}

/* R rows of x (float32) times one block of 16 weight rows, all K columns. */
#define MICRO(R)                                                                                  \
static inline void micro_##R(const float *x, long K, const uint16_t *w, uint16_t *y, long N,     \
                             const uint16_t *bias, long n0) {                                    \
    long KP = K / 2;                                                                             \
    const __m256i top = _mm256_set1_epi32((int)0xffff0000);                                      \
    __m256 acc[R][2];                                                                            \
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                     \
    for (long kp = 0; kp < KP; kp++) {                                                           \
        __m256i a = _mm256_loadu_si256((const __m256i *)(w + kp * 32));                          \
        __m256i b = _mm256_loadu_si256((const __m256i *)(w + kp * 32 + 16));                     \
        __m256 ae = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));                               \
        __m256 ao = _mm256_castsi256_ps(_mm256_and_si256(a, top));                               \
        __m256 be = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));                               \
        __m256 bo = _mm256_castsi256_ps(_mm256_and_si256(b, top));                               \
        for (int r = 0; r < R; r++) {                                                            \
            __m256 xe = _mm256_broadcast_ss(x + r * K + 2 * kp);                                 \
            acc[r][0] = _mm256_fmadd_ps(xe, ae, acc[r][0]);                                      \
            acc[r][1] = _mm256_fmadd_ps(xe, be, acc[r][1]);                                      \
            __m256 xo = _mm256_broadcast_ss(x + r * K + 2 * kp + 1);                             \
            acc[r][0] = _mm256_fmadd_ps(xo, ao, acc[r][0]);                                      \
            acc[r][1] = _mm256_fmadd_ps(xo, bo, acc[r][1]);                                      \
        }                                                                                        \
    }                                                                                            \
    for (int r = 0; r < R; r++) store(y + r * N, bias, acc[r][0], acc[r][1], n0, N);             \
}
MICRO(1)
MICRO(2)
MICRO(3)
MICRO(4)

static const micro_fn MICROS[] = {0, micro_1, micro_2, micro_3, micro_4};

/* As llmsched_vnni_linear, on AVX2 and FMA: one block of 16 outputs a
   task, up to 4 rows a pass. Returns -1 if x's float32 copy cannot be
   allocated (nothing computed), else 0. */
int llmsched_vnni_linear_avx2(const uint16_t *xb, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                              long M, long N, long K) {
    return run_float32(xb, wp, bias, y, M, N, K, 16, 4, MICROS);
}
"""

FLAGS_AVX2 = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]

# The AVX2 kernel's arithmetic in 512-bit registers, for CPUs with AVX512F
# but no native bf16 (Intel Skylake-SP to Ice Lake): a 64-byte line is one
# register, split into two 16-wide ones of float32 weights, and a
# micro-kernel keeps R rows (1 to 8) by two blocks (32 outputs) in up to 16
# of the 32 registers. Each output is summed in the avx2 kernel's order, so
# the two give the same outputs bit for bit. The 112 layer products of a
# Qwen3-0.6B shape on two Zen 4 cores (`python -m bench.cpu_bf16`; their
# AVX-512 units are 256 bits wide, Intel's two 512-bit FMA units may gain
# more, not measured): 77.4 against 101.7 ms at 16 rows, 28.0 against 27.7
# at one row (memory-bound).
SOURCE_AVX512 = FLOAT32_DRIVER + r"""
/* float32 to bf16, rounded to nearest even (a NaN stays a quiet NaN). */
static inline __m256i to_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

static inline void store(uint16_t *y, const uint16_t *bias, __m512 v, long n, long N) {
    uint16_t t[16];
    int valid = N - n < 16 ? (int)(N - n) : 16;
    if (bias) {
        uint16_t b[16] = {0};
        for (int i = 0; i < valid; i++) b[i] = bias[n + i];
        __m512i bb = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b)), 16);
        v = _mm512_add_ps(v, _mm512_castsi512_ps(bb));
    }
    _mm256_storeu_si256((__m256i *)t, to_bf16(v));
    for (int i = 0; i < valid; i++) y[n + i] = t[i];
}

/* R rows of x (float32) times two blocks of 16 weight rows, all K columns. */
#define MICRO(R)                                                                                  \
static inline void micro_##R(const float *x, long K, const uint16_t *w, uint16_t *y, long N,     \
                             const uint16_t *bias, long n0) {                                    \
    long KP = K / 2;                                                                             \
    const uint16_t *w1 = w + 16 * K;                                                             \
    const __m512i top = _mm512_set1_epi32((int)0xffff0000);                                      \
    __m512 acc[R][2];                                                                            \
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                     \
    for (long kp = 0; kp < KP; kp++) {                                                           \
        __m512i a = _mm512_loadu_si512((const void *)(w + kp * 32));                             \
        __m512i b = _mm512_loadu_si512((const void *)(w1 + kp * 32));                            \
        __m512 ae = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));                               \
        __m512 ao = _mm512_castsi512_ps(_mm512_and_si512(a, top));                               \
        __m512 be = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));                               \
        __m512 bo = _mm512_castsi512_ps(_mm512_and_si512(b, top));                               \
        for (int r = 0; r < R; r++) {                                                            \
            __m512 xe = _mm512_set1_ps(x[r * K + 2 * kp]);                                       \
            acc[r][0] = _mm512_fmadd_ps(xe, ae, acc[r][0]);                                      \
            acc[r][1] = _mm512_fmadd_ps(xe, be, acc[r][1]);                                      \
            __m512 xo = _mm512_set1_ps(x[r * K + 2 * kp + 1]);                                   \
            acc[r][0] = _mm512_fmadd_ps(xo, ao, acc[r][0]);                                      \
            acc[r][1] = _mm512_fmadd_ps(xo, bo, acc[r][1]);                                      \
        }                                                                                        \
    }                                                                                            \
    for (int r = 0; r < R; r++) {                                                                \
        store(y + r * N, bias, acc[r][0], n0, N);                                                \
        store(y + r * N, bias, acc[r][1], n0 + 16, N);                                           \
    }                                                                                            \
}
MICRO(1)
MICRO(2)
MICRO(3)
MICRO(4)
MICRO(5)
MICRO(6)
MICRO(7)
MICRO(8)

static const micro_fn MICROS[] = {0, micro_1, micro_2, micro_3, micro_4, micro_5, micro_6, micro_7, micro_8};

/* As llmsched_vnni_linear_avx2, on AVX512F: two blocks (32 outputs) a
   task, up to 8 rows a pass; the same sums in the same order, so the same
   outputs bit for bit. */
int llmsched_vnni_linear_avx512(const uint16_t *xb, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                                long M, long N, long K) {
    return run_float32(xb, wp, bias, y, M, N, K, 32, 8, MICROS);
}
"""
FLAGS_AVX512 = ["-O3", "-mavx512f", "-mfma", "-fopenmp", "-shared", "-fPIC"]

# kind -> (library name, source, compiler flags, function)
BUILDS = {
    "avx512bf16": ("bf16_vnni", SOURCE, FLAGS, "llmsched_vnni_linear"),
    "avx512": ("bf16_vnni_avx512", SOURCE_AVX512, FLAGS_AVX512, "llmsched_vnni_linear_avx512"),
    "avx2": ("bf16_vnni_avx2", SOURCE_AVX2, FLAGS_AVX2, "llmsched_vnni_linear_avx2"),
}

# kind -> the ctypes function once built and checked, or False when it cannot be
_kernels: dict[str, object] = {}


def cpu_has_it() -> bool:
    """AVX512-BF16 without AMX: where the avx512bf16 kernel is chosen over
    oneDNN's."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported()) and not torch.cpu._is_amx_tile_supported()
    except AttributeError:  # a torch without these probes
        return False


def can_build(kind: str) -> bool:
    """Whether the CPU has the instructions of this kind's kernel."""
    if kind == "avx512bf16":
        return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    if kind == "avx512":
        return torch.backends.cpu.get_cpu_capability() == "AVX512"
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def load(kind: str) -> bool:
    """Builds and loads this kind's kernel (avx512bf16, avx512 or avx2)
    where the CPU has its instructions, and checks it against F.linear
    once; False (logged) where it cannot serve."""
    if kind in _kernels:
        return bool(_kernels[kind])
    _kernels[kind] = False
    if not can_build(kind):
        log.info("%s bf16 kernel: not built (the CPU lacks its instructions; torch reports %s)", kind,
                 torch.backends.cpu.get_cpu_capability())
        return False
    name, source, flags, symbol = BUILDS[kind]
    try:
        fn = getattr(cpu_bf16_gemm.load_library(name, source, flags), symbol)
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("%s bf16 kernel: not built (%s); bf16 weights keep another path", kind, exc)
        return False
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    fn.restype = None if kind == "avx512bf16" else ctypes.c_int
    _kernels[kind] = fn
    # Shapes that leave a tail everywhere: 70 outputs (a strip of 4 blocks,
    # the last 6 wide), 1042 columns (521 pairs), rows 1 (the one-block
    # path), 13 (6+6+1, 4+4+4+1) and 50 (two groups: 48, then 2).
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 1042, generator=gen).bfloat16()
    bias = torch.randn(70, generator=gen).bfloat16()
    packed = pack(weight)
    for rows in (1, 13, 50):
        x = torch.randn(rows, 1042, generator=gen).bfloat16()
        want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        got = linear(x, packed, bias, 70, kind).float()
        # The sums in float32, then rounded once to bf16: within one bf16 step of the exact sum.
        if not torch.allclose(got, want, rtol=2 ** -7, atol=1e-2):
            _kernels[kind] = False
            log.warning("%s bf16 kernel: wrong sums on this machine (max error %.3g at %d rows); not used", kind,
                        (got - want).abs().max().item(), rows)
            return False
    return True


def fits(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 2 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 in the kernel's layout: [NP/16, K/2, 16, 2], NP =
    N rounded up to STRIP, the rows past N zero."""
    n, k = weight.shape
    padded = -(-n // STRIP) * STRIP
    if padded != n:
        weight = torch.cat([weight, weight.new_zeros(padded - n, k)])
    return weight.reshape(padded // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the [N, K] weight packed: what F.embedding reads from
    it, for an embedding tied to a packed head. ids of any shape -> [...,
    K]. Each row is K/2 pairs 64 bytes apart: a gather, about 4x an
    embedding lookup's time (2,048 ids of a 1,024-wide weight: 5.9 against
    1.5 ms), a few ms of a prefill that size."""
    flat = ids.reshape(-1)
    out = packed[flat // BLOCK, :, flat % BLOCK, :]  # [T, K/2, 2]
    return out.reshape(*ids.shape, packed.shape[1] * 2)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, kind: str) -> torch.Tensor:
    """x [M, K] bf16 times the packed weight of n outputs, plus bias: [M, n]
    bf16, through this kind's kernel. Needs load(kind)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"a bf16 weight packed for cpu_bf16_vnni's kernels takes bf16 inputs, not {x.dtype}")
    x = x.contiguous()
    m, k = x.shape
    assert packed.shape[1] * 2 == k, (x.shape, packed.shape)
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    if _kernels[kind](x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                      m, n, k):
        raise MemoryError(f"the {kind} bf16 kernel could not allocate x's float32 copy ({m} x {k})")
    return y
