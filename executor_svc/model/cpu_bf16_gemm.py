"""Steps of a few rows through bfloat16 weights on a CPU without native
bf16 instructions: a register-tiled C kernel (AVX2 and FMA), and a GEMV
for one row, built at start-up with the system's C compiler and called
through ctypes.

On AVX2 torch's bf16 GEMM costs a one-row product's time for every row
(cpu_gemv.py), and inductor's several-row passes keep one accumulator per
row for each weight row: every eight multiply-adds load the weight once
and each row's x once, so they run at about 45% of the FMA units' peak
(78 of 172 GFLOP/s at 16 rows, measured on the development machine's two
Zen 3 cores). This kernel converts four weight rows at a time to float32
into a buffer that stays in L1, then multiplies them by three rows of x
at once: twelve accumulators in registers, so each load feeds three or
four multiply-adds. A [4096, 1024] weight on two threads, against the
passes: 1.72 against 2.52 ms at 16 rows, 2.86 against 4.96 at 32, even at
2 to 8 rows (there the weight's bandwidth bounds both).

The sums run in float32, over K in another order than torch's GEMM:
outputs differ from F.linear's by float32 rounding before the cast back.
Threads: an OpenMP loop over blocks of weight rows. The library links
libgomp by its soname, which resolves to the copy torch already loaded, so
its threads are torch's: one pool, sized by torch.set_num_threads on the
calling thread, started from the step thread as every other region is.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# K (the weight's columns) must be a multiple of this: the kernel reads x
# and the weight eight values at a time and has no scalar tail.
K_MULTIPLE = 8

# What this kernel and cpu_fp8_linear.py's share: the blocked GEMM, float32
# sums of up to three rows of x against NB weight rows converted into an L1
# buffer; each kernel brings its own conversion.
MICRO_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NB 4     /* weight rows converted and multiplied at once */
#define KC 1024  /* columns a block: NB x KC float32 = 16 KiB stays in L1 */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* MB rows of x times NB converted weight rows over kc columns; the sums are
   stored (first block of columns) or added (later ones) to y. */
#define MICRO(MB)                                                                          \
static inline void micro##MB(const float *x, long ldx, const float *wf, int kc, float *y,  \
                             long ldy, int nvalid, int add) {                               \
    __m256 acc[MB][NB];                                                                    \
    for (int i = 0; i < MB; i++)                                                           \
        for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();                      \
    for (int k = 0; k < kc; k += 8) {                                                      \
        __m256 xv[MB];                                                                     \
        for (int i = 0; i < MB; i++) xv[i] = _mm256_loadu_ps(x + i * ldx + k);             \
        for (int j = 0; j < NB; j++) {                                                     \
            __m256 w = _mm256_load_ps(wf + j * KC + k);                                    \
            for (int i = 0; i < MB; i++) acc[i][j] = _mm256_fmadd_ps(xv[i], w, acc[i][j]); \
        }                                                                                  \
    }                                                                                      \
    for (int i = 0; i < MB; i++)                                                           \
        for (int j = 0; j < nvalid; j++)                                                   \
            y[i * ldy + j] = (add ? y[i * ldy + j] : 0.0f) + hsum(acc[i][j]);             \
}
MICRO(1)
MICRO(2)
MICRO(3)

/* Every row of x [M, K] times the converted weight rows n0 .. n0 + NB of
   columns k0 .. k0 + kc (wf), into y [M, N]. 3k+1 rows end as 2+2, not
   3+1: micro1 does 4 multiply-adds a 5 loads (16 rows: 6% faster). */
static inline void all_rows(const float *x, long M, long K, long k0, const float *wf, int kc, float *y, long N,
                            long n0, int nvalid) {
    int add = k0 > 0;
    long m = 0;
    long m3 = M % 3 == 1 && M >= 4 ? M - 4 : M;
    for (; m + 3 <= m3; m += 3) micro3(x + m * K + k0, K, wf, kc, y + m * N + n0, N, nvalid, add);
    if (M - m == 4) {
        micro2(x + m * K + k0, K, wf, kc, y + m * N + n0, N, nvalid, add);
        m += 2;
    }
    if (M - m == 2) micro2(x + m * K + k0, K, wf, kc, y + m * N + n0, N, nvalid, add);
    if (M - m == 1) micro1(x + m * K + k0, K, wf, kc, y + m * N + n0, N, nvalid, add);
}

/* Converts columns k0 .. k0 + kc of weight row n to float32 at dst. */
typedef void (*convert_fn)(const void *weight, long n, long k0, int kc, float *dst);

/* y[M, N] = x[M, K] (float32) times a weight [N, K] transposed, its rows
   converted NB at a time, KC columns a block, into an L1 buffer by convert;
   every row of x then multiplies them (all_rows). K % 8 == 0. */
static inline void blocked_gemm(const float *x, float *y, long M, long N, long K, convert_fn convert,
                                const void *weight) {
    long nblocks = (N + NB - 1) / NB;
    #pragma omp parallel for schedule(static)
    for (long b = 0; b < nblocks; b++) {
        float wf[NB * KC] __attribute__((aligned(32)));
        long n0 = b * NB;
        int nvalid = (int)(N - n0 < NB ? N - n0 : NB);
        for (long k0 = 0; k0 < K; k0 += KC) {
            int kc = (int)(K - k0 < KC ? K - k0 : KC);
            for (int j = 0; j < NB; j++) {
                if (j < nvalid)
                    convert(weight, n0 + j, k0, kc, wf + j * KC);
                else
                    memset(wf + j * KC, 0, sizeof(float) * kc);  /* past N: multiplied, never stored */
            }
            all_rows(x, M, K, k0, wf, kc, y, N, n0, nvalid);
        }
    }
}
"""

