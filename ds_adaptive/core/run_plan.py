"""The run plan: the choices a run makes at start-up, resolved once.

``build_run`` (``ds_adaptive.training.assemble``) resolves a :class:`RunPlan` once, after the batch sampler and the
sparse-attention cost exist, and stores it as ``Run.plan``; the model's set-up, the trainer, the metrics, the
placement of the EMA, the previews, the held-out loss and the dry run read their start-up choices from it, not back
from the planner's objects. The sampler still owns planning: it may re-plan during a run (sparse densities, a
resume), so ``run.sampler`` holds the live plan and the ``RunPlan`` the start-up resolution.

Core layer: no planner import; :meth:`RunPlan.from_sampler` reads the sampler by its attributes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

__all__ = ["RunPlan"]


@dataclass(frozen=True)
class RunPlan:
    """The start-up choices of a run (budgets, gradient accumulation, checkpoint policy, kept attention, sparse
    layers), as the batch sampler resolved them when the run was built. Later re-plans of the sampler (new
    densities, a resume) do not change it."""

    gas: int
    """Micro-steps per optimizer step (DeepSpeed's ``gradient_accumulation_steps``), a count."""
    m_mem: float
    """Activation-memory budget per micro-batch and GPU, in GiB."""
    m_comp: Optional[float]
    """Compute budget per micro-batch and GPU, in :attr:`unit` (None: the planner mode has none)."""
    unit: str
    """The cost model's unit of :attr:`m_comp` (``ms`` for a calibrated profile)."""
    max_tokens: Optional[int]
    """Padded tokens per micro-batch and GPU of the ``tokens`` mode, a count (None: not that mode)."""
    solo_over_budget: bool
    """A sample over :attr:`m_comp` at batch 1 (but within :attr:`m_mem`) runs alone instead of being oversize."""
    efficient_batches: bool
    """Each shape's batch is capped at its lowest predicted time per sample (the budget search's choice)."""
    oversize: str
    """What a sample over every budget does: ``error`` (stop) or ``skip`` (left out of the plan)."""
    checkpointing: str
    """The activation-checkpointing policy planned: ``all``, ``none`` or ``auto`` (a block count per batch)."""
    checkpoint_attention: str
    """What a checkpointed block does with its self-attention core, as planned: ``keep`` or ``recompute``."""
    mode: str
    """The planner mode that runs: ``dual``, ``tokens`` or ``fixed`` (the budget search may pick ``tokens``)."""
    sampler_mode: str
    """The batch sampler's own mode, ``dual`` / ``tokens`` / ``fixed`` (``sampler.mode``; ``tokens`` with adaptive_load off)."""
    global_batch: Optional[Mapping[str, Any]] = None
    """``sampler.global_batch`` as {"by": "samples"/"tokens", "value": count per optimizer step, "tolerance":
    relative, "micro_step_share": share of the step one micro-step may hold (or None), "batch_limit": the samples or
    tokens one rank's micro-batch may hold under it (or None)}, or None when the run sets none."""
    global_batch_fit: Optional[Mapping[str, Any]] = None
    """The global batch's fit at start-up: {"gas", "per_micro", "predicted", "error"} (None: no global batch)."""
    budget_note: Optional[str] = None
    """The launcher's line for ``gradient_accumulation_steps: auto`` (the budget search's choice); None when the
    ds_config sets the count."""
    sparse_layers: Optional[tuple[int, ...]] = None
    """Layer indices outside ``sparse_attention.dense_layers``: those the sparse schedule may run sparse (it decides
    per step from the profiled densities); None when sparse attention is off."""

    @classmethod
    def from_sampler(cls, sampler, *, budget_note: Optional[str] = None,
                     sparse_layers: Optional[tuple[int, ...]] = None) -> "RunPlan":
        """The plan of ``sampler`` (``ds_adaptive.planning.sampler``) as it stands: its params, cost and global
        batch; ``budget_note`` and ``sparse_layers`` as the assembler resolved them."""
        p, cost = sampler.params, sampler.cost
        gb = getattr(sampler, "global_batch", None)
        fit = getattr(sampler, "global_batch_fit", None)
        return cls(gas=int(p.micro_steps_per_step), m_mem=float(p.m_mem),
                   m_comp=None if p.m_comp is None else float(p.m_comp), unit=cost.unit, max_tokens=p.max_tokens,
                   solo_over_budget=bool(p.solo_over_budget), efficient_batches=bool(p.efficient_batches),
                   oversize=p.oversize, checkpointing=cost.checkpointing,
                   checkpoint_attention=cost.checkpoint_attention, mode=p.mode, sampler_mode=sampler.mode,
                   global_batch=None if gb is None else {"by": gb.by, "value": gb.value, "tolerance": gb.tolerance,
                                                         "micro_step_share": gb.micro_step_share,
                                                         "batch_limit": p.batch_limit},
                   global_batch_fit=None if fit is None else dict(fit), budget_note=budget_note,
                   sparse_layers=None if sparse_layers is None else tuple(int(i) for i in sparse_layers))

    @property
    def budgets(self) -> dict:
        """The per-micro-batch budgets as ``Run.budgets`` gives them: ``m_mem`` GiB, ``m_comp`` (:attr:`unit`),
        ``max_tokens``, ``unit``, ``solo_over_budget``, ``efficient_batches``."""
        return {"m_mem": self.m_mem, "m_comp": self.m_comp, "max_tokens": self.max_tokens, "unit": self.unit,
                "solo_over_budget": self.solo_over_budget, "efficient_batches": self.efficient_batches}

    def describe(self) -> dict:
        """Every field as plain JSON-friendly values, for logs and the run's summary."""
        out = asdict(self)
        for key in ("global_batch", "global_batch_fit"):
            out[key] = None if out[key] is None else dict(out[key])
        out["sparse_layers"] = None if self.sparse_layers is None else list(self.sparse_layers)
        return out
