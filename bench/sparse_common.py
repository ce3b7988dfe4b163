"""Shared by bench/sparse_kernel.py and bench/sparse_e2e.py: CUDA-event timing and run metadata."""
from __future__ import annotations

import datetime
import os
import statistics
import subprocess

import torch


def cuda_time(fn, warmup: int, reps: int) -> float:
    """Median ms of ``reps`` calls of fn (CUDA events) after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run_meta(**extra) -> dict:
    """Device, torch, commit (GIT_COMMIT or git HEAD), UTC date, plus ``extra``."""
    commit = os.environ.get("GIT_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                            capture_output=True, text=True).stdout.strip()
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **extra}
