"""Throughput-optimal compute budget: ``m_comp: auto`` under memory-aware checkpointing.

With every block checkpointed a micro-batch's time per token falls as it grows (the per-micro-batch
overhead is spread over more samples), so the smallest budget under which no sample is oversize -- the
costliest sample at B=1 -- was the natural ``auto``. With the checkpoint plan (``ds_adaptive.balance.memory``)
that is no longer so: a micro-batch that fills the memory budget must checkpoint blocks, and each one
adds a recomputed forward for every sample of the batch. On an H200 (Wan 1.3B), 21 images of
1x480x832 with no block checkpointed train at ~41k tokens/s; 191 of them (28 blocks checkpointed) at
~32.5k. A smaller compute budget gives smaller micro-batches that checkpoint fewer blocks, and pays the
per-micro-step and per-optimizer-step time of the training loop more often.

:func:`choose_compute_budget` picks, from a small candidate set, the budget with the highest predicted
tokens/s over a plan of the epoch's first samples::

    time = sum over micro-steps of (max over DP ranks of the batch cost  +  micro_step_overhead)
         + optimizer steps x optimizer_step_overhead
    tokens/s = planned tokens / time

Batch costs come from the checkpoint plan (fwd + bwd + the recomputed forwards of exactly the checkpointed
blocks, ``CostModel.ckpt_cost``); the overheads from the profile (``Profile.micro_step_overhead_ms``,
``optimizer_step_overhead_ms``). The plans are the planner's own (``plan_epoch``), so every micro-step stays
cost-balanced across DP ranks, and the imbalance a budget causes is in its predicted time.

Candidates: the reference (the costliest sample at B=1 with its own checkpoint plan: the old ``auto``),
each shape's B=1 cost and the cost of its largest micro-batch that needs no checkpointing (the per-shape
efficiency optimum when the overheads are small), and a geometric grid between the smallest of them and
the reference; all at most the reference.

Samples costlier than the chosen budget (the longest videos) run alone, B=1: the plan is made with
``PlannerParams.solo_over_budget``, so such a sample is never oversize while it fits ``m_mem``, and the
other ranks of its micro-step get batches grown to its cost (within ``m_mem``). Memory is never traded:
every batch of every candidate is within ``m_mem`` (the planner's memory bound does not depend on
``m_comp``).

Gradient accumulation: with ``micro_steps_per_step="auto"`` (ds_config ``"gradient_accumulation_steps":
"auto"``) a candidate budget ``m`` gets ``ceil(reference / m)`` micro-steps per optimizer step, so an
optimizer step covers at least the work of one reference micro-batch, as before; an int is kept as given
(DeepSpeed's value). The chosen pair is published as ``BudgetChoice.micro_steps_per_step``; the trainer
gives DeepSpeed that gradient_accumulation_steps and checks the engine agrees.

Pure and deterministic: a function of (per-sample shapes, seed, cost model, m_mem, dp_size, window,
tolerance, gas), identical on every rank (dp_rank is not an input) and after a resume.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from ds_adaptive.balance.cost import CostModel
from ds_adaptive.balance.memory import micro_batch_table, sample_memory
from ds_adaptive.balance.planner import EpochPlan, PlannerParams, plan_epoch, unique_shapes
from ds_adaptive.shapes import SampleShape

__all__ = ["BudgetChoice", "choose_compute_budget", "candidate_budgets", "predicted_time_ms", "uses_budget_search",
           "SEARCH_SAMPLES", "SEARCH_SAMPLES_MAX", "GRID_POINTS"]

#: samples of the epoch-0 order planned per candidate (all of them for smaller datasets): at least this
#: many and two planning windows, at most SEARCH_SAMPLES_MAX (1024 DP ranks: ~20 candidates in seconds)
SEARCH_SAMPLES = 2048
SEARCH_SAMPLES_MAX = 65536
#: points of the geometric grid between the smallest per-shape candidate and the reference
GRID_POINTS = 8


@dataclass(frozen=True)
class BudgetChoice:
    """The chosen compute budget and what it was chosen over."""

    m_comp: float
    micro_steps_per_step: int
    predicted_tokens_per_s: float
    #: the costliest sample at B=1 (the budget under which no sample is oversize; the old ``auto``)
    reference_m_comp: float
    #: predicted tokens/s of the reference budget, at its own micro-steps per step
    reference_tokens_per_s: float
    samples_planned: int
    #: every candidate: {"m_comp", "micro_steps_per_step", "tokens_per_s", "micro_steps"}
    candidates: tuple = field(default=(), repr=False)

    def describe(self) -> dict:
        return {"m_comp": self.m_comp, "micro_steps_per_step": self.micro_steps_per_step,
                "predicted_tokens_per_s": self.predicted_tokens_per_s, "reference_m_comp": self.reference_m_comp,
                "reference_tokens_per_s": self.reference_tokens_per_s, "samples_planned": self.samples_planned,
                "candidates": [dict(c) for c in self.candidates]}


def uses_budget_search(cost: CostModel, mode: str) -> bool:
    """``m_comp: auto`` searches for the throughput-optimal budget only in ``dual`` mode with the calibrated
    (ms) cost model and the memory-aware checkpoint policy ``auto``; otherwise a micro-batch's time per token
    falls with its size and the reference budget (costliest sample at B=1) is kept."""
    return mode == "dual" and cost.mode == "calibrated" and cost.checkpointing == "auto"


def candidate_budgets(cost: CostModel, shapes: Sequence[SampleShape], m_mem: float, reference: float) -> list[float]:
    """Candidate budgets (ascending, all <= ``reference``, the reference included): per shape its B=1
    cost and the cost of its largest micro-batch without checkpointing, and a geometric grid of
    ``GRID_POINTS`` between the smallest of those and the reference. Near-duplicates (within 3%) dropped."""
    per_shape: list[float] = []
    for s in sorted(set(shapes)):
        b_mem = int(math.floor(m_mem / sample_memory(cost, s) * (1 + 1e-12)))
        if b_mem < 1:
            continue
        t = micro_batch_table(cost, s, b_mem, m_mem)
        per_shape.append(float(t.cost[1]))
        free = np.flatnonzero(t.ckpt[1:] == 0)
        if free.size:
            per_shape.append(float(t.cost[int(free[-1]) + 1]))
    lo = min(per_shape + [reference])
    grid = list(np.geomspace(lo, reference, GRID_POINTS)) if reference > lo else []
    out: list[float] = []
    for c in sorted(x for x in per_shape + grid + [reference] if x <= reference * (1 + 1e-12)):
        if not out or c > out[-1] * 1.03:
            out.append(float(c))
    if out[-1] != reference:
        out[-1] = float(reference)   # the reference itself, not a near-duplicate of it
    return out


def predicted_time_ms(plan: EpochPlan, cost: CostModel, steps: Optional[int] = None) -> float:
    """Predicted wall time (ms) of ``plan`` (of its first ``steps`` optimizer steps): every micro-step takes
    its costliest batch plus the profile's micro-step overhead, every optimizer step the optimizer-step
    overhead."""
    pr = cost.profile
    n_steps = plan.num_steps if steps is None else min(int(steps), plan.num_steps)
    n_micro = plan.num_micro_steps if steps is None else n_steps * plan.micro_steps_per_step
    c = plan.micro_step_costs()[:n_micro]
    busy = float(c.max(axis=1).sum()) if c.size else 0.0
    return busy + n_micro * pr.micro_step_overhead_ms + n_steps * pr.optimizer_step_overhead_ms


def _gas_for(m_comp: float, reference: float, micro_steps_per_step: Union[int, str]) -> int:
    if micro_steps_per_step != "auto":
        return int(micro_steps_per_step)
    return max(1, int(math.ceil(reference / m_comp - 1e-9)))


def choose_compute_budget(cost: CostModel, shapes: Sequence[SampleShape], *, m_mem: float, reference: float,
                          dp_size: int, micro_steps_per_step: Union[int, str] = 1, window: int = 256,
                          balance_tolerance: float = 0.03, seed: int = 0,
                          max_samples: int = SEARCH_SAMPLES) -> BudgetChoice:
    """The candidate budget (:func:`candidate_budgets`) with the highest predicted tokens/s over the plan
    of the first ``min(max(max_samples, 2 x window x dp_size), SEARCH_SAMPLES_MAX)`` samples of epoch 0's
    order (the sampler's shuffle for ``seed``).

    ``shapes``: one entry per sample of the dataset. ``reference``: the costliest sample at B=1 that fits
    ``m_mem`` (``resolve_budgets``). Ties go to the larger budget. Oversize samples (over ``m_mem``) are
    left out of the search (the sampler's own plan reports them)."""
    uniq, sid = unique_shapes(list(shapes))
    n = min(max(int(max_samples), 2 * window * dp_size), SEARCH_SAMPLES_MAX)   # two planning windows, capped
    order = np.random.default_rng([int(seed), 0]).permutation(len(shapes))[:n]
    mem1 = np.array([sample_memory(cost, s) for s in uniq])
    order = order[mem1[sid[order]] <= m_mem]
    rows = []
    best = None
    for m in candidate_budgets(cost, [uniq[i] for i in np.unique(sid[order])] or uniq, m_mem, reference):
        gas = _gas_for(m, reference, micro_steps_per_step)
        params = PlannerParams(mode="dual", dp_size=dp_size, micro_steps_per_step=gas, m_mem=m_mem, m_comp=m,
                               window=window, oversize="skip", balance_tolerance=balance_tolerance,
                               solo_over_budget=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_epoch(sid, uniq, order, cost, params, seed=seed)
        ms = predicted_time_ms(plan, cost)
        tps = float(plan.batch_tokens.sum()) / ms * 1e3 if ms > 0 and plan.num_steps else 0.0
        rows.append({"m_comp": m, "micro_steps_per_step": gas, "tokens_per_s": tps, "micro_steps": plan.num_micro_steps})
        if best is None or tps >= best["tokens_per_s"]:   # ascending candidates: ties go to the larger budget
            best = rows[-1]
    ref = rows[-1]
    if best["tokens_per_s"] <= 0:
        best = ref
    return BudgetChoice(m_comp=best["m_comp"], micro_steps_per_step=best["micro_steps_per_step"],
                        predicted_tokens_per_s=best["tokens_per_s"], reference_m_comp=reference,
                        reference_tokens_per_s=ref["tokens_per_s"], samples_planned=int(len(order)),
                        candidates=tuple(rows))
