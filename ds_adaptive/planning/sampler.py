"""Batch samplers for torch's DataLoader: this rank's index list per micro-step, resumable.

    sampler = build_batch_sampler(cfg.sampler, dataset.sample_shapes(), Layout.detect(sp),
                                  micro_steps_per_step=gradient_accumulation_steps)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=...)
    for epoch in ...:
        sampler.set_epoch(epoch)
        for step_in_epoch, ... in ...:       # micro_steps_per_step batches per optimizer step
            totals = sampler.step_totals(step_in_epoch)   # global samples/tokens: loss weights, LR

Every DP rank gets the same number of micro-steps; the ``sp`` ranks of one Ulysses group get
identical batches (the plan is indexed by ``dp_rank`` only). The plan is a pure function of
(seed, epoch, shapes, config, layout), computed identically on every rank (no communication).
``state_dict(consumed_steps)`` / ``load_state_dict`` resume mid-epoch, also on another world size:
the samples of the epoch not yet consumed are re-planned for the new layout.

Sparse attention (``ds_adaptive.planning.sparse_cost``): a sampler built with ``sparse=`` plans with the
sparse cost; ``update_densities(densities, at_step=None)`` re-plans with the profiler's new
densities at the next epoch boundary (default) or from optimizer step ``at_step`` of the current
epoch (a re-plan point: the steps before it keep their plan, the not-yet-consumed samples are
re-planned, exactly as after a resume; start a new iterator there). Every rank must pass the same
densities (all-reduced / broadcast profiler output): the plan stays a pure function of its inputs.
The active and pending densities are part of ``state_dict``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from typing import Iterator, Mapping, Optional, Sequence

import numpy as np

from ds_adaptive.core.config import OptimizationConfig, RecomputeConfig, SamplerConfig
from ds_adaptive.core.layout import Layout
from ds_adaptive.planning.budget import plan_tokens_per_s, uses_budget_search
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import Profile, load_profile
from ds_adaptive.planning.devices import calibrate_hint, resolve_auto_profile
from ds_adaptive.planning.memory import sample_memory
from ds_adaptive.planning.global_batch import batch_limit, check_epoch, too_small_problem
from ds_adaptive.planning.planner import (EpochPlan, OversizeSampleError, PlanError, PlannerParams, StepTotals,
                                          bucket_tokens, plan_epoch, unique_shapes)
from ds_adaptive.planning.budget import resolve_budgets
from ds_adaptive.planning.validate import check_fixed_batch_sizes
from ds_adaptive.planning.shape_table import indexed
from ds_adaptive.planning.sparse_cost import SparseAttentionCost
from ds_adaptive.planning.sampler_state import STATE_FORMAT, ResumableState, SamplerStateError
from ds_adaptive.core.contracts import DensityMap, load_densities
from ds_adaptive.models.registry import get_model
from ds_adaptive.core.shapes import SampleShape

try:  # a torch Sampler when torch is there (the planner itself never needs torch)
    from torch.utils.data import Sampler as _SamplerBase
except ImportError:  # pragma: no cover
    _SamplerBase = object

__all__ = ["StepTotals", "OversizeSampleError", "AdaptiveBatchSampler", "TokenBucketSampler",
           "FixedBucketSampler", "build_batch_sampler", "SamplerStateError", "STATE_FORMAT"]

# ============================================================================== samplers
def shapes_fingerprint(shapes: Sequence[SampleShape], unique: Optional[tuple] = None) -> str:
    """sha256 (16 hex digits) of every sample's shape as ``"FxHxW;"`` (or ``"S;"``) in order; ``unique``: the
    :func:`unique_shapes` of ``shapes``, to hash without formatting every sample."""
    uniq, sid = unique if unique is not None else unique_shapes(shapes)
    text, h = [f"{s};".encode() for s in uniq], hashlib.sha256()
    for lo in range(0, len(sid), 1 << 20):   # in chunks: no list of every sample's int at once
        h.update(b"".join(map(text.__getitem__, sid[lo:lo + (1 << 20)].tolist())))
    return h.hexdigest()[:16]


def _compact_profile(p: Profile) -> dict:
    """The fields of a profile that planning depends on (stored in resume state)."""
    out = {
        "format": p.raw.get("format"), "name": p.name, "device": p.device, "gpu_mem_gib": p.gpu_mem_gib,
        "model": {"num_layers": p.num_layers, "num_heads": p.num_heads, "dim": p.dim, "params": p.params},
        "sp": p.sp,
        "compute": {"c0_ms": p.c0_ms, "a_ms_per_token": p.a_ms_per_token, "b_ms_per_token2": p.b_ms_per_token2},
        "memory": {"m0_gib": p.m0_gib, "m1_gib_per_token": p.m1_gib_per_token},
        "comm": {"bytes_per_token_per_layer": p.comm_bytes_per_token_per_layer, "link_GBps": p.link_gbps},
        "static_memory": {"bytes_per_param": dict(p.bytes_per_param), "stage3_live_params": p.stage3_live_params,
                          "workspace_gib": p.workspace_gib},
        "gradient_checkpointing": p.gradient_checkpointing,
    }
    out["memory"]["checkpointing"] = {
        "block_full": {"m0_gib": p.block_full_gib[0], "m1_gib_per_token": p.block_full_gib[1]},
        "block_checkpointed": {"m0_gib": p.block_ckpt_gib[0], "m1_gib_per_token": p.block_ckpt_gib[1]},
        "source": p.checkpoint_source}
    if any(p.last_whole_gib):
        out["memory"]["checkpointing"]["last_block_whole"] = {"m0_gib": p.last_whole_gib[0],
                                                              "m1_gib_per_token": p.last_whole_gib[1]}
    if p.per_token_source != "none":
        out["memory"]["per_token_timesteps"] = {"m1_gib_per_token": p.per_token_gib[0],
                                                "block_full_m1_gib_per_token": p.per_token_gib[1],
                                                "applies": p.per_token_applies, "source": p.per_token_source}
    out["compute"]["recompute"] = dict(zip(("c0_ms", "a_ms_per_token", "b_ms_per_token2"), p.recompute_ms))
    if p.fragmentation_margin_gib is not None:
        out["memory"]["fragmentation_margin_gib"] = p.fragmentation_margin_gib
    if p.block_fusion != "off":   # only then: states without the key planned eager blocks
        out["block_fusion"] = p.block_fusion
    out["train_overheads"] = {"micro_step_ms": p.micro_step_overhead_ms, "optimizer_step_ms": p.optimizer_step_overhead_ms,
                              "source": p.overhead_source}
    return out


class _PlannedBatchSampler(ResumableState, _SamplerBase):
    """Shared machinery: epoch shuffle, plan cache, iteration from a resume point, state."""

    mode = "dual"

    def __init__(self, shapes: Sequence[SampleShape], layout: Layout, cost: CostModel, *,
                 micro_steps_per_step: int, m_mem: float, m_comp: Optional[float] = None,
                 max_tokens: Optional[int] = None, fixed_batch_sizes: Optional[Mapping[str, int]] = None,
                 window: int = 256, seed: int = 0, oversize: str = "error", balance_tolerance: float = 0.03,
                 lr_scaling: str = "none", reference_batch: Optional[int] = None,
                 loss_weighting: str = "samples", m_comp_auto: bool = False, solo_over_budget: bool = False,
                 budget_choice=None, plan_mode: Optional[str] = None, efficient_batches: bool = False,
                 batch_cap: bool = True, global_batch=None, global_batch_fit: Optional[dict] = None) -> None:
        if cost.sp != layout.sp_size:
            raise ValueError(f"cost model sp={cost.sp} but layout sp_size={layout.sp_size}")
        if not len(shapes):
            raise ValueError("the dataset has no samples (sample_shapes() is empty)")
        self.shapes = indexed(shapes)
        self.layout = layout
        self.cost = cost
        self.seed = int(seed)
        self.lr_scaling = lr_scaling
        self.reference_batch = reference_batch
        self.loss_weighting = loss_weighting
        self.params = PlannerParams(   # plan_mode: "tokens" when the budget search found the baseline faster
            mode=plan_mode or self.mode, dp_size=layout.dp_size, micro_steps_per_step=int(micro_steps_per_step),
            m_mem=float(m_mem), m_comp=None if m_comp is None else float(m_comp), max_tokens=max_tokens,
            fixed_batch_sizes=dict(fixed_batch_sizes) if fixed_batch_sizes else None, window=int(window),
            oversize=oversize, balance_tolerance=float(balance_tolerance), solo_over_budget=bool(solo_over_budget),
            efficient_batches=bool(efficient_batches), step_balance=None if global_batch is None else global_batch.by,
            batch_limit=batch_limit(global_batch, layout.dp_size) if self.mode == "dual" else None)   # not the baselines
        #: the throughput search behind ``m_comp: auto`` (:class:`ds_adaptive.planning.budget.BudgetChoice`), or None
        self.budget_choice = budget_choice
        self.global_batch = global_batch           # sampler.global_batch (GlobalBatchConfig), or None
        self.global_batch_fit = global_batch_fit   # its fit at start-up: {"gas", "per_micro", "predicted", "error"}
        self._uniq, self._sid = unique_shapes(self.shapes)
        self._fingerprint = shapes_fingerprint(self.shapes, (self._uniq, self._sid))
        self.m_comp_auto = bool(m_comp_auto)       # re-resolve m_comp when the densities change
        self.batch_cap = bool(batch_cap)           # ... with or without the search's efficient batch cap
        self._pending: Optional[dict] = None       # densities waiting for the next epoch boundary
        self.density_updates: list[dict] = []      # applied updates: {"epoch", "step", "at_step", "fingerprint"}
        self.epoch = 0
        self._segments: list[dict] = []      # earlier segments of this epoch (other layouts)
        self._resume_step = 0                # first step (of the current plan) to yield
        self._cache: Optional[tuple] = None  # (key, plans, offsets)

    # ------------------------------------------------------------------ public API
    @property
    def micro_steps_per_step(self) -> int:
        return self.params.micro_steps_per_step

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate; a different epoch than the resumed one starts at step 0."""
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self._segments = []
            self._resume_step = 0
            self._cache = None
            if self._pending is not None:
                pending, self._pending = self._pending, None
                self._set_sparse(SparseAttentionCost.from_description(pending["sparse"]), pending.get("measured_at"), None)

    # ------------------------------------------------------------------ sparse attention
    def update_densities(self, densities: "DensityMap | Mapping | str", at_step: Optional[int] = None, *,
                         measured_at: Optional[int] = None) -> None:
        """Plan with new per-layer x head attention densities (a :class:`DensityMap`, its dict, or a
        density json / metrics.jsonl path).

        ``at_step=None``: from the next epoch boundary (the next :meth:`set_epoch` to another epoch);
        the current epoch's plan is unchanged. ``at_step=k``: from optimizer step ``k`` of the current
        epoch (``k`` >= the steps this sampler already resumed past): steps ``< k`` keep their plan
        and the epoch's samples not consumed by them are re-planned (exactly once, as after a resume);
        iterate the sampler afresh from step ``k`` (a new DataLoader iterator), unless the update kept the
        running plan (``density_updates[-1]["kept"]``: nothing changed, the iterator goes on). ``measured_at`` (the
        global step the profiler measured at) is recorded in :attr:`density_updates`. Needs a sampler
        built with ``sparse=``; call it on every rank with the same densities.
        """
        if self.cost.sparse is None:
            raise ValueError("update_densities needs a sampler planned with a sparse-attention cost "
                             "(build_batch_sampler(..., sparse=SparseAttentionCost(...)))")
        dm = load_densities(densities)
        if dm.num_layers != self.cost.sparse.densities.num_layers and dm.num_layers > self.cost.profile.num_layers:
            dm = dm.with_num_layers(self.cost.profile.num_layers)
        new = self.cost.sparse.with_densities(dm)
        self.cost.with_sparse(new)          # validates layers x heads now
        if at_step is None:
            self._pending = {"sparse": new.describe(), "measured_at": measured_at}
            return
        plan, start = self._plans()
        at_step = int(at_step)
        lo, hi = start + self._resume_step, start + plan.num_steps
        if not lo <= at_step <= hi:
            raise ValueError(f"update_densities(at_step={at_step}): the re-plan point must be a step of epoch "
                             f"{self.epoch} not yet planned away, {lo}..{hi}")
        self._set_sparse(new, measured_at, at_step)

    def _set_sparse(self, sparse: SparseAttentionCost, measured_at: Optional[int], at_step: Optional[int]) -> None:
        """Plan with ``sparse`` from step ``at_step`` of this epoch (None: this epoch is a new one, from its
        start), unless the plan the sampler would run without it is predicted faster under that new cost
        (:func:`ds_adaptive.planning.budget.plan_tokens_per_s`, over the same samples: the rest of the epoch),
        with the training loop's overheads or on compute alone; then that plan is kept, exactly as it was. So
        a re-plan is never predicted slower than not re-planning: the budget search behind ``m_comp: auto``
        scores a prefix of epoch 0 and a re-plan re-draws the batches of the rest, either of which can lose to
        the running plan. Both predictions must favour the re-plan because the loop terms are the uncertain
        part: the shipped profiles' per-step terms are several times the time measured outside compute (they
        absorb compute the calibration under-counts), and on an H200 they once made a re-plan into larger,
        checkpointed micro-batches look faster while its compute per token was predicted, and measured, slower."""
        plan, start = self._plans()
        first = self._resume_step if at_step is None else at_step - start
        new_cost = self.cost.with_sparse(sparse)
        kept_tps = plan_tokens_per_s(plan, new_cost, first)
        kept_compute = plan_tokens_per_s(plan, new_cost, first, loop=False)
        saved = (self.cost, self.params, self.budget_choice, list(self._segments), self._cache, self._resume_step)
        if at_step is not None:   # a re-plan point inside the epoch: the steps before it keep their plan
            self._segments.append({**self._segment_config(), "consumed_steps": at_step - start})
            self._resume_step = 0
        self._apply_cost(new_cost)
        replan_tps = plan_tokens_per_s(self._plans()[0], self.cost)
        replan_compute = plan_tokens_per_s(self._plans()[0], self.cost, loop=False)
        kept = kept_tps > replan_tps or kept_compute > replan_compute
        if kept:   # the sampler exactly as it was: its running iterator goes on (no new DataLoader iterator)
            self.cost, self.params, self.budget_choice, self._segments, self._cache, self._resume_step = saved
        self.density_updates.append({"epoch": self.epoch, "at_step": at_step, "measured_at": measured_at,
                                     "fingerprint": sparse.densities.fingerprint(), "kept": kept,
                                     "predicted_tokens_per_s": {"replan": replan_tps, "kept": kept_tps},
                                     "predicted_compute_tokens_per_s": {"replan": replan_compute,
                                                                        "kept": kept_compute}})

    def _apply_cost(self, cost: CostModel) -> None:
        """Plan with ``cost`` from the current segment on; ``m_comp: auto`` re-resolves the budget for it."""
        self.cost = cost
        if self.m_comp_auto and self.mode == "dual":
            # micro-steps per step stay as DeepSpeed runs them; only the budget (and plan mode) follow the new cost
            b = resolve_budgets(mode="dual", cost=self.cost, shapes=self.shapes, m_mem=self.params.m_mem,
                                m_comp="auto", max_tokens=self.params.max_tokens, gpu_mem_gib=None,
                                mem_utilization=1.0, zero_stage=0, dp_size=self.params.dp_size,
                                micro_steps_per_step=self.params.micro_steps_per_step, window=self.params.window,
                                balance_tolerance=self.params.balance_tolerance, seed=self.seed,
                                batch_cap=self.batch_cap, global_batch=self.global_batch)
            self.params = dataclasses.replace(self.params, m_comp=b["m_comp"], solo_over_budget=b["solo_over_budget"],
                                              mode=b["plan_mode"], efficient_batches=b["efficient_batches"],
                                              max_tokens=b["max_tokens"] if b["plan_mode"] == "tokens" else None)
            self.budget_choice = b["budget_choice"]
        self._cache = None

    @property
    def plan(self) -> EpochPlan:
        """The plan of the current segment of the current epoch (this layout)."""
        return self._plans()[0]

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of the current epoch, counting steps done before a resume."""
        plan, start = self._plans()
        return start + plan.num_steps

    def __len__(self) -> int:
        """Micro-batches this rank yields from the resume point to the end of the epoch."""
        plan, _ = self._plans()
        return (plan.num_steps - self._resume_step) * self.micro_steps_per_step

    def __iter__(self) -> Iterator[list[int]]:
        plan, _ = self._plans()
        start_micro = self._resume_step * self.micro_steps_per_step
        yield from plan.rank_batches(self.layout.dp_rank, start_micro)

    def step_totals(self, step_in_epoch: int) -> StepTotals:
        """Global samples and tokens of optimizer step ``step_in_epoch`` (for loss weighting)."""
        plan, start = self._plans()
        if step_in_epoch >= start:
            return plan.step_totals(step_in_epoch - start)
        for seg_plan, seg_start, seg_steps in self._segment_plans():
            if seg_start <= step_in_epoch < seg_start + seg_steps:
                return seg_plan.step_totals(step_in_epoch - seg_start)
        raise IndexError(f"step {step_in_epoch} is not in epoch {self.epoch}'s plan")

    def checkpoint_blocks(self, step_in_epoch: int, micro: int) -> int:
        """Blocks this rank checkpoints (the first n) in micro-step ``micro`` of optimizer step
        ``step_in_epoch``: the plan's checkpoint plan (:mod:`ds_adaptive.planning.memory`), a pure
        function of the batch and the budgets, so it is the same after a resume and on every rank of
        an SP group. Call it with the trainer's own counters (the DataLoader runs the sampler ahead)."""
        if not 0 <= micro < self.micro_steps_per_step:
            raise IndexError(f"micro-step {micro} is outside 0..{self.micro_steps_per_step - 1}")
        plan, start = self._plans()
        for p, s0, n in ([(plan, start, plan.num_steps)] + self._segment_plans()):
            if s0 <= step_in_epoch < s0 + n:
                return p.checkpoint_blocks((step_in_epoch - s0) * self.micro_steps_per_step + micro,
                                           self.layout.dp_rank)
        raise IndexError(f"step {step_in_epoch} is not in epoch {self.epoch}'s plan")

    def lr_scale(self, step_in_epoch: int) -> float:
        """LR multiplier of the step from ``lr_scaling`` / ``reference_batch``."""
        return self.step_totals(step_in_epoch).lr_scale(self.lr_scaling, self.reference_batch)

    def epoch_stats(self) -> dict:
        """Counts of the current epoch's plan: samples planned, oversize skipped, tail dropped,
        predicted balance (CV of per-rank cost per micro-step)."""
        plan, start = self._plans()
        c = plan.micro_step_costs()
        cv = c.std(axis=1) / np.maximum(c.mean(axis=1), 1e-30) if c.size else np.zeros(0)
        return {"epoch": self.epoch, "mode": self.mode, "plan_mode": self.params.mode, "steps": start + plan.num_steps,
                "micro_steps": plan.num_micro_steps, "samples": plan.num_samples,
                "oversize": len(plan.oversize), "tail_dropped": len(plan.tail_dropped),
                "tail_replanned": plan.tail_replanned,
                "predicted_cv_mean": float(cv.mean()) if cv.size else 0.0,
                "budgets": {"m_mem_gib": self.params.m_mem, "m_comp": self.params.m_comp,
                            "max_tokens": self.params.max_tokens, "unit": self.cost.unit,
                            "micro_steps_per_step": self.micro_steps_per_step,
                            "solo_over_budget": self.params.solo_over_budget,
                            "efficient_batches": self.params.efficient_batches,
                            "budget_search": None if self.budget_choice is None else {
                                k: v for k, v in self.budget_choice.describe().items() if k != "candidates"}}}

    # ------------------------------------------------------------------ internals
    def _segment_config(self) -> dict:
        cfg = {"params": self.params.as_dict(), "profile": _compact_profile(self.cost.profile),
               "cost_mode": self.cost.mode, "p": self.cost.p, "sp": self.cost.sp}
        if self.cost.sparse is not None:   # only then: dense samplers keep their old state format
            cfg["sparse"] = self.cost.sparse.describe()
        if self.cost.num_heads != self.cost.profile.num_heads:   # the trained model's heads (e.g. a smaller model)
            cfg["num_heads"] = self.cost.num_heads
        if self.cost.checkpointing != "all":   # likewise: states without the key planned every block checkpointed
            cfg["checkpointing"] = self.cost.checkpointing
        if self.cost.checkpoint_attention != "recompute":   # likewise: states without it recomputed attention
            cfg["checkpoint_attention"] = self.cost.checkpoint_attention
        return cfg

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.shapes))

    def _segment_plans(self) -> list[tuple[EpochPlan, int, int]]:
        return self._plans_full()[1]

    def _plans(self) -> tuple[EpochPlan, int]:
        plan, _, start = self._plans_full()
        return plan, start

    def _plans_full(self):
        key = (self.epoch, json.dumps(self._segments, sort_keys=True, default=str))
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        order = self._order()
        consumed = np.zeros(len(self.shapes), bool)
        seg_plans, cp = [], self.cost.context_parallel   # the run's context-parallel mode (sp vs the heads)
        start = 0
        for k, seg in enumerate(self._segments):
            remaining = order[~consumed[order]]
            params = PlannerParams(**{**seg["params"], "fixed_batch_sizes": seg["params"].get("fixed_batch_sizes")})
            sparse = SparseAttentionCost.from_description(seg["sparse"]) if seg.get("sparse") else None
            cost = CostModel(Profile.from_dict(seg["profile"], where="sampler state"), seg["cost_mode"],
                             p=seg["p"], sp=seg["sp"], num_heads=seg.get("num_heads"), sparse=sparse,
                             checkpointing=seg.get("checkpointing", "all"),
                             checkpoint_attention=seg.get("checkpoint_attention", "recompute"), context_parallel=cp)
            uniq, sid = self._uniq, self._sid
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sp = plan_epoch(sid, uniq, remaining, cost, params, seed=self._plan_seed(k))
            n = int(seg["consumed_steps"])
            if n > sp.num_steps:
                raise SamplerStateError(f"sampler state segment {k} consumed {n} steps but its plan has "
                                        f"only {sp.num_steps}; the state does not match this dataset")
            consumed[sp.samples_of_steps(n)] = True
            seg_plans.append((sp, start, n))
            start += n
        remaining = order[~consumed[order]] if seg_plans else order   # no copy of a fresh epoch's order
        del order, consumed
        plan = plan_epoch(self._sid, self._uniq, remaining, self.cost, self.params,
                          seed=self._plan_seed(len(self._segments)))
        result = (plan, seg_plans, start)
        self._cache = (key, result)
        return result

    def _plan_seed(self, segment: int) -> int:
        return (self.seed * 1_000_003 + self.epoch * 7919 + segment) % (2 ** 63)


