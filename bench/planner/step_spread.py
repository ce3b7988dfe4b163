"""Samples per optimizer step against the global batch: how far single steps stray from it, with and without
``sampler.global_batch.micro_step_share`` (docs/SCALE.md).

    taskset -c 0 python bench/planner/step_spread.py [--shares none,0.5] [--out bench/out/step_spread.json]

Each case plans one whole epoch as ``ds-adaptive simulate --config`` does (the shipped config of the model, its
shipped mix drawn with seed 0, the profile named by the case), once per share; the table gives the steps' min /
median / max samples (every step, the epoch's last one with its leftover samples too) and the plan's predicted
tokens/s.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from ds_adaptive.simulation import epoch as sim

ROOT = Path(__file__).resolve().parents[2]
#: (config, model, profile, GPUs, samples, global batch, GPU memory GiB or None for the profile's)
CASES = (("zero3_adaptive_ti2v5b.json", "wan2.2-ti2v-5b", "h200-wan2.2-ti2v-5b", 1, 10_000, 32, 139.8),
         ("zero3_adaptive.json", "wan2.1-1.3b", "h200-wan2.1-1.3b", 1, 10_000, 64, 139.8),
         ("zero3_adaptive.json", "wan2.1-1.3b", "h200-wan2.1-1.3b", 8, 10_000, 64, 139.8),
         ("zero3_adaptive.json", "wan2.1-1.3b", "h200-wan2.1-1.3b", 8, 20_000, 256, 139.8),
         ("zero3_adaptive.json", "wan2.1-1.3b", "h100-wan2.1-1.3b", 1024, 1_000_000, 8192, None))


def run_case(case, share, tmp: Path) -> dict:
    config, model, profile, world, n, gb, mem = case
    d = json.loads((ROOT / "launch/configs" / config).read_text())
    d["adaptive_load"]["sampler"]["global_batch"] = {"samples": gb, "micro_step_share": share}
    path = tmp / f"{Path(config).stem}_{gb}_{share}.json"
    path.write_text(json.dumps(d))
    t0 = time.perf_counter()
    out = sim.simulate_epoch(str(path), world=world, num_samples=n, model=model, profile=profile, gpu_mem_gib=mem,
                             baseline=False)
    s = out["samples_per_step"]
    return {"config": config, "model": model, "profile": profile, "world": world, "num_samples": n,
            "global_batch": gb, "micro_step_share": share, "micro_steps_per_step": out["micro_steps_per_step"],
            "m_comp": out["m_comp"], "steps": out["optimizer_steps"], **s,
            "predicted_tokens_per_s": out["dual"]["predicted_tokens_per_s"], "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shares", default="none,0.5", help="comma-separated micro_step_share values (none: no limit)")
    ap.add_argument("--out", default="bench/out/step_spread.json")
    args = ap.parse_args()
    shares = [None if x.strip().lower() in ("none", "null") else float(x) for x in args.shares.split(",")]
    rows = []
    print(f"{'model':16} {'GPUs':>5} {'G':>6} {'share':>6} {'gas':>4} {'min':>7} {'median':>8} {'max':>7} "
          f"{'tokens/s':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            for share in shares:
                r = run_case(case, share, Path(tmp))
                rows.append(r)
                print(f"{r['model']:16} {r['world']:>5} {r['global_batch']:>6} {str(share):>6} "
                      f"{r['micro_steps_per_step']:>4} {r['min']:>7,} {r['median']:>8,.0f} {r['max']:>7,} "
                      f"{r['predicted_tokens_per_s']:>12,.0f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
