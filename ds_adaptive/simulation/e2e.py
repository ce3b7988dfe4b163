"""The end-to-end benchmark's analysis (``bench/training/e2e.py`` runs the arms): the four arms, per-arm figures from
the trainer's ``summary.json`` / ``metrics.jsonl``, ratios against the baseline, and the report tables.

Pure functions of the records and plans (no GPU, no process): ``tests/unit/bench/test_e2e_bench.py`` checks them on
synthetic records. Method: docs/E2E.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ds_adaptive.planning.devices import default_profile_name

FORMAT = "ds_adaptive.simulation.e2e/1"



BASE_PROFILE = default_profile_name()



SIM_WORLDS = (8, 16, 64, 1024)



@dataclass(frozen=True)
class Arm:
    name: str
    sampler: str           # "tokens" | "dual"
    fused: bool
    label: str
    sparse: bool = False   # DSV sparse attention at a forced density (bench/training/e2e.py --sparse-density)

    @property
    def enabled(self) -> bool:
        """The baseline is the shipped ``enabled: false`` path (tokens sampler at the same budget)."""
        return not (self.sampler == "tokens" and not self.fused)



ARMS = {a.name: a for a in (
    Arm("baseline", "tokens", False, "tokens + reference LN (baseline)"),
    Arm("adaptive", "dual", True, "dual + fused LN (AdaptiveLoad)"),
    Arm("dual_ref", "dual", False, "dual + reference LN"),
    Arm("tokens_fused", "tokens", True, "tokens + fused LN"),
    Arm("adaptive_sparse", "dual", True, "dual + fused LN + sparse attention (forced density)", sparse=True),
)}



RECORD_KEYS = ("step", "loss", "lr", "samples", "tokens", "wall_s", "cv_step", "cv_step_wall", "compute_cv",
               "idle_frac", "compute_ms", "wall_ms", "micro_compute_ms", "micro_wall_ms", "samples_per_rank",
               "tokens_per_rank", "peak_mem_gib", "mem_capacity_gib", "data_ms")



def compact_record(r: dict) -> dict:
    return {k: r[k] for k in RECORD_KEYS if k in r}



def weighted_tail_mean(losses: Sequence[float], samples: Sequence[int], frac: float = 0.2) -> float:
    """Mean loss per sample over the last ``frac`` of the samples seen, each step's samples carrying
    the step's mean loss (a step straddling the boundary counts with its share inside)."""
    total = float(sum(samples))
    if total <= 0:
        return float("nan")
    start = total * (1 - frac)
    num = den = 0.0
    seen = 0.0
    for loss, n in zip(losses, samples):
        lo, hi = seen, seen + n
        inside = max(0.0, hi - max(lo, start))
        num += inside * loss
        den += inside
        seen = hi
    return num / den if den else float("nan")



def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])



def _cv_rows(rows) -> list[float]:
    out = []
    for r in rows:
        a = np.asarray(r, float)
        out.append(float(a.std() / a.mean()) if a.size > 1 and a.mean() > 0 else 0.0)
    return out



