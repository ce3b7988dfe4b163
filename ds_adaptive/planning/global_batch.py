"""The user's global batch (``sampler.global_batch``): how many micro-steps per optimizer step hold it.

Every DP rank runs the same number of micro-steps per optimizer step (DeepSpeed's fixed
``gradient_accumulation_steps``), and a micro-step's batches are the planner's (bounded by ``m_mem`` and
``m_comp``, balanced by cost). So the samples of a step are ``gas x`` (the samples of one micro-step over all DP
ranks), and with a plan of a sample of the epoch the mean per micro-step ``q`` is known: ``gas = round(G / q)``
(``auto``), or the given int. The plan keeps the global batch when ``|gas x q - G| <= tolerance x G``; the budget
search (``ds_adaptive.planning.budget``) scores only such plans, and adds budgets scaled so that ``q`` comes near
``G / gas`` when none of its grid does.

Pure: functions of plans and numbers; no torch.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from ds_adaptive.planning.plan_types import EpochPlan, PlanError, bucket_tokens
from ds_adaptive.planning.planner import plan_epoch

__all__ = ["GasFit", "MAX_MICRO_STEPS", "per_micro_step", "fit_gas", "tokens_per_s_at", "no_plan_message",
           "too_small_problem", "step_stats", "describe_step_stats", "check_epoch", "global_batch_candidates"]

#: ``gradient_accumulation_steps: auto`` never plans more micro-steps per optimizer step than this
MAX_MICRO_STEPS = 4096


@dataclass(frozen=True)
class GasFit:
    """Micro-steps per step for a global batch, from a plan's mean count per micro-step."""

    gas: int
    per_micro: float
    """Mean samples (or tokens) of one micro-step over all DP ranks."""
    predicted: float
    """``gas x per_micro``: the planned mean per optimizer step."""
    error: float
    """``|predicted - target| / target``."""
    ok: bool

    def describe(self) -> dict:
        return {"gas": self.gas, "per_micro": self.per_micro, "predicted": self.predicted, "error": self.error,
                "ok": self.ok}


def _micro_steps_used(plan: EpochPlan, steady: bool) -> int:
    """Micro-steps of ``plan`` that stand for the epoch: all, or (``steady``: a whole epoch's plan) without its last
    optimizer step, the epoch's re-planned leftover samples."""
    n = plan.num_micro_steps
    if steady and plan.num_steps > 1:
        n -= plan.micro_steps_per_step
    return max(n, 0)


def per_micro_step(plan: EpochPlan, by: str, steady: bool = False) -> float:
    """Mean samples (``by="samples"``) or tokens of one micro-step over all DP ranks of ``plan``."""
    n = _micro_steps_used(plan, steady)
    if n == 0:
        return 0.0
    nb = n * plan.dp_size
    total = plan.batch_offsets[nb] if by == "samples" else plan.batch_tokens[:nb].sum()
    return float(total) / n


def batch_limit(gb, dp_size: int) -> Optional[float]:
    """``PlannerParams.batch_limit`` for the global batch ``gb`` on ``dp_size`` data-parallel ranks: its
    ``micro_step_share`` of the step, per rank (None without a global batch or a share)."""
    if gb is None or gb.micro_step_share is None:
        return None
    return float(gb.micro_step_share) * gb.value / dp_size


def fit_gas(per_micro: float, target: int, tolerance: float, gas: Union[int, str] = "auto") -> GasFit:
    """Micro-steps per step that hold ``target`` at ``per_micro`` per micro-step: ``round(target / per_micro)``
    (at least 1, at most :data:`MAX_MICRO_STEPS`) for ``"auto"``, else ``gas`` as given."""
    if per_micro <= 0:
        return GasFit(gas=1 if gas == "auto" else int(gas), per_micro=0.0, predicted=0.0, error=1.0, ok=False)
    g = int(min(max(round(target / per_micro), 1), MAX_MICRO_STEPS)) if gas == "auto" else int(gas)
    pred = g * per_micro
    err = abs(pred - target) / target
    return GasFit(gas=g, per_micro=per_micro, predicted=pred, error=err, ok=err <= tolerance)


def tokens_per_s_at(plan: EpochPlan, cost, gas: int, steady: bool = False) -> float:
    """Predicted tokens/s of ``plan``'s micro-steps run ``gas`` per optimizer step (whatever micro-steps per
    step the plan was made with): every micro-step its costliest batch plus the profile's micro-step overhead,
    every ``gas`` micro-steps an optimizer step (``ds_adaptive.planning.budget.predicted_time_ms``)."""
    n = _micro_steps_used(plan, steady)
    if n == 0:
        return 0.0
    pr = cost.profile
    c = plan.micro_step_costs()[:n]
    ms = float(c.max(axis=1).sum()) + n * pr.micro_step_overhead_ms + n / max(gas, 1) * pr.optimizer_step_overhead_ms
    return float(plan.batch_tokens[:n * plan.dp_size].sum()) / ms * 1e3 if ms > 0 else 0.0


