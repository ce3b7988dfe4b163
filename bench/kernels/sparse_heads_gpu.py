"""Head placement on one GPU: per-rank attention time within an SP group, identity vs balanced.

Under Ulysses (sp ranks) each rank runs attention over the full sequence with heads/sp heads after
the all-to-all. With per-head densities, the rank holding the densest heads is the group's
straggler. For every layer of a density table this times, on one GPU, each rank's head subset
(FlexAttention block-sparse fwd+bwd, per-head densities, 128x128 full blocks) under the identity
placement and under ``ds_adaptive.parallel.placement.balance_heads``, and reports per layer
``max / mean`` of the per-rank times (1.0 = perfectly balanced) and the predicted one from the
density sums.

    python bench/kernels/sparse_heads_gpu.py --densities synthetic --layers 30 --heads 12 --sp 4 --seq-len 32768 \
        --out bench/out/sparse_heads.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from ds_adaptive.calibration.sparse import fwd_bwd_fns, make_block_mask
from ds_adaptive.core.timing import time_ms
from ds_adaptive.parallel.placement import balance_heads, identity_placement, placement_lower_bound, rank_heads, rank_sums
from ds_adaptive.core.contracts import load_densities, synthetic_densities


def analyze(path: str) -> dict:
    """CPU, from a results json: fit rank time = c + k * (summed density of the rank's heads) over every
    (layer, placement, rank) and report the scatter of the measurements around it (the part of the
    per-rank time that no placement by density can balance)."""
    import numpy as np

    d = json.load(open(path))
    x, y = [], []
    for layer in d["layers"]:
        for name in ("identity", "balanced"):
            perm, k = layer[name]["perm"], d["heads"] // d["sp"]
            for r in range(d["sp"]):
                x.append(sum(layer["density"][h] for h in perm[r * k:(r + 1) * k]))
                y.append(layer[name]["rank_ms"][r])
    a = np.c_[np.ones(len(x)), x]
    coef = np.linalg.lstsq(a, np.array(y), rcond=None)[0]
    rel = (a @ coef - np.array(y)) / np.array(y)
    out = {"c_ms": float(coef[0]), "ms_per_density": float(coef[1]), "rel_rms": float(np.sqrt(np.mean(rel ** 2))),
           "rel_max": float(np.abs(rel).max()), "points": len(y)}
    print(f"rank ms = {out['c_ms']:.3f} + {out['ms_per_density']:.3f} x summed density over {out['points']} "
          f"(layer, placement, rank) points: relative scatter rms {out['rel_rms']:.3f}, max {out['rel_max']:.3f}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--analyze", default=None, metavar="JSON", help="no GPU: fit and print the scatter of a results json")
    ap.add_argument("--densities", default="synthetic", help="density json / metrics.jsonl, or 'synthetic'")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sp", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.analyze:
        analyze(args.analyze)
        return 0
    import torch

    dm = (synthetic_densities(args.layers, args.heads, seed=args.seed) if args.densities == "synthetic"
          else load_densities(args.densities))
    k = dm.num_heads // args.sp
    dense, sparse = fwd_bwd_fns(k, args.seq_len, args.head_dim)
    t_dense = time_ms(dense, iters=args.iters)
    rows = []
    t0 = time.time()
    for layer, row in enumerate(dm.density):
        res = {"layer": layer, "density": list(row)}
        for name, perm in (("identity", identity_placement(len(row))), ("balanced", balance_heads(row, args.sp))):
            times = []
            for r in range(args.sp):
                heads = rank_heads(perm, args.sp, r)
                mask = make_block_mask([row[h] for h in heads], args.seq_len, device="cuda", seed=layer * 97 + r)
                times.append(time_ms(lambda: sparse(mask), iters=args.iters))
            sums = rank_sums(row, perm, args.sp)
            res[name] = {"perm": perm, "rank_ms": times, "max_over_mean": max(times) / statistics.mean(times),
                         "predicted_max_over_mean": max(sums) / statistics.mean(sums), "max_ms": max(times)}
        res["bound_max_over_mean"] = placement_lower_bound(row, args.sp) / (sum(row) / args.sp)
        rows.append(res)
        print(f"layer {layer:>2}: identity {res['identity']['max_over_mean']:.3f} "
              f"(pred {res['identity']['predicted_max_over_mean']:.3f}) | balanced "
              f"{res['balanced']['max_over_mean']:.3f} (pred {res['balanced']['predicted_max_over_mean']:.3f}, "
              f"bound {res['bound_max_over_mean']:.3f}) | max rank ms {res['identity']['max_ms']:.2f} -> "
              f"{res['balanced']['max_ms']:.2f}", flush=True)
    summ = {}
    for name in ("identity", "balanced"):
        v = [r[name]["max_over_mean"] for r in rows]
        summ[name] = {"mean": statistics.mean(v), "median": statistics.median(v), "max": max(v),
                      "frac_le_1.05": sum(x <= 1.05 for x in v) / len(v),
                      "sum_max_ms": sum(r[name]["max_ms"] for r in rows)}
    summ["bound_mean"] = statistics.mean(r["bound_max_over_mean"] for r in rows)
    summ["attention_speedup_balanced_vs_identity"] = summ["identity"]["sum_max_ms"] / summ["balanced"]["sum_max_ms"]
    print(f"\nper-rank attention time max/mean over {len(rows)} layers (sp={args.sp}, {k} heads/rank, "
          f"S={args.seq_len}, {torch.cuda.get_device_name(0)}), {time.time() - t0:.0f} s")
    print(f"{'placement':>10} {'mean':>7} {'median':>7} {'max':>7} {'<=1.05':>7} {'sum max-rank ms':>16}")
    for name in ("identity", "balanced"):
        s = summ[name]
        print(f"{name:>10} {s['mean']:>7.3f} {s['median']:>7.3f} {s['max']:>7.3f} {s['frac_le_1.05']:>7.0%} "
              f"{s['sum_max_ms']:>16.1f}")
    print(f"equal-count bound (mean over layers): {summ['bound_mean']:.3f}; group attention time identity / "
          f"balanced: {summ['attention_speedup_balanced_vs_identity']:.3f}x; dense SDPA {k} heads: {t_dense:.2f} ms")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "sp": args.sp, "heads": dm.num_heads,
           "seq_len": args.seq_len, "head_dim": args.head_dim, "densities": dm.source, "dense_ms_per_rank": t_dense,
           "summary": summ, "layers": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
