"""The budget search's candidates for the default job (CPU, no GPU needed): every candidate ``m_comp`` with its
gradient accumulation, micro-steps and predicted tokens/s, under the profile's training-loop terms or others.

    python bench/planner/budget_candidates.py --out bench/out/budget_candidates.json
    python bench/planner/budget_candidates.py --loop 220 910 --loop 35.4 66.4   (one column per pair of loop terms:
                                                                          ms per micro-step, ms per optimizer step)
    python bench/planner/budget_candidates.py --checkpoint-attention keep   (the config's auto plans both and takes the faster)

A budget under which some shape's largest batch takes more time per sample than a smaller one (it checkpoints more
blocks) is listed twice: as it is and with each shape's batch capped at its lowest time per sample (``capped``).

The trainer's planning on one GPU: ``launch/configs/zero3_adaptive.json``'s sampler (dual, calibrated, m_mem /
m_comp / gas auto), the embedded synthetic dataset (10,000 samples, seed 0), the fused LayerNorm-modulate path and
block fusion ``regions``, on ``--profile`` (default: the shipped H200 1.3B) with ``--gpu-mem-gib`` of memory. It
explains a plan choice; what a plan trains at is the trainer's figure (``launch/train_wan.sh``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ds_adaptive.planning.profile import load_profile  # noqa: E402
from ds_adaptive.simulation.forecast import budget_choices, describe_choices  # noqa: E402


MODEL = "wan2.1-1.3b"
CONFIG = ROOT / "launch" / "configs" / "zero3_adaptive.json"


def job_sampler_config() -> dict:
    """The shipped default job's ``adaptive_load.sampler`` block."""
    return json.loads(CONFIG.read_text())["adaptive_load"]["sampler"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="h200-wan2.1-1.3b")
    p.add_argument("--gpu-mem-gib", type=float, default=139.80072021484375)
    p.add_argument("--samples", type=int, default=10000)
    p.add_argument("--loop", nargs=2, type=float, action="append", metavar=("MICRO_MS", "STEP_MS"),
                   help="training-loop terms to plan with (repeatable; default: the profile's own)")
    p.add_argument("--checkpoint-attention", choices=("auto", "recompute", "keep"), default="auto",
                   help="recompute.attention to plan with (auto: the one predicted faster, as the trainer)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    choices = budget_choices(job_sampler_config(), load_profile(a.profile), a.gpu_mem_gib, a.samples, model_name=MODEL,
                             loops=[tuple(x) for x in a.loop] if a.loop else None,
                             checkpoint_attention=a.checkpoint_attention)
    arms = {n: c for n, (c, _) in choices.items()}
    attention = {n: att for n, (_, att) in choices.items()}
    names = list(arms)
    keys = sorted({(c["m_comp"], c["efficient_batches"]) for n in names for c in arms[n].candidates})
    by = {n: {(c["m_comp"], c["efficient_batches"]): c for c in arms[n].candidates} for n in names}
    print(f"{'m_comp ms':>10} {'capped':>6} {'gas':>4} {'micro-steps':>11} "
          + " ".join(f"{'tok/s at ' + n:>22}" for n in names))
    for key in keys:
        c0 = next(by[n][key] for n in names if key in by[n])
        marks = [f"{by[n][key]['tokens_per_s']:>21,.0f}" if key in by[n] else f"{'-':>21}" for n in names]
        marks = [m + ("*" if (arms[n].m_comp, arms[n].efficient_batches) == key else " ") for m, n in zip(marks, names)]
        print(f"{key[0]:>10.0f} {'yes' if key[1] else '':>6} {c0['micro_steps_per_step']:>4} {c0['micro_steps']:>11} "
              + " ".join(marks))
    for n in names:
        c = arms[n]
        print(f"loop terms {n}, checkpoint_attention {attention[n]}: chosen m_comp {c.m_comp:.0f} ms at gas "
              f"{c.micro_steps_per_step}{', batches capped' if c.efficient_batches else ''} (* above), predicted {c.predicted_tokens_per_s:,.0f} tokens/s, "
              f"{c.predicted_tokens_per_s / c.equal_token_tokens_per_s:.3f}x the equal-token plan")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"profile": a.profile, "arms": describe_choices(choices)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
