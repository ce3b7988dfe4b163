"""MFU of each micro-batch's compute window in recorded trainer runs (CPU, no GPU needed): where a run's MFU goes.

    python bench/training/micro_batch_mfu.py RUN_DIR [RUN_DIR ...] [--out bench/out/micro_batch_mfu.json]

A run directory is a one-GPU trainer log dir, read by ``ds_adaptive.calibration.trainer_runs.micro_batch_mfu``:
``compute.jsonl`` (every micro-step's shape, B, checkpointed blocks and compute window), or for runs from before
it ``metrics.jsonl`` (the logged steps' windows) with ``memory.jsonl``. Per (shape, B, checkpointed blocks) of the
steps > 1: micro-steps, mean compute ms and model FLOPs over compute time as a share of the GPU's dense bf16
peak (the summary's ``peak_tflops``; recompute not counted, as the summary's MFU). The summary's MFU is this over the
whole step's wall, which also holds the loop's time outside the compute windows (``bench/training/loop_overheads.py``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ds_adaptive.calibration.trainer_runs import micro_batch_mfu  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    tables = [micro_batch_mfu(Path(d)) for d in a.runs]
    for t in tables:
        print(f"{t['run']}  (summary MFU {100 * (t['summary_mfu'] or 0):.1f}%)")
        print(f"  {'shape':<13} {'B':>3} {'ckpt':>4} {'micro':>5} {'compute ms':>10} {'MFU':>6}")
        for r in t["rows"]:
            print(f"  {r['shape']:<13} {r['B']:>3} {r['ckpt_blocks']:>4} {r['micro_steps']:>5} "
                  f"{r['compute_ms']:>10.0f} {100 * r['mfu']:>5.1f}%")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(tables, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
