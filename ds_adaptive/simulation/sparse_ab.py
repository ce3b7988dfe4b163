"""Sparse attention in the training loop, dense vs sparse arms on one pinned plan: their comparison and how far the
planner's cost predicted them (the analysis of ``bench/training/sparse_train_ab.py``'s result JSON).

An arm is ``{"mix", "arm", "steps": [per step: step, tokens, wall_s, compute_ms, profiled], "micro": [per micro-step:
step, shape, B, ckpt, compute_ms, predicted_ms, select_ms, predicted_select_ms], "warmup_s", "train_s",
"fusion_warmup_s", "backend", "loop_overheads_ms"}`` (times in ms unless named ``_s``). Pure functions of the
recorded arms; no GPU.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence


def tokens_per_s(arm: dict, first: int) -> float:
    """Tokens over wall time of ``arm``'s steps from ``first`` on."""
    st = [s for s in arm["steps"] if s["step"] >= first]
    return sum(s["tokens"] for s in st) / sum(s["wall_s"] for s in st)


def compare(dense: dict, other: dict) -> dict:
    """Ratios of ``other`` to ``dense`` (same mix)."""
    res = {"tokens_per_s_2toN": tokens_per_s(other, 2) / tokens_per_s(dense, 2)}
    # steps 1..N plus the sparse backend's warm-up (compile) before step 1; the engine build (the same
    # work in every arm, and the first arm of a process also pays CUDA / DeepSpeed start-up) left out
    warm = lambda a: sum(s["tokens"] for s in a["steps"]) / ((a["warmup_s"] or 0.0) + a["train_s"])  # noqa: E731
    res["tokens_per_s_with_warmup"] = warm(other) / warm(dense)
    # and block fusion's compile, charged to both arms as if each ran alone (the one-off compile a user pays per run)
    fusion_s = max(dense.get("fusion_warmup_s") or 0.0, other.get("fusion_warmup_s") or 0.0)
    every = lambda a: sum(s["tokens"] for s in a["steps"]) / ((a["warmup_s"] or 0.0) + fusion_s + a["train_s"])  # noqa: E731
    res["tokens_per_s_with_every_warmup"] = every(other) / every(dense)
    res["fusion_warmup_s_charged"] = fusion_s
    res["outside_compute_s_per_step"] = {
        name: sum(s["wall_s"] - s["compute_ms"] / 1e3 for s in a["steps"][1:]) / max(1, len(a["steps"]) - 1)
        for name, a in (("dense", dense), (other["arm"], other))}
    if other["arm"] == "profiled":  # the profiling steps' extra time vs the same steps of the sparse arm
        res["profiling"] = profiling_overhead(other)
    res["prediction_over_dense_per_shape"] = prediction_vs_dense(dense, other)
    if other["arm"] == "sparse":  # the same micro-batches: per-shape compute and the new-pair steps
        d_micro, s_micro = dense["micro"], other["micro"]
        same = [(a["shape"], a["B"]) for a in d_micro] == [(b["shape"], b["B"]) for b in s_micro]
        res["same_micro_batches"] = same
        per_shape = defaultdict(lambda: [0.0, 0.0, 0])
        first_pairs = []
        seen = set()
        for a, b in zip(d_micro, s_micro):
            if a["step"] == 1:
                continue
            ps = per_shape[a["shape"]]
            ps[0] += a["compute_ms"]
            ps[1] += b["compute_ms"]
            ps[2] += 1
        for a, b in zip(d_micro, s_micro):
            key = (a["shape"], a["B"])
            if key not in seen:
                seen.add(key)
                first_pairs.append({"shape": a["shape"], "B": a["B"], "step": a["step"], "dense_ms": a["compute_ms"],
                                    "sparse_ms": b["compute_ms"], "ratio": a["compute_ms"] / b["compute_ms"]})
        res["per_shape_compute"] = {k: {"dense_ms": v[0], "sparse_ms": v[1], "micro_steps": v[2],
                                        "speedup": v[0] / v[1] if v[1] else float("nan")}
                                    for k, v in sorted(per_shape.items(), key=lambda kv: -kv[1][0])}
        later = [p for p in first_pairs if p["step"] > 1]
        res["new_pair_steps"] = first_pairs
        res["worst_new_pair_speedup_after_step1"] = min((p["ratio"] for p in later), default=float("nan"))
    return res


def profiling_overhead(arm: dict, interval: int = 50) -> dict:
    """Stage-2 profiling steps vs the other stage-2 steps of the same arm (per token: the batches differ
    by step), and that extra time amortised over ``interval`` steps (the default profile_interval)."""
    st = [s for s in arm["steps"] if s["step"] > 2]
    prof = [s for s in st if s["profiled"]]
    plain = [s for s in st if not s["profiled"]]
    if not prof or not plain:
        return {}
    per_tok = lambda xs: sum(s["wall_s"] for s in xs) / sum(s["tokens"] for s in xs)  # noqa: E731
    extra = per_tok(prof) / per_tok(plain) - 1.0
    return {"profiling_steps": len(prof), "extra_per_profiling_step": extra,
            f"amortised_over_{interval}_steps": extra / interval}


