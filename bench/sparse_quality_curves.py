"""How far apart the dense and sparse arms of ``bench/sparse_quality.py`` are: in steps, and against run-to-run noise.

A ratio of last-window losses says little while both curves still fall fast: a lead of a few dozen steps shows up as
a 10% gap. This reads the runs' JSON (``history``: per-step training loss, held-out evaluations) and reports

* **steps to loss**: for loss levels the dense arm reaches in its last 20% of steps, the first step at which each
  arm's smoothed training loss (centred moving average, ``--smooth`` steps) is at or below the level; ``lead`` =
  dense step - sparse step (> 0: the sparse arm got there earlier), median and range over the levels;
* **slope**: how fast the dense arm's smoothed loss still falls over that window (loss per 100 steps), and the
  last-window gap expressed in steps of that slope;
* **repeat spread** (two or more JSONs of the same arguments and seed): per arm, the relative difference of the
  last-20% training and held-out losses between the repeats: the noise floor of the ratio (GPU kernels are not
  bitwise deterministic; a fast-falling phase amplifies the difference).

    python bench/sparse_quality_curves.py bench/results/sparse_quality_h200.json \\
        bench/results/sparse_quality_h200_1cd4fbb.json --out bench/results/sparse_quality_curves_h200.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ARMS = ("dense", "sparse")


def smoothed(loss, window: int) -> np.ndarray:
    """Centred moving average of ``loss`` (edges averaged over the part of the window inside the run)."""
    x = np.asarray(loss, float)
    w = max(1, min(int(window), len(x)))
    kernel = np.ones(w)
    num = np.convolve(x, kernel, mode="same")
    den = np.convolve(np.ones_like(x), kernel, mode="same")
    return num / den


def first_step_at_or_below(curve: np.ndarray, level: float):
    """1-based step at which ``curve`` first reaches ``level`` (None: never)."""
    idx = np.flatnonzero(curve <= level)
    return int(idx[0]) + 1 if idx.size else None


def steps_to_loss(dense_loss, sparse_loss, *, frac: float = 0.2, levels: int = 9, window: int = 25) -> dict:
    """Steps each arm needs to reach the loss levels the dense arm reaches in its last ``frac`` of steps."""
    d, s = smoothed(dense_loss, window), smoothed(sparse_loss, window)
    n = len(d)
    lo = n - max(1, int(round(n * frac)))
    tail = d[lo:]
    qs = np.quantile(tail, np.linspace(0.1, 0.9, levels))
    rows = []
    for q in qs:
        sd, ss = first_step_at_or_below(d, q), first_step_at_or_below(s, q)
        rows.append({"loss": float(q), "dense_step": sd, "sparse_step": ss,
                     "lead": None if sd is None or ss is None else sd - ss})
    leads = [r["lead"] for r in rows if r["lead"] is not None]
    slope = float((d[lo] - d[-1]) / max(n - 1 - lo, 1) * 100)         # dense loss drop per 100 steps, last window
    gap = float(np.mean(d[lo:]) - np.mean(s[lo:]))
    return {"window_from_step": lo + 1, "smooth": window, "levels": rows,
            "lead_median": float(np.median(leads)) if leads else None,
            "lead_range": [min(leads), max(leads)] if leads else None,
            "dense_drop_per_100_steps": slope,
            "last_window_gap": gap, "gap_in_steps_of_dense_slope": gap / slope * 100 if slope > 0 else None}


def last_window(hist: dict, arm: str, frac: float = 0.2) -> tuple[float, float]:
    """(training loss mean over the last ``frac`` of steps, held-out mean over evaluations in it)."""
    loss = hist[arm]["loss"]
    n = len(loss)
    lo = n - max(1, int(round(n * frac)))
    ev = [v for st, v in hist[arm]["eval"] if st > lo] or [hist[arm]["eval"][-1][1]]
    return float(np.mean(loss[lo:])), float(np.mean(ev))


def repeat_spread(docs: list[dict]) -> dict:
    """Per arm, the largest relative difference of the last-window losses between runs of the same arguments."""
    out = {}
    for arm in ARMS:
        tr, ev = zip(*(last_window(d["history"], arm) for d in docs))
        out[arm] = {"train_last20": list(tr), "eval_last20": list(ev),
                    "train_rel_spread": (max(tr) - min(tr)) / min(tr), "eval_rel_spread": (max(ev) - min(ev)) / min(ev)}
    return out


#: arguments that do not change what a run trains
_NOT_TRAINING = ("out", "runs_dir", "deadline_s", "log_interval")


def _same_run(docs: list[dict]) -> bool:
    """Whether the runs trained with the same arguments (keys absent from an older run's JSON, added later with the
    behaviour it had as default, are not compared) and so are repeats of one experiment."""
    args = [d["meta"]["args"] for d in docs]
    common = set.intersection(*(set(a) for a in args)) - set(_NOT_TRAINING)
    return all(a[k] == args[0][k] for a in args[1:] for k in common)


def analyze(paths: list[str], window: int = 25) -> dict:
    docs = [json.loads(Path(p).read_text()) for p in paths]
    runs = []
    for p, d in zip(paths, docs):
        h = d["history"]
        lead = steps_to_loss(h["dense"]["loss"], h["sparse"]["loss"], window=window)
        tr = {a: last_window(h, a) for a in ARMS}
        runs.append({"file": p, "commit": d["meta"].get("commit"), "seed": d["meta"]["args"].get("seed"),
                     "train_ratio": tr["sparse"][0] / tr["dense"][0], "eval_ratio": tr["sparse"][1] / tr["dense"][1],
                     **lead})
    out = {"runs": runs}
    if len(docs) > 1 and _same_run(docs):
        out["repeat_spread"] = {"commits": [d["meta"].get("commit") for d in docs], **repeat_spread(docs)}
    return out


def print_report(res: dict) -> None:
    print("| run | commit | seed | train sparse/dense | held-out sparse/dense | dense still falls (per 100 steps) | "
          "gap in dense-slope steps | sparse lead, steps (median, range) |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in res["runs"]:
        gs = r["gap_in_steps_of_dense_slope"]
        print(f"| {Path(r['file']).name} | {r['commit']} | {r['seed']} | {r['train_ratio']:.4f} | {r['eval_ratio']:.4f} | "
              f"{r['dense_drop_per_100_steps']:.3f} | {gs if gs is None else round(gs)} | "
              f"{r['lead_median']} ({r['lead_range']}) |")
    rs = res.get("repeat_spread")
    if rs:
        print(f"\nrepeats of the same arguments and seed (commits {', '.join(map(str, rs['commits']))}): "
              "last-20% spread between runs")
        for arm, v in ((a, rs[a]) for a in ARMS):
            print(f"  {arm:6}: training {100 * v['train_rel_spread']:.1f}%, held-out {100 * v['eval_rel_spread']:.1f}% "
                  f"(training {', '.join(f'{x:.4f}' for x in v['train_last20'])}; "
                  f"held-out {', '.join(f'{x:.4f}' for x in v['eval_last20'])})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="sparse_quality.py JSON files (one per run)")
    p.add_argument("--smooth", type=int, default=25, help="moving-average window of the training loss, steps")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    res = analyze(args.runs, args.smooth)
    print_report(res)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
