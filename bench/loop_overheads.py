"""The training loop's time beyond the calibrated batch cost, fitted over recorded trainer runs (CPU, no GPU needed).

The planner predicts a step as ``sum(batch cost) + micro-steps x micro_step_ms + optimizer_step_ms`` (the profile's
``train_overheads``). This reads trainer runs already recorded under ``bench/results`` (per step: wall time, the
trainer's measured compute window, and each micro-batch's shape, B and checkpointed blocks), re-costs every
micro-batch with a profile's calibrated cost, and prints per run: wall / cost, measured compute / cost, the time
outside the compute window per step and per micro-step; then the least-squares fits of
``wall - cost = m x micro-steps + o`` and ``wall = k cost + m micro-steps + o`` over all runs
(``bench/memory_report.fit_overheads``), and of the time outside the trainer's compute windows,
``wall - compute = m x micro-steps + o`` (:func:`fit_outside`: the loop's own time, free of the cost model's error;
what the profile ships), next to the profile's shipped terms.

    python bench/loop_overheads.py --out bench/results/loop_overheads_h200.json
        (defaults: the two dense arms of bench/results/sparse_train_ab_h200_f5432ae/ at gas 1 and the auto arm
         of bench/results/mem16c/ at gas 6, re-costed with the shipped H200 1.3B profile's fused entries)
    python bench/loop_overheads.py --runs LOGDIR [LOGDIR ...]   (more trainer runs, full depth, same GPU and path)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

RESULTS = ROOT / "bench" / "results"
AB_ARMS = [RESULTS / "sparse_train_ab_h200_f5432ae" / f"{mix}_dense.json" for mix in ("default", "long")]
TRAINER_RUNS = [(RESULTS / "mem16c" / "metrics_adaptive_auto.jsonl", RESULTS / "mem16c" / "mem_adaptive_auto.jsonl")]


def _jsonl(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def ab_rows(path: Path, cost) -> list[dict]:
    """Steps > 1 of a bench/sparse_train_ab.py arm (its ``micro`` rows: tokens, B, checkpointed blocks)."""
    arm = json.loads(path.read_text())["arms"][0]
    micro: dict[int, list] = {}
    for m in arm["micro"]:
        micro.setdefault(m["step"], []).append(float(cost.ckpt_cost(int(m["tokens"]), int(m["B"]), int(m["ckpt"]))))
    return [{"run": path.name, "wall_ms": 1e3 * s["wall_s"], "compute_ms": s["compute_ms"], "micro": len(micro[s["step"]]),
             "cost_ms": sum(micro[s["step"]])} for s in arm["steps"] if s["step"] > 1 and s["step"] in micro]


def trainer_rows(metrics: Path, memory: Path, cost) -> list[dict]:
    """Steps > 1 of a trainer log dir's metrics.jsonl + memory.jsonl (shape, B, checkpointed blocks per micro-step)."""
    micro: dict[int, list] = {}
    for r in _jsonl(memory):
        micro.setdefault(r["step"], []).append(float(cost.ckpt_cost(int(r["tokens"]), int(r["B"]), int(r["ckpt_blocks"]))))
    return [{"run": metrics.parent.name + "/" + metrics.name, "wall_ms": 1e3 * s["wall_s"], "micro": len(micro[s["step"]]),
             "compute_ms": sum(sum(m) for m in s["micro_compute_ms"]), "cost_ms": sum(micro[s["step"]])}
            for s in _jsonl(metrics) if s["step"] > 1 and s["step"] in micro]


def summarize(rows: list[dict]) -> dict:
    n_micro = sum(r["micro"] for r in rows)
    outside = sum(r["wall_ms"] - r["compute_ms"] for r in rows)
    return {"steps": len(rows), "micro_steps_per_step": sorted({r["micro"] for r in rows}),
            "wall_over_cost": sum(r["wall_ms"] for r in rows) / sum(r["cost_ms"] for r in rows),
            "compute_over_cost": sum(r["compute_ms"] for r in rows) / sum(r["cost_ms"] for r in rows),
            "outside_compute_ms_per_step": outside / len(rows), "outside_compute_ms_per_micro_step": outside / n_micro}


