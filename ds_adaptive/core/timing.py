"""GPU timing: the median of CUDA-event-timed calls. The one timer of the calibration and of the sparse
backends' efficiency measurement (planning code never times anything)."""
from __future__ import annotations

import torch


def time_ms(fn, *, warmup: int = 3, iters: int = 10) -> float:
    """Median ms of ``fn()`` over ``iters`` CUDA-event-timed calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]
