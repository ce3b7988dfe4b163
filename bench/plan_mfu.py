"""Predicted MFU of the default job's first steps under the budget search's plan (CPU, no GPU needed): each planned
micro-batch's model FLOPs (as the trainer counts them) over the plan's predicted time (calibrated cost with the
checkpoint plan, plus the training loop's terms), for sampler settings side by side.

    python bench/plan_mfu.py                                     (the shipped settings and the plans before them)
    python bench/plan_mfu.py --arm "before:checkpoint_attention=recompute,batch_cap=off" --arm "head:"
    python bench/plan_mfu.py --run bench/results/default_job_h200_2f0fcdc \\
        --arm "2f0fcdc:checkpoint_attention=recompute,batch_cap=off"   (a measured run beside the plan it ran)

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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DEFAULT_ARMS = ("recompute:checkpoint_attention=recompute,batch_cap=off",
                "keep:checkpoint_attention=keep,batch_cap=off",
                "shipped:")


def parse_arm(text: str) -> tuple[str, dict]:
    """``NAME:key=value,...`` (sampler block overrides) -> (NAME, overrides)."""
    name, _, rest = text.partition(":")
    if not name:
        raise SystemExit(f"plan_mfu: --arm {text!r}: expected NAME:key=value,... (NAME not empty)")
    over = {}
    for item in filter(None, rest.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise SystemExit(f"plan_mfu: --arm {text!r}: expected key=value, got {item!r}")
        over[k.strip()] = v.strip()
    return name, over


def plan_mfu(sampler, first: int, last: int, peak_tflops: float, truth=None) -> dict:
    """Predicted totals of plan steps ``first..last`` (0-based, inclusive): tokens, samples, model and hardware
    FLOPs, predicted seconds (micro-steps' costliest batch + the loop's terms), MFU / HFU, checkpointed blocks per
    token. ``truth``: a profile to time the plan with instead of the one it was made with (e.g. one refitted to
    the trainer's windows, ``bench/compute_refit.py``)."""
    from ds_adaptive.planning.budget import predicted_times
    from ds_adaptive.planning.cost import CostModel
    from ds_adaptive.models.registry import get_model

    plan, cost = sampler.plan, sampler.cost
    if truth is not None:
        cost = CostModel(truth, cost.mode, p=cost.p, sp=cost.sp, num_heads=cost.num_heads,
                         checkpointing=cost.checkpointing, checkpoint_attention=cost.checkpoint_attention)
    preset = get_model("wan2.1-1.3b")
    cfg = preset.config(num_layers=cost.profile.num_layers)
    gas, dp = plan.micro_steps_per_step, plan.dp_size
    last = min(last, plan.num_steps - 1)
    lo, hi = first * gas * dp, (last + 1) * gas * dp
    sizes, tokens = plan.batch_sizes()[lo:hi], plan.batch_tokens[lo:hi]
    ckpt = plan.batch_ckpt[lo:hi]
    kept = cost.checkpoint_attention == "keep"
    flops = np.array([preset.flops(cfg, int(t // b), int(b), int(n), kept_attention=kept)
                      for t, b, n in zip(tokens.tolist(), sizes.tolist(), ckpt.tolist())])
    t = predicted_times(plan, cost)[first * gas:(last + 1) * gas]
    n_steps = last - first + 1
    ms = float(t.max(axis=1).sum()) + n_steps * gas * cost.profile.micro_step_overhead_ms \
        + n_steps * cost.profile.optimizer_step_overhead_ms
    den = ms / 1e3 * dp * peak_tflops * 1e12
    return {"m_comp_ms": sampler.params.m_comp, "gas": gas, "batch_cap": sampler.params.efficient_batches,
            "checkpoint_attention": cost.checkpoint_attention, "steps": n_steps, "samples": int(sizes.sum()),
            "tokens": int(tokens.sum()), "predicted_s": ms / 1e3, "tokens_per_s": float(tokens.sum()) / ms * 1e3,
            "mfu": float(flops[:, 0].sum()) / den, "hfu": float(flops[:, 1].sum()) / den,
            "ckpt_blocks_per_token": float((ckpt * tokens).sum() / tokens.sum())}


def main(argv=None) -> int:
    from budget_candidates import default_job_sampler

    from ds_adaptive.planning.profile import load_profile

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
        from ds_adaptive.planning.profile import ProfileError

        try:
            truth = load_profile(a.truth)
        except ProfileError as exc:
            print(f"plan_mfu: --truth {a.truth}: {exc}", file=sys.stderr)
            return 2
    rows = {}
    for text in a.arm or DEFAULT_ARMS:
        name, over = parse_arm(text)
        s = default_job_sampler(profile, a.gpu_mem_gib, a.samples, **over)
        all_tokens = int(s.plan.batch_tokens[:a.steps * s.plan.micro_steps_per_step * s.plan.dp_size].sum())
        rows[name] = {"overrides": over, "job_tokens": all_tokens,
                      **plan_mfu(s, a.warmup, a.steps - 1, a.peak_tflops, truth)}
    runs = []
    for d in a.run:
        path = Path(d) / "summary.json"
        if not path.is_file():
            print(f"plan_mfu: --run {d}: no summary.json there; pass a run's --log-dir", file=sys.stderr)
            return 2
        s = json.loads(path.read_text())
        match = next((n for n, r in rows.items() if r["job_tokens"] == s["tokens"]), None)   # all steps' tokens
        runs.append({"run": d, "tokens": s["tokens"], "mfu": s["mfu"], "tokens_per_s": s["tokens_per_s"], "arm": match,
                     "measured_over_predicted_mfu": s["mfu"] / rows[match]["mfu"] if match else None})
    print(f"{'arm':>16} {'m_comp ms':>9} {'gas':>3} {'cap':>3} {'attention':>9} {'samples':>7} {'tokens':>10} "
          f"{'pred s':>7} {'tok/s':>7} {'MFU':>6} {'HFU':>6} {'ckpt/tok':>8}")
    for n, r in rows.items():
        print(f"{n:>16} {r['m_comp_ms']:>9.0f} {r['gas']:>3} {'yes' if r['batch_cap'] else 'no':>3} "
              f"{r['checkpoint_attention']:>9} {r['samples']:>7} {r['tokens']:>10,} {r['predicted_s']:>7.1f} "
              f"{r['tokens_per_s']:>7,.0f} {r['mfu']:>6.1%} {r['hfu']:>6.1%} {r['ckpt_blocks_per_token']:>8.2f}")
    for r in runs:
        if r["arm"] is None:
            print(f"run {r['run']}: measured MFU {r['mfu']:.1%} over {r['tokens']:,} tokens; no arm planned those "
                  "tokens (other settings or code)")
        else:
            print(f"run {r['run']}: measured MFU {r['mfu']:.1%}, arm {r['arm']} predicted "
                  f"{rows[r['arm']]['mfu']:.1%}: measured / predicted {r['measured_over_predicted_mfu']:.3f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"profile": a.profile, "arms": rows, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
