"""Report of bench/gpu/gpu_memory.sh's training arms: one table of throughput ratios, peak memory
and MFU, and the predicted-vs-measured peak memory per micro-batch; writes JSON.

    python bench/training/memory_report.py --runs /tmp/runs --out bench/out/memory/memory.json

Each arm is a directory of ``ds_adaptive.cli.train`` logs (``summary.json``, ``memory.jsonl``, and with a
metrics interval of 1 ``metrics.jsonl``); an arm without ``summary.json`` did not finish (its log says why:
time limit or out of memory). With ``metrics.jsonl`` the report adds:

- ``all steps`` tokens/s: every step's tokens over every step's wall time, the first included (the
  summary leaves the warm-up step out). When every arm ran one whole epoch of the same dataset, this
  compares the same samples.
- the training-loop overheads the budget search models (``Profile.micro_step_overhead_ms``,
  ``optimizer_step_overhead_ms``): a least-squares fit over the steps > 1 of all arms of
  ``wall - sum of predicted batch costs = micro_step x micro-steps + optimizer_step`` (two arms with
  different gradient_accumulation_steps make both identifiable), and the same with a free scale on the
  predicted cost (``wall = scale x cost + ...``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ds_adaptive.calibration.trainer_runs import fit_overheads  # noqa: E402

REFERENCE_ARM = "adaptive_all"     # every block checkpointed: the throughput reference


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def load_arm(d: Path) -> dict:
    s = d / "summary.json"
    steps = [r for r in _jsonl(d / "metrics.jsonl") if "wall_s" in r and "step" in r]
    out = {"arm": d.name, "finished": s.exists(), "memory": _jsonl(d / "memory.jsonl"), "steps": steps}
    if s.exists():
        out["summary"] = json.loads(s.read_text())
    return out


def memory_table(rows: list[dict], skip_steps: int = 1) -> list[dict]:
    """Per (shape, B, checkpointed blocks): micro-steps, predicted and measured peak (GiB), max |rel err|.
    The first ``skip_steps`` steps are left out (first-step allocations: optimizer state, workspaces)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["step"] > skip_steps:
            groups.setdefault((r["tokens"], r["shape"], r["B"], r["ckpt_blocks"]), []).append(r)
    out = []
    for (tok, shape, b, n), rs in sorted(groups.items()):
        meas = [r["measured_gib"] for r in rs]
        pred = rs[0]["predicted_gib"]
        errs = [(pred - m) / m for m in meas]
        out.append({"shape": shape, "tokens": tok, "B": b, "ckpt_blocks": n, "count": len(rs),
                    "predicted_gib": pred, "measured_gib_mean": sum(meas) / len(meas), "measured_gib_max": max(meas),
                    "max_abs_rel_err": max(abs(e) for e in errs)})
    return out


