"""Step timers and balance figures across data-parallel ranks; JSONL / TensorBoard logs; run summary.

Per micro-step every rank records its compute time (from the batch on the device to the end
of backward, with a device sync so that queued kernels are counted), the samples and tokens
it processed and its quadratic pressure ``sum_b S_b^2``. Once per optimizer step one small
``all_gather`` brings every rank's figures to every rank, so all ranks hold the same
history and the same summary:

* ``cv_step``: coefficient of variation (std / mean over ranks) of compute time, per
  micro-step, averaged over the step's micro-steps (the paper's CV_step);
* ``compute_cv``: the same CV of the quadratic pressure ``B x S^2`` (the paper's Compute CV);
* ``idle_frac``: share of the step's slowest-rank time that the average rank sits idle,
  ``sum_m (max_r t - mean_r t) / sum_m max_r t``;
* ``peak_mem`` / ``mem_capacity``: per-rank peak accelerator memory in the step (host RSS
  on CPU) and the device capacity;
* ``tokens_per_s`` / ``samples_per_s``: global tokens (samples) of the step / step wall time.

Caveat on the timings: under ZeRO-3 the per-layer parameter all-gathers run inside forward
and backward, so a fast rank may wait on a slow one inside its micro-step; that wait is in
its compute time. ``compute_cv`` (from shapes alone) does not have this blind spot.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .config import MetricsConfig

GIB = float(2**30)


def _accelerator():
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


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
    compute_ms: list = field(default_factory=list)   # per rank, summed over the micro-steps
    samples_per_rank: list = field(default_factory=list)
    tokens_per_rank: list = field(default_factory=list)
    peak_mem_gib: list = field(default_factory=list)  # per rank
    mem_capacity_gib: float = 0.0
    data_ms: float = 0.0                              # max over ranks, waiting for the DataLoader

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
        return d


class StepMetrics:
    """Collects per-micro-step figures on each rank and gathers them once per optimizer step.

    Call order per optimizer step: ``start_step()``, then for each micro-step ``data_ready()``
    (batch on the device) and ``end_micro(samples, tokens, quad)`` (after backward), then
    ``end_step(step, loss_num, loss_den, lr)``, which every rank must call (it all-gathers).
    ``loss_num / loss_den`` summed over ranks is the step's loss.
    """

    def __init__(self, cfg: MetricsConfig, *, micro_steps_per_step: int, device: torch.device,
                 log_dir: Optional[str] = None, is_writer: bool = True, count_this_rank: bool = True,
                 run_info: Optional[dict] = None) -> None:
        self.cfg = cfg
        self.gas = int(micro_steps_per_step)
        self.device = device
        self.log_dir = Path(log_dir or cfg.log_dir)
        self.is_writer = is_writer
        self.count_this_rank = count_this_rank  # False on SP ranks > 0: their samples are counted by rank 0 of the group
        self.run_info = dict(run_info or {})
        self.history: list[StepRecord] = []
        self._acc = _accelerator()
        self._use_sync = cfg.sync_timing
        self._jsonl = None
        self._tb = None
        self._reset_step()
        self._step_t0 = time.perf_counter()
        if is_writer:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            if cfg.jsonl:
                self._jsonl = open(self.log_dir / "metrics.jsonl", "a")
            if cfg.tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(str(self.log_dir / "tensorboard"))
                except ImportError:
                    print("ds_adaptive.metrics: the 'tensorboard' package is not installed; TensorBoard logs are "
                          "off (pip install tensorboard, or set adaptive_load.metrics.tensorboard=false)")

    # per-rank recording -------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._micro = []            # (compute_ms, samples, tokens, quad)
        self._data_ms = 0.0
        self._t_fetch = time.perf_counter()
        self._t_micro = None

    def _sync(self) -> None:
        if self._use_sync:
            self._acc.synchronize()

    def start_step(self) -> None:
        """Start timing a new optimizer step (also resets the per-step memory peak)."""
        self._reset_step()
        self._step_t0 = time.perf_counter()
        self._acc.reset_peak_memory_stats()

    def data_ready(self) -> None:
        """The micro-batch is on the device; compute starts now."""
        self._sync()
        now = time.perf_counter()
        self._data_ms += (now - self._t_fetch) * 1e3
        self._t_micro = now

    def end_micro(self, samples: int, tokens: int, quad: float) -> None:
        """Backward of this micro-step is done; sync so its kernels are counted, then stop the clock."""
        if self._t_micro is None:
            raise RuntimeError("StepMetrics.end_micro() without data_ready()")
        self._sync()
        now = time.perf_counter()
        self._acc.max_memory_allocated()  # on CPU this samples the RSS peak; on CUDA it is a counter
        self._micro.append(((now - self._t_micro) * 1e3, samples, tokens, quad))
        self._t_micro = None
        self._t_fetch = now

    # global gather ------------------------------------------------------------------------
    def end_step(self, step: int, loss_num: float, loss_den: float, lr: float, *, log: bool = False) -> StepRecord:
        """Gather this step's figures from every rank (a collective); log on the writer rank every
        ``interval`` steps, at the run's first step, and when ``log`` is true (e.g. the last step)."""
        if len(self._micro) != self.gas:
            raise RuntimeError(f"step {step}: recorded {len(self._micro)} micro-steps, expected {self.gas} "
                               "(gradient_accumulation_steps)")
        count = 1.0 if self.count_this_rank else 0.0
        peak = float(self._acc.max_memory_allocated())
        local = [m[0] for m in self._micro] + [m[1] * count for m in self._micro] + \
                [m[2] * count for m in self._micro] + [m[3] for m in self._micro] + \
                [loss_num * count, loss_den * count, peak, self._data_ms]
        rows = self._gather(torch.tensor(local, dtype=torch.float64))
        g = self.gas
        compute = [r[0:g] for r in rows]
        quad = [r[3 * g:4 * g] for r in rows]
        per_micro_ms = list(zip(*compute))           # [micro][rank]
        per_micro_quad = list(zip(*quad))
        max_sum = sum(max(c) for c in per_micro_ms)
        idle = sum(max(c) - sum(c) / len(c) for c in per_micro_ms) / max_sum if max_sum > 0 else 0.0
        loss_den_all = sum(r[4 * g + 1] for r in rows)
        wall = time.perf_counter() - self._step_t0
        rec = StepRecord(
            step=step,
            loss=sum(r[4 * g] for r in rows) / loss_den_all if loss_den_all > 0 else float("nan"),
            lr=float(lr),
            samples=int(round(sum(sum(r[g:2 * g]) for r in rows))),
            tokens=int(round(sum(sum(r[2 * g:3 * g]) for r in rows))),
            wall_s=wall,
            cv_step=sum(cv(c) for c in per_micro_ms) / g,
            compute_cv=sum(cv(q) for q in per_micro_quad) / g,
            idle_frac=idle,
            compute_ms=[sum(c) for c in compute],
            samples_per_rank=[int(round(sum(r[g:2 * g]))) for r in rows],
            tokens_per_rank=[int(round(sum(r[2 * g:3 * g]))) for r in rows],
            peak_mem_gib=[r[4 * g + 2] / GIB for r in rows],
            mem_capacity_gib=float(self._acc.total_memory()) / GIB,
            data_ms=max(r[4 * g + 3] for r in rows),
        )
        self.history.append(rec)
        if self.is_writer and (log or step % self.cfg.interval == 0 or len(self.history) == 1):
            self.write(rec)
        return rec

    def _gather(self, local: torch.Tensor) -> list[list[float]]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [local.tolist()]
        t = local.to(self.device)
        out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t)
        return [o.cpu().tolist() for o in out]

    # output -------------------------------------------------------------------------------
    def write(self, rec: StepRecord) -> None:
        """Append ``rec`` to metrics.jsonl and TensorBoard (writer rank only)."""
        if not self.is_writer:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(rec.as_dict()) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key in ("loss", "lr", "cv_step", "compute_cv", "idle_frac", "tokens_per_s", "samples_per_s"):
                self._tb.add_scalar(f"train/{key}", getattr(rec, key), rec.step)
            self._tb.add_scalar("train/peak_mem_gib_max", max(rec.peak_mem_gib), rec.step)
            self._tb.add_scalar("train/step_s", rec.wall_s, rec.step)

    def summary(self, warmup_steps: Optional[int] = None) -> dict:
        """Run totals; throughput and balance are measured after ``warmup_steps`` (default: 1 when
        the run has more than 2 steps: the first step pays for compilation and allocator growth)."""
        h = self.history
        if not h:
            return {**self.run_info, "steps": 0}
        if warmup_steps is None:
            warmup_steps = 1 if len(h) > 2 else 0
        measured = h[warmup_steps:]
        wall = sum(r.wall_s for r in measured)
        tokens = sum(r.tokens for r in measured)
        samples = sum(r.samples for r in measured)
        k = max(1, min(5, len(h) // 2))
        first = sum(r.loss for r in h[:k]) / k
        last = sum(r.loss for r in h[-k:]) / k
        cap = h[-1].mem_capacity_gib
        peak = max(max(r.peak_mem_gib) for r in h)
        return {
            **self.run_info,
            "steps": len(h),
            "first_step": h[0].step,
            "last_step": h[-1].step,
            "samples": sum(r.samples for r in h),
            "tokens": sum(r.tokens for r in h),
            "wall_s": sum(r.wall_s for r in h),
            "warmup_steps": warmup_steps,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "samples_per_s": samples / wall if wall > 0 else 0.0,
            "step_s_mean": wall / len(measured) if measured else 0.0,
            "peak_mem_gib": peak,
            "mem_capacity_gib": cap,
            "peak_mem_frac": peak / cap if cap > 0 else 0.0,
            "mem_efficiency": (sum(sum(r.peak_mem_gib) / len(r.peak_mem_gib) for r in measured)
                               / len(measured) / cap) if measured and cap > 0 else 0.0,
            "cv_step": sum(r.cv_step for r in measured) / len(measured) if measured else 0.0,
            "compute_cv": sum(r.compute_cv for r in measured) / len(measured) if measured else 0.0,
            "idle_frac": sum(r.idle_frac for r in measured) / len(measured) if measured else 0.0,
            "loss_window": k,
            "loss_first": first,
            "loss_last": last,
            "loss_fell": last < first,
            "losses": [r.loss for r in h],
        }

    def write_summary(self, summary: dict) -> Optional[Path]:
        if not self.is_writer:
            return None
        path = self.log_dir / "summary.json"
        path.write_text(json.dumps(summary, indent=2) + "\n")
        return path

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def format_summary(s: dict) -> str:
    """A short human-readable block of the run summary (printed on rank 0)."""
    lines = [
        "=" * 72,
        f"ds_adaptive run summary  ({s.get('model', '?')}, {s.get('world_size', '?')} rank(s) on "
        f"{s.get('device', '?')}, sampler {s.get('sampler', '?')})",
        f"  steps            {s['steps']} (steps {s.get('first_step')}..{s.get('last_step')}), "
        f"{s['samples']} samples, {s['tokens']} tokens, {s['wall_s']:.1f} s",
        f"  throughput       {s['tokens_per_s']:.1f} tokens/s, {s['samples_per_s']:.2f} samples/s, "
        f"{s['step_s_mean']:.3f} s/step (after {s['warmup_steps']} warm-up step(s))",
        f"  peak memory      {s['peak_mem_gib']:.2f} GiB of {s['mem_capacity_gib']:.1f} GiB "
        f"({100 * s['peak_mem_frac']:.1f}%; mean per-rank peak {100 * s['mem_efficiency']:.1f}%)",
        f"  balance          CV_step {100 * s['cv_step']:.1f}%, compute CV {100 * s['compute_cv']:.1f}%, "
        f"idle {100 * s['idle_frac']:.1f}%",
        f"  loss             first-{s['loss_window']} mean {s['loss_first']:.4f} -> last-{s['loss_window']} mean "
        f"{s['loss_last']:.4f} ({'falling' if s['loss_fell'] else 'NOT falling'})",
        "=" * 72,
    ]
    return "\n".join(lines)