class AdaptiveBatchSampler(_PlannedBatchSampler):
    """``dual``: batches under memory AND compute budgets, micro-steps balanced by predicted cost."""

    mode = "dual"


class TokenBucketSampler(_PlannedBatchSampler):
    """``tokens``: equal-token bucketing (B*S <= max_tokens per shape bucket), dealt round-robin."""

    mode = "tokens"


class FixedBucketSampler(_PlannedBatchSampler):
    """``fixed``: a fixed batch size per shape bucket (default: the largest within m_mem)."""

    mode = "fixed"


_CLASSES = {"dual": AdaptiveBatchSampler, "tokens": TokenBucketSampler, "fixed": FixedBucketSampler}


def _detect_gpu_mem_gib() -> Optional[float]:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / float(1 << 30)
    except Exception:
        return None
    return None


def _run_profile(sampler_cfg: SamplerConfig, profile: Optional[Profile], model, model_name: Optional[str], *,
                 gpu_mem_gib, profile_log, ln_modulate, num_layers, adapter_params, per_token_timesteps,
                 block_fusion=None) -> Profile:
    """The profile :func:`build_batch_sampler` plans with: the given one, ``auto`` / ``calibrate`` resolved for
    the GPU, or the named one; then its LayerNorm-modulate path, block fusion, depth, LoRA adapters and per-token
    modulation."""
    if sampler_cfg.profile is None:
        raise PlanError("sampler.profile is null: a profile (auto, a shipped name or path of a "
                        "`ds-adaptive calibrate` json) is needed for the memory model")
    if profile is None and sampler_cfg.profile in ("auto", "calibrate"):
        profile, msg = resolve_auto_profile(model_name, gpu_mem_gib=gpu_mem_gib)
        if profile_log is not None:
            profile_log(msg)
    elif profile is None:
        profile = load_profile(sampler_cfg.profile)
    if model is not None and (gpu_mem_gib or _detect_gpu_mem_gib()) and profile.raw.get("model", {}).get("name") not in (
            None, model_name, model.profile_model):   # a CPU run: no GPU to calibrate on, nothing to act on
        warnings.warn(f"sampler.profile '{profile.name}' was measured for model "
                      f"'{profile.raw['model']['name']}', training '{model_name}': predicted costs "
                      f"and memory will be off; {calibrate_hint(model_name)}",
                      stacklevel=3)
    profile, ln_msg = profile.for_ln_modulate(ln_modulate)
    if ln_msg is not None:
        (profile_log or (lambda m: warnings.warn(m, stacklevel=3)))(ln_msg)
    profile, fusion_msg = profile.for_block_fusion(block_fusion, ln_modulate)
    if fusion_msg is not None:
        (profile_log or (lambda m: warnings.warn(m, stacklevel=3)))(fusion_msg)
    if num_layers is not None:
        profile = profile.with_num_layers(int(num_layers))
    if adapter_params is not None:
        profile = profile.with_adapter_params(adapter_params)
    if model is not None:   # video micro-batches with one timestep per token hold its modulation besides
        on = model.trains_per_token_timesteps() if per_token_timesteps is None else bool(per_token_timesteps)
        profile = profile.with_per_token_timesteps(
            on, model.per_token_modulation_bytes(model.config(num_layers=profile.num_layers)))
    return profile


