"""Planning speed: one optimizer step for 1024 GPUs on one CPU core (target <= 50 ms, median).

    python bench/planner/plan_speed.py [--world 1024] [--sp 1] [--repeats 7] [--json bench/out/plan_speed.json]

Plans an epoch of the shipped Wan mix sized for ~--steps optimizer steps (dual, calibrated H100
1.3B profile, auto budgets) and reports the time per optimizer step (epoch planning time / steps),
median over repeats; the process is pinned to one core.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ds_adaptive.core.config import SamplerConfig  # noqa: E402
from ds_adaptive.planning.sampler import build_batch_sampler  # noqa: E402
from ds_adaptive.core.layout import Layout  # noqa: E402
from ds_adaptive.core.shapes import load_shape_distribution  # noqa: E402
from ds_adaptive.simulation.simulate import draw_shapes  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--sp", type=int, default=1)
    ap.add_argument("--ga", type=int, default=1, help="micro-steps per optimizer step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--mode", default="dual", choices=["dual", "tokens", "fixed"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    dp = args.world // args.sp
    cfg = SamplerConfig(mode=args.mode)
    # ~10 samples per batch on average for dual on this mix: size the epoch for --steps steps
    n = dp * args.ga * args.steps * 11
    shapes = draw_shapes(load_shape_distribution(), n, 0)
    times, steps = [], 0
    for rep in range(args.repeats):
        s = build_batch_sampler(cfg, shapes, Layout.explicit(dp_size=dp, sp_size=args.sp), micro_steps_per_step=args.ga)
        s.set_epoch(rep)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = s.plan
        dt = time.perf_counter() - t0
        steps = plan.num_steps
        times.append(dt / steps * 1e3)
    med = statistics.median(times)
    res = {"world": args.world, "sp": args.sp, "dp": dp, "ga": args.ga, "mode": args.mode, "samples": n,
           "steps_per_plan": steps, "ms_per_step_median": med, "ms_per_step_all": times,
           "cpu_cores": 1, "target_ms": 50.0}
    print(f"{args.mode}: {args.world} GPUs (dp {dp}, sp {args.sp}, ga {args.ga}): {n} samples -> {steps} steps; "
          f"planning {med:.1f} ms per optimizer step (median of {args.repeats}; min {min(times):.1f}, "
          f"max {max(times):.1f}) on one core; target <= 50 ms: {'met' if med <= 50 else 'NOT met'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if med <= 50 else 1


if __name__ == "__main__":
    sys.exit(main())
