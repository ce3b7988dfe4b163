"""How far apart the dense and sparse arms of ``bench/training/sparse_quality.py`` are: in steps, and against run-to-run noise.

A ratio of last-window losses says little while both curves still fall fast: a lead of a few dozen steps shows up as
a 10% gap. This reads the runs' JSON (``ds_adaptive.simulation.curves.analyze``) (``history``: per-step training loss, held-out evaluations) and reports

* **steps to loss**: for loss levels the dense arm reaches in its last 20% of steps, the first step at which each
  arm's smoothed training loss (centred moving average, ``--smooth`` steps) is at or below the level; ``lead`` =
  dense step - sparse step (> 0: the sparse arm got there earlier), median and range over the levels;
* **slope**: how fast the dense arm's smoothed loss still falls over that window (loss per 100 steps), and the
  last-window gap expressed in steps of that slope;
* **repeat spread** (two or more JSONs of the same arguments and seed): per arm, the relative difference of the
  last-20% training and held-out losses between the repeats: the noise floor of the ratio (GPU kernels are not
  bitwise deterministic; a fast-falling phase amplifies the difference).

    python bench/training/sparse_quality_curves.py bench/results/sparse/sparse_quality_seed0_h200_fc3f12b.json \\
        bench/results/sparse/sparse_quality_seed0_h200_60ad62d.json --out bench/out/sparse_quality_curves.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ds_adaptive.simulation.curves import ARMS, analyze  # noqa: E402

def print_report(res: dict) -> None:
    print("| run | commit | seed | train sparse/dense | held-out sparse/dense | dense still falls (per 100 steps) | "
          "gap in dense-slope steps | sparse lead, steps (median, range) |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in res["runs"]:
        gs = r["gap_in_steps_of_dense_slope"]
        print(f"| {Path(r['file']).name} | {r['commit']} | {r['seed']} | {r['train_ratio']:.4f} | {r['eval_ratio']:.4f} | "
              f"{r['dense_drop_per_100_steps']:.3f} | {gs if gs is None else round(gs)} | "
              f"{r['lead_median']} ({r['lead_range']}) |")
    rs = res.get("repeat_spread")
    if rs:
        print(f"\nrepeats of the same arguments and seed (commits {', '.join(map(str, rs['commits']))}): "
              "last-20% spread between runs")
        for arm, v in ((a, rs[a]) for a in ARMS):
            print(f"  {arm:6}: training {100 * v['train_rel_spread']:.1f}%, held-out {100 * v['eval_rel_spread']:.1f}% "
                  f"(training {', '.join(f'{x:.4f}' for x in v['train_last20'])}; "
                  f"held-out {', '.join(f'{x:.4f}' for x in v['eval_last20'])})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="sparse_quality.py JSON files (one per run)")
    p.add_argument("--smooth", type=int, default=25, help="moving-average window of the training loss, steps")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    res = analyze(args.runs, args.smooth)
    print_report(res)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