def fit_outside(rows: list[dict], runs: Optional[list[str]] = None) -> dict:
    """Least squares of the time outside the compute windows, ``wall - compute = micro x t_micro + t_step``, over
    ``rows`` (of the named ``runs`` only, when given): the training loop's own time per micro-step (the DataLoader,
    the engine's non-boundary ``step()``, host work) and per optimizer step, measured apart from the cost model,
    whose error (the compute windows over the calibrated cost) the fits of ``wall - cost`` book as loop time. The
    fit is ``ds-adaptive refit``'s (:func:`ds_adaptive.calibration.refit.fit_train_overheads`)."""
    from ds_adaptive.calibration.refit import RefitError, fit_train_overheads

    use = [r for r in rows if runs is None or r["run"] in runs]
    try:
        fit = fit_train_overheads(use)
    except RefitError as exc:
        return {"note": str(exc)}
    return {"steps": len(use), "runs": sorted({r["run"] for r in use}), "micro_step_ms": fit["micro_step_ms"],
            "optimizer_step_ms": fit["optimizer_step_ms"],
            "compute_over_cost": float(sum(r["compute_ms"] for r in use) / sum(r["cost_ms"] for r in use))}


def main(argv=None) -> int:
    from ds_adaptive.planning.cost import CostModel
    from ds_adaptive.planning.profile import load_profile
    from memory_report import fit_overheads

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="h200-wan2.1-1.3b")
    p.add_argument("--runs", nargs="*", default=[], metavar="DIR",
                   help="more trainer log dirs (metrics.jsonl + memory.jsonl of a run on the --profile's GPU and path)")
    p.add_argument("--outside-runs", nargs="*", default=None, metavar="NAME",
                   help="fit the time outside the compute windows over these runs only (names as printed; default: "
                        "the --runs, else all)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    prof = load_profile(args.profile).for_ln_modulate("fused")[0]
    cost = CostModel(prof, checkpointing="auto")
    runs = {a.name: ab_rows(a, cost) for a in AB_ARMS}
    extra = [(Path(d) / "metrics.jsonl", Path(d) / "memory.jsonl") for d in args.runs]
    runs.update({f"{m.parent.name}/{m.name}": trainer_rows(m, mem, cost) for m, mem in TRAINER_RUNS + extra})
    table = {name: summarize(rows) for name, rows in runs.items()}
    print(f"{'run':<36} {'steps':>5} {'micro/step':>10} {'wall/cost':>9} {'compute/cost':>12} {'outside ms/step':>15} "
          f"{'/micro':>7}")
    for name, t in table.items():
        print(f"{name:<36} {t['steps']:>5} {str(t['micro_steps_per_step']):>10} {t['wall_over_cost']:>9.3f} "
              f"{t['compute_over_cost']:>12.3f} {t['outside_compute_ms_per_step']:>15.1f} "
              f"{t['outside_compute_ms_per_micro_step']:>7.1f}")
    fit = fit_overheads([r for rows in runs.values() for r in rows])
    names = args.outside_runs or ([f"{Path(d).name}/metrics.jsonl" for d in args.runs] or None)
    outside = fit_outside([{**r, "run": name} for name, rows in runs.items() for r in rows], names)
    if "micro_step_ms" in outside:
        print(f"outside the compute windows ({outside['steps']} steps of {', '.join(outside['runs'])}): "
              f"{outside['micro_step_ms']:.1f} ms x micro-steps + {outside['optimizer_step_ms']:.1f} ms; their compute "
              f"windows run {outside['compute_over_cost']:.3f} x the calibrated cost")
    else:
        print(f"outside the compute windows: {outside['note']}")
    shipped = {"micro_step_ms": prof.micro_step_overhead_ms, "optimizer_step_ms": prof.optimizer_step_overhead_ms}
    print(f"fit over all steps: wall - cost = {fit['micro_step_ms']:.0f} ms x micro-steps + {fit['optimizer_step_ms']:.0f} ms; "
          f"with a free scale: {fit['with_scale']['cost_scale']:.3f} x cost + {fit['with_scale']['micro_step_ms']:.0f} ms x "
          f"micro-steps + {fit['with_scale']['optimizer_step_ms']:.0f} ms")
    print(f"the profile's shipped terms: {shipped['micro_step_ms']:.0f} ms per micro-step, "
          f"{shipped['optimizer_step_ms']:.0f} ms per optimizer step")
    if args.out:
        Path(args.out).write_text(json.dumps({"profile": args.profile, "runs": table, "fit": fit, "outside_fit": outside,
                                              "shipped": shipped},
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
