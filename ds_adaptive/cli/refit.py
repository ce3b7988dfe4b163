"""``ds-adaptive refit``: a profile's compute and training-loop terms refitted to trainer runs' ``compute.jsonl``
(:mod:`ds_adaptive.calibration.refit`), written as a new profile json; ``--plot`` draws predicted / measured.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ds_adaptive.calibration.refit import (RefitError, _check_runs, fit_train_overheads, plot, refit_compute,
                                           trainer_steps, trainer_windows, with_train_overheads)
from ds_adaptive.planning.profile import ProfileError, load_profile


def main(argv=None) -> int:
    import argparse


    p = argparse.ArgumentParser(prog="ds-adaptive refit", description=__doc__.split("\n\n")[0] + ": reads the "
                                "trainer's --log-dir of one-GPU runs, prints each (shape, batch, checkpointed blocks) "
                                "before and after, writes the refitted profile json")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="trainer log dirs (summary.json and compute.jsonl, or "
                   "metrics.jsonl and memory.jsonl), one GPU each")
    p.add_argument("--profile", required=True, help="the profile to refit: shipped name or json")
    p.add_argument("--ln-modulate", choices=("fused", "reference"), default=None,
                   help="the runs' LayerNorm-modulate path (the profile's matching entries are refitted)")
    p.add_argument("--block-fusion", default=None, help="the runs' adaptive_load.block_fusion")
    p.add_argument("--out", default=None, help="write the refitted profile json here (sampler.profile takes it)")
    p.add_argument("--plot", default=None, metavar="PNG", help="plot predicted / measured per micro-batch, before and "
                   "after the refit")
    a = p.parse_args(argv)
    try:
        prof = load_profile(a.profile)
        prof, _ = prof.for_ln_modulate(a.ln_modulate)
        prof, _ = prof.for_block_fusion(a.block_fusion, a.ln_modulate)
        _check_runs(prof, a.runs)
        fit = refit_compute(prof, [w for d in a.runs for w in trainer_windows(d)])
        steps = [s for d in a.runs for s in trainer_steps(d)]
    except (RefitError, ProfileError, ValueError) as exc:
        print(f"ds-adaptive refit: error: {exc}", file=sys.stderr)
        return 2
    out = fit.profile
    try:
        loop = fit_train_overheads(steps)
        out = with_train_overheads(out, loop, a.runs)
        loop_line = (f"training loop (outside the compute windows, {loop['steps']} steps): "
                     f"{loop['micro_step_ms']:.1f} ms per micro-step + {loop['optimizer_step_ms']:.1f} ms per step "
                     f"(the profile's: {prof.micro_step_overhead_ms:.1f} + {prof.optimizer_step_overhead_ms:.1f})")
    except RefitError as exc:
        loop_line = f"training loop: the profile's terms kept ({exc})"
    print(f"{'shape':>12} {'B':>4} {'ckpt':>4} {'windows':>7} {'measured ms':>11} {'before':>7} {'after':>7}")
    for r in fit.rows:
        print(f"{r['shape']:>12} {r['batch']:>4} {r['ckpt_blocks']:>4} {r['windows']:>7} {r['measured_ms']:>11.1f} "
              f"{r['before']:>7.3f} {r['after']:>7.3f}")
    e, t = fit.errors(), fit.terms
    print(f"predicted / measured: max |err| {e['before']['max']:.1%} -> {e['after']['max']:.1%}, mean "
          f"{e['before']['mean']:.1%} -> {e['after']['mean']:.1%}; no block checkpointed: c0 {t['c0_ms']:.2f} ms, "
          f"a {t['a_ms_per_token']:.4g} ms/token, b {t['b_ms_per_token2']:.4g} ms/token^2, recompute x"
          f"{t['recompute_scale']:.3f}")
    print(loop_line)
    if a.plot:
        plot(fit, a.plot)
        print(f"wrote {a.plot}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out.raw, indent=1) + "\n")
        print(f"wrote {a.out}: set sampler.profile to it, or ship it in a profile json as its block-fusion variant "
              f"(python -m ds_adaptive.calibration.autocalibrate ship {a.out} PROFILE.json --replace)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
