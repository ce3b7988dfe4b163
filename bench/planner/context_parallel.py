"""Hybrid context parallelism on paper: per layer the solver's (head-wise x sequence-wise) mesh and its predicted
attention + communication time against Ulysses only, for Wan 2.1 1.3B and 14B (H200 profiles) at 32k-300k tokens
on 8-64 GPUs, at uniform densities (first and last layer dense). Prints one table and the headline (the 14B at
75k and 300k tokens on 16 and 64 GPUs, density 0.1), writes JSON. CPU only, a few seconds; every figure is a
prediction of ``ds_adaptive.planning.context_parallel`` (no GPU has measured hybrid CP yet).

    python bench/planner/context_parallel.py --out bench/out/context_parallel.json
    python bench/planner/context_parallel.py --densities 0.02,0.05,0.1 --inter-node-gbps 50
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ds_adaptive.planning.context_parallel import CPLinks
from ds_adaptive.simulation.context_parallel import context_parallel_report, context_parallel_table

PROFILES = ("h200-wan2.1-1.3b", "h200-wan2.1-14b")
TOKENS = (32760, 75600, 151200, 302400)
GPUS = (8, 16, 32, 64)
HEADLINE = [("h200-wan2.1-14b", t, n) for t in (75600, 302400) for n in (16, 64)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/out/context_parallel.json", help="JSON output path")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--gpus", default=",".join(map(str, GPUS)))
    ap.add_argument("--densities", default="0.1", help="comma-separated uniform densities")
    ap.add_argument("--mode", default="auto", choices=["auto", "sequence"])
    ap.add_argument("--intra-node-gbps", type=float, default=CPLinks.intra_node_gbps)
    ap.add_argument("--inter-node-gbps", type=float, default=CPLinks.inter_node_gbps)
    ap.add_argument("--gpus-per-node", type=int, default=CPLinks.gpus_per_node)
    ap.add_argument("--overlap", type=float, default=CPLinks.query_block_overlap,
                    help="query_block_overlap of the fetch-share estimate")
    args = ap.parse_args(argv)
    links = CPLinks(intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
                    gpus_per_node=args.gpus_per_node, query_block_overlap=args.overlap)
    t0 = time.time()
    reports = [context_parallel_report(profile=p, gpus=int(n), seq_len=int(t), densities=float(d), mode=args.mode,
                                       links=links)
               for d in args.densities.split(",") for p in args.profiles.split(",")
               for t in args.tokens.split(",") for n in args.gpus.split(",")]
    print(context_parallel_table(reports))
    print("\nheadline (14B, density 0.1, auto): predicted step-time gain of the hybrid mesh over Ulysses x DP")
    head = []
    for p, t, n in HEADLINE:
        r = context_parallel_report(profile=p, gpus=n, seq_len=t, densities=0.1, mode="auto", links=links)
        head.append({"profile": p, "tokens": t, "gpus": n, "gain": r["predicted_gain"],
                     "meshes": r["meshes"], "ulysses_degree": r["ulysses_degree"]})
        print(f"  {t:>7} tokens, {n:>2} GPUs: meshes {r['meshes']}, Ulysses degree {r['ulysses_degree']}, "
              f"gain {r['predicted_gain']:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"reports": reports, "headline": head, "seconds": time.time() - t0,
                               "predicted_only": True}, indent=1))
    print(f"wrote {out} ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
