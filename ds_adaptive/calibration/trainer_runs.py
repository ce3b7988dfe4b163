"""Recorded trainer runs, analysed on the CPU: A/Bs on one pinned plan, MFU per micro-batch, the loop's own time.

A run is a trainer ``--log-dir``: ``summary.json``, ``metrics.jsonl`` (per logged step: tokens, wall seconds,
``micro_compute_ms`` per micro-step, ms) and ``memory.jsonl`` (per micro-step: shape, B, checkpointed blocks), or
``compute.jsonl`` (:func:`ds_adaptive.calibration.refit.trainer_windows`). Everything here is a pure function of
those files and, where a prediction is compared, of a :class:`~ds_adaptive.planning.cost.CostModel`. The
benchmarks in ``bench/training/`` print these tables.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ds_adaptive.calibration.refit import RefitError, fit_train_overheads, trainer_windows
from ds_adaptive.models.registry import get_model
from ds_adaptive.planning.cost import CostModel


class PlanMismatch(ValueError):
    """Two arms of an A/B did not train the same micro-batches (names the first difference)."""


def read_jsonl(path: "str | Path") -> list[dict]:
    """The JSON lines of ``path`` (``[]`` when it does not exist)."""
    p = Path(path)
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def load_run(d: "str | Path") -> dict:
    """A run's summary, its logged steps with compute windows (``{step: record}``) and its micro-steps as
    ``(step, micro, shape, B, checkpointed blocks)``; ``FileNotFoundError`` when the run wrote no summary (it did
    not finish)."""
    d = Path(d)
    s = d / "summary.json"
    if not s.exists():
        raise FileNotFoundError(f"{d}: no summary.json: the arm did not finish (see its log)")
    return {"summary": json.loads(s.read_text()),
            "steps": {r["step"]: r for r in read_jsonl(d / "metrics.jsonl") if "micro_compute_ms" in r},
            "micro": [(m["step"], m["micro"], m["shape"], m["B"], m["ckpt_blocks"])
                      for m in read_jsonl(d / "memory.jsonl")]}


def same_plan(a: dict, b: dict) -> int:
    """The last step both runs (:func:`load_run`) logged; :class:`PlanMismatch` on the first micro-batch that
    differs (step, micro, shape, B, checkpointed blocks)."""
    n = min(len(a["micro"]), len(b["micro"]))
    for x, y in zip(a["micro"][:n], b["micro"][:n]):
        if x != y:
            raise PlanMismatch(f"the arms did not run the same plan: {x} vs {y} (step, micro, shape, B, checkpointed "
                               "blocks): both arms must use the same prepared config and --num-samples")
    return min(max(a["steps"], default=0), max(b["steps"], default=0))


def pinned_ab(runs: "str | Path", arms: Sequence[str]) -> dict:
    """An A/B of trainer arms on one pinned plan (``runs/<arm>`` log dirs; the first arm is the baseline): over
    the steps after step 1 that every arm logged, tokens/s, wall seconds, summed compute (ms), the summary's MFU /
    HFU / peak memory (GiB) and each arm's tokens/s over the first's (``ratio_tokens_per_s``).
    :class:`PlanMismatch` when an arm trained other micro-batches; ``ValueError`` without a common step."""
    runs = Path(runs)
    data = {a: load_run(runs / a) for a in arms}
    last = min(same_plan(data[a], data[arms[0]]) for a in arms)
    steps = [k for k in range(2, last + 1) if all(k in data[a]["steps"] for a in arms)]
    if not steps:
        raise ValueError(f"{runs}: no common step after step 1 in metrics.jsonl (metrics interval must be 1)")
    tokens = sum(data[arms[0]]["steps"][k]["tokens"] for k in steps)
    rows = []
    for a in arms:
        st, s = data[a]["steps"], data[a]["summary"]
        wall = sum(st[k]["wall_s"] for k in steps)
        compute = sum(sum(sum(m) for m in st[k]["micro_compute_ms"]) for k in steps)
        rows.append({"arm": a, "tokens_per_s": tokens / wall, "wall_s": wall, "compute_ms": compute,
                     "summary_tokens_per_s": s.get("tokens_per_s"), "mfu": s.get("mfu"), "hfu": s.get("hfu"),
                     "peak_mem_gib": s.get("peak_mem_gib")})
    for r in rows:
        r["ratio_tokens_per_s"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return {"steps": steps, "tokens": tokens, "rows": rows}


def epoch_figures(d: "str | Path", cost: CostModel) -> dict:
    """An arm that trained one epoch of its own plan (the arms of an A/B whose plans differ): tokens/s over all
    steps (warm-up counted) and over steps >= 2, summed compute (s), the summary's MFU / HFU / peak, and the
    planner's predicted / measured micro-step (``cost``'s batch cost with its checkpointed blocks plus the
    profile's per-micro-step loop time)."""
    d = Path(d)
    data = load_run(d)
    st, s = data["steps"], data["summary"]
    steps = sorted(st)

    def over(ks):
        wall = sum(st[k]["wall_s"] for k in ks)
        tok = sum(st[k]["tokens"] for k in ks)
        return tok, wall, tok / wall if wall else 0.0
    tok_all, wall_all, tps_all = over(steps)
    measured = [ms for k in steps for ms in (sum(m) for m in st[k]["micro_compute_ms"])]
    mem = read_jsonl(d / "memory.jsonl")
    pred = [float(cost.ckpt_cost(int(m["tokens"]), int(m["B"]), int(m["ckpt_blocks"])))
            + cost.profile.micro_step_overhead_ms for m in mem]
    n = min(len(pred), len(measured))
    return {"steps": len(steps), "tokens": tok_all, "wall_s": wall_all, "tokens_per_s": tps_all,
            "tokens_per_s_from_step_2": over(steps[1:])[2], "compute_s": sum(measured) / 1e3,
            "predicted_over_measured_micro_step": sum(pred[:n]) / sum(measured[:n]) if n else None,
            "mfu": s.get("mfu"), "hfu": s.get("hfu"), "peak_mem_gib": s.get("peak_mem_gib"),
            "micro_batches": len(mem),
            "mean_checkpointed_blocks": sum(m["ckpt_blocks"] for m in mem) / len(mem) if mem else None}


