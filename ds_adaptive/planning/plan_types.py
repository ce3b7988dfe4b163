"""The planner's types: parameters, per-step totals, the epoch plan (no planning here; ``planning/planner.py`` plans)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Literal, Mapping, Optional, Union

import numpy as np

from ds_adaptive.core.shapes import SampleShape


Mode = Literal["dual", "tokens", "fixed"]
Bucket = Union[SampleShape, int]
"""A shape bucket: a video/image shape, or a plain sequence length in tokens (non-video datasets)."""


def bucket_tokens(b: Bucket) -> int:
    """Tokens (unpadded) of a bucket."""
    return b.tokens if isinstance(b, SampleShape) else int(b)


class OversizeSampleError(ValueError):
    """A sample that exceeds a budget even alone (B=1)."""


class PlanError(ValueError):
    """Budgets or parameters that cannot produce a plan."""


@dataclass(frozen=True)
class PlannerParams:
    """Resolved planning parameters (budgets are numbers here, never ``auto``)."""

    mode: Mode
    dp_size: int
    micro_steps_per_step: int
    m_mem: float
    m_comp: Optional[float] = None
    max_tokens: Optional[int] = None
    fixed_batch_sizes: Optional[Mapping[str, int]] = None
    window: int = 256
    oversize: Literal["error", "skip"] = "error"
    balance_tolerance: float = 0.03
    #: ``dual``: a sample whose B=1 cost is over ``m_comp`` (but fits ``m_mem``) runs alone (B=1) instead of
    #: being oversize, and the other ranks of its micro-step get batches up to its cost (within ``m_mem``).
    #: Set by the throughput-optimal ``m_comp: auto`` (``ds_adaptive.planning.budget``), whose budget may be
    #: below the longest sample's cost.
    solo_over_budget: bool = False
    #: ``dual`` with a checkpoint plan per batch (``recompute.blocks: auto``): each shape's batch is at most the size
    #: with the lowest predicted time per sample, its cost plus the training loop's time per micro-step and share
    #: of an optimizer step's (``Profile.micro_step_overhead_ms``, ``optimizer_step_overhead_ms``). Past that size
    #: a larger batch checkpoints more blocks, and each recomputes a forward for every sample of the batch. Set by
    #: the budget search (``ds_adaptive.planning.budget``) where it predicts the capped plan faster.
    efficient_batches: bool = False
    #: ``"samples"`` / ``"tokens"`` (``sampler.global_batch``): the micro-steps of each block of
    #: :data:`STEP_BALANCE_BLOCK` optimizer steps are grouped into steps with about equal totals of that count
    #: (``ds_adaptive.planning.planner.balance_steps``); None: in planned order
    step_balance: Optional[str] = None
    #: with a global batch: the most samples (``step_balance="samples"``) or tokens (``"tokens"``) one rank's
    #: micro-batch may hold (``GlobalBatchConfig.micro_step_share`` of the step over the DP ranks; AdaptiveLoad's plans); at
    #: least one sample. None: the budgets alone bound a batch
    batch_limit: Optional[float] = None

    def __post_init__(self) -> None:
        if self.mode not in ("dual", "tokens", "fixed"):
            raise PlanError(f"mode must be dual, tokens or fixed, got {self.mode!r}")
        if self.dp_size < 1 or self.micro_steps_per_step < 1:
            raise PlanError(f"dp_size ({self.dp_size}) and micro_steps_per_step "
                            f"({self.micro_steps_per_step}) must be >= 1")
        if not self.m_mem > 0:
            raise PlanError(f"memory budget m_mem must be > 0 GiB, got {self.m_mem}")
        if self.mode == "dual" and not (self.m_comp is not None and self.m_comp > 0):
            raise PlanError(f"mode dual needs a compute budget m_comp > 0, got {self.m_comp}")
        if self.mode == "tokens" and not (self.max_tokens and self.max_tokens > 0):
            raise PlanError(f"mode tokens needs max_tokens > 0, got {self.max_tokens}")

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["fixed_batch_sizes"] = dict(self.fixed_batch_sizes) if self.fixed_batch_sizes else None
        if not self.efficient_batches:   # only then: a sampler state saved before the field resumes its plan exactly
            del d["efficient_batches"]
        if self.step_balance is None:    # likewise
            del d["step_balance"]
        if self.batch_limit is None:     # likewise
            del d["batch_limit"]
        return d


@dataclass
class StepTotals:
    """Global counts of one optimizer step (over DP ranks; an SP group counts once)."""

    samples: int
    tokens: int
    micro_steps: int

    def loss_weight(self, local_samples: int, local_tokens: int, dp_size: int,
                    by: Literal["samples", "tokens"] = "samples") -> float:
        """Factor for one rank's mean micro-batch loss so that the DP-averaged gradient of the step
        is the mean over all samples (or tokens) of the step: local share x dp_size x micro_steps
        (DeepSpeed averages over DP and divides by gradient_accumulation_steps itself)."""
        num, den = (local_samples, self.samples) if by == "samples" else (local_tokens, self.tokens)
        return num / den * dp_size * self.micro_steps if den else 0.0

    def lr_scale(self, mode: Literal["none", "linear", "sqrt"], reference_batch: Optional[int]) -> float:
        """LR multiplier of this step: 1, samples/reference or sqrt(samples/reference)."""
        if mode == "none":
            return 1.0
        if not reference_batch:
            raise PlanError("lr_scaling needs optimization.reference_batch (global samples per optimizer "
                            "step that the base LR was tuned for)")
        r = self.samples / reference_batch
        return r if mode == "linear" else math.sqrt(r)


@dataclass
class EpochPlan:
    """All micro-steps of one epoch (or of a resumed segment of it).

    Batch ``j = micro * dp_size + rank`` holds ``sample_ids[batch_offsets[j]:batch_offsets[j+1]]``,
    all of shape ``shapes[batch_shape[j]]``.
    """

    dp_size: int
    micro_steps_per_step: int
    shapes: list[SampleShape]
    sample_ids: np.ndarray
    batch_offsets: np.ndarray
    batch_shape: np.ndarray
    batch_cost: np.ndarray
    batch_memory: np.ndarray
    batch_tokens: np.ndarray
    oversize: list[int] = field(default_factory=list)
    tail_dropped: list[int] = field(default_factory=list)
    tail_replanned: int = 0
    #: blocks to checkpoint (the first n) per batch: the checkpoint plan (ds_adaptive/planning/memory.py)
    batch_ckpt: Optional[np.ndarray] = None

    @property
    def num_micro_steps(self) -> int:
        return len(self.batch_shape) // self.dp_size

    @property
    def num_steps(self) -> int:
        return self.num_micro_steps // self.micro_steps_per_step

    @property
    def num_samples(self) -> int:
        return int(len(self.sample_ids))

    def batch(self, micro_step: int, dp_rank: int) -> list[int]:
        j = micro_step * self.dp_size + dp_rank
        return self.sample_ids[self.batch_offsets[j]:self.batch_offsets[j + 1]].tolist()

    def rank_batches(self, dp_rank: int, start_micro: int = 0) -> Iterator[list[int]]:
        for m in range(start_micro, self.num_micro_steps):
            yield self.batch(m, dp_rank)

    def micro_step_costs(self) -> np.ndarray:
        """[num_micro_steps, dp_size] predicted per-GPU cost of every batch."""
        return self.batch_cost.reshape(-1, self.dp_size)

    def batch_sizes(self) -> np.ndarray:
        return np.diff(self.batch_offsets)

    def checkpoint_blocks(self, micro_step: int, dp_rank: int) -> int:
        """Blocks that rank ``dp_rank`` checkpoints in ``micro_step`` (from the plan's checkpoint plan)."""
        if self.batch_ckpt is None:
            raise ValueError("this plan carries no checkpoint plan")
        return int(self.batch_ckpt[micro_step * self.dp_size + dp_rank])

    def step_totals(self, step: int) -> StepTotals:
        if not 0 <= step < self.num_steps:
            raise IndexError(f"optimizer step {step} is outside this plan (0..{self.num_steps - 1})")
        g = self.micro_steps_per_step * self.dp_size
        lo, hi = step * g, (step + 1) * g
        return StepTotals(samples=int(self.batch_offsets[hi] - self.batch_offsets[lo]),
                          tokens=int(self.batch_tokens[lo:hi].sum()), micro_steps=self.micro_steps_per_step)

    def samples_of_steps(self, num_steps: int) -> np.ndarray:
        """Sample ids consumed by the first ``num_steps`` optimizer steps."""
        hi = min(num_steps, self.num_steps) * self.micro_steps_per_step * self.dp_size
        return self.sample_ids[:self.batch_offsets[hi]]