def step_costs(arm: dict, profile: str) -> list[dict]:
    """Per step (> 1) of an arm: wall ms, micro-steps and the predicted batch costs' sum (ms), from the
    arm's metrics.jsonl and memory.jsonl (shape, B, checkpointed blocks of each micro-step), with the
    profile's entries of the LayerNorm-modulate path the arm ran (its summary's ``fused_ln_modulate``)."""
    from ds_adaptive.planning.cost import CostModel
    from ds_adaptive.planning.profile import load_profile
    from ds_adaptive.core.shapes import SampleShape

    fused = arm.get("summary", {}).get("fused_ln_modulate")
    prof = load_profile(profile).for_ln_modulate(None if fused is None else "fused" if fused else "reference")[0]
    cost = CostModel(prof, checkpointing="auto")
    by_step: dict[int, list[float]] = {}
    for r in arm["memory"]:
        f, h, w = (int(x) for x in r["shape"].split("x"))
        by_step.setdefault(r["step"], []).append(float(cost.ckpt_cost(SampleShape(f, h, w), r["B"], r["ckpt_blocks"])))
    return [{"step": s["step"], "wall_ms": 1e3 * s["wall_s"], "micro": len(by_step[s["step"]]),
             "cost_ms": sum(by_step[s["step"]])} for s in arm["steps"] if s["step"] > 1 and s["step"] in by_step]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="directory holding one log directory per arm")
    ap.add_argument("--out", required=True, help="JSON to write")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--profile", default="h200-wan2.1-1.3b", help="profile of the predicted costs (default: the "
                    "arm's summary's)")
    a = ap.parse_args(argv)
    arms = [load_arm(d) for d in sorted(Path(a.runs).iterdir()) if d.is_dir()]
    ref = next((x for x in arms if x["arm"] == REFERENCE_ARM and x["finished"]), None)
    ref_tps = ref["summary"]["tokens_per_s"] if ref else None
    print(f"{'arm':<15} {'done':>4} {'steps':>5} {'tok/s':>9} {'x all-ckpt':>10} {'peak GiB':>9} {'peak %':>7} "
          f"{'MFU %':>6} {'HFU %':>6} {'mem err max':>11}")
    for x in arms:
        s = x.get("summary", {})
        tps = s.get("tokens_per_s", 0.0)
        table = memory_table(x["memory"])
        x["memory_table"] = table
        err = max((t["max_abs_rel_err"] for t in table), default=float("nan"))
        ratio = f"{tps / ref_tps:.3f}" if ref_tps and s else "-"
        print(f"{x['arm']:<15} {'yes' if x['finished'] else 'NO':>4} {s.get('steps', 0):>5} {tps:>9.0f} {ratio:>10} "
              f"{s.get('peak_mem_gib', 0):>9.2f} {100 * s.get('peak_mem_frac', 0):>7.1f} {100 * s.get('mfu', 0):>6.1f} "
              f"{100 * s.get('hfu', 0):>6.1f} {err:>11.1%}")
    fit_rows = []
    for x in arms:
        if x["steps"]:
            x["all_steps_tokens_per_s"] = sum(r["tokens"] for r in x["steps"]) / sum(r["wall_s"] for r in x["steps"])
            x["all_steps"] = {"steps": len(x["steps"]), "tokens": sum(r["tokens"] for r in x["steps"]),
                              "wall_s": sum(r["wall_s"] for r in x["steps"])}
            x["step_costs"] = step_costs(x, x.get("summary", {}).get("profile") or a.profile)
            fit_rows += x["step_costs"]
    ref_all = next((x.get("all_steps_tokens_per_s") for x in arms if x["arm"] == REFERENCE_ARM), None)
    for x in arms:
        if "all_steps_tokens_per_s" in x:
            ratio = f"{x['all_steps_tokens_per_s'] / ref_all:.3f}" if ref_all else "-"
            print(f"{x['arm']:<15} all steps (warm-up included): {x['all_steps']['steps']} steps, "
                  f"{x['all_steps']['tokens']} tokens, {x['all_steps']['wall_s']:.1f} s, "
                  f"{x['all_steps_tokens_per_s']:.0f} tok/s, x all-ckpt {ratio}")
    overheads = fit_overheads(fit_rows) if fit_rows else {}
    if overheads:
        print(f"training-loop overheads (fit over steps > 1): {json.dumps(overheads)}")
    for x in arms:
        if not x["memory_table"]:
            continue
        print(f"\n{x['arm']}: predicted vs measured peak memory per micro-batch (steps > 1)")
        print(f"  {'shape':>14} {'B':>4} {'ckpt':>4} {'n':>3} {'pred GiB':>9} {'meas GiB':>9} {'max|err|':>8}")
        for t in x["memory_table"]:
            print(f"  {t['shape']:>14} {t['B']:>4} {t['ckpt_blocks']:>4} {t['count']:>3} {t['predicted_gib']:>9.2f} "
                  f"{t['measured_gib_max']:>9.2f} {t['max_abs_rel_err']:>8.1%}")
    for x in arms:
        x.pop("memory", None)
        x.pop("steps", None)
        if "summary" in x:
            x["summary"].pop("losses", None)
    Path(a.out).write_text(json.dumps({"commit": a.commit, "reference_arm": REFERENCE_ARM, "overheads": overheads,
                                       "arms": arms}, indent=1) + "\n")
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