SOURCE = MICRO_SOURCE + r"""
/* Eight bfloat16 values to float32: their bits are a float32's top half. */
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* y[N] = x[K] (float32) times w[N, K] (bfloat16 bits) transposed, one row:
   bound by the weight's bandwidth, so no buffer; eight weight rows at once,
   eight streams for the prefetchers and eight accumulators. K % 8 == 0. */
void llmsched_gemv_f32_bf16(const float *x, const uint16_t *w, float *y, long N, long K) {
    #pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N; n0 += 8) {
        int nvalid = (int)(N - n0 < 8 ? N - n0 : 8);
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        if (nvalid == 8) {
            for (long k = 0; k < K; k += 8) {
                __m256 xv = _mm256_loadu_ps(x + k);
                for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(xv, bf16x8(w + (n0 + j) * K + k), acc[j]);
            }
        } else {
            for (int j = 0; j < nvalid; j++)
                for (long k = 0; k < K; k += 8)
                    acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), bf16x8(w + (n0 + j) * K + k), acc[j]);
        }
        for (int j = 0; j < nvalid; j++) y[n0 + j] = hsum(acc[j]);
    }
}

struct bf16_weight { const uint16_t *w; long K; };

static void convert_bf16(const void *weight, long n, long k0, int kc, float *dst) {
    const struct bf16_weight *c = weight;
    const uint16_t *src = c->w + n * c->K + k0;
    for (int k = 0; k < kc; k += 8) _mm256_store_ps(dst + k, bf16x8(src + k));
}

/* y[M, N] = x[M, K] (float32) times w[N, K] (bfloat16 bits) transposed.
   K % 8 == 0; all three contiguous. */
void llmsched_gemm_f32_bf16(const float *x, const uint16_t *w, float *y, long M, long N, long K) {
    struct bf16_weight c = {w, K};
    blocked_gemm(x, y, M, N, K, convert_bf16, &c);
}
"""

FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]

_kernel = None  # the ctypes functions (GEMM, GEMV) once built and checked; False when they cannot be


def compiler() -> str | None:
    """CC, else the first C or C++ compiler found (the source is compiled as
    C either way: `-x c`), as inductor looks for one."""
    found = [os.environ.get("CC"), shutil.which("cc"), shutil.which("gcc"), os.environ.get("CXX"),
             shutil.which("c++"), shutil.which("g++")]
    return next((c for c in found if c), None)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmsched" / "cpu_kernels"