def _checkpoint_attention_plan(asked: str, mode: str, model, shapes, plan_with, profile_log):
    """``(cost, budgets)`` of ``plan_with(attention)`` for ``recompute.attention`` (``asked``); ``auto``: both modes where
    the budget search runs (``dual``, calibrated, ``recompute.blocks: auto``, a family that can keep its attention, or
    no model: planning on paper), the one with the higher predicted tokens/s (ties: ``recompute``), with a line
    to ``profile_log``; elsewhere ``recompute``. ``keep`` is not taken where a shape that fits ``m_mem`` with every
    block recomputing would not fit with the kept attention outputs (its search leaves such samples out)."""
    if asked != "auto":
        return plan_with(asked)
    cost, budgets = plan_with("recompute")
    if not (uses_budget_search(cost, mode) and (model is None or model.family.keeps_attention)
            and budgets.get("budget_choice") is not None):
        return cost, budgets
    try:
        keep_cost, keep_budgets = plan_with("keep")
    except PlanError as exc:   # e.g. no plan with kept attention holds the global batch: recompute's does
        if profile_log is not None:
            profile_log(f"recompute.attention auto -> recompute: with kept attention outputs {exc}")
        return cost, budgets
    m_mem = budgets["m_mem"]
    lost = [s for s in unique_shapes(shapes)[0] if sample_memory(keep_cost, s) > m_mem >= sample_memory(cost, s)]
    tps = {"recompute": budgets["budget_choice"].predicted_tokens_per_s,
           "keep": keep_budgets["budget_choice"].predicted_tokens_per_s}
    pick = "keep" if tps["keep"] > tps["recompute"] and not lost else "recompute"
    if profile_log is not None:
        why = (f" (keeping it, {lost[0]} would not fit m_mem {m_mem:.2f} GiB even with every block checkpointed)"
               if lost else "")
        profile_log(f"recompute.attention auto -> {pick}: the budget search predicts {tps['keep']:,.0f} "
                    f"tokens/s with checkpointed blocks keeping their self-attention output, {tps['recompute']:,.0f} "
                    f"recomputing it{why}")
    return (keep_cost, keep_budgets) if pick == "keep" else (cost, budgets)


