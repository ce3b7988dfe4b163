"""A whole epoch on paper at any world size, planned as the trainer plans it from a ds_config.

    ds-adaptive simulate --config launch/configs/zero3_adaptive.json --world 1024 --num-samples 1000000 --json

The sampler is :func:`ds_adaptive.planning.sampler.build_batch_sampler` with the ds_config's ``adaptive_load``
block, ``gradient_accumulation_steps`` and ZeRO stage, for a GPU run (the fused LayerNorm-modulate path when the
block asks for it, its ``block_fusion``), on ``Layout.for_world(world, sp)``; the dataset is ``num_samples`` shapes
drawn from the model's shape mix (or ``shapes``). Reported (:func:`simulate_epoch`):

    samples_per_step, tokens_per_step   {mean, min, max} over the epoch's optimizer steps (global: all DP ranks)
    global_batch                        the config's ``sampler.global_batch`` (None: not set)
    optimizer_steps, micro_steps_per_step, m_comp, plan_mode
    plan_s                              wall time of building the sampler (budget search included) and
                                        planning the epoch, in this process (``plan_cpu_s``: its CPU time)
    peak_rss_mb                         this process's peak resident memory (MB) at the end
    dual / tokens                       predicted CV (mean over micro-steps of per-rank time CV) and tokens/s
                                        (``ds_adaptive.simulation.simulate.score_plan``, calibrated times) of
                                        the plan and of the equal-token baseline at the same global batch
"""
from __future__ import annotations

import resource
import sys
import time
import warnings
from typing import Optional


from ds_adaptive.core.ds_config import load_adaptive_config, read_ds_config
from ds_adaptive.core.layout import Layout
from ds_adaptive.core.shapes import IndexedShapes, load_shape_distribution
from ds_adaptive.data.index import ShardIndex, find_index
from ds_adaptive.models.registry import default_model, get_model
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.global_batch import step_stats
from ds_adaptive.planning.plan_types import PlanError
from ds_adaptive.planning.sampler import build_batch_sampler
from ds_adaptive.simulation.simulate import draw_shapes, score_plan

__all__ = ["simulate_epoch", "peak_rss_mb", "dataset_shapes"]


def peak_rss_mb() -> float:
    """Peak resident memory of this process (MB)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 1e6 if sys.platform == "darwin" else r / 1e3


def dataset_shapes(root: str, model) -> IndexedShapes:
    """The shapes of the dataset directory ``root``'s samples (its Arrow index: the shape ids and the distinct
    shapes, no tensor read, no object per sample)."""
    path = find_index(root)
    if path is None:
        raise FileNotFoundError(f"--data {root}: no index.arrow (or legacy index.json) in it; write one with "
                                "`ds-adaptive preprocess` or convert it with `ds-adaptive data convert`")
    idx = ShardIndex.open(path, model.input_spec)
    return IndexedShapes(idx.unique_shapes(), idx.shape_ids()).compact()


def _sampler_row(sampler, truth: CostModel) -> dict:
    plan = sampler.plan
    score = score_plan(plan, plan.num_steps, sampler.params.m_mem, truth)
    st = step_stats(plan)
    return {"plan_mode": sampler.params.mode, "m_comp": sampler.params.m_comp,
            "micro_steps_per_step": sampler.micro_steps_per_step, "optimizer_steps": plan.num_steps,
            "samples_per_step": st["samples"], "tokens_per_step": st["tokens"],
            "predicted_cv": score.get("compute_cv_mean"), "predicted_tokens_per_s": score.get("predicted_tokens_per_s"),
            "samples_planned": plan.num_samples, "oversize": len(plan.oversize),
            "tail_dropped": len(plan.tail_dropped)}


def simulate_epoch(config: str, *, world: int, num_samples: int, sp: int = 1, model: Optional[str] = None,
                   shapes: Optional[str] = None, seed: int = 0, gpu_mem_gib: Optional[float] = None,
                   profile: Optional[str] = None, baseline: bool = True, data: Optional[str] = None) -> dict:
    """Plan one epoch of ``num_samples`` samples on ``world`` GPUs as the trainer would with the ds_config at
    ``config`` (see the module doc for the keys). ``profile`` overrides ``sampler.profile``; ``baseline``: also plan
    the equal-token baseline (``enabled: false``) at the same global batch. ``data``: plan the shapes of this dataset
    directory's index (``ds_adaptive.data.index``) instead of ``num_samples`` drawn ones."""
    ds = read_ds_config(config)
    block = load_adaptive_config(ds)
    s_cfg = block.sampler if profile is None else block.sampler.model_copy(update={"profile": profile})
    model = model or default_model()
    m = get_model(model)
    dist = load_shape_distribution(shapes or s_cfg.shapes or m.shapes, grid=m.grid)
    if data is not None:
        data = dataset_shapes(data, m)
        num_samples = len(data)
    else:
        data = draw_shapes(dist, int(num_samples), seed)
    gas = ds.get("gradient_accumulation_steps", 1)
    gas = gas if gas == "auto" else int(gas)
    stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
    layout = Layout.for_world(int(world), int(sp))
    kw = dict(micro_steps_per_step=gas, gpu_mem_gib=gpu_mem_gib, model_name=model, zero_stage=stage,
              ln_modulate="fused" if block.fused_ln_modulate else "reference", block_fusion=block.block_fusion,
              per_token_timesteps=m.trains_per_token_timesteps(), recompute=block.recompute,
              optimization=block.optimization)
    notes: list[str] = []
    t0, c0 = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler = build_batch_sampler(s_cfg, data, layout, enabled=block.enabled, profile_log=notes.append, **kw)
        plan = sampler.plan
    plan_s, plan_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    truth = CostModel(sampler.cost.profile, "calibrated", sp=layout.sp_size,
                      checkpointing=sampler.cost.checkpointing,
                      checkpoint_attention=sampler.cost.checkpoint_attention)
    row = _sampler_row(sampler, truth)
    plan_samples, profile_name = plan.num_samples, sampler.cost.profile.name
    del sampler, plan   # the baseline's plan need not sit beside this one (peak memory)
    out = {"config": str(config), "world": int(world), "sp": layout.sp_size, "dp": layout.dp_size,
           "num_samples": int(num_samples), "model": model, "profile": profile_name,
           "global_batch": None if getattr(s_cfg, "global_batch", None) is None else s_cfg.global_batch.model_dump(exclude_none=True),
           "plan_s": plan_s, "plan_cpu_s": plan_cpu_s, **{k: row[k] for k in ("samples_per_step", "tokens_per_step", "optimizer_steps",
                                                   "micro_steps_per_step", "m_comp", "plan_mode")},
           "dual": {"predicted_cv": row["predicted_cv"], "predicted_tokens_per_s": row["predicted_tokens_per_s"]},
           "samplers": {"adaptive": row}, "notes": notes, "plan_samples": plan_samples}
    if baseline:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                base = build_batch_sampler(s_cfg, data, layout, enabled=False, **kw)
        except PlanError as exc:   # e.g. the equal-token batches cannot hold this global batch
            out["tokens"] = {"error": str(exc), "predicted_cv": None, "predicted_tokens_per_s": None}
        else:
            brow = _sampler_row(base, truth)
            out["samplers"]["tokens"] = brow
            out["tokens"] = {"predicted_cv": brow["predicted_cv"],
                             "predicted_tokens_per_s": brow["predicted_tokens_per_s"]}
    out["peak_rss_mb"] = peak_rss_mb()
    return out
