"""Many ranks on paper: plan M optimizer steps for N GPUs with every sampler and score them.

``ds-adaptive simulate --world 16 --sp 1 --steps 50 --json``

All samplers plan the same shuffled dataset (drawn from a shape distribution) at the same memory
budget, with the same cost model; a micro-step takes as long as its slowest rank (ZeRO-3
synchronises every micro-step). Per sampler (``samplers.<mode>`` of the JSON):

    compute_cv_mean        mean over micro-steps of the CV (std/mean) of per-rank predicted time
    cv_p50, cv_p90         median and 90th percentile of that CV
    balance_efficiency     sum over micro-steps of mean rank time / sum of max rank time
    idle_fraction          1 - balance_efficiency (GPU time spent waiting for the slowest rank)
    predicted_tokens_per_s tokens / (sum of max-rank times + loop overheads) (whole cluster; an SP
                           group counts once)
    predicted_step_ms      mean predicted optimizer-step time, loop overheads included
    loop_overhead_ms       the profile's per-micro-step and per-optimizer-step time, summed

Times are always those of the calibrated profile (ms), also for samplers that plan with another
cost model: every batch with the recompute of the blocks its plan checkpoints, every micro-step and
optimizer step with the profile's loop overheads (the budget search's own time model,
``ds_adaptive.planning.budget.predicted_time_ms``). ``dual_power`` is the paper's variant:
dual-constraint batching with cost S^p.
    samples, tokens, micro_steps, steps, oversize, tail_dropped
    memory_utilization     mean and max of batch memory / m_mem (VRAM efficiency of the plan)
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ds_adaptive.core.config import SamplerConfig
from ds_adaptive.core.figure import agg_figure
from ds_adaptive.core.layout import Layout
from ds_adaptive.core.shapes import IndexedShapes, ShapeWeight, load_shape_distribution
from ds_adaptive.planning.budget import predicted_times, resolve_budgets
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.devices import default_profile_name, resolve_auto_profile
from ds_adaptive.planning.planner import EpochPlan
from ds_adaptive.planning.profile import Profile, load_profile
from ds_adaptive.planning.sampler import build_batch_sampler
from ds_adaptive.models.registry import default_model, get_model, model_for_profile


SAMPLERS = ("tokens", "fixed", "dual")


# The paper's variant: dual-constraint with the power-law cost S^p (p = sampler.p), scored with
# the calibrated model like every other sampler.
PAPER_VARIANT = "dual_power"


def profile_distribution(profile: Profile, path: Optional[str] = None) -> list[ShapeWeight]:
    """The shape mix at ``path`` (default: the profiled model's shipped mix) under the profiled model's grid
    rule; a profile of an unregistered model plans with the default model's."""
    m = model_for_profile(profile.raw.get("model", {}).get("name")) or get_model(default_model())
    return load_shape_distribution(path or m.shapes, grid=m.grid)


def draw_shapes(dist: Sequence[ShapeWeight], n: int, seed: int) -> IndexedShapes:
    """``n`` samples drawn i.i.d. from a shape distribution (deterministic in ``seed``), as ids into its distinct
    shapes (4 bytes a sample: 10M samples are 40 MB, not a list of 10M references)."""
    w = np.array([d.weight for d in dist], float)
    idx = np.random.default_rng([seed, 0xD157]).choice(len(dist), size=n, p=w / w.sum())
    uniq = sorted({d.shape for d in dist})
    pos = np.array([uniq.index(d.shape) for d in dist], np.int32)
    return IndexedShapes(uniq, pos[idx])


def loop_overhead_ms(truth: CostModel, micro_steps: int, steps: int) -> float:
    """Training-loop time outside fwd+bwd (ms): the profile's per-micro-step and per-optimizer-step
    overheads (``Profile.micro_step_overhead_ms``, ``optimizer_step_overhead_ms``), as the budget search
    predicts them (:func:`ds_adaptive.planning.budget.predicted_time_ms`)."""
    pr = truth.profile
    return micro_steps * pr.micro_step_overhead_ms + steps * pr.optimizer_step_overhead_ms


def score_plan(plan: EpochPlan, steps: int, m_mem: float, truth: Optional[CostModel] = None) -> dict:
    """Balance and throughput figures of the first ``steps`` optimizer steps of a plan, timed with
    ``truth`` (default: the plan's own predicted costs)."""
    n_steps = min(steps, plan.num_steps)
    n_micro = n_steps * plan.micro_steps_per_step
    c = (predicted_times(plan, truth) if truth is not None else plan.micro_step_costs())[:n_micro]
    nb = n_micro * plan.dp_size
    if n_micro == 0:
        return {"steps": 0, "micro_steps": 0, "samples": 0, "compute_cv_mean": float("nan")}
    mean, mx = c.mean(axis=1), c.max(axis=1)
    cv = c.std(axis=1) / mean
    tokens = int(plan.batch_tokens[:nb].sum())
    mem = plan.batch_memory[:nb] / m_mem
    sizes = plan.batch_sizes()[:nb]
    loop = loop_overhead_ms(truth, n_micro, n_steps) if truth is not None else 0.0
    wall = float(mx.sum()) + loop
    return {
        "steps": n_steps, "micro_steps": n_micro, "samples": int(sizes.sum()), "tokens": tokens,
        "compute_cv_mean": float(cv.mean()), "cv_p50": float(np.median(cv)), "cv_p90": float(np.quantile(cv, 0.9)),
        "cv_max": float(cv.max()),
        "balance_efficiency": float(mean.sum() / mx.sum()), "idle_fraction": float(1 - mean.sum() / mx.sum()),
        "predicted_tokens_per_s": float(tokens / (wall / 1e3)),
        "predicted_step_ms": float(wall / n_steps),
        "loop_overhead_ms": loop,
        "mean_batch_size": float(sizes.mean()),
        "memory_utilization": {"mean": float(mem.mean()), "max": float(mem.max())},
        "plan_total_steps": plan.num_steps,
    }


def _expected_batch(cost: CostModel, dist: Sequence[ShapeWeight], budgets: dict) -> float:
    """A pessimistic (large) expected batch size over the samplers: sizes the simulated dataset."""
    w = np.array([d.weight for d in dist], float)
    w /= w.sum()
    inv = 0.0
    for d, p in zip(dist, w):
        b = max(cost.max_batch_size(d.shape, budgets["m_mem"]), 1)
        inv += p / b
    return 1.0 / inv


def simulated_dataset(cost: CostModel, dist: Sequence[ShapeWeight], cfg: SamplerConfig, *, dp: int, steps: int,
                      seed: int, micro_steps_per_step: int, gpu_mem_gib: Optional[float]):
    """``(budgets, n, shapes)``: the ``dual`` budgets under ``cost`` and ``n`` samples drawn from ``dist``,
    enough for ``steps`` steps of the hungriest sampler plus one planning window."""
    uniq = [d.shape for d in dist]
    budgets = resolve_budgets(mode="dual", cost=cost, shapes=uniq, m_mem=cfg.m_mem, m_comp=cfg.m_comp,
                              max_tokens=cfg.max_tokens, gpu_mem_gib=gpu_mem_gib,
                              mem_utilization=cfg.mem_utilization, zero_stage=3, dp_size=dp)   # the shipped configs' ZeRO-3
    per_step = dp * micro_steps_per_step * _expected_batch(cost, dist, budgets)
    n = int(math.ceil(per_step * steps * 1.3)) + cfg.window * dp
    return budgets, n, draw_shapes(dist, n, seed)


def simulate(*, world: int, sp: int = 1, steps: int = 50, seed: int = 0,
             dist: Optional[Sequence[ShapeWeight]] = None, profile: Optional[str] = None,
             sampler_cfg: Optional[SamplerConfig] = None, micro_steps_per_step: int = 1,
             gpu_mem_gib: Optional[float] = None, samplers: Sequence[str] = SAMPLERS + (PAPER_VARIANT,),
             keep_plans: bool = False, num_layers: Optional[int] = None, whole_epoch: bool = False) -> dict:
    """Plan ``steps`` optimizer steps on ``world`` GPUs (Ulysses degree ``sp``) with each sampler.

    ``whole_epoch``: score every plan over its whole epoch (a dataset sized for ``steps`` steps of the
    hungriest sampler), not its first ``steps`` steps: the first steps alone are a draw of the dual plan's
    shuffled micro-steps, where one micro-step of long videos more or less decides a comparison.
    ``num_layers``: plan for a model of that many blocks (the profile rescaled by
    :meth:`ds_adaptive.planning.profile.Profile.with_num_layers`, as the trainer does for ``--layers``).
    ``profile`` default: :func:`default_profile_name`; ``dist`` default: the profiled model's mix."""
    if world % sp:
        raise ValueError(f"--world {world} is not divisible by --sp {sp}")
    profile = profile or default_profile_name()
    cfg = sampler_cfg or SamplerConfig(profile=profile)
    if cfg.profile != profile and sampler_cfg is None:
        cfg = cfg.model_copy(update={"profile": profile})
    dp = world // sp
    prof = resolve_auto_profile(None)[0] if cfg.profile == "auto" else load_profile(cfg.profile)
    dist = list(dist) if dist is not None else profile_distribution(prof)
    prof = prof.with_num_layers(num_layers) if num_layers is not None else prof
    cost = CostModel(prof, cfg.cost_model, p=cfg.p, sp=sp)
    truth = CostModel(cost.profile, "calibrated", sp=sp)   # what the GPUs would take (ms)
    budgets, n, shapes = simulated_dataset(cost, dist, cfg, dp=dp, steps=steps, seed=seed,
                                           micro_steps_per_step=micro_steps_per_step, gpu_mem_gib=gpu_mem_gib)
    out = {"world": world, "sp": sp, "dp": dp, "micro_steps_per_step": micro_steps_per_step,
           "steps": steps, "seed": seed, "profile": cost.profile.name, "layers": cost.profile.num_layers,
           "cost_model": cost.mode,
           "cost_unit": cost.unit, "dataset_samples": n,
           "budgets": {"m_mem_gib": budgets["m_mem"], "m_comp": budgets["m_comp"],
                       "max_tokens": budgets["max_tokens"]},
           "samplers": {}}
    plans = {}
    for name in samplers:
        mode, scfg = name, cfg.model_copy(update={"seed": seed})
        if name == PAPER_VARIANT:
            mode, scfg = "dual", scfg.model_copy(update={"cost_model": "power"})
        s = build_batch_sampler(scfg, shapes, Layout.explicit(dp_size=dp, sp_size=sp),
                                micro_steps_per_step=micro_steps_per_step, mode=mode, gpu_mem_gib=gpu_mem_gib,
                                num_layers=num_layers)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = s.plan
        res = score_plan(plan, plan.num_steps if whole_epoch else steps, s.params.m_mem, truth)
        res["plan_mode"], res["m_comp"] = s.params.mode, s.params.m_comp
        res["oversize"] = len(plan.oversize)
        res["tail_dropped"] = len(plan.tail_dropped)
        out["samplers"][name] = res
        plans[name] = plan
    if keep_plans:
        out["_plans"] = plans
        out["_truth"] = truth
    return out


def plot(result: dict, path: str) -> None:
    """Per-micro-step CV (like the paper's Fig. 6/7), its distribution, and per-rank load."""
    plans = result["_plans"]
    fig = agg_figure(figsize=(16, 4.5))
    axes = fig.subplots(1, 3)
    colors = {"tokens": "tab:red", "fixed": "tab:orange", "dual": "tab:blue", PAPER_VARIANT: "tab:green"}
    cvs = {}
    for mode, plan in plans.items():
        n_micro = result["samplers"][mode]["micro_steps"]
        c = predicted_times(plan, result["_truth"])[:n_micro]
        if not len(c):
            continue
        cv = c.std(axis=1) / c.mean(axis=1)
        cvs[mode] = cv
        axes[0].plot(np.arange(len(cv)), cv * 100, lw=0.8, color=colors.get(mode), label=f"{mode} (mean {cv.mean():.1%})")
        busy = (c / c.max(axis=1, keepdims=True)).mean(axis=0)
        axes[2].plot(np.arange(len(busy)), busy * 100, marker="." if len(busy) <= 64 else None, lw=0.8,
                     color=colors.get(mode), label=f"{mode} (mean {busy.mean():.1%})")
    axes[0].set(xlabel="micro-step", ylabel="CV of per-rank predicted time [%]",
                title=f"Per-micro-step imbalance, {result['world']} GPUs, sp={result['sp']}")
    axes[0].legend()
    axes[1].boxplot(list(cvs.values()), whis=(5, 95), showfliers=False)
    axes[1].set_xticks(range(1, len(cvs) + 1), [m for m in cvs])
    axes[1].set(ylabel="CV per micro-step", title="CV distribution (box 25-75%, whiskers 5-95%)")
    axes[2].set(xlabel="data-parallel rank", ylabel="busy time / micro-step time [%]",
                title="Per-rank load (100% = never waits)", ylim=(0, 105))
    axes[2].legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)