def _check_batch_settings(sampler_cfg: SamplerConfig, shapes, layout: Layout, micro_steps_per_step, profile_log) -> None:
    """Before planning: a global batch the data-parallel ranks cannot hold is a :class:`PlanError`; ``auto``
    gradient accumulation without a global batch is a warning (the batch would follow the world size); bucket
    names of ``fixed_batch_sizes`` are checked."""
    gb = sampler_cfg.global_batch
    if gb is not None:
        problem = too_small_problem(gb.value, gb.by, layout.dp_size, min(bucket_tokens(s) for s in unique_shapes(shapes)[0]))
        if problem:
            raise PlanError(problem)
    elif micro_steps_per_step == "auto":
        (profile_log or (lambda m: warnings.warn(m, stacklevel=3)))(
            "warning: gradient_accumulation_steps \"auto\" without adaptive_load.sampler.global_batch: the samples "
            "per optimizer step follow the world size and the data; set sampler.global_batch (docs/SCALE.md)")
    check_fixed_batch_sizes(sampler_cfg.fixed_batch_sizes, shapes)


def _zero_stage(given: Optional[int], sampler_cfg: SamplerConfig) -> int:
    """The ZeRO stage ``m_mem: auto`` plans the static memory for: the run's (``given``), else the deprecated
    ``sampler.zero_stage``, else 3 (what the shipped configs run)."""
    if given is not None:
        return int(given)
    return 3 if sampler_cfg.dropped_zero_stage is None else sampler_cfg.dropped_zero_stage