def too_small_problem(target: int, by: str, dp_size: int, min_tokens: Optional[int] = None) -> Optional[str]:
    """One line when ``target`` cannot give every DP rank one sample per micro-step, else None."""
    need = dp_size if by == "samples" else dp_size * int(min_tokens or 1)
    if target >= need:
        return None
    what = ("one sample per data-parallel rank" if by == "samples"
            else f"one sample of the shortest shape ({min_tokens} tokens) per data-parallel rank")
    return (f"adaptive_load.sampler.global_batch.{by} is {target} but {dp_size} data-parallel ranks need at least "
            f"{need} ({what} in one micro-step): set global_batch.{by} >= {need} (and scale the LR with it), or "
            "train on fewer ranks")


def no_plan_message(target: int, by: str, tolerance: float, fits: list, dp_size: int, gas: Union[int, str]) -> str:
    """The line for a global batch that no candidate plan keeps; ``fits``: ``(m_comp, GasFit)`` of the scored
    plans."""
    pred = sorted(f.predicted for _, f in fits if f.per_micro > 0)
    span = f"{pred[0]:,.0f} .. {pred[-1]:,.0f}" if pred else "none"
    if gas != "auto":
        lo = min((f.per_micro for _, f in fits if f.per_micro > 0), default=0.0) * int(gas)
        hi = max((f.per_micro for _, f in fits), default=0.0) * int(gas)
        why = (f"with gradient_accumulation_steps {gas} on {dp_size} data-parallel ranks a step holds "
               f"{lo:,.0f} .. {hi:,.0f} {by} (the smallest to the largest micro-batches within m_mem)")
        fix = ("set global_batch within that range, or gradient_accumulation_steps to \"auto\" (or an int "
               f"near {target / max(hi, 1e-9) * int(gas):.0f} for this batch)")
    else:
        why = (f"the plans within the budgets give {span} {by} per optimizer step on {dp_size} data-parallel ranks "
               f"(at most {MAX_MICRO_STEPS} micro-steps per step)")
        fix = "set global_batch to a value in that range (and scale the LR with it), or change m_comp / m_mem"
    return (f"adaptive_load.sampler.global_batch.{by} = {target} cannot be kept within {tolerance:.0%}: {why}; "
            f"{fix}")


def require_fit(fit: GasFit, target: int, by: str, tolerance: float, dp_size: int, gas, m_comp: float) -> GasFit:
    """``fit`` when it keeps the global batch, else :class:`PlanError` with :func:`no_plan_message`."""
    if fit.ok:
        return fit
    raise PlanError(no_plan_message(target, by, tolerance, [(m_comp, fit)], dp_size, gas))


def counts(plan: EpochPlan) -> np.ndarray:
    """Samples of each optimizer step of ``plan`` (global)."""
    g = plan.micro_steps_per_step * plan.dp_size
    return np.diff(plan.batch_offsets[np.arange(plan.num_steps + 1) * g])


def step_stats(plan) -> dict:
    """``{"samples": {mean,min,median,max}, "tokens": {...}}`` over the optimizer steps of an ``EpochPlan``."""
    g = plan.micro_steps_per_step * plan.dp_size
    n = plan.num_steps
    if n == 0:
        zero = {"mean": 0.0, "min": 0, "median": 0.0, "max": 0}
        return {"samples": zero, "tokens": dict(zero)}
    edges = np.arange(n + 1) * g
    samples = np.diff(plan.batch_offsets[edges])
    tokens = np.add.reduceat(plan.batch_tokens[:n * g], edges[:-1])

    def mmm(x):
        return {"mean": float(x.mean()), "min": int(x.min()), "median": float(np.median(x)), "max": int(x.max())}
    return {"samples": mmm(samples), "tokens": mmm(tokens)}


def describe_step_stats(stats: dict, gb=None) -> str:
    """One line of :func:`step_stats` (and the set global batch ``gb``, a ``GlobalBatchConfig``, when given)."""
    sm, tk = stats["samples"], stats["tokens"]
    line = (f"samples per optimizer step mean {sm['mean']:,.1f} (min {sm['min']:,}, median {sm['median']:,.0f}, max "
            f"{sm['max']:,}), tokens per step mean {tk['mean']:,.0f} (min {tk['min']:,}, max {tk['max']:,})")
    if gb is not None:
        mean = sm["mean"] if gb.by == "samples" else tk["mean"]
        line += (f"; global_batch {gb.by} {gb.value:,} set: planned mean {mean / gb.value - 1:+.1%} "
                 f"(tolerance {gb.tolerance:.0%}; the epoch's last step holds its leftover samples)")
    else:
        line += "; sampler.global_batch not set: this is the global batch these micro-steps per step give"
    return line


