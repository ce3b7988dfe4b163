"""Throughput-optimal compute budget: ``m_comp: auto`` under memory-aware checkpointing.

With every block checkpointed a micro-batch's time per token falls as it grows (the per-micro-batch
overhead is spread over more samples), so the smallest budget under which no sample is oversize -- the
costliest sample at B=1 -- was the natural ``auto``. With the checkpoint plan (``ds_adaptive.planning.memory``)
that is no longer so: a micro-batch that fills the memory budget must checkpoint blocks, and each one
adds a recomputed forward for every sample of the batch: a memory-filling batch of images that checkpoints most
blocks trains fewer tokens per second than a smaller one that checkpoints none. A smaller compute budget gives smaller micro-batches that checkpoint fewer blocks, and pays the
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
efficiency optimum when the overheads are small), a geometric grid between the smallest of them and
the reference, and a geometric grid ABOVE the reference up to the costliest micro-batch that fits
``m_mem`` (:func:`upper_budget`). The grid above matters when every sample is short (low resolution,
image-only sets): the reference is then a few tens of ms, about the per-micro-batch cost ``c0`` plus the
per-micro-step loop overhead, and micro-batches sized to it are dominated by those fixed costs; the
equal-token baseline, whose batches fill the memory, is predicted far faster on such a set. The
*equal-token plan* (mode ``tokens`` at the same ``m_mem`` and ``max_tokens``) is scored as well: its
costliest micro-batch is a candidate budget (under it every batch the baseline forms is feasible), and
its predicted tokens/s is published (``BudgetChoice.equal_token_tokens_per_s``). When it is predicted faster
than every dual candidate, the choice is that plan itself (``BudgetChoice.plan_mode == "tokens"``: the
sampler forms equal-token batches at the same budgets). That happens with few samples per rank and
shape, where balancing the micro-steps splits batches (more micro-steps, each paying ``c0`` and the loop
overhead) by more than the balance gains; with the grid above the reference it is the exception (none
of the random mixes of ``tests/unit/simulation/test_never_slower.py`` at 8 and 64 GPUs needs it).

The samples planned per candidate grow with the budget so that its plan has several micro-steps
(:data:`SEARCH_MICRO_STEPS`, at most ``SEARCH_SAMPLES_ABOVE_MAX``), and a plan of a prefix of the epoch
is scored without its re-planned last step.

Samples costlier than the chosen budget (the longest videos) run alone, B=1: the plan is made with
``PlannerParams.solo_over_budget``, so such a sample is never oversize while it fits ``m_mem``, and the
other ranks of its micro-step get batches grown to its cost (within ``m_mem``). Memory is never traded:
every batch of every candidate is within ``m_mem`` (the planner's memory bound does not depend on
``m_comp``).

Efficient batches: under a budget where a shape's largest batch must checkpoint blocks, a smaller batch of it
can take less time per sample (its cost plus the loop's time per micro-step, over its samples): a batch of images
just small enough to checkpoint no block beats the largest one that checkpoints several. Each such
budget is scored twice, as it is and with every shape's batch capped at its lowest time per sample
(``PlannerParams.efficient_batches``; ``BudgetChoice.efficient_batches`` says which won). With several DP ranks the
cap can cost balance (a capped batch may no longer reach a micro-step's target), which the prediction counts.

Gradient accumulation: with ``micro_steps_per_step="auto"`` (ds_config ``"gradient_accumulation_steps":
"auto"``) a candidate budget ``m`` gets ``ceil(reference / m)`` micro-steps per optimizer step, so an
optimizer step covers at least the work of one reference micro-batch, as before; an int is kept as given
(DeepSpeed's value). The chosen pair is published as ``BudgetChoice.micro_steps_per_step``; the trainer
gives DeepSpeed that gradient_accumulation_steps and checks the engine agrees.

Pure and deterministic: a function of (per-sample shapes, seed, cost model, m_mem, dp_size, window,
tolerance, gas), identical on every rank (dp_rank is not an input) and after a resume.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from ds_adaptive.planning import global_batch as _global_batch
from ds_adaptive.planning import planner as _planner
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.memory import micro_batch_table, sample_memory
from ds_adaptive.planning.planner import (EpochPlan, Mode, PlannerParams, bucket_tokens, efficient_batch,
                                         loop_ms_per_micro_step, plan_epoch, unique_shapes)
from ds_adaptive.core.shapes import SampleShape
from ds_adaptive.planning.global_batch import (batch_limit, fit_gas, global_batch_candidates, no_plan_message, per_micro_step,
                                               tokens_per_s_at)
from ds_adaptive.planning.plan_types import PlanError
from ds_adaptive.planning.search_cache import cached_search

__all__ = ["BudgetChoice", "choose_compute_budget", "candidate_budgets", "predicted_time_ms", "predicted_times",
           "plan_tokens_per_s", "uses_budget_search",
           "upper_budget", "shape_tables", "SEARCH_SAMPLES", "SEARCH_SAMPLES_MAX", "SEARCH_SAMPLES_ABOVE_MAX",
           "SEARCH_MICRO_STEPS", "GRID_POINTS", "GRID_POINTS_ABOVE"]

#: samples of the epoch-0 order planned per candidate (all of them for smaller datasets): at least this
#: many and two planning windows, at most SEARCH_SAMPLES_MAX (1024 DP ranks: ~20 candidates in seconds)
SEARCH_SAMPLES = 2048
SEARCH_SAMPLES_MAX = 65536
#: points of the geometric grid between the smallest per-shape candidate and the reference
GRID_POINTS = 8
#: points of the geometric grid above the reference, up to the costliest micro-batch within m_mem
GRID_POINTS_ABOVE = 10
#: a candidate's plan should have at least this many micro-steps: the samples planned for a large budget
#: grow with it (at most SEARCH_SAMPLES_ABOVE_MAX, at most the dataset)
SEARCH_MICRO_STEPS = 8
SEARCH_SAMPLES_ABOVE_MAX = 1 << 21
#: with ``sampler.global_batch`` the search plans at most this many DP ranks and scales to the cluster
SEARCH_DP = 16


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
    #: predicted tokens/s of the equal-token plan of the same samples at the same m_mem (None: not scored)
    equal_token_tokens_per_s: Optional[float] = None
    #: the planner mode to run: "dual", or "tokens" when the equal-token plan is predicted faster than every
    #: dual candidate (few samples per rank, where balancing splits batches into more micro-steps)
    plan_mode: str = "dual"
    #: the chosen plan caps each shape's batch at its lowest predicted time per sample
    #: (``PlannerParams.efficient_batches``)
    efficient_batches: bool = False
    #: with ``sampler.global_batch``: the chosen plan's fit (``GasFit.describe``: gas, per_micro, predicted, error)
    global_batch: Optional[dict] = None

    def describe(self) -> dict:
        return {"m_comp": self.m_comp, "micro_steps_per_step": self.micro_steps_per_step,
                "global_batch": self.global_batch,
                "efficient_batches": self.efficient_batches,
                "predicted_tokens_per_s": self.predicted_tokens_per_s, "reference_m_comp": self.reference_m_comp,
                "reference_tokens_per_s": self.reference_tokens_per_s, "samples_planned": self.samples_planned,
                "equal_token_tokens_per_s": self.equal_token_tokens_per_s, "plan_mode": self.plan_mode,
                "candidates": [dict(c) for c in self.candidates]}


def uses_budget_search(cost: CostModel, mode: str) -> bool:
    """``m_comp: auto`` searches for the throughput-optimal budget only in ``dual`` mode with the calibrated
    (ms) cost model and the memory-aware checkpoint policy ``auto``; otherwise a micro-batch's time per token
    falls with its size and the reference budget (costliest sample at B=1) is kept."""
    return mode == "dual" and cost.mode == "calibrated" and cost.checkpointing == "auto"


def shape_tables(cost: CostModel, shapes: Sequence[SampleShape], m_mem: float) -> dict:
    """Per distinct shape with at least one sample within ``m_mem`` (sorted): its :class:`MicroBatchTable` over
    B = 0..(its largest batch within ``m_mem``), with that batch's checkpoint plan, by shape. No budget changes
    them: the search builds them once for every candidate and its plans."""
    out = {}
    for s in unique_shapes(shapes)[0]:
        b_mem = int(math.floor(m_mem / sample_memory(cost, s) * (1 + 1e-12)))
        if b_mem >= 1:
            out[s] = micro_batch_table(cost, s, b_mem, m_mem)
    return out


def upper_budget(cost: CostModel, shapes: Sequence[SampleShape], m_mem: float, tables: Optional[dict] = None) -> float:
    """The cost of the costliest micro-batch that fits ``m_mem`` (over ``shapes``, each at its largest
    memory-feasible batch with its checkpoint plan): no budget above it changes a plan. ``tables``:
    :func:`shape_tables` of the same arguments, when the caller has them."""
    tables = shape_tables(cost, shapes, m_mem) if tables is None else tables
    return max((float(t.cost[-1]) for t in tables.values()), default=0.0)


def candidate_budgets(cost: CostModel, shapes: Sequence[SampleShape], m_mem: float, reference: float,
                      upper: Optional[float] = None, tables: Optional[dict] = None) -> list[float]:
    """Candidate budgets (ascending, the reference included): per shape its B=1 cost and the cost of its
    largest micro-batch without checkpointing, a geometric grid of ``GRID_POINTS`` between the smallest of
    those and the reference, and, when ``upper`` (:func:`upper_budget`) is over the reference, a geometric
    grid of ``GRID_POINTS_ABOVE`` from the reference to ``upper``. Near-duplicates (within 3%) dropped.
    ``tables``: :func:`shape_tables` of the same arguments, when the caller has them."""
    per_shape: list[float] = []
    for t in (shape_tables(cost, shapes, m_mem) if tables is None else tables).values():
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
    if upper is not None and upper > reference * 1.03:
        out.extend(float(c) for c in np.geomspace(reference, upper, GRID_POINTS_ABOVE + 1)[1:])
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


def predicted_times(plan: EpochPlan, truth: CostModel) -> np.ndarray:
    """[micro_steps, dp] per-GPU time of every batch under the ``truth`` cost model (the
    calibrated one), whatever cost model the plan was made with: fwd + bwd with the recomputed forwards
    of the blocks the plan checkpoints in that batch (:meth:`CostModel.ckpt_cost`; a plan without a
    checkpoint plan is timed at the profile's own calibration)."""
    sizes = plan.batch_sizes()
    if plan.batch_ckpt is None:
        per = np.array([truth.per_gpu_cost(s) for s in plan.shapes])
        over = np.array([truth.batch_overhead(s) for s in plan.shapes])
        return (over[plan.batch_shape] + sizes * per[plan.batch_shape]).reshape(-1, plan.dp_size)
    out = np.empty(len(sizes), float)
    for u in np.unique(plan.batch_shape).tolist():
        j = plan.batch_shape == u
        out[j] = truth.ckpt_cost(plan.shapes[u], sizes[j], plan.batch_ckpt[j])
    return out.reshape(-1, plan.dp_size)


def plan_tokens_per_s(plan: EpochPlan, cost: CostModel, first_step: int = 0, *, loop: bool = True) -> float:
    """Predicted tokens/s of ``plan``'s optimizer steps ``first_step..`` (to its end) under ``cost``, whatever
    cost the plan was made with (its batches re-costed with their checkpoint plan, :func:`predicted_times`),
    with the training loop's overheads as :func:`predicted_time_ms` counts them (``loop=False``: compute
    alone). 0 for no steps."""
    first = max(int(first_step), 0)
    if first >= plan.num_steps:
        return 0.0
    lo = first * plan.micro_steps_per_step
    c = predicted_times(plan, cost)[lo:]
    n_micro, n_steps = c.shape[0], plan.num_steps - first
    ms = float(c.max(axis=1).sum())
    if loop:
        ms += n_micro * cost.profile.micro_step_overhead_ms + n_steps * cost.profile.optimizer_step_overhead_ms
    tokens = float(plan.batch_tokens[lo * plan.dp_size:].sum())
    return tokens / ms * 1e3 if ms > 0 else 0.0


def _gas_for(m_comp: float, reference: float, micro_steps_per_step: Union[int, str]) -> int:
    if micro_steps_per_step != "auto":
        return int(micro_steps_per_step)
    return max(1, int(math.ceil(reference / m_comp - 1e-9)))


def _samples_for(m: float, cost: CostModel, base: int, mean_cost: float, dp_size: int) -> int:
    """Samples to plan for candidate ``m``: ``base`` (two planning windows, at least ``max_samples``, at
    most ``SEARCH_SAMPLES_MAX``: the old search), more for a budget whose micro-steps hold more than
    ``SEARCH_MICRO_STEPS`` of them (estimated with the mean per-sample cost ``mean_cost``), at most
    ``SEARCH_SAMPLES_ABOVE_MAX``. A tiny-resolution set at 64 GPUs needs ~10^5 samples for ONE micro-step
    that fills the memory."""
    if mean_cost <= 0:
        return base
    need = int(SEARCH_MICRO_STEPS * dp_size * max(m - cost.c0, 0.0) / mean_cost)
    return max(base, min(need, SEARCH_SAMPLES_ABOVE_MAX))


def _search_samples(cost: CostModel, shapes: Sequence[SampleShape], seed: int, m_mem: float) -> tuple:
    """(distinct shapes, sample shape ids, epoch 0's order without samples over ``m_mem``, that order's shapes)."""
    uniq, sid = unique_shapes(shapes)
    order = np.random.default_rng([int(seed), 0]).permutation(len(shapes))
    mem1 = np.array([sample_memory(cost, s) for s in uniq])
    order = order[mem1[sid[order]] <= m_mem]
    return uniq, sid, order, [uniq[i] for i in np.unique(sid[order])] or uniq


def choose_compute_budget(cost: CostModel, shapes: Sequence[SampleShape], *, m_mem: float, reference: float,
                          dp_size: int, micro_steps_per_step: Union[int, str] = 1, window: int = 256,
                          balance_tolerance: float = 0.03, seed: int = 0,
                          max_samples: int = SEARCH_SAMPLES, max_tokens: Optional[int] = None,
                          batch_cap: bool = True, global_batch=None) -> BudgetChoice:
    """The candidate budget (:func:`candidate_budgets`) with the highest predicted tokens/s over the plan
    of the first samples of epoch 0's order (the sampler's shuffle for ``seed``): for each candidate the
    first ``min(max(max_samples, 2 x window x dp), SEARCH_SAMPLES_MAX)`` samples, more for large budgets
    (:func:`_samples_for`). A plan of a prefix of the epoch is scored without its last optimizer step
    (:func:`_tokens_per_s`).

    ``shapes``: one entry per sample of the dataset. ``reference``: the costliest sample at B=1 that fits
    ``m_mem`` (``resolve_budgets``). ``max_tokens``: the equal-token baseline's budget at this ``m_mem``;
    when given, the equal-token plan of the same samples is scored (``equal_token_tokens_per_s``) and its
    costliest batch is a candidate. Ties go to the larger budget. ``batch_cap``: also score each budget with every
    shape's batch capped at its lowest time per sample, where that changes a batch (``efficient_batches``).
    Oversize samples (over ``m_mem``) are left out of the search (the sampler's own plan reports them).

    ``global_batch`` (:class:`ds_adaptive.core.config.GlobalBatchConfig`): only plans whose micro-steps per step
    (``auto``: ``round(G / per micro-step)``; an int: as given) hold it within its tolerance are scored, budgets
    aimed at it are added (:mod:`ds_adaptive.planning.global_batch`), and :class:`PlanError` names the range that
    can be planned when none keeps it. The search then plans ``min(dp_size, SEARCH_DP)`` ranks (batches and balance
    are per rank) and scales counts and tokens/s to ``dp_size``; the sampler checks the epoch's own plan."""
    full_dp, limit = dp_size, batch_limit(global_batch, dp_size)   # the limit is per rank: the same on a sample of ranks
    if global_batch is not None:
        dp_size = min(dp_size, SEARCH_DP)
    scale = full_dp / dp_size
    uniq, sid, order, present = _search_samples(cost, shapes, seed, m_mem)
    tables = shape_tables(cost, present, m_mem)   # every candidate and its plan reuse them
    upper = upper_budget(cost, present, m_mem, tables)
    cands = candidate_budgets(cost, present, m_mem, reference, upper=upper, tables=tables)
    base = min(max(int(max_samples), 2 * window * dp_size), SEARCH_SAMPLES_MAX)
    per = np.array([cost.per_gpu_cost(s) for s in uniq])
    mean_cost = float(per[sid[order[:base]]].mean()) if len(order) else 0.0
    rows: dict[tuple, dict] = {}   # by (budget, capped): the reference is also a grid point

    def plan_for(params: PlannerParams, m: float) -> tuple[float, EpochPlan, int]:
        n = _samples_for(m, cost, base, mean_cost, dp_size)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # a prefix of the epoch: with a global batch its last step is not re-planned (its micro-steps are scored,
            # not its steps); without one, as the search always scored, re-planned and left out (steady)
            plan = plan_epoch(sid, uniq, order[:n], cost, params, seed=seed,
                              replan_tail=global_batch is None or n >= len(order), tables=tables)
        return _tokens_per_s(plan, cost, steady=global_batch is None and n < len(order)), plan, min(n, len(order))

    def score(m: float, capped: bool = False) -> dict:
        if (m, capped) not in rows:
            if global_batch is not None:
                rows[m, capped] = _score_for_global_batch(plan_for, m, capped, rows, global_batch, cost, dp_size,
                                                          micro_steps_per_step, window, balance_tolerance, m_mem,
                                                          scale, limit)
                return rows[m, capped]
            gas = _gas_for(m, reference, micro_steps_per_step)
            tps, plan, n = plan_for(PlannerParams(mode="dual", dp_size=dp_size, micro_steps_per_step=gas, m_mem=m_mem,
                                                  m_comp=m, window=window, oversize="skip",
                                                  balance_tolerance=balance_tolerance, solo_over_budget=True,
                                                  efficient_batches=capped), m)
            rows[m, capped] = {"m_comp": m, "micro_steps_per_step": gas, "efficient_batches": capped,
                               "tokens_per_s": tps, "micro_steps": plan.num_micro_steps, "samples": n}
        return rows[m, capped]

    equal_tps, equal_gas, cands = _equal_token_plan(plan_for, cost, cands, reference=reference, upper=upper,
                                                    max_tokens=max_tokens, dp_size=dp_size, m_mem=m_mem,
                                                    window=window, micro_steps_per_step=micro_steps_per_step,
                                                    global_batch=global_batch, scale=scale, limit=limit)
    table = []
    for m in cands:   # each budget as it is and, where that changes a batch, with each shape's efficient cap
        table.append(score(m))
        loop = loop_ms_per_micro_step(cost.profile, _gas_for(m, reference, micro_steps_per_step))
        if batch_cap and _cap_changes(tables.values(), m, loop):
            table.append(score(m, capped=True))
    if global_batch is not None:
        _aim_at_global_batch(table, score, global_batch, micro_steps_per_step, cost.c0, min(cands),
                             max(upper, reference), equal_tps, full_dp)
    return _budget_choice(table, score(float(reference)), reference, equal_tps, equal_gas, global_batch)


def _equal_token_plan(plan_for, cost: CostModel, cands: list, *, reference: float, upper: float,
                      max_tokens: Optional[int], dp_size: int, m_mem: float, window: int, micro_steps_per_step,
                      global_batch, scale: float, limit: Optional[float] = None) -> tuple:
    """The equal-token plan of the same samples: its predicted tokens/s (kept to plans that hold the global batch),
    its micro-steps per step, and the candidates with its costliest batch added."""
    equal_tps, equal_gas = None, _gas_for(reference, reference, micro_steps_per_step)  # "auto": 1, as the baseline runs
    if max_tokens is None:
        return equal_tps, equal_gas, cands
    equal_tps, eq, _ = plan_for(PlannerParams(mode="tokens", dp_size=dp_size, micro_steps_per_step=equal_gas,
                                              m_mem=m_mem, max_tokens=int(max_tokens), window=window,
                                              oversize="skip", step_balance=None if global_batch is None
                                              else global_batch.by, batch_limit=limit), max(upper, reference))
    if global_batch is not None:   # only a plan that keeps the global batch may win
        fit = fit_gas(per_micro_step(eq, global_batch.by) * scale, global_batch.value, global_batch.tolerance,
                      micro_steps_per_step)
        equal_gas = fit.gas
        equal_tps = tokens_per_s_at(eq, cost, fit.gas) * scale if fit.ok else 0.0
    if eq.batch_cost.size:
        top = float(eq.batch_cost.max())
        if all(abs(top - c) > 0.03 * c for c in cands):
            cands = sorted(cands + [top])
    return equal_tps, equal_gas, cands


def _aim_at_global_batch(table: list, score, global_batch, micro_steps_per_step, c0: float, lowest: float,
                         highest: float, equal_tps, full_dp: int) -> None:
    """Adds to ``table`` the budgets aimed at the global batch (up to 6 rounds), sorts it, and raises
    :class:`PlanError` with the range that can be planned when no plan (nor the equal-token one) keeps it."""
    for it in range(6):
        if any(r["keeps_global_batch"] for r in table) and it >= 1:
            break
        table += [score(m) for m in global_batch_candidates(table, global_batch, micro_steps_per_step, c0,
                                                             lowest, highest)]
    table.sort(key=lambda r: (r["m_comp"], r["efficient_batches"]))
    if not any(r["keeps_global_batch"] for r in table) and not equal_tps:
        raise PlanError(no_plan_message(global_batch.value, global_batch.by, global_batch.tolerance,
                                        [(r["m_comp"], r["fit"]) for r in table], full_dp, micro_steps_per_step))


def _budget_choice(table: list, ref: dict, reference: float, equal_tps, equal_gas, global_batch) -> BudgetChoice:
    """The best scored budget (ties: the larger), the reference's row when none predicts any throughput, or the
    equal-token plan where it predicts more: never slower than the baseline by the same prediction."""
    best = table[_best_index(table)]
    if best["tokens_per_s"] <= 0:
        best = ref
    tokens_wins = equal_tps is not None and equal_tps > best["tokens_per_s"]
    return BudgetChoice(m_comp=best["m_comp"], micro_steps_per_step=best["micro_steps_per_step"] if not tokens_wins
                        else equal_gas,
                        predicted_tokens_per_s=equal_tps if tokens_wins else best["tokens_per_s"],
                        reference_m_comp=reference, reference_tokens_per_s=ref.get("raw_tokens_per_s",
                                                                                   ref["tokens_per_s"]),
                        samples_planned=int(best["samples"]), candidates=tuple(
                            {k: v for k, v in r.items() if k != "fit"} for r in table),
                        equal_token_tokens_per_s=equal_tps, plan_mode="tokens" if tokens_wins else "dual",
                        efficient_batches=bool(best["efficient_batches"]) and not tokens_wins,
                        global_batch=None if global_batch is None or tokens_wins else best["fit"].describe())


def _score_for_global_batch(plan_for, m: float, capped: bool, rows: dict, gb, cost: CostModel, dp_size: int,
                            micro_steps_per_step, window: int, tolerance: float, m_mem: float, scale: float,
                            limit: Optional[float] = None) -> dict:
    """A candidate row under ``global_batch``: the plan of budget ``m`` (capped: planned with the micro-steps per
    step of the uncapped row, which the cap's loop share uses), its micro-steps per step for the global batch
    (:func:`ds_adaptive.planning.global_batch.fit_gas`) and its predicted tokens/s at them (0 when the plan does
    not keep the global batch; ``raw_tokens_per_s`` has it regardless). ``scale``: the cluster's DP ranks over the
    planned ones (counts and tokens/s are the cluster's)."""
    fixed = micro_steps_per_step if micro_steps_per_step != "auto" else None
    est = rows[m, False]["micro_steps_per_step"] if capped and (m, False) in rows else None
    plan_gas = int(fixed or est or 1)
    _, plan, n = plan_for(PlannerParams(mode="dual", dp_size=dp_size, micro_steps_per_step=plan_gas, m_mem=m_mem,
                                        m_comp=m, window=window, oversize="skip", balance_tolerance=tolerance,
                                        solo_over_budget=True, efficient_batches=capped, step_balance=gb.by,
                                        batch_limit=limit), m)
    fit = fit_gas(per_micro_step(plan, gb.by) * scale, gb.value, gb.tolerance, micro_steps_per_step)
    raw = tokens_per_s_at(plan, cost, fit.gas) * scale
    return {"m_comp": m, "micro_steps_per_step": fit.gas, "efficient_batches": capped,
            "tokens_per_s": raw if fit.ok else 0.0, "raw_tokens_per_s": raw, "micro_steps": plan.num_micro_steps,
            "samples": n, "global_batch": fit.predicted, "keeps_global_batch": fit.ok, "fit": fit}


def _cap_changes(tables: Sequence, m_comp: float, loop_ms: float) -> bool:
    """Whether ``PlannerParams.efficient_batches`` lowers some shape's largest batch under ``m_comp`` (``tables``:
    :func:`shape_tables`' values; ``loop_ms``: the loop's time per micro-step)."""
    for t in tables:
        c = t.cost
        b = int(np.searchsorted(c, m_comp * (1 + 1e-12), "right")) - 1
        if b > 1 and efficient_batch(c[:b + 1], loop_ms) < b:
            return True
    return False


def _tokens_per_s(plan: EpochPlan, cost: CostModel, steady: bool) -> float:
    """Predicted tokens/s of ``plan``; with ``steady`` without its last optimizer step (when it has more than
    one): the planner re-batches the samples left at the end into one step of smaller batches, which a
    prefix of the epoch would weigh far more than the whole epoch does (a budget whose micro-steps take
    thousands of short samples has only a few in the prefix)."""
    steps = plan.num_steps - 1 if steady and plan.num_steps > 1 else plan.num_steps
    if steps < 1:
        return 0.0
    ms = predicted_time_ms(plan, cost, steps)
    nb = steps * plan.micro_steps_per_step * plan.dp_size
    return float(plan.batch_tokens[:nb].sum()) / ms * 1e3 if ms > 0 else 0.0


def _best_index(rows: Sequence[dict]) -> int:
    """Index of the highest tokens/s in ascending-budget rows; ties go to the larger budget, at one budget to the
    first row (uncapped before capped)."""
    best = 0
    for i, r in enumerate(rows):
        t, b = r["tokens_per_s"], rows[best]["tokens_per_s"]
        if t > b or (t == b and r["m_comp"] > rows[best]["m_comp"]):
            best = i
    return best


def _search_constants() -> dict:
    """The module constants the search reads (part of its cache key: :mod:`ds_adaptive.planning.search_cache`)."""
    own = {k: globals()[k] for k in ("SEARCH_SAMPLES", "SEARCH_SAMPLES_MAX", "GRID_POINTS", "GRID_POINTS_ABOVE",
                                     "SEARCH_MICRO_STEPS", "SEARCH_SAMPLES_ABOVE_MAX", "SEARCH_DP")}
    gb = {f"global_batch.{k}": getattr(_global_batch, k) for k in (
        "MAX_MICRO_STEPS", "CHECK_SAMPLES_PER_RANK", "CHECK_STEPS", "AIM_TRIES", "CHECK_MIN_SAMPLES")}
    return {**own, **gb, "planner.STEP_BALANCE_BLOCK": _planner.STEP_BALANCE_BLOCK}


def resolve_budgets(*, mode: Mode, cost: CostModel, shapes: Sequence[SampleShape],
                    m_mem: "float | str", m_comp: "float | str", max_tokens: Optional[int],
                    gpu_mem_gib: Optional[float], mem_utilization: Optional[float], zero_stage: int,
                    dp_size: int, micro_steps_per_step: "int | str" = 1, window: int = 256,
                    balance_tolerance: float = 0.03, seed: int = 0, batch_cap: bool = True, global_batch=None,
                    fixed_batch_sizes=None, oversize: str = "skip") -> dict:
    """Numbers for ``auto`` budgets (``shapes``: one per sample; the budget search weighs shapes by count).

    - ``m_mem: auto`` = usable GPU memory - static memory (ZeRO stage, ranks); usable = capacity x
      ``mem_utilization`` when set, else capacity minus the profile's measured fragmentation margin
      and headroom (:meth:`CostModel.usable_memory_gib`).
    - ``m_comp: auto``: the reference = the costliest sample (that fits ``m_mem``) at B=1, i.e. the
      smallest budget under which no sample is oversize. With the memory-aware checkpoint policy
      (``dual``, calibrated, ``recompute.blocks: auto``) the throughput-optimal budget, below or above it
      (:func:`ds_adaptive.planning.budget.choose_compute_budget`, which also scores the equal-token plan at
      ``max_tokens``; the plan runs samples over a budget below the reference alone: ``solo_over_budget``),
      else the reference itself. ``batch_cap``: the search may cap each shape's batches at their lowest time
      per sample (``sampler.batch_cap``).
    - ``micro_steps_per_step``: an int is kept; ``"auto"`` = the search's choice (1 without a search).
    - ``global_batch`` (``sampler.global_batch``; ``oversize``: the sampler's policy, which the fit without a search
      plans with, so that a sample over fixed budgets is named before the global batch): the search keeps it (:func:`choose_compute_budget`); without a
      search, ``"auto"`` micro-steps per step are fitted to it from a plan of the epoch's first samples
      (:func:`fit_plain_budgets`), and a global batch the budgets cannot keep is a :class:`PlanError`.
    - ``max_tokens`` (tokens mode) = the tokens that ``m_mem`` holds at the per-token memory of the
      longest sample, so that both baselines run at the same memory budget as ``dual``.

    Returns ``{"m_mem", "m_comp", "max_tokens", "micro_steps_per_step", "solo_over_budget", "budget_choice",
    "plan_mode", "efficient_batches"}`` (``budget_choice``: the search's
    :class:`~ds_adaptive.planning.budget.BudgetChoice`, or None; ``plan_mode``: ``mode``, or ``tokens`` when the
    search found the equal-token plan faster; ``efficient_batches``: the search's choice to cap batches at their
    lowest time per sample).
    """
    uniq = unique_shapes(shapes)[0]
    if m_mem == "auto":
        m_mem_v = cost.auto_memory_budget(gpu_mem_gib, mem_utilization, zero_stage=zero_stage, dp_size=dp_size)
    else:
        m_mem_v = float(m_mem)
    mem1 = {s: sample_memory(cost, s) for s in uniq}
    fits = [s for s in uniq if mem1[s] <= m_mem_v] or uniq
    choice = None
    gas = micro_steps_per_step if micro_steps_per_step != "auto" else 1
    if max_tokens is None:
        longest = max(fits, key=bucket_tokens)
        per_tok = mem1[longest] / cost.padded_tokens(longest)
        max_tokens_v = max(int(m_mem_v / per_tok), cost.padded_tokens(longest))
    else:
        max_tokens_v = int(max_tokens)
    if m_comp == "auto":   # B=1 with its checkpoint plan
        m_comp_v = max(float(micro_batch_table(cost, s, 1, m_mem_v).cost[1]) for s in fits)
        if uses_budget_search(cost, mode):
            choice = cached_search(choose_compute_budget, cost, shapes, constants=_search_constants(),
                                   m_mem=m_mem_v, reference=m_comp_v, dp_size=dp_size,
                                   micro_steps_per_step=micro_steps_per_step, window=window,
                                   balance_tolerance=balance_tolerance, seed=seed, max_tokens=max_tokens_v,
                                   batch_cap=batch_cap, global_batch=global_batch)
            m_comp_v, gas = choice.m_comp, choice.micro_steps_per_step
    else:
        m_comp_v = float(m_comp)
    plan_mode = choice.plan_mode if choice is not None else mode
    fit, solo = None, choice is not None and plan_mode == "dual"
    if global_batch is not None and choice is None:
        scaled = {"dual": "m_comp", "tokens": "max_tokens"}.get(mode) if (
            m_comp == "auto" if mode == "dual" else max_tokens is None) else None
        params, fit = fit_plain_budgets(
            PlannerParams(mode=mode, dp_size=dp_size, micro_steps_per_step=1 if gas == "auto" else int(gas),
                          m_mem=m_mem_v, m_comp=m_comp_v if mode == "dual" else None,
                          max_tokens=max_tokens_v if mode == "tokens" else None, fixed_batch_sizes=fixed_batch_sizes,
                          window=window, oversize=oversize, balance_tolerance=balance_tolerance),
            cost, shapes, global_batch, micro_steps_per_step, seed, scaled=scaled)
        gas, solo = fit["gas"], params.solo_over_budget
        m_comp_v = params.m_comp if mode == "dual" else m_comp_v
        max_tokens_v = params.max_tokens if mode == "tokens" else max_tokens_v
    return {"global_batch_fit": fit if fit is not None else (
                None if choice is None or choice.global_batch is None else choice.global_batch),
            "m_mem": m_mem_v, "m_comp": m_comp_v, "max_tokens": max_tokens_v, "micro_steps_per_step": int(gas),
            "solo_over_budget": solo, "budget_choice": choice,
            "plan_mode": plan_mode, "efficient_batches": choice is not None and choice.efficient_batches}


def fit_plain_budgets(params: PlannerParams, cost: CostModel, shapes: Sequence[SampleShape], global_batch,
                      micro_steps_per_step, seed: int = 0, scaled: Optional[str] = None
                      ) -> "tuple[PlannerParams, dict]":
    """Micro-steps per step for ``global_batch`` without the budget search, from plans of the first
    ``max(SEARCH_SAMPLES, 2 x window x dp)`` samples of epoch 0's order. ``scaled`` (``"m_comp"`` / ``"max_tokens"``:
    a budget that was ``auto``) may be lowered so that the micro-steps hold ``G / k``, ``k`` the fewest micro-steps
    per step (``auto``) or the given int: at most 4 plans, each budget the last one times the ratio of wanted to
    planned samples per micro-step; under a lowered ``m_comp`` samples costlier than it run alone
    (``solo_over_budget``). Raises :class:`PlanError` when no plan keeps the global batch. Returns the params and
    ``GasFit.describe()``."""
    uniq, sid = unique_shapes(shapes)
    order = np.random.default_rng([int(seed), 0]).permutation(len(sid))
    dp = min(params.dp_size, SEARCH_DP)   # a sample of the ranks, scaled to the cluster (as the search does)
    n = min(max(SEARCH_SAMPLES, 2 * params.window * dp), SEARCH_SAMPLES_MAX)
    gb = global_batch

    def fit_of(p: PlannerParams):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_epoch(sid, uniq, order[:n], cost, dataclasses.replace(p, dp_size=dp), seed=seed,
                              replan_tail=n >= len(order))
        return fit_gas(per_micro_step(plan, gb.by) * p.dp_size / dp, gb.value, gb.tolerance, micro_steps_per_step)
    policy, params = params.oversize, dataclasses.replace(params, oversize="skip")
    fit, tried = fit_of(params), []
    if scaled is not None and not fit.ok and fit.per_micro > 0:
        k = max(1, math.ceil(gb.value / fit.per_micro)) if micro_steps_per_step == "auto" else int(micro_steps_per_step)
        top = getattr(params, scaled)
        for _ in range(4):
            tried.append((getattr(params, scaled), fit))
            value = getattr(params, scaled) * gb.value / (k * fit.per_micro)
            # max_tokens never below the longest sample (it would be oversize): the fewest micro-steps may not hold it
            floor = max(cost.padded_tokens(u) for u in uniq) if scaled == "max_tokens" else 0
            value = min(value, top) if scaled == "m_comp" else int(min(max(value, floor), top))
            params = dataclasses.replace(params, **{scaled: value},
                                         solo_over_budget=scaled == "m_comp" and value < top)
            fit = fit_of(params)
            if fit.ok:
                break
    if not fit.ok:
        if policy == "error":   # a sample over these budgets is named first (OversizeSampleError), as the plan would
            plan_epoch(sid, uniq, order[:n], cost, dataclasses.replace(params, oversize="error"), seed=seed)
        raise PlanError(no_plan_message(gb.value, gb.by, gb.tolerance, tried + [(params.m_comp, fit)], params.dp_size,
                                        micro_steps_per_step))
    return dataclasses.replace(params, oversize=policy), fit.describe()
