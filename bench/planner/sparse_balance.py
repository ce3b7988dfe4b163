"""Sparsity-aware balancing on paper: dense-cost vs sparse-cost dual planner under sparsity.

For the shipped mixed shape distribution and Wan 2.1 1.3B (H100 profile), 16 and 128 GPUs, sp 1 and 4,
per layer x head densities drawn from 0.02-0.5 (``synthetic_densities``), every arm is timed with the
sparse truth (see ``ds_adaptive.simulation.sparse``). Prints one table of CV and tokens/s ratios
from this run and writes JSON (+ PNG per configuration).

    python bench/planner/sparse_balance.py --out bench/out/sparse_balance      # ~10 s on a laptop core
    python bench/planner/sparse_balance.py --efficiency bench/results/sparse/h200-wan2.1-1.3b-sparse_c5deae0.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ds_adaptive.simulation.sparse import plot, simulate_sparse, table
from ds_adaptive.planning.sparse_cost import load_efficiency

CONFIGS = [(16, 1), (16, 4), (128, 1), (128, 4)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/out/sparse_balance", help="folder for JSON and PNGs")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seeds", default="0,1,2", help="density/data seeds (one draw each)")
    ap.add_argument("--profile", default="h100-wan2.1-1.3b")
    ap.add_argument("--densities", default="synthetic", help="'synthetic' (0.02-0.5) or a density json / metrics.jsonl")
    ap.add_argument("--efficiency", default=None, help="sparse calibration json (default: DSV.md's H100 anchors)")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    eff = load_efficiency(args.efficiency)
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.time()
    results = []
    for world, sp in CONFIGS:
        for seed in seeds:
            r = simulate_sparse(world=world, sp=sp, steps=args.steps, seed=seed, densities=args.densities,
                                efficiency=eff, profile=args.profile, keep_plans=not args.no_plots and seed == seeds[0])
            if "_plans" in r:
                plot(r, str(out / f"sparse_w{world}_sp{sp}.png"))
                r.pop("_plans"), r.pop("_truths")
            print(table(r), flush=True)
            results.append(r)
    hdr = (f"{'GPUs':>5} {'sp':>3} {'seed':>4} {'CV dense-cost':>14} {'CV sparse':>10} {'CV ratio':>9} "
           f"{'tok/s gain':>11} {'vs dense attn':>14} {'placement gain':>15}")
    lines = ["", f"sparse-aware vs dense-cost dual planner, both timed with the sparse truth "
             f"({args.profile}, efficiency: {eff.source})", hdr]
    for r in results:
        s, q = r["samplers"], r["ratios"]
        lines.append(f"{r['world']:>5} {r['sp']:>3} {r['seed']:>4} {s['dense_cost']['compute_cv_mean']:>14.2%} "
                     f"{s['sparse']['compute_cv_mean']:>10.2%} {q['cv_dense_cost_over_sparse']:>8.1f}x "
                     f"{q['tokens_per_s_sparse_over_dense_cost']:>10.3f}x "
                     f"{q['tokens_per_s_sparse_over_dense_attention']:>13.3f}x "
                     + (f"{q['tokens_per_s_placed_over_identity']:>14.3f}x" if "tokens_per_s_placed_over_identity" in q
                        else f"{'-':>15}"))
    worst_sparse = max(r["samplers"]["sparse"]["compute_cv_mean"] for r in results)
    worst_ratio = min(r["ratios"]["cv_dense_cost_over_sparse"] for r in results)
    lines.append(f"targets: sparse-aware CV <= 5% (worst {worst_sparse:.2%}): "
                 f"{'met' if worst_sparse <= 0.05 else 'MISSED'}; dense-cost CV >= 3x sparse-aware "
                 f"(worst {worst_ratio:.1f}x): {'met' if worst_ratio >= 3 else 'MISSED'}  [{time.time() - t0:.0f} s]")
    print("\n".join(lines))
    (out / "sparse_balance.json").write_text(json.dumps({"efficiency": eff.as_dict(), "results": results}, indent=1))
    print(f"wrote {out / 'sparse_balance.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
