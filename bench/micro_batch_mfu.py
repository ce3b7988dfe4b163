"""MFU of each micro-batch's compute window in recorded trainer runs (CPU, no GPU needed): where a run's MFU goes.

    python bench/micro_batch_mfu.py RUN_DIR [RUN_DIR ...] [--out bench/out/micro_batch_mfu.json]

A run directory is a one-GPU trainer log dir, read by ``ds_adaptive.calibration.refit.trainer_windows``:
``compute.jsonl`` (every micro-step's shape, B, checkpointed blocks and compute window), or for runs from before
it ``metrics.jsonl`` (the logged steps' windows) with ``memory.jsonl``. Per (shape, B, checkpointed blocks) of the
steps > 1: micro-steps, mean compute ms and model FLOPs over compute time as a share of the GPU's dense bf16
peak (the summary's ``peak_tflops``; recompute not counted, as the summary's MFU). The summary's MFU is this over the
whole step's wall, which also holds the loop's time outside the compute windows (``bench/loop_overheads.py``).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_table(d: Path) -> dict:
    from ds_adaptive.calibration.refit import trainer_windows
    from ds_adaptive.models import get_model

    summary = json.loads((d / "summary.json").read_text())
    model = get_model(summary["model"])
    cfg = model.config(num_layers=summary.get("layers"))
    peak = float(summary["peak_tflops"]) * 1e12
    agg: dict[tuple, list] = defaultdict(lambda: [0.0, 0.0, 0])
    for w in trainer_windows(d):   # the run's logged steps after the warm-up, one window per micro-step
        flops = model.flops(cfg, int(w.shape.tokens), w.batch, 0)
        a = agg[(str(w.shape), w.batch, w.ckpt_blocks)]
        a[0] += float(flops[0] if isinstance(flops, tuple) else flops)
        a[1] += w.ms
        a[2] += 1
    rows = [{"shape": k[0], "B": k[1], "ckpt_blocks": k[2], "micro_steps": n, "compute_ms": ms / n,
             "mfu": f / (ms * 1e-3) / peak} for k, (f, ms, n) in sorted(agg.items())]
    return {"run": str(d), "summary_mfu": summary.get("mfu"), "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    tables = [run_table(Path(d)) for d in a.runs]
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