#: the check of the search's estimate plans this many samples per DP rank of the epoch (at least the whole epoch
#: when it is smaller): at 1,024 ranks 131,072 samples, about a second
CHECK_SAMPLES_PER_RANK = 128
#: ... and at least this many global batches
CHECK_STEPS = 16
#: ``m_comp: auto``: re-aim the budget at most this many times when the check misses the tolerance
AIM_TRIES = 3
#: ... and at least this many samples (fewer than the search planned would be a worse estimate than its own)
CHECK_MIN_SAMPLES = 4096


def check_epoch(sampler, gb, micro_steps_per_step) -> None:
    """(A ``_PlannedBatchSampler`` just built with ``gb``.) The bound on the budget search's estimate: a plan at the run's own layout of the epoch's first
    ``max(CHECK_SAMPLES_PER_RANK x dp, CHECK_STEPS global batches)`` samples (the whole epoch when smaller: its
    own plan) holds the global batch. With ``gradient_accumulation_steps: auto`` the micro-steps per step are re-fitted to that plan's mean samples
    (or tokens) per micro-step when they differ (the search planned a sample of the epoch on a sample of the
    ranks); the fit is in ``sampler.global_batch_fit``. With ``m_comp: auto`` a fit outside the tolerance re-aims the
    budget (at most :data:`AIM_TRIES` times) so that a micro-step holds ``G / gas``; the aimed budget is in the fit's
    ``m_comp_aimed``. Still outside: a warning; more than twice the tolerance off is a :class:`PlanError`."""
    order = sampler._order()
    counts = np.bincount(sampler._sid, minlength=len(sampler._uniq))   # no per-sample array (10M: 80 MB)
    tokens = np.array([bucket_tokens(u) for u in sampler._uniq], float)
    per_sample = 1.0 if gb.by == "samples" else float(tokens @ counts / max(counts.sum(), 1))
    n = int(max(CHECK_SAMPLES_PER_RANK * sampler.layout.dp_size, CHECK_STEPS * gb.value / per_sample, CHECK_MIN_SAMPLES))

    def check(params) -> GasFit:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # oversize samples skipped here: the sampler's own plan reports them (error or skip) where it is planned
            plan = plan_epoch(sampler._sid, sampler._uniq, order[:n], sampler.cost,
                              dataclasses.replace(params, oversize="skip"), seed=sampler._plan_seed(0),
                              replan_tail=n >= len(order))
        # a whole epoch's plan without its last step (the epoch's leftover samples, re-planned); a prefix's plan has
        # no such step (its incomplete last step is left out unplanned): all of its steps stand for the epoch
        return fit_gas(per_micro_step(plan, gb.by, steady=n >= len(order)), gb.value, gb.tolerance, micro_steps_per_step)
    fit, aimed_from = check(sampler.params), None
    # only a budget the search chose (it plans samples over the budget alone): the search-less m_comp is the costliest
    # sample's B=1 cost, and a lower one would make that sample oversize
    searched = sampler.budget_choice is not None and bool(sampler.params.solo_over_budget)
    tries = AIM_TRIES if sampler.m_comp_auto and sampler.params.m_comp is not None and searched else 0
    seen = [(sampler.params.m_comp, fit.per_micro)]   # (budget, samples or tokens per micro-step) of every plan
    while tries > 0 and not fit.ok and fit.per_micro > 0:
        tries -= 1
        # the micro-steps per step k as fitted or one either side (a plan's samples per micro-step move in steps:
        # the next k can be the nearer), each with the budget aimed so that a micro-step holds G / k; a bracketed
        # aim first, then the fitted k; none that was planned already
        ks = [fit.gas] if micro_steps_per_step != "auto" else [fit.gas, fit.gas - 1, fit.gas + 1]
        aims = [(not bracketed, j, k, m) for j, k in enumerate(ks) if k >= 1
                for m, bracketed in [_aim_budget(seen, gb.value / k, sampler.cost.c0)]
                if all(abs(m / m_seen - 1) > 1e-3 for m_seen, _ in seen)]
        if not aims:
            break
        _, _, k, m_aim = min(aims)
        aimed = dataclasses.replace(sampler.params, m_comp=m_aim, micro_steps_per_step=k)
        f2 = check(aimed)
        seen.append((aimed.m_comp, f2.per_micro))
        if f2.error < fit.error:
            sampler.params, fit, aimed_from = aimed, f2, aimed_from if aimed_from is not None else seen[0][0]
            sampler._cache = None
    if micro_steps_per_step == "auto" and fit.gas != sampler.micro_steps_per_step:
        sampler.params = dataclasses.replace(sampler.params, micro_steps_per_step=fit.gas)
        sampler._cache = None
    if fit.error > 2 * gb.tolerance and n < len(order):
        # the search kept its estimate within the tolerance; a plan of CHECK_STEPS global batches may miss by twice.
        # An epoch of fewer samples is too short to tell its rounding from a miss: a warning (its steps are printed)
        raise PlanError(no_plan_message(gb.value, gb.by, gb.tolerance, [(sampler.params.m_comp, fit)],
                                        sampler.layout.dp_size, micro_steps_per_step)
                        + f" (the plan of the epoch's first {min(n, len(order)):,} samples on all ranks is "
                          f"{fit.error:.1%} off, more than twice the tolerance)")
    if gb.tolerance < fit.error <= 2 * gb.tolerance:
        warnings.warn(f"sampler: the plan holds {fit.predicted:,.0f} {gb.by} per optimizer step for global_batch."
                      f"{gb.by} {gb.value:,} ({fit.error:.1%} off, tolerance {gb.tolerance:.0%}): set a global batch "
                      "nearer a whole number of micro-steps, or a wider tolerance, to hold it closer", stacklevel=3)
    elif fit.error > 2 * gb.tolerance:
        warnings.warn(f"sampler: the epoch of {len(order):,} samples plans {fit.predicted:,.0f} {gb.by} per optimizer "
                      f"step for global_batch.{gb.by} {gb.value:,} ({fit.error:.0%} off): too few samples to hold it "
                      "closer", stacklevel=3)
    sampler.global_batch_fit = {**fit.describe(), "checked_samples": int(min(n, len(order)))}
    if aimed_from is not None:
        sampler.global_batch_fit["m_comp_aimed"] = {"from": aimed_from, "to": sampler.params.m_comp}