def aggregate_arm(res: dict, plan: dict, warmup_steps: int) -> dict:
    """Figures of one finished arm (``res`` from :func:`run_arm`, ``plan`` from :func:`plan_arm`)."""
    gas = plan["gas"]
    recs = res["records"]
    summ = res["summary"]
    w = min(warmup_steps, max(len(recs) - 1, 0))
    meas = recs[w:]
    wall = sum(r["wall_s"] for r in meas)
    tokens = sum(r["tokens"] for r in meas)
    samples = sum(r["samples"] for r in meas)
    micro_c = [m for r in meas for m in r["micro_compute_ms"]]
    micro_w = [m for r in meas for m in r["micro_wall_ms"]]
    cv_c, cv_w = _cv_rows(micro_c), _cv_rows(micro_w)
    mx = sum(max(m) for m in micro_c)
    idle = sum(max(m) - sum(m) / len(m) for m in micro_c) / mx if mx > 0 else 0.0
    first_micro = w * gas
    pred = plan["predicted_micro_ms"][first_micro:first_micro + len(micro_c)]
    pred_cv = plan["predicted_cv"][first_micro:first_micro + len(micro_c)]
    quad_cv = plan["quad_cv"][first_micro:first_micro + len(micro_c)]
    peak_per_rank = [max(r["peak_mem_gib"][k] for r in recs) for k in range(len(recs[0]["peak_mem_gib"]))]
    cap = recs[-1]["mem_capacity_gib"]
    losses = [r["loss"] for r in recs]
    step_samples = [r["samples"] for r in recs]
    cum = np.cumsum(step_samples).tolist()
    n_ranks = len(recs[0]["compute_ms"])
    seen = sum(step_samples)
    return {
        "arm": res["arm"], "label": res["label"], "ok": True,
        "steps": len(recs), "warmup_steps": w, "measured_steps": len(meas),
        "samples_seen": seen, "tokens_seen": sum(r["tokens"] for r in recs),
        "samples_planned": plan["samples"], "samples_match_plan": seen == plan["samples"],
        "steps_match_plan": len(recs) == plan["steps"],
        "tail_dropped": plan["tail_dropped"], "oversize": plan["oversize"],
        "trainer_plan": summ.get("plan"),
        "ln_modulate_op": summ.get("ln_modulate_op"),
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "step_s_mean": wall / len(meas) if meas else 0.0,
        "train_wall_s": sum(r["wall_s"] for r in recs),
        "process_wall_s": res["process_wall_s"],
        # launcher, imports, process groups, model build, ZeRO-3 init, op load, and shutdown
        "startup_shutdown_s": (res["process_wall_s"] - sum(r["wall_s"] for r in recs)
                               - (summ.get("eval") or {}).get("s", 0.0)),
        "eval_s": (summ.get("eval") or {}).get("s", 0.0),
        "timing": summ.get("timing", "wall"),
        "cv_step": float(np.mean(cv_c)) if cv_c else 0.0,
        "cv_step_wall": float(np.mean(cv_w)) if cv_w else 0.0,
        "cv_step_p90": float(np.quantile(cv_c, 0.9)) if cv_c else 0.0,
        "cv_step_micro": cv_c, "cv_step_wall_micro": cv_w,
        "compute_cv_pred": float(np.mean(pred_cv)) if pred_cv else 0.0,
        "compute_cv_quad": float(np.mean(quad_cv)) if quad_cv else 0.0,
        "idle_frac": idle,
        "compute_ms_per_rank": [float(np.mean([m[k] for m in micro_c])) for k in range(n_ranks)] if micro_c else [],
        "wall_ms_per_rank": [float(np.mean([m[k] for m in micro_w])) for k in range(n_ranks)] if micro_w else [],
        "peak_mem_gib_per_rank": peak_per_rank, "mem_capacity_gib": cap,
        "peak_mem_frac_per_rank": [p / cap for p in peak_per_rank] if cap else [],
        "mem_efficiency": float(np.mean(peak_per_rank) / cap) if cap else 0.0,
        "loss_curve": {"samples_seen": cum, "loss": losses},
        "loss_last20": weighted_tail_mean(losses, step_samples, 0.2),
        "eval_loss": summ.get("eval_loss"),
        "tokens_per_s_steps": [r["tokens"] / r["wall_s"] if r["wall_s"] > 0 else 0.0 for r in recs],
        "step_wall_s": [r["wall_s"] for r in recs],
        "data_ms_max": max(r.get("data_ms", 0.0) for r in meas) if meas else 0.0,
        "predicted": {
            "tokens_per_s": plan_tokens_per_s(plan, w),
            "step_s_mean": float(np.mean(plan["predicted_step_ms"][w:]) / 1e3) if plan["steps"] > w else 0.0,
            "cv_step": float(np.mean(pred_cv)) if pred_cv else 0.0,
            "pearson_batch_cost_vs_compute": pearson([x for m in pred for x in m], [x for m in micro_c for x in m]),
            "pearson_step_max": pearson([max(m) for m in pred], [max(m) for m in micro_c]),
            "measured_over_predicted_step_time": (wall / len(meas)) / (np.mean(plan["predicted_step_ms"][w:]) / 1e3)
            if meas and plan["steps"] > w else float("nan"),
            "micro_max_ms": [max(m) for m in pred], "measured_micro_max_ms": [max(m) for m in micro_c],
        },
    }



def plan_tokens_per_s(plan: dict, warmup_steps: int) -> float:
    t = sum(plan["predicted_step_ms"][warmup_steps:]) / 1e3
    return sum(plan["step_tokens"][warmup_steps:]) / t if t > 0 else 0.0



