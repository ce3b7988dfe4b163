"""The run's :class:`~ds_adaptive.training.metrics.StepMetrics` and the facts about the run its logs carry.

    metrics = open_metrics(run, engine, log=print)   # run_info (model, layout, plan, dataset), compute timing, the line
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from ds_adaptive.ops.ln_modulate import op_status
from ds_adaptive.training.assemble import leaf_block_count
from ds_adaptive.training.metrics import StepMetrics, truncate_jsonl

__all__ = ["run_info", "open_metrics"]


def run_info(run) -> dict:
    """What the summary and the W&B config say about ``run``: model, layout, dtype, sampler, plan, data."""
    opts, al, layout = run.cfg.trainer, run.cfg.adaptive_load, run.layout
    info = {
        "model": opts.model, "layers": run.model_config.num_layers, "objective": run.objective.as_dict(),
        "world_size": layout.world,
        "dp_size": layout.dp_size, "sp": layout.sp_size, "device": run.device.type,
        "dtype": str(run.dtype).replace("torch.", ""), "gradient_accumulation_steps": run.gas,
        "adaptive_load": al.enabled, "sampler": type(run.sampler).__name__,
        "sampler_mode": al.sampler.mode if al.enabled else "tokens", "fused_ln_modulate": al.fused_ln_modulate,
        "grad_ckpt": al.recompute.blocks, "checkpoint_attention": run.plan.checkpoint_attention,
        "profile": run.profile.name,
        "checkpoint_source": run.profile.checkpoint_source, "data": opts.data,
        "dataset": run.dataset.describe(),
        "loss_weighting": al.optimization.loss_weighting, "plan": run.sampler.epoch_stats(),
        "global_batch": None if al.sampler.global_batch is None else al.sampler.global_batch.model_dump(exclude_none=True),
        "zero3_leaf_blocks": leaf_block_count(run.model),
        "run_plan": run.plan.describe(),   # the start-up choices as build_run resolved them (core.run_plan)
    }
    if al.fused_ln_modulate:
        info["ln_modulate_op"] = op_status()
    return info


def open_metrics(run, engine, log: Callable[[str], None], resumed_step: Optional[int] = None) -> StepMetrics:
    """The run's StepMetrics (rank 0 writes; SP ranks > 0 do not count samples), compute timing attached to
    ``engine`` unless ``--no-compute-timing``; one line describes the run. ``resumed_step``: a resumed run first
    drops the steps after it from metrics.jsonl (they are trained again: each step is in the file once)."""
    opts, al, layout = run.cfg.trainer, run.cfg.adaptive_load, run.layout
    if resumed_step is not None and layout.rank == 0 and al.metrics.jsonl:
        dropped = truncate_jsonl(Path(al.metrics.log_dir) / "metrics.jsonl", resumed_step)
        if dropped:
            log(f"ds_adaptive: {al.metrics.log_dir}/metrics.jsonl: dropped {dropped} line(s) after step "
                f"{resumed_step} (this run trains those steps again)")
    info = run_info(run)
    metrics = StepMetrics(al.metrics, micro_steps_per_step=run.gas, device=run.device, log_dir=al.metrics.log_dir,
                          is_writer=layout.rank == 0, count_this_rank=layout.sp_rank == 0, run_info=info)
    if opts.compute_timing:
        metrics.attach_engine(engine)
    w = run.model_config
    log(f"ds_adaptive: {opts.model} ({w.num_layers} blocks, dim {w.dim}) on {layout.world} "
        f"{run.device.type} rank(s), {info['dtype']}, gas {run.gas}; {run.dataset.describe()}; sampler "
        f"{info['sampler']} ({run.sampler.steps_per_epoch} steps/epoch); logs in {al.metrics.log_dir}")
    return metrics
