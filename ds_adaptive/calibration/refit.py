"""A profile's compute and training-loop terms refitted to the trainer's own compute windows.

``ds-adaptive calibrate`` times fwd + bwd of a model of 2 and 4 blocks at a dozen (tokens, batch) points and
extrapolates to the full depth. The trainer logs each micro-step's compute window with its shape, batch size,
checkpointed blocks and its step's wall time (``compute.jsonl``; runs from before it: ``metrics.jsonl``'s
``micro_compute_ms`` every ``metrics.interval``-th step, with ``memory.jsonl``). The calibrated cost
can miss those windows in both directions (under for long clips, over for large, checkpointed image batches;
docs/RESULTS.md): the planner then balances and sizes batches on a cost the trainer does not run.

:func:`refit_compute` fits, by least squares of the relative error over the windows,

    window_ms = c0 + B (a S + b S^2) + r x recompute(S, B, checkpointed blocks)

(``S``: padded tokens per sample, ``recompute``: the profile's own recompute of the checkpointed blocks, so
``r`` scales it; ``c0`` held at 0 where the fit would make it negative) and returns the profile with those terms:
top-level ``compute`` holds a micro-batch with every block checkpointed, as ``ds-adaptive calibrate`` measures it
(``c0 + L r rc0``, ``a + L r ra``, ``b + L r rb``), and ``compute.recompute`` is scaled by ``r``. Windows after
each run's warm-up step only; one GPU (``sp`` 1, ``dp`` 1) and the profile's depth. :func:`fit_train_overheads`
fits the loop's terms (``train_overheads``) to the time outside the windows of the same runs' steps. Pure: no GPU.
"""
from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ds_adaptive.core.figure import agg_figure
from ds_adaptive.core.shapes import SampleShape
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import Profile


__all__ = ["COMPUTE_LOG", "Window", "Refit", "RefitError", "trainer_windows", "trainer_steps", "refit_compute",
           "fit_train_overheads", "with_train_overheads", "plot", "MIN_CONFIGS"]


#: the trainer's per-micro-step compute log in its --log-dir (``trainer.MemoryLog``)
COMPUTE_LOG = "compute.jsonl"


#: distinct (shape, B, checkpointed blocks) a fit needs: 4 terms, and at least one more to judge them
MIN_CONFIGS = 5


class RefitError(ValueError):
    """Input a refit cannot use; the message names the run or file and what to do."""


@dataclass(frozen=True)
class Window:
    """One micro-step's compute window of a trainer run."""

    run: str
    step: int
    shape: SampleShape
    batch: int
    ckpt_blocks: int
    ms: float
    checkpoint_attention: str = "recompute"


@dataclass(frozen=True)
class Refit:
    profile: Profile
    #: c0 (ms), a (ms per token), b (ms per token^2) of a micro-batch with no block checkpointed; r: recompute scale
    terms: dict
    #: per (shape, B, checkpointed blocks): windows, mean measured ms, mean predicted / measured before and after
    rows: tuple

    def errors(self) -> dict:
        """Largest and mean |predicted / measured - 1| over the windows, before and after."""
        out = {}
        for k in ("before", "after"):
            e = np.array([abs(r[k] - 1) for r in self.rows for _ in range(r["windows"])])
            out[k] = {"max": float(e.max()), "mean": float(e.mean())}
        return out


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise RefitError(f"{path}: not a readable trainer log ({exc}); pass a run's --log-dir") from None


def trainer_windows(run_dir: "str | Path") -> list[Window]:
    """The compute windows of a trainer run's micro-steps after its first step (its warm-up), from the trainer's
    ``--log-dir``: ``compute.jsonl`` (every step's windows, written by the trainer since 2026-11-29) where it is
    there, else the steps ``metrics.jsonl`` logged (every ``metrics.interval``-th) joined with ``memory.jsonl``."""
    d = Path(run_dir)
    if not (d / "summary.json").is_file():
        raise RefitError(f"{d}: no summary.json (expected a trainer --log-dir with summary.json and compute.jsonl, "
                         "or metrics.jsonl and memory.jsonl)")
    summary = json.loads((d / "summary.json").read_text())
    if int(summary.get("sp", 1)) != 1 or int(summary.get("dp_size", 1)) != 1:
        raise RefitError(f"{d}: sp {summary.get('sp')} x dp {summary.get('dp_size')}: the refit reads one GPU's "
                         "windows (sp 1, dp 1); refit from a one-GPU run of the same model")
    attention = str(summary.get("checkpoint_attention", "recompute"))
    rows = _compute_log_rows(d) if (d / COMPUTE_LOG).is_file() else _interval_rows(d)
    out = []
    for r in rows:
        f, h, w = (int(x) for x in str(r["shape"]).split("x"))
        out.append(Window(str(d), int(r["step"]), SampleShape(f, h, w), int(r["B"]), int(r["ckpt_blocks"]),
                          float(r["compute_ms"]), attention))
    if not out:
        raise RefitError(f"{d}: no logged step after the warm-up with per-micro-step compute windows; run more "
                         "steps (the trainer logs every adaptive_load.metrics.interval steps)")
    return out