def epoch_ratios(rows: dict, base: str, other: str) -> dict:
    """``other`` over ``base`` (:func:`epoch_figures` rows): tokens/s over the epoch and over steps >= 2, and how
    much faster its summed compute is."""
    b, o = rows[base], rows[other]
    return {"tokens_per_s": o["tokens_per_s"] / b["tokens_per_s"],
            "tokens_per_s_from_step_2": o["tokens_per_s_from_step_2"] / b["tokens_per_s_from_step_2"],
            "compute": b["compute_s"] / o["compute_s"]}


def micro_batch_mfu(d: "str | Path") -> dict:
    """MFU of each micro-batch kind's compute windows in a one-GPU run: per (shape, B, checkpointed blocks) of the
    steps after the warm-up, micro-steps, mean compute ms and model FLOPs over compute time as a share of the GPU's
    dense bf16 peak (the summary's ``peak_tflops``; recompute not counted, as the summary's MFU). The summary's
    MFU is this over the whole step's wall, which also holds the loop's time outside the compute windows."""
    d = Path(d)
    summary = json.loads((d / "summary.json").read_text())
    model = get_model(summary["model"])
    cfg = model.config(num_layers=summary.get("layers"))
    peak = float(summary["peak_tflops"]) * 1e12
    agg: dict[tuple, list] = defaultdict(lambda: [0.0, 0.0, 0])
    for w in trainer_windows(d):   # the run's logged steps after the warm-up, one window per micro-step
        flops = model.flops(cfg, int(w.shape.tokens), w.batch, 0)
        a = agg[(str(w.shape), w.batch, w.ckpt_blocks)]
        a[0] += float(flops[0] if isinstance(flops, tuple) else flops)
        a[1] += w.ms
        a[2] += 1
    rows = [{"shape": k[0], "B": k[1], "ckpt_blocks": k[2], "micro_steps": n, "compute_ms": ms / n,
             "mfu": f / (ms * 1e-3) / peak} for k, (f, ms, n) in sorted(agg.items())]
    return {"run": str(d), "summary_mfu": summary.get("mfu"), "rows": rows}


def recost_steps(metrics: "str | Path", memory: "str | Path", cost: CostModel) -> list[dict]:
    """The steps after step 1 of a trainer run, each with its wall and compute window (ms), its micro-steps and
    ``cost``'s batch cost of them (ms; shape, B and checkpointed blocks from ``memory``). Named
    ``<log dir>/<metrics file>``."""
    metrics = Path(metrics)
    micro: dict[int, list] = {}
    for r in read_jsonl(memory):
        micro.setdefault(r["step"], []).append(float(cost.ckpt_cost(int(r["tokens"]), int(r["B"]),
                                                                    int(r["ckpt_blocks"]))))
    return [{"run": metrics.parent.name + "/" + metrics.name, "wall_ms": 1e3 * s["wall_s"], "micro": len(micro[s["step"]]),
             "compute_ms": sum(sum(m) for m in s["micro_compute_ms"]), "cost_ms": sum(micro[s["step"]])}
            for s in read_jsonl(metrics) if s["step"] > 1 and s["step"] in micro]


