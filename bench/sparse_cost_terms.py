"""Where the sparse cost's micro-step prediction goes wrong: the terms of an A/B run, re-predicted by this tree.

Reads a ``bench/sparse_train_ab.py`` result (dense and sparse arms on the same micro-batches) and, per
shape, splits the sparse arm's error ``measured - predicted`` into

* **common**: the dense arm's relative error on the same micro-batches applied to the sparse prediction
  (the calibrated profile vs the trainer, the same in both arms; on the H200 A/B mostly a scale:
  measured ~ 1.10 x predicted + 65 ms);
* **selection**: the runtime's measured selection (CUDA events) minus the cost's;
* **attention + rest**: what is left (the kernel's efficiency curve, the recomputed forwards, any fixed
  cost of the sparse path).

Two predictions: as the run recorded it, and this tree's cost model rebuilt for the run (the profile
``--profile`` at the run's depth and LayerNorm-modulate path, the run's forced density, first and last
layer dense, the sparse backend's shipped curve for the run's GPU, or the curve the run recorded). CPU
only, seconds::

    python bench/sparse_cost_terms.py bench/results/sparse_train_ab_h200/ab_default.json
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def rebuilt_cost(doc: dict, sparse_arm: dict, profile: str):
    """``(dense CostModel, sparse CostModel)`` of this tree for the run of ``doc``."""
    from ds_adaptive.planning.cost import CostModel
    from ds_adaptive.planning.profile import load_profile
    from ds_adaptive.planning.sparse_cost import SparseAttentionCost
    from ds_adaptive.core.contracts import DensityMap, KernelEfficiency
    from ds_adaptive.attention.kernels.triton_configs import shipped_table

    args = doc["args"]
    layers = int(sparse_arm["layers"])
    prof = load_profile(profile).for_ln_modulate("fused" if args.get("fused_ln") else "reference")[0]
    prof = prof.with_num_layers(layers)
    dec = sparse_arm.get("decision")
    if dec:  # recorded by the run: its densities and curve, with this tree's selection and recompute terms
        sparse = SparseAttentionCost.from_description(dec)
        sparse = SparseAttentionCost(sparse.densities, efficiency=sparse.efficiency, block_size=sparse.block_size,
                                     min_blocks=sparse.min_blocks, dense_above=sparse.dense_above)
    else:
        entry = next(e for e in shipped_table()["entries"] if e["device"] == doc["device"])
        c = entry["curve"]
        rho, h = float(args["density"]), prof.num_heads
        dm = DensityMap(tuple((1.0,) * h if i in (0, layers - 1) else (rho,) * h for i in range(layers)),
                        dense_layers=(0, layers - 1))
        sparse = SparseAttentionCost(dm, efficiency=KernelEfficiency(tuple(c["density"]), tuple(c["ratio"])),
                                     min_blocks=1, dense_above=0.6)
    dense = CostModel(prof, checkpointing="auto")
    return dense, dense.with_sparse(sparse)


def terms(doc: dict, profile: str) -> list[dict]:
    arms = {a["arm"]: a for a in doc["arms"]}
    dense_arm, sparse_arm = arms["dense"], arms["sparse"]
    dense, sparse = rebuilt_cost(doc, sparse_arm, profile)
    sel_by_step = {s["step"]: s["select_ms_per_micro"] for s in sparse_arm["steps"]}
    groups = defaultdict(list)
    for a, b in zip(dense_arm["micro"], sparse_arm["micro"]):
        if a["step"] < 2 or a["tokens"] is None:
            continue
        s, n, ck = b["tokens"], b["B"], b["ckpt"]
        sp = sparse.sparse
        groups[(b["shape"], n)].append({
            "Md": a["compute_ms"], "Pd": a["predicted_ms"], "Ms": b["compute_ms"], "Ps_run": b["predicted_ms"],
            "Pd_now": float(dense.ckpt_cost(s, n, ck)), "Ps_now": float(sparse.ckpt_cost(s, n, ck)),
            "sel": sel_by_step.get(b["step"]) or 0.0,
            "sel_now": n * sp.selection_ms(s, 1, sparse.num_heads) + sp.selection_call_ms(s, 1)})
    out = []
    for (shape, n), rs in sorted(groups.items(), key=lambda kv: -sum(r["Ms"] for r in kv[1])):
        t = {k: sum(r[k] for r in rs) for k in rs[0]}
        common = t["Ps_now"] * (t["Md"] / t["Pd_now"] - 1.0)   # the dense arm's error, as a share of the prediction
        selection = t["sel"] - t["sel_now"]
        out.append({"shape": shape, "B": n, "micro_steps": len(rs), "dense_pred_over_measured": t["Pd"] / t["Md"],
                    "sparse_pred_over_measured_run": t["Ps_run"] / t["Ms"], "sparse_pred_over_measured_now": t["Ps_now"] / t["Ms"],
                    "now_over_dense": (t["Ps_now"] / t["Ms"]) / (t["Pd_now"] / t["Md"]),
                    "gap_ms": (t["Ms"] - t["Ps_now"]) / len(rs), "common_ms": common / len(rs),
                    "selection_ms": selection / len(rs), "attention_rest_ms": (t["Ms"] - t["Ps_now"] - common - selection) / len(rs),
                    "select_measured_ms": t["sel"] / len(rs), "select_predicted_ms": t["sel_now"] / len(rs)})
    tot = defaultdict(float)
    for rs in groups.values():
        for r in rs:
            for k, v in r.items():
                tot[k] += v
    out.append({"shape": "all", "B": None, "micro_steps": sum(len(v) for v in groups.values()),
                "dense_pred_over_measured": tot["Pd"] / tot["Md"], "sparse_pred_over_measured_run": tot["Ps_run"] / tot["Ms"],
                "sparse_pred_over_measured_now": tot["Ps_now"] / tot["Ms"],
                "now_over_dense": (tot["Ps_now"] / tot["Ms"]) / (tot["Pd_now"] / tot["Md"]),
                "select_measured_ms": tot["sel"], "select_predicted_ms": tot["sel_now"]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="sparse_train_ab.py json(s) with a dense and a sparse arm")
    ap.add_argument("--profile", default="h200-wan2.1-1.3b", help="the profile the run planned with (profile: auto on an H200)")
    ap.add_argument("--out", default=None, help="write the rows as json")
    args = ap.parse_args(argv)
    allrows = {}
    for path in args.results:
        doc = json.loads(Path(path).read_text())
        rows = allrows[path] = terms(doc, args.profile)
        print(f"\n{path}: predicted / measured micro-step compute (steps 2..N); ms per micro-step")
        print("| shape | B | n | dense | sparse (run) | sparse (this tree) | over dense | gap | common | selection | "
              "attention+rest | selection measured / predicted |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            g = lambda k: f"{r[k]:.0f}" if k in r else "-"  # noqa: E731
            print(f"| {r['shape']} | {r['B'] or ''} | {r['micro_steps']} | {r['dense_pred_over_measured']:.3f} | "
                  f"{r['sparse_pred_over_measured_run']:.3f} | {r['sparse_pred_over_measured_now']:.3f} | "
                  f"{r['now_over_dense']:.3f} | {g('gap_ms')} | {g('common_ms')} | {g('selection_ms')} | "
                  f"{g('attention_rest_ms')} | {r['select_measured_ms']:.1f} / {r['select_predicted_ms']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(allrows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