def ratios(arms: dict, base: str = "baseline") -> dict:
    """Per arm: figure / baseline's (loss: relative difference)."""
    b = arms.get(base)
    if not b or not b.get("ok"):
        return {}
    out = {}
    for name, a in arms.items():
        if not a.get("ok"):
            continue
        r = {"tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else float("nan"),
             "samples_per_s": a["samples_per_s"] / b["samples_per_s"] if b["samples_per_s"] else float("nan"),
             "train_wall_s": a["train_wall_s"] / b["train_wall_s"] if b["train_wall_s"] else float("nan"),
             "cv_step": a["cv_step"] / b["cv_step"] if b["cv_step"] else float("nan"),
             "max_peak_mem": max(a["peak_mem_gib_per_rank"]) / max(b["peak_mem_gib_per_rank"]),
             "mem_efficiency": a["mem_efficiency"] / b["mem_efficiency"] if b["mem_efficiency"] else float("nan"),
             "loss_last20_rel_diff": (a["loss_last20"] - b["loss_last20"]) / b["loss_last20"]}
        if a.get("eval_loss") is not None and b.get("eval_loss"):
            r["eval_loss_rel_diff"] = (a["eval_loss"] - b["eval_loss"]) / b["eval_loss"]
        out[name] = r
    return out



