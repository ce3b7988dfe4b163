"""Balance figures of one optimizer step across the data-parallel ranks: :class:`StepRecord`, :func:`step_record`.

Per micro-step every rank records how long its forward + backward took, the samples and tokens
it processed and its quadratic pressure ``sum_b S_b^2``. Once per optimizer step one small
``all_gather`` (``StepMetrics.end_step``) brings every rank's figures to every rank, so all ranks hold the same
history and the same summary:

* ``cv_step``: coefficient of variation (std / mean over ranks) of per-rank *compute* time,
  per micro-step, averaged over the step's micro-steps (the paper's CV_step);
* ``cv_step_wall``: the same CV of per-rank *wall-clock* time of the same region;
* ``compute_cv``: the same CV of the quadratic pressure ``B x S^2`` (the paper's Compute CV);
* ``idle_frac``: share of the step's slowest-rank compute time that the average rank sits
  idle, ``sum_m (max_r t - mean_r t) / sum_m max_r t``;
* ``peak_mem`` / ``mem_capacity``: per-rank peak accelerator memory in the step (host RSS
  on CPU) and the device capacity;
* ``tokens_per_s`` / ``samples_per_s``: global tokens (samples) of the step / step wall time.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

__all__ = ["GIB", "cv", "StepRecord", "step_record"]

GIB = float(2**30)


def cv(values) -> float:
    """Coefficient of variation (population std / mean); 0 for a single value or a zero mean."""
    vals = [float(v) for v in values]
    if len(vals) < 2:
        return 0.0
    mean = sum(vals) / len(vals)
    if mean == 0:
        return 0.0
    return math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)) / mean


@dataclass
class StepRecord:
    """One optimizer step, global over ranks (identical on every rank)."""

    step: int
    loss: float
    lr: float
    samples: int
    tokens: int
    wall_s: float
    cv_step: float
    compute_cv: float
    idle_frac: float
    compute_ms: list = field(default_factory=list)   # per rank, summed over the micro-steps (waits excluded)
    samples_per_rank: list = field(default_factory=list)
    tokens_per_rank: list = field(default_factory=list)
    peak_mem_gib: list = field(default_factory=list)  # per rank
    mem_capacity_gib: float = 0.0
    data_ms: float = 0.0                              # max over ranks, waiting for the DataLoader
    cv_step_wall: float = 0.0                         # CV_step of the region's wall-clock time
    wall_ms: list = field(default_factory=list)       # per rank, region wall-clock, summed over micro-steps
    micro_compute_ms: list = field(default_factory=list)  # [micro][rank]
    micro_wall_ms: list = field(default_factory=list)     # [micro][rank]
    model_flops: float = 0.0                          # all ranks, fwd+bwd, recompute excluded (models/flops.py)
    hw_flops: float = 0.0                             # the same with the recomputed forwards
    peak_tflops: float = 0.0                          # dense bf16 peak of one GPU (0: unknown)
    world: int = 1

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation of the step: model FLOPs / (wall x GPUs x peak); 0 when the peak is unknown."""
        den = self.wall_s * self.world * self.peak_tflops * 1e12
        return self.model_flops / den if den > 0 else 0.0

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation (recomputed forwards of checkpointed blocks included)."""
        den = self.wall_s * self.world * self.peak_tflops * 1e12
        return self.hw_flops / den if den > 0 else 0.0
    skipped: bool = False                             # the optimizer skipped the update (non-finite step)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        d["samples_per_s"] = self.samples_per_s
        d["mfu"] = self.mfu
        d["hfu"] = self.hfu
        return d


def step_record(step: int, rows: list, gas: int, *, lr: float, wall_s: float, mem_capacity_gib: float,
                peak_tflops: float, skipped: bool = False) -> StepRecord:
    """The step's record from every rank's gathered row (``StepMetrics.end_step`` lays a row out as: compute ms,
    samples, tokens, quadratic pressure and wall ms per micro-step, then loss numerator, loss denominator, peak
    memory bytes, data-wait ms, model FLOPs, hardware FLOPs)."""
    g = gas
    compute = [r[0:g] for r in rows]
    quad = [r[3 * g:4 * g] for r in rows]
    wall_ms = [r[4 * g:5 * g] for r in rows]
    tail = 5 * g
    per_micro_ms = [list(c) for c in zip(*compute)]      # [micro][rank]
    per_micro_wall = [list(c) for c in zip(*wall_ms)]
    per_micro_quad = list(zip(*quad))
    max_sum = sum(max(c) for c in per_micro_ms)
    idle = sum(max(c) - sum(c) / len(c) for c in per_micro_ms) / max_sum if max_sum > 0 else 0.0
    loss_den_all = sum(r[tail + 1] for r in rows)
    return StepRecord(
        step=step,
        loss=sum(r[tail] for r in rows) / loss_den_all if loss_den_all > 0 else float("nan"),
        lr=float(lr),
        samples=int(round(sum(sum(r[g:2 * g]) for r in rows))),
        tokens=int(round(sum(sum(r[2 * g:3 * g]) for r in rows))),
        wall_s=wall_s,
        cv_step=sum(cv(c) for c in per_micro_ms) / g,
        compute_cv=sum(cv(q) for q in per_micro_quad) / g,
        idle_frac=idle,
        compute_ms=[sum(c) for c in compute],
        samples_per_rank=[int(round(sum(r[g:2 * g]))) for r in rows],
        tokens_per_rank=[int(round(sum(r[2 * g:3 * g]))) for r in rows],
        peak_mem_gib=[r[tail + 2] / GIB for r in rows],
        mem_capacity_gib=mem_capacity_gib,
        data_ms=max(r[tail + 3] for r in rows),
        cv_step_wall=sum(cv(c) for c in per_micro_wall) / g,
        wall_ms=[sum(w) for w in wall_ms],
        micro_compute_ms=per_micro_ms,
        micro_wall_ms=per_micro_wall,
        model_flops=sum(r[tail + 4] for r in rows),
        hw_flops=sum(r[tail + 5] for r in rows),
        peak_tflops=peak_tflops,
        world=len(rows),
        skipped=skipped,
    )
