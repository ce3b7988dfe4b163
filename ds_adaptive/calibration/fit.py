"""Fitting the calibration's measurements (pure numpy): ``c0 + B*(a*S + b*S^2)`` compute and ``m0 + m1*S`` memory by
non-negative least squares on relative error, the checkpointed-block terms, the allocator's fragmentation margin,
and the check that a fit is good enough to plan with.
"""
from __future__ import annotations

import itertools
from typing import Any, Mapping, Optional, Sequence

import numpy as np


MAX_FIT_ERROR = 0.10
"""Quality bar of a calibration: largest |relative error| of the compute fit over its fitted points.
A fit worse than this would mis-plan batches (the shipped calibrations' errors: docs/RESULTS.md)."""


# ------------------------------------------------------------------------------------- fitting
def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares ``min ||a x - y||, x >= 0`` for a few columns (exact: tries every
    active set and keeps the best feasible one)."""
    a = np.asarray(a, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = a.shape[1]
    best, best_res = np.zeros(n), float(np.sum(y * y))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = a[:, cols]
            x, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(x < 0):
                continue
            res = float(np.sum((sub @ x - y) ** 2))
            if res < best_res * (1 - 1e-12):
                best = np.zeros(n)
                best[list(cols)] = x
                best_res = res
    return best


def _errors(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    return (pred - y) / y


def fit_compute(points: Sequence[Mapping[str, float]], *, min_fit_tokens: int = 0) -> dict:
    """Fit ``ms = c0 + B*(a*S + b*S^2)`` (non-negative, relative error) to points with keys
    ``S`` (tokens per sample, padded), ``B`` and ``ms``. Returns coefficients and the error
    of every point (``fit: true/false`` says whether it was used)."""
    pts = [dict(p) for p in points]
    use = [p for p in pts if p["B"] * p["S"] >= min_fit_tokens]
    if len(use) < 3:
        raise ValueError(f"compute fit needs >= 3 points with >= {min_fit_tokens} tokens per micro-batch, "
                         f"got {len(use)} of {len(pts)}; add longer lengths or lower --min-fit-tokens")
    s = np.array([p["S"] for p in use], float)
    b = np.array([p["B"] for p in use], float)
    y = np.array([p["ms"] for p in use], float)
    design = np.stack([np.ones_like(s), b * s, b * s * s], axis=1) / y[:, None]
    c0, a, bb = nnls(design, np.ones_like(y))
    rows = []
    for p in pts:
        pred = c0 + p["B"] * (a * p["S"] + bb * p["S"] ** 2)
        rows.append({"S": p["S"], "B": p["B"], "measured_ms": p["ms"], "predicted_ms": pred,
                     "rel_err": (pred - p["ms"]) / p["ms"], "fit": p in use})
    errs = np.array([abs(r["rel_err"]) for r in rows if r["fit"]])
    return {"c0_ms": float(c0), "a_ms_per_token": float(a), "b_ms_per_token2": float(bb),
            "fit": {"max_rel_err": float(errs.max()), "mean_rel_err": float(errs.mean()),
                    "min_fit_tokens": int(min_fit_tokens), "points": rows}}


def fit_memory(points: Sequence[Mapping[str, float]], *, relative: bool = True) -> dict:
    """Fit activation memory per sample ``gib/B = m0 + m1*S`` (non-negative; relative error, or absolute
    with ``relative=False``) to points with keys ``S``, ``B`` and ``gib`` (activation memory of the
    micro-batch).

    Points measured with one timestep per token (``pt`` true: the videos of a model trained with first-frame
    conditioning) hold that modulation besides; when both kinds are present the fit has a third term,
    ``gib/B = m0 + (m1 + pt * m1_pt) S``, and returns ``per_token_timesteps_gib_per_token`` (m1_pt): one
    ``m1`` over both kinds over-predicts the images and under-predicts the videos."""
    pts = [dict(p) for p in points]
    s = np.array([p["S"] for p in pts], float)
    b = np.array([p["B"] for p in pts], float)
    y = np.array([p["gib"] for p in pts], float)
    pt = np.array([bool(p.get("pt")) for p in pts], float)
    split = 0 < pt.sum() < len(pts)
    cols = [b, b * s] + ([b * s * pt] if split else [])
    design = np.stack(cols, axis=1)
    coef = nnls(design / y[:, None], np.ones_like(y)) if relative else nnls(design, y)
    m0, m1 = coef[0], coef[1]
    m1_pt = coef[2] if split else 0.0
    rows = []
    for p, v in zip(pts, pt):
        pred = p["B"] * (m0 + (m1 + v * m1_pt) * p["S"])
        row = {"S": p["S"], "B": p["B"], "measured_gib": p["gib"], "predicted_gib": pred,
               "rel_err": (pred - p["gib"]) / p["gib"]}
        if split:
            row["per_token_timesteps"] = bool(v)
        rows.append(row)
    errs = np.array([abs(r["rel_err"]) for r in rows])
    out = {"m0_gib": float(m0), "m1_gib_per_token": float(m1)}
    if split:
        out["per_token_timesteps_gib_per_token"] = float(m1_pt)
    out["fit"] = {"max_rel_err": float(errs.max()), "mean_rel_err": float(errs.mean()), "points": rows}
    return out


def row_per_token(row: Mapping[str, Any], model) -> bool:
    """Whether a calibration row was measured with one timestep per token: its ``per_token_timesteps``, or
    for rows written before calibrate recorded it, :func:`_timesteps`' rule (a video of a model trained with
    first-frame conditioning)."""
    if "per_token_timesteps" in row:
        return bool(row["per_token_timesteps"])
    frames = int(str(row.get("shape", "1x")).split("x")[0])
    return bool(model is not None and model.objective.first_frame_ratio > 0 and frames > 1)


def per_token_entry(memory: Mapping[str, Any]) -> Optional[dict]:
    """``memory.per_token_timesteps`` of a profile from its fits (None when no fit separated the two kinds):
    the per-token extra of the full-model fit and of a whole block (``CostModel.ckpt_memory``)."""
    own = memory.get("per_token_timesteps_gib_per_token")
    block = (memory.get("checkpointing") or {}).get("block_full", {}).get("per_token_timesteps_gib_per_token")
    if own is None:
        return None
    return {"m1_gib_per_token": float(own), "block_full_m1_gib_per_token": float(block or 0.0), "source": "measured",
            "note": "extra activation memory of micro-batches with one timestep per token (first-frame "
                    "conditioned videos): fitted as a third term over the video (per-token) and image points"}


def full_model_points(rows: Sequence[Mapping[str, Any]], num_layers: int) -> tuple[list[dict], list[dict]]:
    """Depth differencing: per (S, B) with two depths k1 < k2, per-block = (t2 - t1) / (k2 - k1),
    overhead = t1 - k1 * per-block, full = overhead + num_layers * per-block. Memory the same
    way on the activation memory. With one depth only, scale it (full = t * L / k)."""
    by_key: dict[tuple, dict[int, Mapping]] = {}
    modes = {r.get("checkpointing") for r in rows}
    if len(modes) > 1:   # both modes measured: the fit is of the first row's mode (the profile's own)
        rows = [r for r in rows if r.get("checkpointing") == rows[0].get("checkpointing")]
    for r in rows:
        by_key.setdefault((r["S"], r["B"], r["shape"]), {})[r["layers"]] = r
    comp, mem = [], []
    for (s, b, shape), d in sorted(by_key.items()):
        depths = sorted(d)
        if len(depths) >= 2:
            k1, k2 = depths[0], depths[-1]
            blk = (d[k2]["ms"] - d[k1]["ms"]) / (k2 - k1)
            ms = d[k1]["ms"] + (num_layers - k1) * blk
            blk_m = (d[k2]["act_gib"] - d[k1]["act_gib"]) / (k2 - k1)
            gib = d[k1]["act_gib"] + (num_layers - k1) * blk_m
        else:
            k = depths[0]
            ms = d[k]["ms"] * num_layers / k
            gib = d[k]["act_gib"] * num_layers / k
        comp.append({"S": s, "B": b, "shape": shape, "ms": ms})
        if gib > 0:
            pt = any(bool(r.get("per_token_timesteps")) for r in d.values())
            mem.append({"S": s, "B": b, "shape": shape, "gib": gib, **({"pt": True} if pt else {})})
    return comp, mem


def checkpoint_fit(rows: Sequence[Mapping[str, Any]], *, min_fit_tokens: int = 8192) -> Optional[dict]:
    """Per-block memory with and without checkpointing and the recompute time, from rows measured at
    two depths in both modes (``measure(..., both_checkpointing=True)``). Per (S, B):

    - whole block ``g = (act_none(k2) - act_none(k1)) / (k2 - k1)`` (GiB per micro-batch),
    - checkpointed block ``c`` the same on the checkpointed rows (its kept input),
    - recompute ``r = ((t_ckpt(k2) - t_ckpt(k1)) - (t_none(k2) - t_none(k1))) / (k2 - k1)`` (ms),
    - last-block term ``d = (act_none(k1) - k1 g) - (act_ckpt(k1) - k1 c - g)``: what the rest of the model
      (embeddings, head, loss, the backward's working set) holds more when the last block is whole than
      when every block is checkpointed (``CostModel.ckpt_memory``); a small difference of large numbers:
      fitted with absolute error on the points with B x S >= ``min_fit_tokens`` (all when fewer than 2),
      omitted when not above 1 KiB at 2 points,

    fitted as ``B (m0 + m1 S)`` and ``c0 + B (a S + b S^2)`` (non-negative, relative error; recompute on
    points with B x S >= ``min_fit_tokens``). None when the rows lack a mode or a second depth."""
    by: dict[tuple, dict] = {}
    for r in rows:
        if "checkpointing" not in r:
            return None
        by.setdefault((r["S"], r["B"]), {})[(bool(r["checkpointing"]), r["layers"])] = r
    g_pts, c_pts, r_pts, d_pts = [], [], [], []
    for (s, b), d in sorted(by.items()):
        depths = sorted({k for _, k in d})
        if len(depths) < 2:
            continue
        k1, k2 = depths[0], depths[-1]
        if not all((m, k) in d for m in (True, False) for k in (k1, k2)):
            continue
        g = (d[(False, k2)]["act_gib"] - d[(False, k1)]["act_gib"]) / (k2 - k1)
        c = (d[(True, k2)]["act_gib"] - d[(True, k1)]["act_gib"]) / (k2 - k1)
        rc = ((d[(True, k2)]["ms"] - d[(True, k1)]["ms"]) - (d[(False, k2)]["ms"] - d[(False, k1)]["ms"])) / (k2 - k1)
        pt = {"pt": True} if any(bool(r.get("per_token_timesteps")) for r in d.values()) else {}
        if g > 0:
            g_pts.append({"S": s, "B": b, "gib": g, **pt})
        if c > 0:
            c_pts.append({"S": s, "B": b, "gib": c})
        if rc > 0:
            r_pts.append({"S": s, "B": b, "ms": rc})
        d_last = (d[(False, k1)]["act_gib"] - k1 * g) - (d[(True, k1)]["act_gib"] - k1 * c - g)
        if d_last > 1e-6:   # GiB (1 KiB): above the float noise of the differences
            d_pts.append({"S": s, "B": b, "gib": d_last})
    if len(g_pts) < 2 or len(c_pts) < 2 or len(r_pts) < 3:
        return None
    full, kept = fit_memory(g_pts), fit_memory(c_pts)
    use_min = min_fit_tokens if sum(p["B"] * p["S"] >= min_fit_tokens for p in r_pts) >= 3 else 0
    rec = fit_compute(r_pts, min_fit_tokens=use_min)
    memory = {"block_full": full, "block_checkpointed": kept, "source": "measured"}
    big = [p for p in d_pts if p["B"] * p["S"] >= min_fit_tokens]
    if len(d_pts) >= 2:
        memory["last_block_whole"] = {**fit_memory(big if len(big) >= 2 else d_pts, relative=False),
                                      "note": "E(no block checkpointed) - E(every block): absolute-error fit"}
    return {
        "memory": memory,
        "recompute": {**{k: rec[k] for k in ("c0_ms", "a_ms_per_token", "b_ms_per_token2")},
                      "note": "recomputed forward of ONE block (ms): checkpointed minus plain fwd+bwd per block",
                      "fit": rec["fit"]},
    }


def fragmentation_margin(rows: Sequence[Mapping[str, Any]]) -> Optional[float]:
    """Largest ``reserved - allocated`` peak (GiB) over the shape sweep's high-water marks, or None.

    Only rows whose allocated peak is the largest so far at their depth count (rows in measurement
    order; a new model per depth starts from an empty cache): there the reserved peak is the
    measurement's own, while a smaller point after a larger one reads memory that the allocator
    still caches from the larger one (reserved, free, reusable: not fragmentation)."""
    vals, high = [], {}
    for r in rows:
        if not r.get("reserved_gib"):
            continue
        k = r["layers"]
        if r["peak_gib"] >= high.get(k, 0.0):
            high[k] = r["peak_gib"]
            vals.append(r["reserved_gib"] - r["peak_gib"])
    return float(max(vals)) if vals else None


def fit_quality_problem(compute: Mapping[str, Any], max_err: float = MAX_FIT_ERROR) -> Optional[str]:
    """Why a compute fit is not usable (None when it is): error over the bar, or no length dependence."""
    err = float(compute["fit"]["max_rel_err"])
    if compute["a_ms_per_token"] <= 0 and compute["b_ms_per_token2"] <= 0:
        return (f"the fit has a = b = 0 (cost does not grow with length; max |rel err| {err:.1%}): the timings "
                "are dominated by overhead or noise")
    if err > max_err:
        return f"the fit's max |rel err| {err:.1%} is over the quality bar {max_err:.0%} (--max-fit-error)"
    return None
