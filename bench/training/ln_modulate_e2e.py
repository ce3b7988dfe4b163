"""The default job with and without the fused LayerNorm-modulate op, on the SAME plan.

With ``profile: auto`` and ``m_comp`` / ``gradient_accumulation_steps: auto`` each path plans with its
own calibration (the fused op is cheaper and holds less memory), so the two runs train different
micro-batches and their tokens/s mix the op's effect with the planner's. This benchmark pins the plan:

    python bench/training/ln_modulate_e2e.py prepare --dir D
        writes D/profile.json (the shipped H200 1.3B profile with its *reference* entries, the path that
        holds more memory, so the plan is safe for both paths) and D/config.json (zero3_adaptive.json with
        that profile and metrics every step; m_comp / gas stay ``auto``: the search is a pure function of
        profile, data and config, so both arms get the same budget, gas and micro-batches)
    python -m ds_adaptive.cli.train --deepspeed_config D/config.json ... --fused-ln-modulate    --log-dir RUNS/op
    python -m ds_adaptive.cli.train --deepspeed_config D/config.json ... --no-fused-ln-modulate --log-dir RUNS/ref
    python bench/training/ln_modulate_e2e.py report --runs RUNS --out JSON

``report`` checks that both arms ran the same micro-batches (shape, B, checkpointed blocks, in order; an
error names the first difference) and prints tokens/s and the summed per-micro-step compute of the
steps both arms finished (step 1 excluded: first allocations and kernel builds), with ratios op / ref.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ds_adaptive.calibration import trainer_runs
from ds_adaptive.calibration.trainer_runs import PlanMismatch, load_run
from ds_adaptive.planning.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "ds_adaptive" / "planning" / "profiles" / "h200-wan2.1-1.3b.json"
CONFIG = ROOT / "launch" / "configs" / "zero3_adaptive.json"


def reference_profile() -> dict:
    """The shipped profile as a run on the reference path plans with it (``Profile.for_ln_modulate``: its
    ``ln_modulate_variants.reference`` entries at top level, no variants left), renamed."""
    prof, _ = load_profile(PROFILE).for_ln_modulate("reference")
    if prof.ln_modulate != "reference":
        raise SystemExit(f"{PROFILE}: no reference entries: nothing to pin the plan to")
    return {**dict(prof.raw), "name": f"{prof.name}-reference-pinned"}


def _auto_or(v: str):
    return v if v == "auto" else (int(v) if v.isdigit() else float(v))


def prepare(d: Path, m_comp: str, gas: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "profile.json").write_text(json.dumps(reference_profile(), indent=1))
    cfg = json.loads(CONFIG.read_text())
    cfg["gradient_accumulation_steps"] = _auto_or(gas)
    cfg.get("adaptive_load", {}).get("sampler", {}).pop("global_batch", None)  # a pinned A/B: its own gas, not the shipped global batch
    s = cfg["adaptive_load"]["sampler"]
    s["profile"], s["m_comp"] = str(d / "profile.json"), _auto_or(m_comp)
    cfg["adaptive_load"]["metrics"]["interval"] = 1
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    print(f"wrote {d / 'profile.json'} and {d / 'config.json'} (m_comp {m_comp} ms, gas {gas})")


def load(d: Path) -> dict:
    try:
        return load_run(d)
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from exc


def same_plan(op: dict, ref: dict) -> int:
    """Number of common steps; exits on the first micro-batch that differs."""
    try:
        return trainer_runs.same_plan(op, ref)
    except PlanMismatch as exc:
        raise SystemExit(str(exc)) from exc


def report(runs: Path, out: Path) -> dict:
    op, ref = load(runs / "op"), load(runs / "ref")
    last = same_plan(op, ref)
    steps = [k for k in range(2, last + 1) if k in op["steps"] and k in ref["steps"]]
    if not steps:
        raise SystemExit(f"{runs}: no common step after step 1 in metrics.jsonl (metrics interval must be 1)")
    def tot(arm, key):
        return sum(sum(sum(m) for m in arm["steps"][k][key]) for k in steps)
    def wall(arm):
        return sum(arm["steps"][k]["wall_s"] for k in steps)
    tokens = sum(op["steps"][k]["tokens"] for k in steps)
    rows = []
    for name, arm in (("op", op), ("ref", ref)):
        s = arm["summary"]
        rows.append({"arm": name, "ln_modulate": s.get("ln_modulate"), "calls": s.get("ln_modulate_calls"),
                     "steps_compared": len(steps), "tokens": tokens, "wall_s": wall(arm),
                     "tokens_per_s": tokens / wall(arm), "compute_ms": tot(arm, "micro_compute_ms"),
                     "summary_tokens_per_s": s.get("tokens_per_s"), "mfu": s.get("mfu"),
                     "peak_mem_gib": s.get("peak_mem_gib")})
    res = {"steps": steps, "rows": rows,
           "ratio_tokens_per_s": rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"],
           "ratio_compute": rows[1]["compute_ms"] / rows[0]["compute_ms"],
           "micro_batches_compared": sum(len(op["steps"][k]["micro_compute_ms"]) for k in steps)}
    print(f"same plan: {res['micro_batches_compared']} micro-batches in steps {steps[0]}-{steps[-1]}, "
          f"{tokens} tokens")
    print(f"{'arm':4} {'path':10} {'tok/s':>8} {'wall s':>8} {'compute s':>10} {'summary tok/s':>14} {'MFU':>6} {'peak GiB':>9}")
    for r in rows:
        print(f"{r['arm']:4} {str(r['ln_modulate']):10} {r['tokens_per_s']:8.0f} {r['wall_s']:8.1f} "
              f"{r['compute_ms'] / 1e3:10.1f} {r['summary_tokens_per_s'] or 0:14.0f} {100 * (r['mfu'] or 0):5.1f}% "
              f"{r['peak_mem_gib'] or 0:9.2f}")
    print(f"op / ref: tokens/s {res['ratio_tokens_per_s']:.3f}x, compute {res['ratio_compute']:.3f}x faster")
    out.write_text(json.dumps(res, indent=1))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--dir", type=Path, required=True)
    a.add_argument("--m-comp", default="auto", help="compute budget, ms, or auto (default; a fixed budget makes "
                   "samples over it an error: only the auto search runs them alone)")
    a.add_argument("--gas", default="auto", help="micro-steps per optimizer step, or auto (default)")
    b = sub.add_parser("report")
    b.add_argument("--runs", type=Path, required=True, help="directory with the arms' log dirs op/ and ref/")
    b.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.dir, args.m_comp, args.gas)
    else:
        report(args.runs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
