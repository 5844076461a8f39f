"""What the GPU kernel benchmarks share (bench/moe_kernels.py,
bench/quant_gemm.py): CUDA-event timing with warm-up, as a median, and
agreement with a reference within bf16's tolerance."""

from __future__ import annotations

import statistics

TOLERANCE = 3e-2  # bf16, relative to the output's scale


def time_ms(fn, repeats: int, flush=None) -> float:
    """Median milliseconds of fn() over `repeats` timed calls after 3
    warm-up calls; `flush` (a large buffer) is zeroed before each, so no
    call finds its weights in L2."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def agree(got, want) -> dict:
    """The largest absolute difference, the output's scale, and whether the
    difference is within TOLERANCE of that scale."""
    scale = max(1.0, want.float().abs().max().item())
    diff = (got.float() - want.float()).abs().max().item()
    return {"max_abs_diff": diff, "scale": scale, "ok": diff <= TOLERANCE * scale}