def _blocks(sampler_cfg, recompute, optimization) -> tuple[SamplerConfig, RecomputeConfig, OptimizationConfig]:
    """The sampler, recompute and optimization blocks validated (a dict validates; None: a block's defaults)."""
    return tuple(cfg if isinstance(cfg, model) else model.model_validate(cfg or {})
                 for cfg, model in ((sampler_cfg, SamplerConfig), (recompute, RecomputeConfig),
                                    (optimization, OptimizationConfig)))


def build_batch_sampler(sampler_cfg: SamplerConfig, shapes: Sequence[SampleShape], layout: Layout, *,
                        micro_steps_per_step: "int | str", enabled: bool = True, gpu_mem_gib: Optional[float] = None,
                        model_name: Optional[str] = None, zero_stage: Optional[int] = None,
                        mode: Optional[str] = None, num_layers: Optional[int] = None,
                        sparse: Optional[SparseAttentionCost] = None, checkpointing: Optional[str] = None,
                        profile_log=None, ln_modulate: Optional[str] = None,
                        profile: Optional[Profile] = None, recompute: "RecomputeConfig | Mapping | None" = None,
                        adapter_params: Optional[int] = None, optimization: "OptimizationConfig | Mapping | None" = None,
                        per_token_timesteps: Optional[bool] = None,
                        block_fusion: Optional[str] = None, ema_params: Optional[int] = None,
                        kept_inputs_bytes: float = 0.0) -> _PlannedBatchSampler:
    """The batch sampler that ``sampler_cfg`` describes, with ``auto`` budgets resolved.

    ``enabled=False`` builds the ``tokens`` baseline at the same memory budget (AdaptiveLoad off);
    ``mode`` overrides ``sampler_cfg.mode`` (the simulator builds every sampler from one config).
    ``gpu_mem_gib`` defaults to the visible GPU, else the profile's device. ``num_layers``: the
    trained model's depth (``--layers``); when it differs from the profile's, the profile is
    rescaled to it (:meth:`Profile.with_num_layers`; ``sampler.cost.profile.rescaled_from_layers``
    then holds the profile's own depth). ``sparse``: plan with the sparse-attention cost (its
    densities may be updated later with ``update_densities``). ``recompute`` / ``optimization``: those adaptive_load
    blocks (None: defaults); ``checkpointing`` overrides ``recompute.blocks`` (``--grad-ckpt``). ``profile: auto``
    resolves the profile for the detected GPU (:func:`ds_adaptive.planning.devices.resolve_auto_profile`); its
    one-line message goes to ``profile_log`` (e.g. ``print``) when given. ``micro_steps_per_step``: DeepSpeed's
    gradient_accumulation_steps, or ``"auto"``: the throughput-optimal ``m_comp: auto`` chooses it with the
    budget (:mod:`ds_adaptive.planning.budget`; 1 without that search); the sampler's
    ``micro_steps_per_step`` publishes it (the trainer sets DeepSpeed's value from it). ``ln_modulate``: the
    run's LayerNorm-modulate path (``fused`` | ``reference``); the profile's matching entries are used, or a
    warning goes to ``profile_log`` (:meth:`Profile.for_ln_modulate`). ``profile``: plan with this profile
    instead of ``sampler_cfg.profile`` (the start-up calibration's, ``ds_adaptive.calibration.autocalibrate``);
    ``profile: calibrate`` without one resolves like ``auto``. ``adapter_params``: a LoRA run's adapter parameters, the only trained ones (:meth:`Profile.with_adapter_params`:
    static memory, hence ``m_mem: auto``). ``per_token_timesteps``: whether the run's video micro-batches take one
    timestep per token (first-frame conditioning; default: the model's preset objective); their memory then
    counts the per-token modulation (:meth:`Profile.with_per_token_timesteps`). ``block_fusion``: the run's
    ``adaptive_load.block_fusion`` where it can run (None: no check); the profile's entries for it are used, or a
    note says the plan is conservative (:meth:`Profile.for_block_fusion`). :meth:`Profile.with_ema`, ``with_kept_inputs``."""
    sampler_cfg, recompute, opt = _blocks(sampler_cfg, recompute, optimization)
    shapes = indexed(shapes)
    chosen = mode or (sampler_cfg.mode if enabled else "tokens")
    if chosen not in _CLASSES:
        raise ValueError(f"sampler mode must be one of {sorted(_CLASSES)}, got {chosen!r}")
    model = get_model(model_name) if model_name else None
    profile = _run_profile(sampler_cfg, profile, model, model_name, gpu_mem_gib=gpu_mem_gib, profile_log=profile_log,
                           ln_modulate=ln_modulate, num_layers=num_layers, adapter_params=adapter_params,
                           per_token_timesteps=per_token_timesteps, block_fusion=block_fusion).with_ema(ema_params)
    profile = profile.with_kept_inputs(kept_inputs_bytes)
    num_heads = int(model.config().num_heads) if model is not None else None
    if sparse is not None and num_layers is not None and sparse.densities.num_layers != profile.num_layers:
        sparse = sparse.with_densities(sparse.densities.with_num_layers(profile.num_layers))
    def plan_with(attention: str):
        cost = CostModel(profile, sampler_cfg.cost_model, p=sampler_cfg.p, sp=layout.sp_size, num_heads=num_heads,
                         sparse=sparse, checkpointing=checkpointing or recompute.blocks,
                         checkpoint_attention=attention, context_parallel=layout.context_parallel)
        return cost, resolve_budgets(
            mode=chosen, cost=cost, shapes=shapes, m_mem=sampler_cfg.m_mem, m_comp=sampler_cfg.m_comp,
            max_tokens=sampler_cfg.max_tokens, gpu_mem_gib=gpu_mem_gib or _detect_gpu_mem_gib(),
            mem_utilization=sampler_cfg.mem_utilization,
            zero_stage=_zero_stage(zero_stage, sampler_cfg), dp_size=layout.dp_size,
            micro_steps_per_step=micro_steps_per_step, window=sampler_cfg.window,
            balance_tolerance=sampler_cfg.balance_tolerance, seed=sampler_cfg.seed,
            batch_cap=sampler_cfg.batch_cap == "auto", global_batch=sampler_cfg.global_batch, oversize=sampler_cfg.oversize,
            fixed_batch_sizes=sampler_cfg.fixed_batch_sizes if chosen == "fixed" else None)

    gb = sampler_cfg.global_batch
    _check_batch_settings(sampler_cfg, shapes, layout, micro_steps_per_step, profile_log)
    cost, budgets = _checkpoint_attention_plan(recompute.attention, chosen, model, shapes, plan_with, profile_log)
    plan_mode = budgets["plan_mode"] if chosen == "dual" else chosen
    sampler = _CLASSES[chosen](
        shapes, layout, cost, micro_steps_per_step=budgets["micro_steps_per_step"], m_mem=budgets["m_mem"],
        m_comp=budgets["m_comp"] if chosen == "dual" else None,
        max_tokens=budgets["max_tokens"] if plan_mode == "tokens" else None,
        fixed_batch_sizes=sampler_cfg.fixed_batch_sizes, window=sampler_cfg.window, seed=sampler_cfg.seed,
        oversize=sampler_cfg.oversize, balance_tolerance=sampler_cfg.balance_tolerance,
        lr_scaling=opt.lr_scaling, reference_batch=opt.reference_batch,
        loss_weighting=opt.loss_weighting, m_comp_auto=sampler_cfg.m_comp == "auto",
        solo_over_budget=budgets["solo_over_budget"] and chosen == "dual", budget_choice=budgets["budget_choice"],
        plan_mode=plan_mode, efficient_batches=budgets["efficient_batches"] and chosen == "dual",
        batch_cap=sampler_cfg.batch_cap == "auto", global_batch=gb, global_batch_fit=budgets["global_batch_fit"])
    if gb is not None:
        check_epoch(sampler, gb, micro_steps_per_step)
    return sampler
