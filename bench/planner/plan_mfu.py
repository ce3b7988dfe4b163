"""Predicted MFU of the default job's first steps under the budget search's plan (CPU, no GPU needed): each planned
micro-batch's model FLOPs (as the trainer counts them) over the plan's predicted time (calibrated cost with the
checkpoint plan, plus the training loop's terms), for sampler settings side by side.

    python bench/planner/plan_mfu.py                                     (the shipped settings and the plans before them)
    python bench/planner/plan_mfu.py --arm "before:recompute.attention=recompute,batch_cap=off" --arm "head:"
    python bench/planner/plan_mfu.py --run tests/data/trainer_runs/default_job_h200_2f0fcdc \\
        --arm "2f0fcdc:recompute.attention=recompute,batch_cap=off"   (a measured run beside the plan it ran)

Steps as the trainer's summary counts them: 22 steps, MFU after the first, a warm-up (``--steps``, ``--warmup``).
A run's summary is matched to an arm by its tokens (all steps'); the ratio measured / predicted MFU of a run it ran
is the correction to read the other arms' predictions with. Explains a plan choice; what a plan trains at is the
trainer's figure (``launch/train_wan.sh``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from budget_candidates import MODEL, job_sampler_config  # noqa: E402  (bench/planner/)
from ds_adaptive.planning.profile import load_profile
from ds_adaptive.planning.profile import ProfileError  # noqa: E402
from ds_adaptive.simulation.forecast import default_job_sampler, match_runs, parse_arm, plan_mfu, run_lines  # noqa: E402

DEFAULT_ARMS = ("recompute:recompute.attention=recompute,batch_cap=off",
                "keep:recompute.attention=keep,batch_cap=off",
                "shipped:")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", action="append", metavar="NAME:key=value,...",
                   help="sampler overrides of one arm (repeatable; default: recompute and keep without the batch "
                        "cap, and the shipped settings)")
    p.add_argument("--profile", default="h200-wan2.1-1.3b", help="the profile the arms plan with (name or json)")
    p.add_argument("--truth", default=None, metavar="PROFILE",
                   help="time every plan with this profile instead (e.g. a refit to trainer windows)")
    p.add_argument("--gpu-mem-gib", type=float, default=139.80072021484375)
    p.add_argument("--samples", type=int, default=10000)
    p.add_argument("--steps", type=int, default=22, help="steps of the job (the summary's)")
    p.add_argument("--warmup", type=int, default=1, help="leading steps the summary leaves out")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of one GPU (the summary's)")
    p.add_argument("--run", action="append", default=[], metavar="DIR",
                   help="a measured run (its summary.json) to show beside the arm whose plan has its tokens")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    profile = load_profile(a.profile)
    truth = None
    if a.truth:
        try:
            truth = load_profile(a.truth)
        except ProfileError as exc:
            print(f"plan_mfu: --truth {a.truth}: {exc}", file=sys.stderr)
            return 2
    try:
        arms = [parse_arm(text) for text in a.arm or DEFAULT_ARMS]
    except ValueError as exc:
        print(f"plan_mfu: {exc}", file=sys.stderr)
        return 2
    rows = {}
    for name, over in arms:
        s = default_job_sampler(job_sampler_config(), profile, a.gpu_mem_gib, a.samples, model_name=MODEL, **over)
        all_tokens = int(s.plan.batch_tokens[:a.steps * s.plan.micro_steps_per_step * s.plan.dp_size].sum())
        rows[name] = {"overrides": over, "job_tokens": all_tokens,
                      **plan_mfu(s, a.warmup, a.steps - 1, a.peak_tflops, model_name=MODEL, truth=truth)}
    try:
        runs = match_runs(rows, a.run)
    except FileNotFoundError as exc:
        print(f"plan_mfu: {exc}", file=sys.stderr)
        return 2
    print(f"{'arm':>16} {'m_comp ms':>9} {'gas':>3} {'cap':>3} {'attention':>9} {'samples':>7} {'tokens':>10} "
          f"{'pred s':>7} {'tok/s':>7} {'MFU':>6} {'HFU':>6} {'ckpt/tok':>8}")
    for n, r in rows.items():
        print(f"{n:>16} {r['m_comp_ms']:>9.0f} {r['gas']:>3} {'yes' if r['batch_cap'] else 'no':>3} "
              f"{r['checkpoint_attention']:>9} {r['samples']:>7} {r['tokens']:>10,} {r['predicted_s']:>7.1f} "
              f"{r['tokens_per_s']:>7,.0f} {r['mfu']:>6.1%} {r['hfu']:>6.1%} {r['ckpt_blocks_per_token']:>8.2f}")
    for line in run_lines(runs, rows):
        print(line)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"profile": a.profile, "arms": rows, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
