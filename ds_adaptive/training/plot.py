"""One picture of a training run: ``LOG_DIR/run.png`` from the run's logs (needs matplotlib).

    path = plot_run("runs/wan")                  # the trainer at the end of a run; `ds-adaptive plot RUN_DIR`

Four panels over the optimizer steps, from ``metrics.jsonl`` (one line per step by default,
``metrics.jsonl_interval``) and ``validation.jsonl``:

* loss: the training loss of every logged step (and its running mean over 10 steps), the held-out validation loss
  of every round (and the EMA's, when scored);
* tokens/s of every step (the whole job);
* peak memory per rank (GiB; with more than 16 ranks: the lowest, mean and highest rank);
* compute per rank per step (ms, waits for other ranks excluded where the trainer could time them; the same
  reduction above 16 ranks).

A log directory that several runs appended to (a resumed run) is drawn by step, the last line of a step winning.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ds_adaptive.core.figure import agg_figure

__all__ = ["plot_run", "draw_at_end", "read_jsonl", "PlotError", "PLOT_FILE"]

PLOT_FILE = "run.png"
MAX_RANK_LINES = 16


class PlotError(ValueError):
    """A log directory that cannot be drawn (missing logs, no matplotlib); the message says what to do."""


def read_jsonl(path: Path) -> list[dict]:
    """The JSON lines of ``path`` by step (the last line of a step wins), sorted; a cut-off last line is ignored."""
    rows: dict = {}
    if not path.is_file():
        return []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue   # a line a killed run did not finish
        if isinstance(rec, dict) and "step" in rec:
            rows[int(rec["step"])] = rec
    return [rows[k] for k in sorted(rows)]


def _per_rank(ax, steps, table, label: str) -> None:
    """One line per rank, or the lowest / mean / highest rank above :data:`MAX_RANK_LINES` ranks."""
    import numpy as np

    ranks = max((len(r) for r in table), default=0)
    if ranks == 0:
        return
    arr = np.array([r + [np.nan] * (ranks - len(r)) for r in table], dtype=float)
    if ranks <= MAX_RANK_LINES:
        for j in range(ranks):
            ax.plot(steps, arr[:, j], lw=1, label=f"rank {j}")
        if ranks > 1:
            ax.legend(fontsize=7, ncol=2)
    else:
        ax.fill_between(steps, np.nanmin(arr, 1), np.nanmax(arr, 1), alpha=0.3, label=f"lowest..highest of {ranks}")
        ax.plot(steps, np.nanmean(arr, 1), lw=1.2, label="mean rank")
        ax.legend(fontsize=7)
    ax.set_ylabel(label)


def plot_run(log_dir, out: Optional[str] = None) -> Path:
    """Draw the run in ``log_dir`` to ``out`` (default ``log_dir/run.png``); returns the file."""
    log_dir = Path(log_dir)
    steps_log = read_jsonl(log_dir / "metrics.jsonl")
    if not steps_log:
        raise PlotError(f"{log_dir / 'metrics.jsonl'} is missing or empty: pass the --log-dir of a run "
                        "(adaptive_load.metrics.log_dir; metrics.jsonl needs metrics.jsonl: true)")
    try:
        fig = agg_figure(figsize=(12, 7.5), layout="constrained")
    except ImportError:
        raise PlotError("drawing the run needs matplotlib: pip install matplotlib") from None
    import numpy as np

    val = read_jsonl(log_dir / "validation.jsonl")
    summary = {}
    if (log_dir / "summary.json").is_file():
        try:
            summary = json.loads((log_dir / "summary.json").read_text())
        except json.JSONDecodeError:
            summary = {}
    steps = [r["step"] for r in steps_log]
    axes = fig.subplots(2, 2)
    ax = axes[0][0]
    loss = np.array([np.nan if r.get("loss") is None else r["loss"] for r in steps_log], float)
    ax.plot(steps, loss, lw=0.8, alpha=0.5, color="tab:blue", label="train (each step)")
    if len(loss) >= 10:
        kernel = np.ones(10) / 10
        ax.plot(steps[9:], np.convolve(np.nan_to_num(loss, nan=np.nanmean(loss)), kernel, "valid"), lw=1.5,
                color="tab:blue", label="train (mean of 10)")
    if val:
        ax.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", color="tab:red", label="validation")
        if any("loss_ema" in r for r in val):
            ax.plot([r["step"] for r in val if "loss_ema" in r], [r["loss_ema"] for r in val if "loss_ema" in r],
                    "s--", color="tab:green", label="validation, EMA weights")
    ax.set_ylabel("flow-matching loss")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    ax.plot(steps, [r.get("tokens_per_s", 0.0) for r in steps_log], lw=1, color="tab:purple")
    ax.set_ylabel("tokens/s (all ranks)")
    _per_rank(axes[1][0], steps, [list(r.get("peak_mem_gib", [])) for r in steps_log], "peak memory per rank (GiB)")
    _per_rank(axes[1][1], steps, [list(r.get("compute_ms", [])) for r in steps_log], "compute per rank per step (ms)")
    for ax in axes.flat:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    title = f"{log_dir.name}: {summary.get('model', '?')}, {summary.get('world_size', len(steps_log[0].get('compute_ms', [])))} " \
            f"rank(s) on {summary.get('device', '?')}, steps {steps[0]}..{steps[-1]}"
    if summary.get("tokens_per_s"):
        title += f", {summary['tokens_per_s']:,.0f} tokens/s after warm-up"
    fig.suptitle(title, fontsize=10)
    path = Path(out) if out else log_dir / PLOT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def draw_at_end(log_dir, log) -> Optional[Path]:
    """The trainer's end of run (rank 0, ``metrics.plot``): :func:`plot_run`, or a note saying why not."""
    try:
        path = plot_run(log_dir)
    except PlotError as exc:
        log(f"ds_adaptive: note: no run plot ({exc})")
        return None
    log(f"run plot written to {path}")
    return path
