"""Predicted vs measured per-micro-batch peak memory of a recorded run (a trainer's
memory.jsonl), recomputed on the CPU with a profile's LayerNorm-modulate entries: the profile's
``reference`` entries and its ``fused`` entries (Profile.for_ln_modulate), same static memory as the run
logged. Prints a table of predicted/measured ratios per micro-batch and writes JSON.

    python bench/memory_recheck.py --memory bench/results/final_x2/train2_memory.jsonl \
        --profile h200-wan2.1-1.3b --out bench/results/mem16b/recheck_final_x2.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import LN_MODULATE_PATHS, load_profile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", required=True, help="a trainer's memory.jsonl")
    ap.add_argument("--profile", required=True, help="profile name or json path")
    ap.add_argument("--sp", type=int, default=1, help="the run's Ulysses degree")
    ap.add_argument("--out", required=True, help="JSON to write")
    args = ap.parse_args()
    rows = [json.loads(line) for line in Path(args.memory).read_text().splitlines() if line.strip()]
    base = load_profile(args.profile)
    costs = {p: CostModel(base.for_ln_modulate(p)[0], "calibrated", sp=args.sp, checkpointing="auto")
             for p in LN_MODULATE_PATHS}
    out_rows = []
    print(f"{'shape':>14} {'B':>3} {'ckpt':>4} {'measured':>9} " + " ".join(f"{p + ' pred':>14} {'ratio':>6}"
                                                                            for p in LN_MODULATE_PATHS))
    for r in rows:
        shape = int(r["tokens"])   # ckpt_memory pads to the sp multiple itself
        rec = {k: r[k] for k in ("step", "micro", "shape", "tokens", "B", "ckpt_blocks", "measured_gib")}
        rec["logged_predicted_gib"] = r["predicted_gib"]
        for p, cost in costs.items():
            pred = r["static_gib"] + float(cost.ckpt_memory(shape, r["B"], r["ckpt_blocks"]))
            rec[f"{p}_predicted_gib"] = pred
            rec[f"{p}_ratio"] = pred / r["measured_gib"]
        out_rows.append(rec)
        print(f"{r['shape']:>14} {r['B']:>3} {r['ckpt_blocks']:>4} {r['measured_gib']:>9.2f} " + " ".join(
            f"{rec[p + '_predicted_gib']:>14.2f} {rec[p + '_ratio']:>6.3f}" for p in LN_MODULATE_PATHS))
    summary = {}
    for p in LN_MODULATE_PATHS:
        ratios = np.array([x[f"{p}_ratio"] for x in out_rows])
        summary[p] = {"min_ratio": float(ratios.min()), "max_ratio": float(ratios.max()),
                      "mean_ratio": float(ratios.mean())}
        print(f"{p:>9}: predicted/measured min {ratios.min():.3f} mean {ratios.mean():.3f} max {ratios.max():.3f}")
    logged = np.array([x["logged_predicted_gib"] / x["measured_gib"] for x in out_rows])
    print(f"   logged: predicted/measured min {logged.min():.3f} mean {logged.mean():.3f} max {logged.max():.3f}")
    summary["logged"] = {"min_ratio": float(logged.min()), "max_ratio": float(logged.max()),
                         "mean_ratio": float(logged.mean())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"memory": args.memory, "profile": args.profile, "summary": summary,
                                          "rows": out_rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
