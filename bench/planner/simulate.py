"""Sampler simulation benchmark: the shipped Wan mix, H100 Wan 1.3B profile, 8-1024 GPUs, sp 1/2/4.

    python bench/planner/simulate.py [--out bench/out] [--steps 40] [--profile h100-wan2.1-1.3b]

Prints dual vs tokens ratios (CV, balance efficiency, predicted tokens/s) measured in the same
run, and writes bench/out/simulate.json and one PNG per configuration (per-micro-step CV and
per-rank load). Targets at 16 GPUs: dual compute_cv_mean <= 0.05 while tokens >= 0.15, and
dual predicted tokens/s >= 1.25x tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ds_adaptive.simulation.simulate import plot, simulate  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--profile", default="h100-wan2.1-1.3b")
    ap.add_argument("--worlds", default="8,16,64,1024")
    ap.add_argument("--sps", default="1,2,4")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    hdr = (f"{'GPUs':>5} {'sp':>3} {'dp':>5} | {'CV tokens':>9} {'CV dual':>8} {'CV paper':>8} | "
           f"{'bal tok':>8} {'bal dual':>8} | {'tok/s dual/tokens':>17} {'paper/tokens':>12} | {'s':>5}")
    print(hdr)
    print("-" * len(hdr))
    ok = True
    for world in (int(w) for w in args.worlds.split(",")):
        for sp in (int(s) for s in args.sps.split(",")):
            if world % sp:
                continue
            t0 = time.perf_counter()
            res = simulate(world=world, sp=sp, steps=args.steps, seed=args.seed, profile=args.profile, keep_plans=True)
            plot(res, str(out / f"simulate_w{world}_sp{sp}.png"))
            res.pop("_plans")
            res.pop("_truth")
            dt = time.perf_counter() - t0
            s = res["samplers"]
            d, t, p = s["dual"], s["tokens"], s["dual_power"]
            res["ratios"] = {"cv_dual_over_tokens": d["compute_cv_mean"] / t["compute_cv_mean"],
                             "balance_dual_over_tokens": d["balance_efficiency"] / t["balance_efficiency"],
                             "tokens_per_s_dual_over_tokens": d["predicted_tokens_per_s"] / t["predicted_tokens_per_s"],
                             "tokens_per_s_paper_over_tokens": p["predicted_tokens_per_s"] / t["predicted_tokens_per_s"]}
            res["wall_s"] = dt
            results.append(res)
            r = res["ratios"]
            print(f"{world:>5} {sp:>3} {res['dp']:>5} | {t['compute_cv_mean']:>9.2%} {d['compute_cv_mean']:>8.2%} "
                  f"{p['compute_cv_mean']:>8.2%} | {t['balance_efficiency']:>8.2%} {d['balance_efficiency']:>8.2%} | "
                  f"{r['tokens_per_s_dual_over_tokens']:>16.2f}x {r['tokens_per_s_paper_over_tokens']:>11.2f}x | {dt:>5.1f}")
            if world == 16:
                ok &= (d["compute_cv_mean"] <= 0.05 and t["compute_cv_mean"] >= 0.15
                       and r["tokens_per_s_dual_over_tokens"] >= 1.25)
    (out / "simulate.json").write_text(json.dumps({"profile": args.profile, "steps": args.steps, "runs": results}, indent=1))
    print(f"\nCV = mean over micro-steps of the CV of per-rank predicted time; paper = dual with S^p (p=1.5).")
    print(f"16-GPU targets (dual CV <= 5%, tokens CV >= 15%, tokens/s >= 1.25x): {'met' if ok else 'NOT met'}")
    print(f"wrote {out / 'simulate.json'} and {len(results)} PNGs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