def _compute_log_rows(d: Path) -> list[dict]:
    """``compute.jsonl``'s lines after step 1."""
    rows = [r for r in _jsonl(d / COMPUTE_LOG) if int(r["step"]) >= 2]
    for r in rows:
        missing = [k for k in ("step", "shape", "B", "ckpt_blocks", "compute_ms") if k not in r]
        if missing:
            raise RefitError(f"{d / COMPUTE_LOG}: a line without {', '.join(missing)} ({r}); expected the trainer's "
                             "compute log, one line per micro-step")
    return rows


def _interval_rows(d: Path) -> list[dict]:
    """The micro-steps of the steps after step 1 that ``metrics.jsonl`` logged, with their ``memory.jsonl``
    lines (runs from before the trainer wrote ``compute.jsonl``)."""
    for name in ("metrics.jsonl", "memory.jsonl"):
        if not (d / name).is_file():
            raise RefitError(f"{d}: no {COMPUTE_LOG} and no {name} (expected a trainer --log-dir)")
    micro: dict[int, list] = {}
    for r in _jsonl(d / "memory.jsonl"):
        micro.setdefault(int(r["step"]), []).append(r)
    out = []
    for s in _jsonl(d / "metrics.jsonl"):
        step = int(s["step"])
        if step < 2 or step not in micro or "micro_compute_ms" not in s:
            continue
        rows = sorted(micro[step], key=lambda r: int(r["micro"]))
        if len(rows) != len(s["micro_compute_ms"]):
            raise RefitError(f"{d}: step {step} has {len(s['micro_compute_ms'])} compute windows in metrics.jsonl "
                             f"but {len(rows)} micro-steps in memory.jsonl; the logs are from different runs")
        out += [{**r, "compute_ms": ms[0]} for r, ms in zip(rows, s["micro_compute_ms"])]
    return out


def trainer_steps(run_dir: "str | Path") -> list[dict]:
    """Per step after the warm-up of a trainer run: ``run``, ``step``, ``wall_ms``, ``compute_ms`` (the sum of its
    micro-steps' compute windows) and ``micro`` (micro-steps), from ``compute.jsonl`` where its lines carry the step's
    wall time (``step_wall_ms``), else from the steps ``metrics.jsonl`` logged."""
    d = Path(run_dir)
    lines = _jsonl(d / COMPUTE_LOG) if (d / COMPUTE_LOG).is_file() else []
    if lines and all("step_wall_ms" in r for r in lines):
        steps: dict[int, dict] = {}
        for r in lines:
            if int(r["step"]) >= 2:
                s = steps.setdefault(int(r["step"]), {"run": str(d), "step": int(r["step"]),
                                                      "wall_ms": float(r["step_wall_ms"]), "compute_ms": 0.0,
                                                      "micro": 0})
                s["compute_ms"] += float(r["compute_ms"])
                s["micro"] += 1
        return [steps[k] for k in sorted(steps)]
    if not (d / "metrics.jsonl").is_file():
        raise RefitError(f"{d}: no metrics.jsonl and no {COMPUTE_LOG} with step wall times; pass a trainer --log-dir")
    return [{"run": str(d), "step": int(s["step"]), "wall_ms": 1e3 * float(s["wall_s"]),
             "compute_ms": float(sum(sum(m) for m in s["micro_compute_ms"])), "micro": len(s["micro_compute_ms"])}
            for s in _jsonl(d / "metrics.jsonl") if int(s["step"]) >= 2 and "micro_compute_ms" in s]


