"""Predicted throughput of the shipped configs' plans under each checkpointing policy (issue 16), from
the H200 calibration, for the trainer's default data (synthetic, 10,000 samples, seed 0, 1 GPU, gas 1).

    python bench/memory_plan.py [--steps 19,200] [--out bench/out/memory_plan.json]

The plans are the ones the trainer forms (same seed, budgets and profile), so their tokens equal the
tokens a GPU run of that many steps trains (bench/RESULTS.md checks 19 steps against the H200 runs).
Predicted time = sum of the plan's batch costs (the cost model: fwd + bwd + recompute; no optimizer
step, data loading or ZeRO-3 communication): a ratio between policies, not a measured speed.
"""
from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

from ds_adaptive.balance.sampler import build_batch_sampler
from ds_adaptive.layout import Layout
from ds_adaptive.config import load_adaptive_config
from ds_adaptive.data import build_dataset

CONFIGS = ("launch/configs/zero3_adaptive.json", "launch/configs/zero3_baseline.json")
H200_GIB = 139.80072021484375


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="19,200")
    ap.add_argument("--profile", default="h200-wan2.1-1.3b")
    ap.add_argument("--out", default="bench/out/memory_plan.json")
    a = ap.parse_args(argv)
    shapes = build_dataset("synthetic", num_samples=10000, shapes=None, seed=0).sample_shapes()
    rows = []
    for path in CONFIGS:
        cfg = load_adaptive_config(path)
        for policy in ("auto", "all"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                s = build_batch_sampler(cfg.sampler.model_copy(update={"profile": a.profile}), shapes, Layout.explicit(dp_size=1),
                                        micro_steps_per_step=1, enabled=cfg.enabled, gpu_mem_gib=H200_GIB,
                                        model_name="wan2.1-1.3b", zero_stage=3, checkpointing=policy)
                s.set_epoch(0)
                plan = s.plan
            for n in (int(x) for x in a.steps.split(",")):
                tok, ms = int(plan.batch_tokens[:n].sum()), float(plan.batch_cost[:n].sum())
                rows.append({"config": Path(path).name, "checkpointing": policy, "steps": n, "tokens": tok,
                             "predicted_s": ms / 1e3, "predicted_tokens_per_s": tok / ms * 1e3,
                             "ckpt_blocks_mean": float(plan.batch_ckpt[:n].mean()), "m_mem_gib": s.params.m_mem,
                             "m_comp_ms": s.params.m_comp})
    print(f"{'config':<20} {'ckpt':<5} {'steps':>5} {'tokens':>10} {'pred s':>8} {'pred tok/s':>10} {'x all':>6} {'n mean':>6}")
    for r in rows:
        ref = next(x for x in rows if x["config"] == r["config"] and x["steps"] == r["steps"]
                   and x["checkpointing"] == "all")
        print(f"{r['config']:<20} {r['checkpointing']:<5} {r['steps']:>5} {r['tokens']:>10} {r['predicted_s']:>8.1f} "
              f"{r['predicted_tokens_per_s']:>10.0f} {r['predicted_tokens_per_s'] / ref['predicted_tokens_per_s']:>6.3f} "
              f"{r['ckpt_blocks_mean']:>6.1f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"profile": a.profile, "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