PREDICTION_TARGET = 0.10
"""Predicted vs measured micro-step compute should agree within this relative error (sparse arms)."""


def prediction_error(arm: dict) -> dict:
    """Predicted vs measured micro-step compute (steps 2..N): mean |relative error|, summed predicted /
    measured overall and per shape (with ``within_target``: |ratio - 1| <= PREDICTION_TARGET), and for the
    sparse arms the selection's predicted / measured time."""
    rows = [r for r in arm["micro"] if r.get("predicted_ms") and r["step"] > 1]
    if not rows:
        return {}
    errs = [(r["predicted_ms"] - r["compute_ms"]) / r["compute_ms"] for r in rows]
    per = defaultdict(list)
    for r, e in zip(rows, errs):
        per[r["shape"]].append((r, e))
    ratio = lambda rs: sum(r["predicted_ms"] for r in rs) / sum(r["compute_ms"] for r in rs)  # noqa: E731
    per_shape = {}
    for shape, items in per.items():
        rs = [r for r, _ in items]
        d = {"micro_steps": len(rs), "batch_sizes": sorted({r["B"] for r in rs}), "measured_ms": sum(r["compute_ms"] for r in rs) / len(rs),
             "predicted_ms": sum(r["predicted_ms"] for r in rs) / len(rs), "pred_over_measured": ratio(rs)}
        d["within_target"] = abs(d["pred_over_measured"] - 1.0) <= PREDICTION_TARGET
        sel = [r for r in rs if r.get("select_ms") is not None]
        if sel:
            d["select_ms"] = sum(r["select_ms"] for r in sel) / len(sel)
            d["predicted_select_ms"] = sum(r["predicted_select_ms"] for r in sel) / len(sel)
        per_shape[shape] = d
    out = {"micro_steps": len(rows), "mean_abs_rel_err": sum(abs(e) for e in errs) / len(errs),
           "sum_pred_over_measured": ratio(rows),
           "per_shape_mean_rel_err": {k: sum(e for _, e in v) / len(v) for k, v in per.items()},
           "per_shape": per_shape, "target": PREDICTION_TARGET,
           "shapes_within_target": sum(d["within_target"] for d in per_shape.values()), "shapes": len(per_shape)}
    loop = arm.get("loop_overheads_ms")
    if loop:  # the planner's micro-step: the cost plus the profile's measured per-micro-step time (ZeRO-3's hooks)
        n = sum(r["predicted_ms"] + loop["micro_step"] for r in rows)
        out["micro_step_pred_over_measured"] = n / sum(r["compute_ms"] for r in rows)
    if loop:  # the planner's whole step: compute + its per-micro-step and per-optimizer-step loop time, vs the wall
        by_step = defaultdict(list)
        for r in rows:
            by_step[r["step"]].append(r["predicted_ms"])
        walls = {s["step"]: s["wall_s"] for s in arm["steps"]}
        pred = sum(sum(v) + len(v) * loop["micro_step"] + loop["optimizer_step"] for v in by_step.values()) / 1e3
        out["step_pred_over_measured"] = pred / sum(walls[k] for k in by_step)
    sel = [r for r in rows if r.get("select_ms") is not None]
    if sel and sum(r["select_ms"] for r in sel) > 0:  # 0: no sparse layer selected (e.g. all ran dense)
        out["select_pred_over_measured"] = sum(r["predicted_select_ms"] for r in sel) / sum(r["select_ms"] for r in sel)
    return out


def prediction_vs_dense(dense: dict, other: dict) -> dict:
    """Per shape, the sparse arm's predicted / measured over the dense arm's (same micro-batches): the
    sparse cost's own error, with the calibration's error common to both arms divided out."""
    d, o = (a.get("prediction", {}).get("per_shape", {}) for a in (dense, other))
    return {k: o[k]["pred_over_measured"] / d[k]["pred_over_measured"] for k in o if k in d}


def same_plan_status(arm: Optional[dict], micro: Sequence[tuple]) -> str:
    """``"same"``, ``"differs from micro-step N"`` or ``"not recorded"``: a plan's micro-steps ``micro`` (``(shape,
    B, checkpointed blocks)`` each) against a recorded arm's ``micro`` rows."""
    if arm is None:
        return "not recorded"
    ran = [(m["shape"], m["B"], m["ckpt"]) for m in arm["micro"]]
    mine = [(str(s), b, c) for s, b, c in micro]
    diff = next((i for i, (x, y) in enumerate(zip(mine, ran)) if x != y), None)
    if diff is None and len(mine) == len(ran):
        return "same"
    return f"differs from micro-step {diff if diff is not None else min(len(mine), len(ran))}"