def fit_train_overheads(steps: Sequence[dict]) -> dict:
    """The training loop's own time, least squares of the time outside the compute windows,
    ``wall - compute = micro_step_ms x micro-steps + optimizer_step_ms``, over ``steps`` (:func:`trainer_steps`):
    the DataLoader, the engine's non-boundary ``step()`` and host work per micro-step, the optimizer per step. Free of
    the cost model's error (a fit of ``wall - cost`` books the windows' excess over the cost as loop time). Needs
    steps of at least two micro-step counts (runs of different gradient accumulation)."""
    counts = sorted({int(s["micro"]) for s in steps})
    if len(counts) < 2:
        raise RefitError(f"the runs' steps all have {counts} micro-steps: the loop's per-micro-step and per-step "
                         "times need runs of at least two gradient accumulation counts")
    x = np.array([[float(s["micro"]), 1.0] for s in steps])
    y = np.array([float(s["wall_ms"]) - float(s["compute_ms"]) for s in steps])
    (tm, ts), *_ = np.linalg.lstsq(x, y, rcond=None)
    if tm < 0 or ts < 0:
        raise RefitError(f"the loop-time fit has a negative term ({tm:.1f} ms per micro-step, {ts:.1f} ms per step) "
                         "over these steps; add runs with other gradient accumulation counts")
    return {"micro_step_ms": float(tm), "optimizer_step_ms": float(ts), "steps": len(steps),
            "micro_steps_per_step": counts, "runs": len({s["run"] for s in steps})}


def with_train_overheads(profile: Profile, fit: dict, runs: Sequence[str]) -> Profile:
    """``profile`` with ``fit`` (:func:`fit_train_overheads`) as its ``train_overheads``, with a note of the runs."""
    out = profile.with_train_overheads(fit["micro_step_ms"], fit["optimizer_step_ms"])
    out.raw["train_overheads"]["note"] = (
        f"the time outside the trainer's compute windows, least squares of wall - compute = micro_step x micro-steps "
        f"+ optimizer_step over {fit['steps']} steps (after the warm-up; {fit['micro_steps_per_step']} micro-steps "
        f"per step) of {fit['runs']} one-GPU run(s), the same the compute terms were refitted on "
        f"(ds-adaptive refit): {', '.join(str(r) for r in runs)}")
    return out


def _design(profile: Profile, windows: Sequence[Window]) -> tuple[np.ndarray, np.ndarray]:
    """[n, 4] columns (1, B S, B S^2, the profile's recompute of the checkpointed blocks) and the profile's own
    prediction of each window."""
    costs = {a: CostModel(profile, "calibrated", checkpointing="auto", checkpoint_attention=a)
             for a in {w.checkpoint_attention for w in windows}}
    x = np.empty((len(windows), 4))
    pred = np.empty(len(windows))
    for i, w in enumerate(windows):
        c = costs[w.checkpoint_attention]
        s = float(c.padded_tokens(w.shape))
        full, none = (float(c.ckpt_cost(w.shape, w.batch, k)) for k in (w.ckpt_blocks, 0))
        x[i] = (1.0, w.batch * s, w.batch * s * s, full - none)
        pred[i] = full
    return x, pred


def refit_compute(profile: Profile, windows: Sequence[Window]) -> Refit:
    """``profile`` (as the runs planned with it: its LayerNorm-modulate path and block fusion resolved) with its
    compute terms fitted to ``windows`` (:func:`trainer_windows`)."""
    if profile.sp != 1:
        raise RefitError(f"profile '{profile.name}' is for sp {profile.sp}; the refit needs an sp 1 profile")
    configs = {(w.shape, w.batch, w.ckpt_blocks) for w in windows}
    if len(configs) < MIN_CONFIGS:
        raise RefitError(f"{len(configs)} distinct (shape, batch, checkpointed blocks) in the windows, need at least "
                         f"{MIN_CONFIGS}: add runs with other plans (e.g. other sampler.m_comp)")
    x, pred = _design(profile, windows)
    y = np.array([w.ms for w in windows])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    if coef[0] < 0:   # c0 is small against a micro-batch of ~1-10 s and poorly determined: held at 0, not negative
        coef = np.concatenate([[0.0], np.linalg.lstsq(x[:, 1:] / y[:, None], np.ones_like(y), rcond=None)[0]])
    c0, a, b, r = (float(v) for v in coef)
    if min(a, b, r) <= 0:
        raise RefitError(f"the fit has a non-positive term (a {a:.4g}, b {b:.4g}, recompute x{r:.3g}):"
                         " the windows do not span enough token counts and batch sizes; add runs with other plans")
    after = x @ coef
    rows = []
    for key in sorted(configs, key=lambda k: (k[0].tokens, k[1], k[2])):
        j = [i for i, w in enumerate(windows) if (w.shape, w.batch, w.ckpt_blocks) == key]
        m = float(y[j].mean())
        rows.append({"shape": str(key[0]), "batch": key[1], "ckpt_blocks": key[2], "windows": len(j),
                     "measured_ms": m, "before": float(pred[j].mean()) / m, "after": float(after[j].mean()) / m})
    return Refit(_with_compute(profile, c0, a, b, r, len(windows), len({w.run for w in windows})),
                 {"c0_ms": c0, "a_ms_per_token": a, "b_ms_per_token2": b, "recompute_scale": r}, tuple(rows))


