"""Shared by bench/kernels/sparse_kernel.py and bench/kernels/sparse_e2e.py: CUDA-event timing and run metadata."""
from __future__ import annotations

import datetime
import os
import subprocess

import torch


def cuda_time(fn, warmup: int, reps: int) -> float:
    """Median ms of ``reps`` calls of fn (CUDA events) after ``warmup`` untimed calls: the package's
    timer (``ds_adaptive.core.timing.time_ms``), so benchmarks and calibration agree."""
    from ds_adaptive.core.timing import time_ms

    return time_ms(fn, warmup=warmup, iters=reps)


def run_meta(**extra) -> dict:
    """Device, torch, commit (GIT_COMMIT or git HEAD), UTC date, plus ``extra``."""
    commit = os.environ.get("GIT_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                            capture_output=True, text=True).stdout.strip()
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **extra}


def write_results(path: str, meta: dict, rows: list) -> None:
    """``{"meta": ..., "results": rows}`` as JSON at ``path`` (parent folders created)."""
    import json
    from pathlib import Path

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    print(f"wrote {out}")
