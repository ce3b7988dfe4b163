"""Predicted throughput of the shipped configs' plans under each checkpointing policy, from
the H200 calibration, for the trainer's default data (synthetic, 10,000 samples, seed 0, 1 GPU).

    python bench/planner/memory_plan.py [--steps 30,200] [--num-samples 10000] [--out bench/out/memory_plan.json]

The plans are the ones the trainer forms (same seed, budgets, profile entries of the config's
LayerNorm-modulate path, and ``gradient_accumulation_steps`` of the config: ``auto`` lets the throughput-optimal ``m_comp: auto`` choose it), so their tokens equal the
tokens a GPU run of that many optimizer steps trains. Predicted time = the cost model's batch costs (fwd +
bwd + recompute of the checkpointed blocks) + the profile's per-micro-step and per-optimizer-step
overheads (``ds_adaptive.planning.budget.predicted_time_ms``): a ratio between policies, not a measured speed.
"""
from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

from ds_adaptive.planning.budget import predicted_time_ms
from ds_adaptive.planning.sampler import build_batch_sampler
from ds_adaptive.core.ds_config import load_adaptive_config, read_ds_config
from ds_adaptive.data import build_dataset
from ds_adaptive.core.layout import Layout

CONFIGS = ("launch/configs/zero3_adaptive.json", "launch/configs/zero3_baseline.json")
H200_GIB = 139.80072021484375


def plan_rows(path: str, profile: str, steps: list[int], shapes, dp: int = 1) -> list[dict]:
    """One row per (checkpointing policy, step count) of ``path``'s plan."""
    cfg = load_adaptive_config(path)
    gas = read_ds_config(path).get("gradient_accumulation_steps", 1)
    rows = []
    for policy in ("auto", "all"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s = build_batch_sampler(cfg.sampler.model_copy(update={"profile": profile}), shapes,
                                    Layout.explicit(dp_size=dp), micro_steps_per_step=gas, enabled=cfg.enabled,
                                    gpu_mem_gib=H200_GIB, model_name="wan2.1-1.3b", zero_stage=3, checkpointing=policy,
                                    ln_modulate="fused" if cfg.fused_ln_modulate else "reference")
            s.set_epoch(0)
            plan = s.plan
        for n in steps + [plan.num_steps]:
            n = min(n, plan.num_steps)
            hi = n * plan.micro_steps_per_step * dp
            tok, ms = int(plan.batch_tokens[:hi].sum()), predicted_time_ms(plan, s.cost, n)
            rows.append({"config": Path(path).name, "checkpointing": policy, "steps": n, "epoch": n == plan.num_steps,
                         "gas": plan.micro_steps_per_step, "tokens": tok, "predicted_s": ms / 1e3,
                         "predicted_tokens_per_s": tok / ms * 1e3, "ckpt_blocks_mean": float(plan.batch_ckpt[:hi].mean()),
                         "m_mem_gib": s.params.m_mem, "m_comp_ms": s.params.m_comp,
                         "overheads_ms": {"micro_step": s.cost.profile.micro_step_overhead_ms,
                                          "optimizer_step": s.cost.profile.optimizer_step_overhead_ms,
                                          "source": s.cost.profile.overhead_source}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="30,200")
    ap.add_argument("--profile", default="h200-wan2.1-1.3b")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--num-samples", type=int, default=10000, help="synthetic dataset size (the trainer's --num-samples)")
    ap.add_argument("--out", default="bench/out/memory_plan.json")
    a = ap.parse_args(argv)
    shapes = build_dataset("synthetic", num_samples=a.num_samples, shapes=None, seed=0).sample_shapes()
    steps = [int(x) for x in a.steps.split(",")]
    rows = [r for path in a.configs.split(",") for r in plan_rows(path, a.profile, steps, shapes)]
    print(f"{'config':<20} {'ckpt':<5} {'steps':>6} {'gas':>3} {'m_comp':>7} {'tokens':>10} {'pred s':>8} "
          f"{'pred tok/s':>10} {'x all':>6} {'n mean':>6}")
    for r in rows:
        ref = next(x for x in rows if x["config"] == r["config"] and x["checkpointing"] == "all"
                   and (x["epoch"] if r["epoch"] else x["steps"] == r["steps"]))
        print(f"{r['config']:<20} {r['checkpointing']:<5} {str(r['steps']) + ('e' if r['epoch'] else ''):>6} "
              f"{r['gas']:>3} {r['m_comp_ms'] or 0:>7.0f} {r['tokens']:>10} {r['predicted_s']:>8.1f} "
              f"{r['predicted_tokens_per_s']:>10.0f} {r['predicted_tokens_per_s'] / ref['predicted_tokens_per_s']:>6.3f} "
              f"{r['ckpt_blocks_mean']:>6.1f}")
    print("(steps 'e': the whole epoch; overheads per micro-step / optimizer step: "
          f"{rows[0]['overheads_ms']['micro_step']:.0f} / {rows[0]['overheads_ms']['optimizer_step']:.0f} ms, "
          f"{rows[0]['overheads_ms']['source']})")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"profile": a.profile, "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