def _with_compute(profile: Profile, c0: float, a: float, b: float, r: float, n: int, runs: int) -> Profile:
    d = copy.deepcopy(dict(profile.raw))
    L = profile.num_layers if profile.gradient_checkpointing else 0
    rc0, ra, rb = (r * v for v in profile.recompute_ms)
    comp = d["compute"]
    comp["recompute"] = {**comp.get("recompute", {}), "c0_ms": rc0, "a_ms_per_token": ra, "b_ms_per_token2": rb}
    comp["recompute"]["refit_scale"] = r   # its fit points are the calibration's, before this scale
    comp.update({"c0_ms": c0 + L * rc0, "a_ms_per_token": a + L * ra, "b_ms_per_token2": b + L * rb})
    comp["fit"] = {"source": "trainer compute windows (ds_adaptive.calibration.refit)", "windows": n, "runs": runs,
                   "recompute_scale": r, "calibrated": {k: profile.raw["compute"][k]
                                                        for k in ("c0_ms", "a_ms_per_token", "b_ms_per_token2")}}
    d["source"] = f"{profile.raw.get('source', profile.name)}; compute refitted to {n} trainer windows of {runs} run(s)"
    d["date"] = time.strftime("%Y-%m-%dT%H:%M:%S")   # of the refit (the calibration's: compute.fit.calibrated_date)
    comp["fit"]["calibrated_date"] = profile.raw.get("date")
    return Profile.from_dict(d, where=f"{profile.name} refitted")


def plot(fit: Refit, path: "str | Path") -> None:
    """Predicted / measured compute of each (shape, batch, checkpointed blocks) against its measured window, with
    the profile's terms and with the refitted ones (marker area: windows), and the +-5% band."""
    fig = agg_figure(figsize=(8, 4.5))
    ax = fig.subplots()
    ms = [r["measured_ms"] for r in fit.rows]
    size = [20 + 12 * r["windows"] for r in fit.rows]
    e = fit.errors()
    for key, color, label in (("before", "tab:red", "profile"), ("after", "tab:blue", "refitted")):
        ax.scatter(ms, [r[key] for r in fit.rows], s=size, color=color, alpha=0.7,
                   label=f"{label}: max |err| {e[key]['max']:.1%}, mean {e[key]['mean']:.1%}")
    ax.axhspan(0.95, 1.05, color="0.9", zorder=0)
    ax.axhline(1.0, color="0.4", lw=0.8)
    ax.set_xscale("log")
    ax.set(xlabel="measured compute window per micro-step [ms]", ylabel="predicted / measured",
           title=f"{fit.profile.name}: compute of {sum(r['windows'] for r in fit.rows)} trainer windows")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _check_runs(profile: Profile, run_dirs: Sequence[str]) -> None:
    """Each run trained the profile's model at its depth (``summary.json``)."""
    model = profile.raw.get("model", {})
    for d in run_dirs:
        path = Path(d) / "summary.json"
        if not path.is_file():
            raise RefitError(f"{d}: no summary.json (expected a trainer --log-dir)")
        s = json.loads(path.read_text())
        if s.get("model") not in (model.get("name"), None):
            raise RefitError(f"{d}: the run trained '{s.get('model')}', profile '{profile.name}' is for "
                             f"'{model.get('name')}'; refit a profile of the run's model")
        if s.get("layers") not in (profile.num_layers, None):
            raise RefitError(f"{d}: the run had {s.get('layers')} blocks, profile '{profile.name}' "
                             f"{profile.num_layers}; refit from full-depth runs")