def _aim_budget(seen: list[tuple[float, float]], want: float, c0: float) -> tuple[float, bool]:
    """The budget whose micro-steps hold ``want`` samples (or tokens): between the two nearest planned budgets of
    ``seen`` (budget, per micro-step) that bracket it, linearly; else from the latest, scaled above the per-micro-batch
    cost ``c0`` (a micro-step's samples grow about linearly with the budget there; a plan's count moves in steps, so
    the bracket is the better guess once there is one). Returns (budget, bracketed)."""
    lo = max(((m, q) for m, q in seen if q <= want), default=None, key=lambda x: x[1])
    hi = min(((m, q) for m, q in seen if q > want), default=None, key=lambda x: x[1])
    if lo is not None and hi is not None and hi[1] > lo[1]:
        return lo[0] + (hi[0] - lo[0]) * (want - lo[1]) / (hi[1] - lo[1]), True
    m, q = seen[-1]
    return max(c0 + (m - c0) * want / q, c0 * 1.01), False


def global_batch_candidates(table: Sequence[dict], gb, micro_steps_per_step, c0: float, lo: float, hi: float,
                            best: int = 3) -> list[float]:
    """Budgets aimed at the global batch: for the micro-step counts ``k`` nearest ``G / q`` of the ``best`` fastest
    rows (by ``raw_tokens_per_s``) that miss it (``q``: their samples or tokens per micro-step), the budget where
    ``k x q`` crosses ``G`` between two scored budgets (linear interpolation of ``q`` over the budget), or, past
    the scored range, the row's budget scaled by ``G / (k q)`` above the per-micro-batch cost ``c0`` (a
    micro-step's samples grow about linearly with the budget there). Within ``[lo, hi]``, not within 0.5% of a
    scored budget."""
    rows = sorted((r for r in table if not r["efficient_batches"] and r["fit"].per_micro > 0), key=lambda r: r["m_comp"])
    misses = sorted((r for r in table if not r["keeps_global_batch"] and r["fit"].per_micro > 0),
                    key=lambda r: -r["raw_tokens_per_s"])[:best]
    have = [r["m_comp"] for r in table]
    out: list[float] = []

    def add(m2: float) -> None:
        m2 = float(min(max(m2, lo), hi))
        if all(abs(m2 - x) > 0.005 * x for x in have + out):
            out.append(m2)
    for r in misses:
        q, m = r["fit"].per_micro, r["m_comp"]
        ks = ({max(1, math.floor(gb.value / q)), max(1, math.ceil(gb.value / q))} if micro_steps_per_step == "auto"
              else {int(micro_steps_per_step)})
        for k in sorted(ks):
            want = gb.value / k
            crossed = False
            for a, b in zip(rows, rows[1:]):
                qa, qb = a["fit"].per_micro, b["fit"].per_micro
                if (qa - want) * (qb - want) < 0:
                    add(a["m_comp"] + (want - qa) * (b["m_comp"] - a["m_comp"]) / (qb - qa))
                    crossed = True
            if not crossed:
                add(c0 + (m - c0) * want / q)
    return out