def fmt(x, spec=".3f", pct=False) -> str:
    """A table cell: ``-`` for None/NaN, a percentage with ``pct``."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{100 * x:.1f}%" if pct else format(x, spec)



def table(report: dict) -> str:
    arms, rat = report["arms"], report.get("ratios", {})
    st = report["settings"]
    planned = [n for n in arms if n in report.get("plans", {})]
    lines = [f"End-to-end: {st['model']} ({st['layers']} blocks), {st['num_gpus']} x "
             f"{report['environment']['device_name']}, ZeRO-3, gas "
             f"{'/'.join(str(report['plans'][n]['gas']) for n in planned)} ({', '.join(planned)}), one epoch of "
             f"{st['num_samples']} samples (seed {st['seed']}), "
             f"m_mem {report['budgets']['m_mem_gib']:.2f} GiB, m_comp {report['budgets']['m_comp_ms']:.0f} ms; "
             f"warm-up {st['warmup_steps']} step(s) excluded"]
    hdr = (f"{'arm':<14}{'steps':>6}{'seen/drop':>11}{'tok/s':>11}{'x base':>8}{'smp/s':>8}{'x base':>8}"
           f"{'CV_step':>9}{'(wall)':>8}{'cCV pred':>9}{'idle':>7}{'peak GiB':>9}{'mem eff':>8}"
           f"{'loss20':>8}{'d%':>7}{'eval':>8}{'d%':>7}")
    lines += [hdr, "-" * len(hdr)]
    for name, a in arms.items():
        if not a.get("ok"):
            lines.append(f"{name:<14}  FAILED: {a.get('error', '')}")
            continue
        r = rat.get(name, {})
        lines.append(
            f"{name:<14}{a['steps']:>6}{str(a['samples_seen']) + '/' + str(a['tail_dropped'] + a['oversize']):>11}"
            f"{a['tokens_per_s']:>11,.0f}{fmt(r.get('tokens_per_s'), '.3f'):>8}{a['samples_per_s']:>8.2f}"
            f"{fmt(r.get('samples_per_s'), '.3f'):>8}{fmt(a['cv_step'], pct=True):>9}"
            f"{fmt(a['cv_step_wall'], pct=True):>8}{fmt(a['compute_cv_pred'], pct=True):>9}"
            f"{fmt(a['idle_frac'], pct=True):>7}{max(a['peak_mem_gib_per_rank']):>9.2f}"
            f"{fmt(a['mem_efficiency'], pct=True):>8}{a['loss_last20']:>8.4f}"
            f"{fmt(r.get('loss_last20_rel_diff'), pct=True):>7}{fmt(a.get('eval_loss'), '.4f'):>8}"
            f"{fmt(r.get('eval_loss_rel_diff'), pct=True):>7}")
    sim = report.get("simulator", {})
    same = sim.get("same_run")
    if same:
        lines.append("")
        lines.append(f"Simulator vs measurement ({st['num_gpus']} GPUs, same samples and budgets): predicted "
                     f"tokens/s dual/tokens {same['predicted_ratio_dual_over_tokens']:.3f}x, predicted CV tokens "
                     f"{fmt(same['predicted_cv']['tokens'], pct=True)} dual "
                     f"{fmt(same['predicted_cv']['dual'], pct=True)}")
        for label, m in same.get("measured", {}).items():
            lines.append(f"  measured ({label}): dual/tokens {m['ratio_dual_over_tokens']:.3f}x, CV_step tokens "
                         f"{fmt(m['cv_step']['tokens'], pct=True)} dual {fmt(m['cv_step']['dual'], pct=True)} "
                         f"(wall-clock {fmt(m['cv_step_wall']['tokens'], pct=True)} / "
                         f"{fmt(m['cv_step_wall']['dual'], pct=True)})")
    for name, a in arms.items():
        if a.get("ok"):
            p = a["predicted"]
            lines.append(f"  {name:<13} measured/predicted step time "
                         f"{fmt(p['measured_over_predicted_step_time'], '.2f')}, "
                         f"Pearson r (batch cost vs rank compute) {fmt(p['pearson_batch_cost_vs_compute'], '.3f')}, "
                         f"(step max) {fmt(p['pearson_step_max'], '.3f')}; process {a['process_wall_s']:.0f} s = "
                         f"steps {a['train_wall_s']:.0f} s + eval {a['eval_s']:.0f} s + start-up/shutdown "
                         f"{a['startup_shutdown_s']:.0f} s")
    if sim.get("scale"):
        lines.append("")
        lines.append("Simulated at scale (same profile, shape mix and budgets):")
        lines.append(f"{'GPUs':>6}{'dual/tokens':>13}{'CV tokens':>11}{'CV dual':>9}{'idle tokens':>13}"
                     f"{'idle dual':>11}")
        lines.append(f"{str(st['num_gpus']) + '*':>6}"
                     f"{fmt(same and same['predicted_ratio_dual_over_tokens'], '.3f'):>13}"
                     f"{fmt(same and same['predicted_cv']['tokens'], pct=True):>11}"
                     f"{fmt(same and same['predicted_cv']['dual'], pct=True):>9}{'':>13}{'':>11}")
        for world, v in sim["scale"].items():
            lines.append(f"{world:>6}{v['ratio_dual_over_tokens']:>13.3f}{fmt(v['cv']['tokens'], pct=True):>11}"
                         f"{fmt(v['cv']['dual'], pct=True):>9}{fmt(v['idle']['tokens'], pct=True):>13}"
                         f"{fmt(v['idle']['dual'], pct=True):>11}")
        lines.append("  (* the measured run's own plans)")
    return "\n".join(lines)



def plan_table(report: dict) -> str:
    st, b = report["settings"], report["budgets"]
    lines = [f"Plan: {st['model']} ({st['layers']} blocks) on {st['num_gpus']} {st['device']} rank(s), "
             f"{st['num_samples']} samples; profile {Path(report['profile']['path']).name}",
             f"  memory budget {b['m_mem_gib']:.3f} GiB ({b['rule']}); compute budget {b['m_comp_ms']:.1f} ms "
             f"(costliest sample at B=1); tokens max_tokens {b['max_tokens']}",
             f"  assumptions: start-up {st['startup_s']:.0f} s per arm, {st['step_overhead_s']:.2f} s per optimizer "
             f"step; times of the (rescaled) {st['profile']} profile",
             f"{'arm':<14}{'sampler':>8}{'gas':>4}{'steps':>6}{'micro':>6}{'samples':>8}{'dropped':>8}{'maxB':>6}"
             f"{'compute s':>10}{'eval s':>8}{'total s':>9}{'pred CV':>9}"]
    for name, p in report["plans"].items():
        t = report["predicted_time"][name]
        lines.append(f"{name:<14}{p['mode']:>8}{p['gas']:>4}{p['steps']:>6}{p['micro_steps']:>6}{p['samples']:>8}"
                     f"{p['tail_dropped'] + p['oversize']:>8}{p['max_batch']:>6}{t['compute_s']:>10.1f}"
                     f"{t['eval_s']:>8.1f}{t['total_s']:>9.1f}{fmt(float(np.mean(p['predicted_cv'])), pct=True):>9}")
    tot = report["predicted_total_s"]
    verdict = "within" if tot <= st["budget_s"] else "OVER"
    lines.append(f"predicted total for {len(report['plans'])} arm(s): {tot:.0f} s ({verdict} the "
                 f"{st['budget_s']:.0f} s "
                 "budget; the fused op's one-time build is not included)")
    few = [n for n, p in report["plans"].items() if p["steps"] < st["warmup_steps"] + 8]
    if few:
        lines.append(f"warning: arm(s) {few} have fewer than warm-up + 8 optimizer steps")
    return "\n".join(lines)

