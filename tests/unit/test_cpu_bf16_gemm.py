"""The tiled bf16 GEMM kernel (executor_svc/model/cpu_bf16_gemm.py) that
steps of several rows take on a CPU without native bf16: built with the
system's C compiler, checked against F.linear in float32 on shapes that
leave a tail in each of its loops, cached on disk, and refused (the
passes serve) where it cannot be built."""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch

from executor_svc.model import cpu_bf16_gemm, cpu_gemv

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="the kernel needs AVX2")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The kernel built once for this module, in an empty cache."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        mp.setattr(cpu_bf16_gemm, "_kernel", None)
        assert cpu_bf16_gemm.load(), "the kernel did not build or failed its own check"
        yield cache, cpu_bf16_gemm._kernel


@pytest.fixture
def kernel(built, monkeypatch):
    cache, fn = built
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setattr(cpu_bf16_gemm, "_kernel", fn)
    return cache


# rows: tails of the 3-row tiles (1, 2; 3k+1 rows end as 2+2: 4, 7, 16),
# 64 (ROWS_MAX); weight rows: tails of the 4-row blocks; columns: one
# block, a block and a tail, several blocks.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 64])
@pytest.mark.parametrize("n, k", [(4, 8), (7, 1024), (1030, 1048), (257, 3072)])
def test_the_kernel_sums_what_f_linear_does_in_float32(kernel, rows, n, k):
    g = torch.Generator().manual_seed(rows * 7919 + n)
    weight = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g)
    got = cpu_bf16_gemm.matmul(x, weight)
    want = torch.nn.functional.linear(x, weight.float())
    assert got.shape == (rows, n) and got.dtype == torch.float32
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * (k ** 0.5), f"max error {err:.3g} against F.linear in float32 ({rows}x{k} by {n}x{k})"


def test_a_view_of_a_larger_weight_is_read_from_its_offset(kernel):
    """A contiguous slice (a layer's rows of a fused weight) starts at its
    storage offset, which data_ptr includes."""
    whole = torch.randn(64, 512).bfloat16()
    part = whole[16:40]
    x = torch.randn(6, 512)
    assert part.is_contiguous() and cpu_bf16_gemm.fits(part)
    assert torch.allclose(cpu_bf16_gemm.matmul(x, part), torch.nn.functional.linear(x, part.float()), atol=1e-3)


def test_weights_the_kernel_cannot_read_go_to_the_passes(kernel, monkeypatch):
    """Columns not a multiple of 8 (no scalar tail), a transposed view, or
    float32: fits() says no, and cpu_gemv.gemm_rows takes the passes (the
    passes' own sums are tested in test_cpu_gemv.py)."""
    assert not cpu_bf16_gemm.fits(torch.zeros(8, 1020, dtype=torch.bfloat16))
    assert not cpu_bf16_gemm.fits(torch.zeros(1024, 8, dtype=torch.bfloat16).t())
    assert not cpu_bf16_gemm.fits(torch.zeros(8, 1024))
    passes = []
    monkeypatch.setattr(cpu_gemv, "gemm_passes", lambda x, w: passes.append(w.shape) or torch.zeros(x.shape[0], w.shape[0]))
    cpu_gemv.gemm_rows(torch.randn(5, 1020).bfloat16(), torch.randn(600, 1020).bfloat16())
    assert passes == [(600, 1020)]
    x, weight = torch.randn(5, 1024).bfloat16(), torch.randn(600, 1024).bfloat16()
    got = cpu_gemv.gemm_rows(x, weight)
    assert passes == [(600, 1020)], "a weight the kernel fits went to the passes"
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), torch.nn.functional.linear(x, weight).float(),
                                                          rtol=1e-2, atol=0.05)


def test_the_build_is_cached_by_source_and_a_second_start_loads_it(kernel, monkeypatch):
    built = list((kernel / "llmsched" / "cpu_kernels").glob("bf16_gemm-*.so"))
    assert len(built) == 1, built
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_bf16_gemm, "_kernel", None)
    assert cpu_bf16_gemm.load()
    assert built[0].stat().st_mtime_ns == stamp, "the cached library was built again"


def test_without_a_c_compiler_the_kernel_is_not_used_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpu_bf16_gemm, "_kernel", None)
    with caplog.at_level(logging.WARNING, logger=cpu_bf16_gemm.__name__):
        assert cpu_bf16_gemm.load() is False
    assert not cpu_bf16_gemm.available()
    assert "bf16 GEMM kernel: not built" in caplog.text and "no-such-cc" in caplog.text


def test_an_unwritable_cache_builds_into_a_temporary_directory_removed_once_loaded(monkeypatch, tmp_path):
    """A read-only home (a locked-down container) costs the cache, not the
    kernel, and leaves no temporary directory behind."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setattr(cpu_bf16_gemm, "_kernel", None)
    assert cpu_bf16_gemm.load(), "the kernel did not build outside the cache"
    x, weight = torch.randn(4, 64), torch.randn(12, 64).bfloat16()
    assert torch.allclose(cpu_bf16_gemm.matmul(x, weight), torch.nn.functional.linear(x, weight.float()), atol=1e-4)
    assert list(temp.iterdir()) == [], "the temporary build directory was left behind"


def test_one_bf16_row_takes_the_c_gemv_and_other_rows_or_dtypes_do_not(kernel, monkeypatch):
    """cpu_gemv.gemv: a bf16 weight the library fits goes to its GEMV (not
    inductor's); a float32 one, or columns not a multiple of 8, to inductor's."""
    inductor = []
    monkeypatch.setattr(cpu_gemv, "_call", lambda cache, key, *a: inductor.append(key) or torch.zeros(1, a[-2].shape[0]))
    x, weight = torch.randn(1, 1024).bfloat16(), torch.randn(777, 1024).bfloat16()
    got = cpu_gemv.gemv(x, weight)
    assert inductor == [], "a bf16 row the C GEMV fits went to inductor's"
    want = torch.nn.functional.linear(x.float(), weight.float())
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want, rtol=1e-2, atol=0.05)
    cpu_gemv.gemv(torch.randn(1, 1024), torch.randn(777, 1024))
    cpu_gemv.gemv(torch.randn(1, 1020).bfloat16(), torch.randn(777, 1020).bfloat16())
    assert inductor == [torch.float32, torch.bfloat16]
