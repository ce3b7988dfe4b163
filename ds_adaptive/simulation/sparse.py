"""Sparse attention on paper: does a planner that balances *dense* cost still balance sparse micro-steps?

``ds-adaptive simulate --world 16 --sp 4 --sparse synthetic`` (or ``--sparse densities.json`` /
``--sparse run/metrics.jsonl``)

Every arm plans the same shuffled dataset at the same memory budget; every arm is *timed* with the
sparse truth (:class:`ds_adaptive.planning.sparse_cost.SparseAttentionCost` on the calibrated profile:
the densities, the kernel's efficiency curve, the selection term, the busiest SP rank's heads):

    dense_cost       dual planner with the dense cost ``c0 + aS + bS^2`` (what a sparse run gets
                     from a planner that ignores sparsity); heads placed as in ``sparse``
    sparse           dual planner with the sparse cost; density-balanced head placement (sp > 1)
    sparse_identity  (sp > 1) dual planner with the sparse cost, heads NOT re-placed: planned and
                     timed with the identity placement (the head-placement effect)
    tokens           the equal-token baseline under the same sparsity
    dense_attention  reference: the dense run (no sparsity), dual planner, dense truth

Fields per arm as in ``ds-adaptive simulate`` (``compute_cv_mean``, ``balance_efficiency``,
``predicted_tokens_per_s``, ...). ``ratios``: ``cv_dense_cost_over_sparse`` (how much worse the
dense-cost planner balances) and ``tokens_per_s_sparse_over_dense_cost`` (predicted gain).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import load_profile
from ds_adaptive.planning.sampler import build_batch_sampler
from ds_adaptive.core.layout import Layout
from ds_adaptive.planning.devices import default_profile_name
from ds_adaptive.simulation.simulate import profile_distribution, score_plan, simulated_dataset
from ds_adaptive.planning.sparse_cost import SparseAttentionCost, load_efficiency
from ds_adaptive.core.contracts import DensityMap, load_densities, synthetic_densities
from ds_adaptive.core.figure import agg_figure
from ds_adaptive.core.config import SamplerConfig
from ds_adaptive.core.shapes import ShapeWeight
from ds_adaptive.planning.budget import predicted_times

ARMS = ("dense_cost", "sparse", "sparse_identity", "tokens", "dense_attention")


def resolve_densities(spec: "str | DensityMap", *, num_layers: int, num_heads: int, seed: int = 0,
                      step: Optional[int] = None) -> DensityMap:
    """``synthetic`` (:func:`synthetic_densities` for the model, 0.02-0.5), a density json, a
    run's metrics.jsonl, or a DensityMap."""
    if isinstance(spec, DensityMap):
        return spec
    if spec == "synthetic":
        return synthetic_densities(num_layers, num_heads, seed=seed)
    return load_densities(spec, step=step)


def simulate_sparse(*, world: int, sp: int = 1, steps: int = 50, seed: int = 0,
                    densities: "str | DensityMap" = "synthetic", efficiency=None,
                    dist: Optional[Sequence[ShapeWeight]] = None, profile: Optional[str] = None,
                    sampler_cfg: Optional[SamplerConfig] = None, micro_steps_per_step: int = 1,
                    gpu_mem_gib: Optional[float] = None, arms: Sequence[str] = ARMS,
                    keep_plans: bool = False) -> dict:
    """Plan ``steps`` optimizer steps on ``world`` GPUs with every arm and time them with the sparse truth."""
    if world % sp:
        raise ValueError(f"--world {world} is not divisible by --sp {sp}")
    profile = profile or default_profile_name()
    cfg = (sampler_cfg or SamplerConfig(profile=profile)).model_copy(update={"seed": seed, "profile": profile})
    prof = load_profile(profile)
    dist = list(dist) if dist is not None else profile_distribution(prof)
    dm = resolve_densities(densities, num_layers=prof.num_layers, num_heads=prof.num_heads, seed=seed)
    eff = load_efficiency(efficiency)
    dp = world // sp
    sparse_bal = SparseAttentionCost(dm, efficiency=eff, head_placement="balanced")
    sparse_id = SparseAttentionCost(dm, efficiency=eff, head_placement="identity")
    truth = {"balanced": CostModel(prof, sp=sp, sparse=sparse_bal), "identity": CostModel(prof, sp=sp, sparse=sparse_id),
             "dense": CostModel(prof, sp=sp)}
    # the dense budgets for every arm (sparse batches are larger: the dense-cost dataset is the hungriest)
    _, n, shapes = simulated_dataset(truth["dense"], dist, cfg, dp=dp, steps=steps, seed=seed,
                                     micro_steps_per_step=micro_steps_per_step, gpu_mem_gib=gpu_mem_gib)
    arms = [a for a in arms if sp > 1 or a != "sparse_identity"]
    spec = {"dense_cost": ("dual", None, "balanced"), "sparse": ("dual", sparse_bal, "balanced"),
            "sparse_identity": ("dual", sparse_id, "identity"), "tokens": ("tokens", None, "balanced"),
            "dense_attention": ("dual", None, "dense")}
    out = {"world": world, "sp": sp, "dp": dp, "steps": steps, "seed": seed, "profile": prof.name,
           "micro_steps_per_step": micro_steps_per_step, "dataset_samples": n,
           "densities": {"source": dm.source, "num_layers": dm.num_layers, "num_heads": dm.num_heads,
                         "min": min(min(r) for r in dm.density), "max": max(max(r) for r in dm.density),
                         "mean": sum(map(sum, dm.density)) / (dm.num_layers * dm.num_heads),
                         "dense_layers": list(dm.dense_layers)},
           "efficiency": eff.as_dict(),
           "rho_eff": {name: {str(s): truth[name].sparse.rho_eff(s, sp) for s in (1560, 7800, 32760, 75600)}
                       for name in ("balanced", "identity")},
           "samplers": {}}
    plans, truths = {}, {}
    for arm in arms:
        mode, sparse, tname = spec[arm]
        s = build_batch_sampler(cfg, shapes, Layout.explicit(dp_size=dp, sp_size=sp), micro_steps_per_step=micro_steps_per_step,
                                mode=mode, gpu_mem_gib=gpu_mem_gib, sparse=sparse)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = s.plan
        res = score_plan(plan, steps, s.params.m_mem, truth[tname])
        res.update(oversize=len(plan.oversize), tail_dropped=len(plan.tail_dropped), timed_with=tname,
                   m_comp=s.params.m_comp)
        out["samplers"][arm] = res
        plans[arm], truths[arm] = plan, truth[tname]
    r = out["samplers"]
    if "dense_cost" in r and "sparse" in r:
        out["ratios"] = {
            "cv_dense_cost_over_sparse": r["dense_cost"]["compute_cv_mean"] / max(r["sparse"]["compute_cv_mean"], 1e-12),
            "tokens_per_s_sparse_over_dense_cost": r["sparse"]["predicted_tokens_per_s"] / r["dense_cost"]["predicted_tokens_per_s"]}
        if "dense_attention" in r:
            out["ratios"]["tokens_per_s_sparse_over_dense_attention"] = (
                r["sparse"]["predicted_tokens_per_s"] / r["dense_attention"]["predicted_tokens_per_s"])
        if "sparse_identity" in r:
            out["ratios"]["tokens_per_s_placed_over_identity"] = (
                r["sparse"]["predicted_tokens_per_s"] / r["sparse_identity"]["predicted_tokens_per_s"])
    if keep_plans:
        out["_plans"], out["_truths"] = plans, truths
    return out