def merge_results(docs: Sequence[dict], names: Sequence[str] = ()) -> dict:
    """One result document from the arms of several (one device: the documents must name the same one;
    ``ValueError`` otherwise), each arm's :func:`prediction_error` and every mix's :func:`compare` against its
    dense arm. ``names``: where the documents came from."""
    devices = {d["device"] for d in docs}
    if len(devices) != 1:
        raise ValueError(f"--merge: the files ran on different devices {sorted(devices)}: timings compare only on one")
    doc = {"args": [d["args"] for d in docs], "device": docs[0]["device"], "torch": docs[0]["torch"],
           "merged_from": [str(p) for p in names], "arms": [a for d in docs for a in d["arms"]], "compare": {},
           "total_s": sum(d.get("total_s", 0.0) for d in docs)}
    for mix in dict.fromkeys(a["mix"] for a in doc["arms"]):
        arms = {a["arm"]: a for a in doc["arms"] if a["mix"] == mix}
        for a in arms.values():
            a["prediction"] = prediction_error(a)
        if "dense" in arms:
            doc["compare"][mix] = {k: compare(arms["dense"], a) for k, a in arms.items() if k != "dense"}
    return doc


def table(doc: dict) -> str:
    """The result document as markdown tables: one row per arm (tokens/s, ratios to dense, warm-up, predictions),
    per sparse arm its per-shape prediction, per mix the per-shape compute of the same micro-batches."""
    lines = []
    lines.append("\n| mix | arm | tokens/s 2..N | vs dense | with warm-up vs dense | + block fusion's compile | warm-up s | "
                 "graphs | outside compute s/step | pred/measured compute | pred/measured micro-step | pred/measured step (loop) | "
                 "worst new-pair speed-up |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for a in doc["arms"]:
        c = doc["compare"].get(a["mix"], {}).get(a["arm"], {})
        p = a.get("prediction") or {}
        oc = c.get("outside_compute_s_per_step", {}).get(a["arm"])
        if oc is None:  # the dense arm, or an arm run without its dense arm (merged later)
            oc = sum(s["wall_s"] - s["compute_ms"] / 1e3 for s in a["steps"][1:]) / max(1, len(a["steps"]) - 1)
        lines.append(f"| {a['mix']} | {a['arm']} | {tokens_per_s(a, 2):,.0f} | {c.get('tokens_per_s_2toN', 1.0):.3f} | "
                     f"{c.get('tokens_per_s_with_warmup', 1.0):.3f} | {c.get('tokens_per_s_with_every_warmup', 1.0):.3f} | "
                     f"{a['warmup_s'] or 0.0:.1f} | "
                     f"{(a['backend'] or {}).get('graphs', '-')} | {oc:.2f} | {p.get('sum_pred_over_measured', float('nan')):.3f} | "
                     f"{p.get('micro_step_pred_over_measured', float('nan')):.3f} | "
                     f"{p.get('step_pred_over_measured', float('nan')):.3f} | "
                     f"{c.get('worst_new_pair_speedup_after_step1', float('nan')):.3f} |")
    for a in doc["arms"]:
        ps = (a.get("prediction") or {}).get("per_shape")
        if not ps or a["arm"] == "dense":
            continue
        rel = doc["compare"].get(a["mix"], {}).get(a["arm"], {}).get("prediction_over_dense_per_shape", {})
        p = a["prediction"]
        lines.append(f"\n{a['mix']}/{a['arm']}: predicted / measured micro-step compute per shape (target within "
                     f"{p['target']:.0%}: {p['shapes_within_target']} of {p['shapes']} shapes; all {p['sum_pred_over_measured']:.3f}; "
                     f"selection {p.get('select_pred_over_measured', float('nan')):.2f})")
        lines.append("| shape | B | micro-steps | measured ms | predicted ms | pred / measured | over dense's | selection ms measured | predicted |")
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for shape, v in sorted(ps.items(), key=lambda kv: -kv[1]["measured_ms"]):
            lines.append(f"| {shape} | {','.join(map(str, v['batch_sizes']))} | {v['micro_steps']} | {v['measured_ms']:.0f} | "
                         f"{v['predicted_ms']:.0f} | {v['pred_over_measured']:.3f} | {rel.get(shape, float('nan')):.3f} | "
                         f"{v.get('select_ms', float('nan')):.1f} | {v.get('predicted_select_ms', float('nan')):.1f} |")
    for mix, cmp in doc["compare"].items():
        ps = (cmp.get("sparse") or {}).get("per_shape_compute")
        if ps:
            lines.append(f"\n{mix}: per-shape compute of the same micro-batches (steps 2..N), dense / sparse")
            for shape, v in ps.items():
                lines.append(f"  {shape:>14}: {v['speedup']:.2f}x  ({v['micro_steps']} micro-steps, dense {v['dense_ms'] / 1e3:.1f} s)")
    return "\n".join(lines)
