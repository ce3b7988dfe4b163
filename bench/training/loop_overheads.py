"""The training loop's time beyond the calibrated batch cost, fitted over recorded trainer runs (CPU, no GPU needed).

The planner predicts a step as ``sum(batch cost) + micro-steps x micro_step_ms + optimizer_step_ms`` (the profile's
``train_overheads``). This reads recorded trainer runs (per step: wall time, the trainer's measured compute window,
and each micro-batch's shape, B and checkpointed blocks), re-costs every micro-batch with a profile's calibrated cost,
and prints per run: wall / cost, measured compute / cost, the time outside the compute window per step and per
micro-step; then the least-squares fits of ``wall - cost = m x micro-steps + o`` and ``wall = k cost + m micro-steps
+ o`` over all runs, and of the time outside the trainer's compute windows, ``wall - compute = m x micro-steps + o``
(the loop's own time, free of the cost model's error; what the profile ships), next to the profile's shipped terms
(``ds_adaptive.calibration.trainer_runs.loop_report``).

    python bench/training/loop_overheads.py --out bench/out/loop_overheads.json
        (defaults: two dense arms of the sparse A/B at gas 1 and one default-job arm at gas 6, recorded on an H200,
         in tests/data/trainer_runs/, re-costed with the shipped H200 1.3B profile's fused entries)
    python bench/training/loop_overheads.py --runs LOGDIR [LOGDIR ...]   (more trainer runs, full depth, same GPU and path)

Prints a table and writes JSON (``--out``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RUNS = ROOT / "tests" / "data" / "trainer_runs"   # recorded H200 runs (the refit's and these fits' test fixtures)
AB_ARMS = [RUNS / "sparse_train_ab_h200_f5432ae" / f"{mix}_dense.json" for mix in ("default", "long")]
TRAINER_RUNS = [(RUNS / "mem16c" / "metrics_adaptive_auto.jsonl", RUNS / "mem16c" / "mem_adaptive_auto.jsonl")]


def main(argv=None) -> int:
    from ds_adaptive.calibration.trainer_runs import loop_report
    from ds_adaptive.planning.cost import CostModel
    from ds_adaptive.planning.profile import load_profile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="h200-wan2.1-1.3b")
    p.add_argument("--runs", nargs="*", default=[], metavar="DIR",
                   help="more trainer log dirs (metrics.jsonl + memory.jsonl of a run on the --profile's GPU and path)")
    p.add_argument("--outside-runs", nargs="*", default=None, metavar="NAME",
                   help="fit the time outside the compute windows over these runs only (names as printed; default: "
                        "the --runs, else all)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    prof = load_profile(args.profile).for_ln_modulate("fused")[0]
    cost = CostModel(prof, checkpointing="auto")
    extra = [(Path(d) / "metrics.jsonl", Path(d) / "memory.jsonl") for d in args.runs]
    names = args.outside_runs or ([f"{Path(d).name}/metrics.jsonl" for d in args.runs] or None)
    res = loop_report(AB_ARMS, TRAINER_RUNS + extra, cost, names)
    fit, outside, shipped = res["fit"], res["outside_fit"], res["shipped"]
    print(f"{'run':<36} {'steps':>5} {'micro/step':>10} {'wall/cost':>9} {'compute/cost':>12} {'outside ms/step':>15} "
          f"{'/micro':>7}")
    for name, t in res["runs"].items():
        print(f"{name:<36} {t['steps']:>5} {str(t['micro_steps_per_step']):>10} {t['wall_over_cost']:>9.3f} "
              f"{t['compute_over_cost']:>12.3f} {t['outside_compute_ms_per_step']:>15.1f} "
              f"{t['outside_compute_ms_per_micro_step']:>7.1f}")
    if "micro_step_ms" in outside:
        print(f"outside the compute windows ({outside['steps']} steps of {', '.join(outside['runs'])}): "
              f"{outside['micro_step_ms']:.1f} ms x micro-steps + {outside['optimizer_step_ms']:.1f} ms; their compute "
              f"windows run {outside['compute_over_cost']:.3f} x the calibrated cost")
    else:
        print(f"outside the compute windows: {outside['note']}")
    print(f"fit over all steps: wall - cost = {fit['micro_step_ms']:.0f} ms x micro-steps + {fit['optimizer_step_ms']:.0f} ms; "
          f"with a free scale: {fit['with_scale']['cost_scale']:.3f} x cost + {fit['with_scale']['micro_step_ms']:.0f} ms x "
          f"micro-steps + {fit['with_scale']['optimizer_step_ms']:.0f} ms")
    print(f"the profile's shipped terms: {shipped['micro_step_ms']:.0f} ms per micro-step, "
          f"{shipped['optimizer_step_ms']:.0f} ms per optimizer step")
    if args.out:
        Path(args.out).write_text(json.dumps({"profile": args.profile, **res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