# Where build() compiles when cache_dir() cannot be written.
TEMP_PREFIX = "llmsched-cpu-kernels-"


def load_library(name: str = "bf16_gemm", source: str = SOURCE, flags: list[str] = FLAGS) -> ctypes.CDLL:
    """build()'s library, loaded. One built into a temporary directory is
    removed once loaded (the loaded code does not need its file), so no
    start leaves a directory behind."""
    path = build(name, source, flags)
    try:
        return ctypes.CDLL(str(path))
    finally:
        if path.parent.name.startswith(TEMP_PREFIX):
            shutil.rmtree(path.parent, ignore_errors=True)


def build(name: str = "bf16_gemm", source: str = SOURCE, flags: list[str] = FLAGS) -> Path:
    """The shared library of a C source, compiled once per source, compiler
    and flags and kept in cache_dir() (written under a temporary name, then
    renamed, so a concurrent start never loads half a file); where that
    directory cannot be written, in a temporary one (load_library removes
    it once loaded)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (CC, cc, gcc, CXX, c++ or g++)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([source, cc, version, *flags]).encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}-{key}.so"
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=path.parent)
    except OSError:  # a read-only home: built for this process alone
        tmp = tempfile.mkdtemp(prefix=TEMP_PREFIX)
        path = Path(tmp) / path.name
    try:
        src = Path(tmp) / f"{name}.c"
        src.write_text(source)
        out = Path(tmp) / f"{path.name}.part"
        done = subprocess.run([cc, *flags, "-x", "c", str(src), "-o", str(out)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.replace(out, path)
    finally:
        if path.parent != Path(tmp) or not path.exists():  # the cache's, or nothing built
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def load() -> bool:
    """Builds and loads the kernel where the CPU has AVX2 and FMA, and checks
    it against F.linear once; False (logged) where it cannot serve."""
    global _kernel
    if _kernel is not None:
        return bool(_kernel)
    _kernel = False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("bf16 GEMM kernel: not built (needs AVX2; torch reports %s)",
                 torch.backends.cpu.get_cpu_capability())
        return False
    try:
        lib = load_library()
        gemm, gemv = lib.llmsched_gemm_f32_bf16, lib.llmsched_gemv_f32_bf16
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("bf16 GEMM kernel: not built (%s); steps of several rows take inductor's passes", exc)
        return False
    gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    gemv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2
    gemm.restype = gemv.restype = None
    _kernel = (gemm, gemv)
    # Shapes that leave a tail in every loop: 7 rows (3+2+2), 2 rows, 1 row
    # (the GEMV), 10 weight rows (4+4+2; 8+2), 1040 columns (1024+16).
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 1040, generator=gen).bfloat16()
    for rows in (7, 2, 1):
        x = torch.randn(rows, 1040, generator=gen)
        want = torch.nn.functional.linear(x, weight.float())
        got = matmul(x, weight)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-3):
            _kernel = False
            log.warning("bf16 GEMM kernel: wrong sums on this machine (max error %.3g at %d rows); not used",
                        (got - want).abs().max().item(), rows)
            return False
    return True


def available() -> bool:
    """Whether load() built the kernel and it passed its check."""
    return bool(_kernel)


def fits(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.is_contiguous() and weight.shape[1] % K_MULTIPLE == 0


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 times weight [N, K] bfloat16 transposed: [M, N]
    float32, one row through the GEMV. Needs available() and fits(weight)."""
    x = x.contiguous()
    m, k = x.shape
    assert x.dtype == torch.float32 and k == weight.shape[1] and fits(weight), (x.dtype, x.shape, weight.shape)
    out = torch.empty(m, weight.shape[0], dtype=torch.float32)
    gemm, gemv = _kernel
    if m == 1:
        gemv(x.data_ptr(), weight.data_ptr(), out.data_ptr(), weight.shape[0], k)
    else:
        gemm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), m, weight.shape[0], k)
    return out