def table(result: dict) -> str:
    d = result["densities"]
    rows = [f"{result['world']} GPUs, sp={result['sp']} (dp={result['dp']}), {result['steps']} steps, profile "
            f"{result['profile']}, densities {d['min']:.3f}-{d['max']:.3f} (mean {d['mean']:.3f}) {d['source']}",
            f"{'arm':>16} {'timed with':>10} {'CV mean':>8} {'CV p90':>8} {'balance':>8} {'tok/s':>10} {'samples':>8}"]
    for arm, r in result["samplers"].items():
        rows.append(f"{arm:>16} {r['timed_with']:>10} {r['compute_cv_mean']:>8.2%} {r['cv_p90']:>8.2%} "
                    f"{r['balance_efficiency']:>8.2%} {r['predicted_tokens_per_s']:>10.0f} {r['samples']:>8}")
    for k, v in result.get("ratios", {}).items():
        rows.append(f"  {k}: {v:.2f}x")
    return "\n".join(rows)


def plot(result: dict, path: str) -> None:
    """Per-micro-step CV and per-rank load of every arm, each timed with its truth."""
    fig = agg_figure(figsize=(17, 4.6))
    axes = fig.subplots(1, 3)
    colors = {"dense_cost": "tab:red", "sparse": "tab:blue", "sparse_identity": "tab:purple", "tokens": "tab:orange",
              "dense_attention": "tab:gray"}
    for arm, plan in result["_plans"].items():
        n_micro = result["samplers"][arm]["micro_steps"]
        c = predicted_times(plan, result["_truths"][arm])[:n_micro]
        if not len(c):
            continue
        cv = c.std(axis=1) / c.mean(axis=1)
        axes[0].plot(cv * 100, lw=0.8, color=colors.get(arm), label=f"{arm} (mean {cv.mean():.1%})")
        busy = (c / c.max(axis=1, keepdims=True)).mean(axis=0)
        axes[1].plot(busy * 100, lw=0.8, marker="." if len(busy) <= 64 else None, color=colors.get(arm),
                     label=f"{arm} (mean {busy.mean():.1%})")
        m = min(len(c), 40)
        if arm == "tokens":   # its long micro-steps would flatten the planners' curves
            continue
        axes[2].plot(np.arange(m), c[:m].max(axis=1) / 1e3, lw=1.0, color=colors.get(arm), label=f"{arm} max rank")
        axes[2].fill_between(np.arange(m), c[:m].min(axis=1) / 1e3, c[:m].max(axis=1) / 1e3, color=colors.get(arm),
                             alpha=0.12)
    w, sp = result["world"], result["sp"]
    axes[0].set(xlabel="micro-step", ylabel="CV of per-rank time [%]", title=f"Sparse truth, {w} GPUs, sp={sp}")
    axes[1].set(xlabel="data-parallel rank", ylabel="busy / micro-step time [%]", title="Per-rank load", ylim=(0, 105))
    axes[2].set(xlabel="micro-step", ylabel="per-rank time [s] (band: min..max)", title="Per-rank cost, first 40 micro-steps (dual planners)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
