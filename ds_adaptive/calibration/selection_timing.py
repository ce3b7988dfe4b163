"""Time the runtime's block selection on this GPU and fit its cost (``calibrate --sparse --selection``).

The timed call is the runtime's own: :meth:`SparseAttentionRuntime.select` (scoring + top-k, what a sparse
layer runs once per micro-batch in the forward), and :meth:`SparseAttentionRuntime.block_scores` alone
(the scoring part, so that the fit can tell the scoring from the top-k). Each ``(B, S)`` of the grid is
timed with CUDA events (the runtime's own ``select_ms`` telemetry times the same span the same way), median
of ``iters`` calls after 2 untimed ones. The fit is :func:`fit_selection`.
"""
from __future__ import annotations

import datetime as _dt
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from ds_adaptive.calibration.fit import nnls
from ds_adaptive.planning.selection_cost import SelectionCost, selection_features
from ds_adaptive.core.timing import time_ms
from ds_adaptive.attention.runtime import SparseAttentionRuntime

__all__ = ["DEFAULT_GRID", "measure_selection", "selection_section", "fit_selection"]

DEFAULT_GRID = ((32, 1560), (1, 8190), (8, 8190), (1, 16380), (4, 16380), (1, 32760), (2, 32760), (4, 32760),
                (1, 46800), (3, 46800), (1, 75600), (2, 75600))
"""``(B, S)`` micro-batches timed by default: images (1,560 tokens: 480x832) to 81x720x1280 videos
(75,600), up to ~150k tokens per micro-batch (the sizes the planner forms on an H100/H200 at 1.3B)."""


def measure_selection(grid: Sequence[tuple[int, int]] = DEFAULT_GRID, *, heads: int = 12, head_dim: int = 128,
                      block_size: int = 128, block_score: str = "pooled_lse", density: float = 0.1,
                      device: Any = "cuda", dtype: torch.dtype = torch.bfloat16, iters: int = 10,
                      log: Optional[Callable[[str], None]] = print) -> list[dict]:
    """Rows ``{B, S, heads, select_ms, score_ms}`` for every ``(B, S)`` of ``grid`` (CUDA)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"measure_selection times CUDA kernels; got device {dev}")
    rt = SparseAttentionRuntime({"enabled": True, "forced_density": density, "block_size": block_size,
                                 "block_score": block_score}, num_layers=1, num_heads=heads, head_dim=head_dim,
                                device=dev)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for b, s in grid:
        q, k = (torch.randn(int(b), int(s), heads, head_dim, generator=gen).to(dev, dtype) for _ in range(2))
        select = time_ms(lambda q=q, k=k: rt.select(0, q, k), warmup=2, iters=iters)
        score = time_ms(lambda q=q, k=k: rt.block_scores(0, q, k), warmup=2, iters=iters)
        rows.append({"B": int(b), "S": int(s), "heads": heads, "select_ms": select, "score_ms": score})
        if log is not None:
            log(f"selection B={b:>3} S={s:>6}: {select:8.3f} ms (scoring {score:8.3f} ms)")
        del q, k
        torch.cuda.empty_cache()
    return rows


def selection_section(rows: Sequence[dict], *, heads: int, head_dim: int, block_size: int, block_score: str,
                      command: str) -> dict:
    """The profile's ``sparse_attention.selection`` section: the fitted :class:`SelectionCost` (its keys),
    what it was measured for, the fit's errors and the timings."""
    cost, fit = fit_selection(rows, block_size=block_size,
                              source=f"measured on {torch.cuda.get_device_name()} (torch {torch.__version__}): {command}")
    return {**cost.as_dict(), "block_score": block_score, "heads": heads, "head_dim": head_dim,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": _dt.datetime.now().isoformat(timespec="seconds"), "command": command, "fit": fit}


def fit_selection(rows: Sequence[Mapping[str, float]], *, block_size: int, source: str = "fit") -> tuple[SelectionCost, dict]:
    """Fit :class:`SelectionCost` to timings. Each row: ``B``, ``S``, ``heads``, ``select_ms`` (the whole
    call) and optionally ``score_ms`` (the scoring part alone). With ``score_ms`` in every row, the
    scoring is fitted on ``(1, B h S, B h nq S)`` and the rest (top-k) on ``(1, B h nq nk)``: at one
    block size ``nq S`` and ``nq nk`` are nearly proportional, so only this split tells them apart;
    without it the whole call is fitted on ``(1, B h S, B h nq S)`` (top-k inside ``ms_per_logit``).
    Non-negative least squares on relative error. Returns ``(cost, {"max_rel_err", "mean_rel_err",
    "points": [...]})``."""
    if len(rows) < 3:
        raise ValueError(f"fit_selection needs >= 3 timed (B, S) points, got {len(rows)}")
    x = selection_features([r["B"] for r in rows], [r["S"] for r in rows], [r["heads"] for r in rows], block_size)
    total = np.array([float(r["select_ms"]) for r in rows])
    if np.any(total <= 0):
        raise ValueError("fit_selection: every select_ms must be > 0")
    split = all(r.get("score_ms") is not None for r in rows)
    coef = np.zeros(4)
    if split:
        score = np.array([float(r["score_ms"]) for r in rows])
        rest = np.maximum(total - score, 1e-6)
        w = 1.0 / np.maximum(score, 1e-6)
        c_s = nnls(x[:, :3] * w[:, None], score * w)
        w = 1.0 / rest
        c_k = nnls(x[:, [0, 3]] * w[:, None], rest * w)
        coef[:3] = c_s
        coef[0] += c_k[0]
        coef[3] = c_k[1]
    else:
        w = 1.0 / total
        coef[:3] = nnls(x[:, :3] * w[:, None], total * w)
    cost = SelectionCost(*(float(c) for c in coef), block_size=int(block_size), source=source)
    pred = x @ coef
    err = (pred - total) / total
    pts = [{**{k: r[k] for k in ("B", "S", "heads")}, "select_ms": float(t), "predicted_ms": float(p), "rel_err": float(e)}
           for r, t, p, e in zip(rows, total, pred, err)]
    return cost, {"max_rel_err": float(np.max(np.abs(err))), "mean_rel_err": float(np.mean(np.abs(err))),
                  "split": split, "points": pts}
