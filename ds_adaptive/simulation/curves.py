"""Training-loss curves of two arms compared: in steps, against run-to-run noise, and over samples seen.

A ratio of last-window losses says little while both curves still fall fast: a lead of a few dozen steps shows up as
a 10% gap. :func:`steps_to_loss` reads the lead in steps, :func:`analyze` the runs of ``bench/training/sparse_quality.py``
(their ``history``: per-step training loss and held-out evaluations, per arm ``dense`` / ``sparse``) with the spread
between repeats of one experiment (the noise floor of the ratio), and :func:`loss_curve_gap` the relative gap between
two runs' curves over the samples seen (``bench/training/scale.py``). Pure functions of the losses; no GPU.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

ARMS = ("dense", "sparse")
"""The two arms of a quality run's ``history``."""

NOT_TRAINING = ("out", "runs_dir", "deadline_s", "log_interval")
"""Arguments of a quality run that do not change what it trains (ignored when deciding whether runs repeat)."""


def smoothed(loss: Sequence[float], window: int) -> np.ndarray:
    """Centred moving average of ``loss`` over ``window`` steps (edges averaged over the part of the window inside
    the run); the same length as ``loss``."""
    x = np.asarray(loss, float)
    w = max(1, min(int(window), len(x)))
    kernel = np.ones(w)
    num = np.convolve(x, kernel, mode="same")
    den = np.convolve(np.ones_like(x), kernel, mode="same")
    return num / den


def first_step_at_or_below(curve: np.ndarray, level: float) -> Optional[int]:
    """1-based step at which ``curve`` first reaches ``level`` (``None``: never)."""
    idx = np.flatnonzero(curve <= level)
    return int(idx[0]) + 1 if idx.size else None


def steps_to_loss(dense_loss: Sequence[float], sparse_loss: Sequence[float], *, frac: float = 0.2, levels: int = 9,
                  window: int = 25) -> dict:
    """Steps each arm needs to reach the loss levels the dense arm reaches in its last ``frac`` of steps.

    ``levels`` quantiles (10th to 90th) of the dense arm's smoothed last window; per level the first step each
    smoothed curve (``window`` steps) is at or below it and ``lead`` = dense step - sparse step (> 0: the sparse
    arm got there earlier), with the median and range; ``dense_drop_per_100_steps``: how fast the dense loss still
    falls over the window (loss per 100 steps); ``gap_in_steps_of_dense_slope``: the last-window gap in steps of
    that slope."""
    d, s = smoothed(dense_loss, window), smoothed(sparse_loss, window)
    n = len(d)
    lo = n - max(1, int(round(n * frac)))
    qs = np.quantile(d[lo:], np.linspace(0.1, 0.9, levels))
    rows = []
    for q in qs:
        sd, ss = first_step_at_or_below(d, q), first_step_at_or_below(s, q)
        rows.append({"loss": float(q), "dense_step": sd, "sparse_step": ss,
                     "lead": None if sd is None or ss is None else sd - ss})
    leads = [r["lead"] for r in rows if r["lead"] is not None]
    slope = float((d[lo] - d[-1]) / max(n - 1 - lo, 1) * 100)
    gap = float(np.mean(d[lo:]) - np.mean(s[lo:]))
    return {"window_from_step": lo + 1, "smooth": window, "levels": rows,
            "lead_median": float(np.median(leads)) if leads else None,
            "lead_range": [min(leads), max(leads)] if leads else None,
            "dense_drop_per_100_steps": slope,
            "last_window_gap": gap, "gap_in_steps_of_dense_slope": gap / slope * 100 if slope > 0 else None}


def last_window(hist: dict, arm: str, frac: float = 0.2) -> tuple[float, float]:
    """(training loss mean over the last ``frac`` of steps, held-out mean over the evaluations in it) of ``arm``."""
    loss = hist[arm]["loss"]
    n = len(loss)
    lo = n - max(1, int(round(n * frac)))
    ev = [v for st, v in hist[arm]["eval"] if st > lo] or [hist[arm]["eval"][-1][1]]
    return float(np.mean(loss[lo:])), float(np.mean(ev))


def repeat_spread(docs: Sequence[dict]) -> dict:
    """Per arm, the relative difference (largest over smallest, minus one) of the last-window training and held-out
    losses between runs of the same arguments."""
    out = {}
    for arm in ARMS:
        tr, ev = zip(*(last_window(d["history"], arm) for d in docs))
        out[arm] = {"train_last20": list(tr), "eval_last20": list(ev),
                    "train_rel_spread": (max(tr) - min(tr)) / min(tr), "eval_rel_spread": (max(ev) - min(ev)) / min(ev)}
    return out


def same_run(docs: Sequence[dict]) -> bool:
    """Whether the runs trained with the same arguments (``meta.args``; keys absent from an older run, and
    :data:`NOT_TRAINING`, are not compared), i.e. are repeats of one experiment."""
    args = [d["meta"]["args"] for d in docs]
    common = set.intersection(*(set(a) for a in args)) - set(NOT_TRAINING)
    return all(a[k] == args[0][k] for a in args[1:] for k in common)


def analyze(paths: Sequence["str | Path"], window: int = 25) -> dict:
    """Per quality run (a JSON of ``bench/training/sparse_quality.py``): sparse / dense last-window ratios and
    :func:`steps_to_loss`; with two or more repeats of one experiment also their ``repeat_spread``."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    runs = []
    for p, d in zip(paths, docs):
        h = d["history"]
        lead = steps_to_loss(h["dense"]["loss"], h["sparse"]["loss"], window=window)
        tr = {a: last_window(h, a) for a in ARMS}
        runs.append({"file": str(p), "commit": d["meta"].get("commit"), "seed": d["meta"]["args"].get("seed"),
                     "train_ratio": tr["sparse"][0] / tr["dense"][0], "eval_ratio": tr["sparse"][1] / tr["dense"][1],
                     **lead})
    out = {"runs": runs}
    if len(docs) > 1 and same_run(docs):
        out["repeat_spread"] = {"commits": [d["meta"].get("commit") for d in docs], **repeat_spread(docs)}
    return out


def loss_curve_gap(a: dict, b: dict, smooth: int = 5) -> float:
    """Mean relative gap between two training-loss curves (``loss_curve``: ``samples_seen``, ``loss``) over the
    second half of the samples seen: each curve smoothed by a trailing moving average of ``smooth`` steps, ``a``
    interpolated on ``b``'s points."""
    def sm(lc):
        x, y = np.asarray(lc["samples_seen"], float), np.asarray(lc["loss"], float)
        k = min(smooth, len(y))
        return x[k - 1:], np.convolve(y, np.ones(k) / k, mode="valid")
    xa, ya = sm(a["loss_curve"])
    xb, yb = sm(b["loss_curve"])
    keep = xb >= xb[-1] / 2
    return float(np.mean(np.abs(np.interp(xb[keep], xa, ya) - yb[keep]) / yb[keep]))
