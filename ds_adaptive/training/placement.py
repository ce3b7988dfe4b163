"""What ``build_run`` decides for the held-out split and the EMA before the model exists.

    dataset, held_out = split_for_validation(cfg, dataset, notes)        # adaptive_load.validation
    n = ema_param_count(cfg, preset, model_config, adapters)              # what the memory model counts
    sampler, plan, ema_device = sampler_and_ema(build, cfg, layout, ds_config, notes, device=..., ema_params=n)

The EMA on the accelerator is static memory the plan counts (``Profile.with_ema``: ``m_mem: auto`` shrinks by it);
with ``ema.device: auto`` it stays there unless that costs the plan a sample or its ``m_mem`` (:func:`ema_crowds_out`):
then the plan is made without it and the EMA lives in host memory.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ds_adaptive.core.config import ConfigError
from ds_adaptive.core.features import validation_count
from ds_adaptive.data import split_held_out
from ds_adaptive.planning.memory import sample_memory

__all__ = ["split_for_validation", "ema_param_count", "sampler_and_ema", "ema_crowds_out"]


def split_for_validation(cfg, dataset, notes: list):
    """``(training split, held-out split)`` for ``adaptive_load.validation`` (else ``(dataset, None)``)."""
    v = cfg.adaptive_load.validation
    if v is None:
        return dataset, None
    try:
        count = validation_count(v, len(dataset))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    train, held_out = split_held_out(dataset, count=count, seed=v.seed)
    notes.append(f"validation: {count} of {len(dataset)} samples held out (adaptive_load.validation.samples "
                 f"{v.samples!r}, seed {v.seed}); the sampler plans the other {len(train)}")
    return train, held_out


def ema_param_count(cfg, preset, model_config, adapters: Optional[int]) -> Optional[int]:
    """Parameters the EMA averages (the memory model's count; None without ``adaptive_load.ema``): the LoRA
    adapters, else every parameter of the model (counted on the meta device)."""
    ema = cfg.adaptive_load.ema
    if ema is None:
        return None
    if cfg.adaptive_load.lora.enabled:
        return int(adapters)
    with torch.device("meta"):
        return sum(p.numel() for p in preset.build(model_config).parameters())


def sampler_and_ema(build: Callable, cfg, layout, ds_config: dict, notes: list, *, device: torch.device,
                    ema_params: Optional[int], gpu_mem_gib=None):
    """``(sampler, its RunPlan, where the EMA lives)`` (None: no EMA). ``build(notes, ema_params)`` builds the run's
    batch sampler and resolves its plan (``(sampler, plan)``), its notes into ``notes``, planning with an EMA of ``ema_params`` on the accelerator (None: none).
    ``ema.device: auto`` keeps the EMA on ``device`` unless :func:`ema_crowds_out` (or a budget left at nothing)
    says what that costs: then the plan is made again without it, the EMA goes to the CPU, a note names both."""
    ema = cfg.adaptive_load.ema
    if ema is None or ema.device == "cpu":
        sampler, plan = build(notes, None)
        return sampler, plan, (None if ema is None else torch.device("cpu"))
    gas, trial = ds_config["gradient_accumulation_steps"], []
    gib = ema_params * 4 / max(layout.world_size, 1) / 2**30
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    try:
        sampler, plan = build(trial, ema_params)
        problem = ema_crowds_out(sampler, plan, cfg, gib, gpu_mem_gib, zero_stage=stage, world=layout.world_size)
    except ValueError as exc:   # m_mem auto found no memory left, or a sample over every budget
        if ema.device != "auto":
            raise
        problem = str(exc).split(". ")[0]
    if problem is None or ema.device != "auto":
        notes.extend(trial)
        return sampler, plan, device
    ds_config["gradient_accumulation_steps"] = gas   # the first attempt resolved "auto": plan it again
    sampler, plan = build(notes, None)
    notes.append(f"EMA on the CPU (adaptive_load.ema.device auto): {gib:.2f} GiB per rank on the accelerator would "
                 f"leave too little for the plan ({problem}); each update copies the rank's slice to the host")
    return sampler, plan, torch.device("cpu")


def ema_crowds_out(sampler, plan, cfg, ema_gib: float, gpu_mem_gib, *, zero_stage: int,
                   world: int) -> Optional[str]:
    """What the EMA on the accelerator costs the plan, or None: a ``sampler.m_mem`` that no longer fits beside the
    static memory, or a sample that fits one GPU at batch 1 only without the EMA's ``ema_gib``. ``plan``: the
    sampler's :class:`ds_adaptive.core.run_plan.RunPlan` (its ``m_mem``)."""
    cost, m_mem = sampler.cost, plan.m_mem
    room = cost.usable_memory_gib(gpu_mem_gib, cfg.adaptive_load.sampler.mem_utilization) - \
        cost.profile.static_memory_gib(zero_stage, world)
    if m_mem > room * (1 + 1e-9):
        return f"sampler.m_mem {m_mem:.2f} GiB > the {room:.2f} GiB left beside the static memory"
    lost = [s for s in sorted(sampler.shapes.unique, key=str) if m_mem < sample_memory(cost, s) <= m_mem + ema_gib]
    if lost:
        return (f"m_mem {m_mem:.2f} GiB < the {sample_memory(cost, lost[0]):.2f} GiB one sample of {lost[0]} needs, "
                f"which fits without the EMA")
    return None
