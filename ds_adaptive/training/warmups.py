"""What compiles before step 1: the sparse-attention backend and block fusion, for the plan's micro-batches.

    warm_sparse(hook, sampler, dtype=run.dtype, log=log)           # DSV sparse attention (``sparse_attention``)
    warm_block_fusion(fusion, sampler, sp=2, epoch=0, pin_memory=False)   # ``adaptive_load.block_fusion``

A step that compiles mid-run makes every other rank wait at its next collective; compiling for the plan's
(B, S) pairs first keeps every step's time a step's time. Later plans (a new epoch, a sparse re-plan) are
compiled for by :class:`ds_adaptive.training.fusion_warmup.FusionWarmup` before their first step.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ds_adaptive.core.config import ConfigError

__all__ = ["planned_micro_batches", "fusion_pairs", "warm_sparse", "warm_block_fusion"]


def planned_micro_batches(plan) -> set:
    """The distinct (B, shape) of a plan's micro-batches."""
    sizes = plan.batch_offsets[1:] - plan.batch_offsets[:-1]
    return {(int(b), plan.shapes[int(j)]) for b, j in zip(sizes, plan.batch_shape)}


def fusion_pairs(plan, sp: int) -> set:
    """The (B, tokens per rank) pairs of a plan's micro-batches (what block fusion compiles for)."""
    return {(b, shape.padded_tokens(sp) // sp) for b, shape in planned_micro_batches(plan)}


def warm_sparse(sparse, sampler, *, dtype: torch.dtype, log: Callable[[str], None]) -> None:
    """Before step 1: the sparse backend compiles for the plan's (B, S) micro-batches (shapes are dynamic: a
    handful of graphs whatever the plan; a re-plan adds none); the time is in the summary
    (``sparse_attention.warmup_s``)."""
    cost = sampler.cost
    shapes = {(b, cost.padded_tokens(shape)) for b, shape in planned_micro_batches(sampler.plan)}
    t0 = time.perf_counter()
    spent = sparse.runtime.warmup(shapes, dtype=dtype)
    if spent:
        log(f"ds_adaptive: sparse attention warm-up: {spent:.1f} s ({time.perf_counter() - t0:.1f} s with "
            f"planning) for {len(shapes)} planned (batch, tokens) pairs")


def warm_block_fusion(fusion, sampler, *, sp: int, epoch: int, pin_memory: bool) -> None:
    """Before step 1: ``adaptive_load.block_fusion`` compiles its pieces for the plan's (B, tokens per rank)
    pairs (torch specialises B = 1, Inductor some element counts), so that no step compiles; the trainer does the
    same for pairs a later plan adds (:class:`FusionWarmup`). ``fusion`` None (block fusion off): nothing. A
    fallback to eager blocks where the plan counted the fused blocks' smaller activations is a ConfigError."""
    if fusion is None:
        return
    if pin_memory:   # the loader's pin-memory thread sets the process's threads to 1 (torch), and the
        torch.set_num_threads(1)   # compiled graphs guard on the count: set it now, as training will have it
    fusion.before_step(sampler.plan, lambda: fusion_pairs(sampler.plan, sp), epoch)
    planned = sampler.cost.profile.block_fusion
    if fusion.fallback and planned != "off":
        raise ConfigError(f"adaptive_load.block_fusion '{fusion.mode}' could not compile here, but the plan "
                          f"counts its smaller activations (profile '{sampler.cost.profile.name}' entries "
                          f"for block fusion '{planned}'): eager blocks could run out of memory. Install a working "
                          "triton, or set adaptive_load.block_fusion to 'off'")