def recost_ab_arm(path: "str | Path", cost: CostModel) -> list[dict]:
    """:func:`recost_steps` for an arm of ``bench/training/sparse_train_ab.py``'s JSON (its ``micro`` rows: tokens, B,
    checkpointed blocks), named by the file."""
    path = Path(path)
    arm = json.loads(path.read_text())["arms"][0]
    micro: dict[int, list] = {}
    for m in arm["micro"]:
        micro.setdefault(m["step"], []).append(float(cost.ckpt_cost(int(m["tokens"]), int(m["B"]), int(m["ckpt"]))))
    return [{"run": path.name, "wall_ms": 1e3 * s["wall_s"], "compute_ms": s["compute_ms"],
             "micro": len(micro[s["step"]]), "cost_ms": sum(micro[s["step"]])}
            for s in arm["steps"] if s["step"] > 1 and s["step"] in micro]


def step_summary(rows: Sequence[dict]) -> dict:
    """Over re-costed steps: wall / cost, compute window / cost, and the time outside the compute windows per step
    and per micro-step (ms)."""
    n_micro = sum(r["micro"] for r in rows)
    outside = sum(r["wall_ms"] - r["compute_ms"] for r in rows)
    return {"steps": len(rows), "micro_steps_per_step": sorted({r["micro"] for r in rows}),
            "wall_over_cost": sum(r["wall_ms"] for r in rows) / sum(r["cost_ms"] for r in rows),
            "compute_over_cost": sum(r["compute_ms"] for r in rows) / sum(r["cost_ms"] for r in rows),
            "outside_compute_ms_per_step": outside / len(rows), "outside_compute_ms_per_micro_step": outside / n_micro}


def fit_overheads(rows: Sequence[dict]) -> dict:
    """Least squares of ``wall - cost = micro x t_micro + t_step`` and ``wall = k cost + micro t_micro + t_step``
    over re-costed steps (ms): the loop terms with the cost model's error booked as loop time, and with a free
    scale ``k`` on the cost. Needs steps of at least two micro-step counts."""
    if len({r["micro"] for r in rows}) < 2:
        return {"note": "needs arms with different micro-steps per step"}
    wall = np.array([r["wall_ms"] for r in rows])
    cost = np.array([r["cost_ms"] for r in rows])
    micro = np.array([r["micro"] for r in rows], float)
    one = np.ones_like(wall)
    (tm, ts), *_ = np.linalg.lstsq(np.stack([micro, one], 1), wall - cost, rcond=None)
    (k, tm3, ts3), *_ = np.linalg.lstsq(np.stack([cost, micro, one], 1), wall, rcond=None)
    return {"steps": len(rows), "micro_step_ms": float(tm), "optimizer_step_ms": float(ts),
            "with_scale": {"cost_scale": float(k), "micro_step_ms": float(tm3), "optimizer_step_ms": float(ts3)}}


def fit_outside(rows: Sequence[dict], runs: Optional[Sequence[str]] = None) -> dict:
    """Least squares of the time outside the compute windows, ``wall - compute = micro x t_micro + t_step`` (ms),
    over ``rows`` (of the named ``runs`` only, when given): the training loop's own time per micro-step and per
    optimizer step, apart from the cost model's error. The fit is ``ds-adaptive refit``'s
    (:func:`ds_adaptive.calibration.refit.fit_train_overheads`); ``{"note": ...}`` when it cannot be identified."""
    use = [r for r in rows if runs is None or r["run"] in runs]
    try:
        fit = fit_train_overheads(use)
    except RefitError as exc:
        return {"note": str(exc)}
    return {"steps": len(use), "runs": sorted({r["run"] for r in use}), "micro_step_ms": fit["micro_step_ms"],
            "optimizer_step_ms": fit["optimizer_step_ms"],
            "compute_over_cost": float(sum(r["compute_ms"] for r in use) / sum(r["cost_ms"] for r in use))}


def loop_report(ab_arms: Sequence["str | Path"], trainer_runs: Sequence[tuple], cost: CostModel,
                outside_runs: Optional[Sequence[str]] = None) -> dict:
    """The training loop's time beyond the calibrated cost over recorded runs: ``ab_arms`` (sparse A/B arm JSONs)
    and ``trainer_runs`` (``(metrics.jsonl, memory.jsonl)`` pairs), re-costed with ``cost``. Returns per run
    :func:`step_summary` (``runs``), :func:`fit_overheads` over all steps (``fit``), :func:`fit_outside` over
    ``outside_runs`` (``outside_fit``) and the profile's shipped terms (``shipped``, ms)."""
    runs = {Path(a).name: recost_ab_arm(a, cost) for a in ab_arms}
    runs.update({f"{Path(m).parent.name}/{Path(m).name}": recost_steps(m, mem, cost) for m, mem in trainer_runs})
    pr = cost.profile
    return {"runs": {name: step_summary(rows) for name, rows in runs.items()},
            "fit": fit_overheads([r for rows in runs.values() for r in rows]),
            "outside_fit": fit_outside([{**r, "run": name} for name, rows in runs.items() for r in rows], outside_runs),
            "shipped": {"micro_step_ms": pr.micro_step_overhead_ms, "optimizer_step_ms": pr.optimizer_step_overhead_ms}}
