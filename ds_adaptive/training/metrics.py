"""Step timers and balance figures across data-parallel ranks; JSONL / TensorBoard logs; run summary.

Per micro-step every rank records how long its forward + backward took, the samples and tokens
it processed and its quadratic pressure ``sum_b S_b^2``. Once per optimizer step one small
``all_gather`` brings every rank's figures to every rank, so all ranks hold the same history
and the same summary:

* ``cv_step``: coefficient of variation (std / mean over ranks) of per-rank *compute* time,
  per micro-step, averaged over the step's micro-steps (the paper's CV_step);
* ``cv_step_wall``: the same CV of per-rank *wall-clock* time of the same region;
* ``compute_cv``: the same CV of the quadratic pressure ``B x S^2`` (the paper's Compute CV);
* ``idle_frac``: share of the step's slowest-rank compute time that the average rank sits
  idle, ``sum_m (max_r t - mean_r t) / sum_m max_r t``;
* ``peak_mem`` / ``mem_capacity``: per-rank peak accelerator memory in the step (host RSS
  on CPU) and the device capacity;
* ``tokens_per_s`` / ``samples_per_s``: global tokens (samples) of the step / step wall time.

Compute time versus wall-clock time. Under ZeRO-3 every module's parameters are all-gathered
inside forward and backward, and gradients are reduce-scattered inside backward: collectives
that complete only when every rank has reached them. A rank with a light batch therefore
*waits* inside its own forward/backward for the rank with the heavy one, and a wall-clock timer
around forward + backward reads about the same on every rank (``cv_step_wall`` is small even
when the load is not balanced). :class:`ComputeTimer` (``StepMetrics.attach_engine(engine)``)
takes those waits out: it brackets every DeepSpeed entry point that can wait for another rank
(ZeRO-3's parameter fetch before a module's forward and backward, the gradient reduce hook, the
backward epilogue; see ``WAIT_POINTS``) and subtracts them from the micro-step's region
(``data_ready()`` .. ``backward_done()``). On CUDA both the region and the windows are CUDA
events on the compute stream, read once per optimizer step (no per-micro-step sync): a window's
length is how long the *stream* stalled there (a stream wait on NCCL or an idle stream while the
host blocked), so kernels that were still queued while the host waited count as compute, not as
waiting. On the CPU, where gloo collectives block the caller, the same points are timed with
``perf_counter``. Without an engine (or with ``attach_engine`` not called) compute time is the
region's wall-clock time, as before.
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

from ds_adaptive.core.config import MetricsConfig
from ds_adaptive.training.wandb_log import WandbLogger
from ds_adaptive.planning.devices import peak_tflops

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


# (attribute path from the DeepSpeed engine, method name): every entry point through which a
# rank can wait for another one inside forward/backward. ZeRO-3 calls them through ``self.``,
# so an instance attribute that wraps the bound method is what runs.
WAIT_POINTS = (
    ("optimizer.parameter_offload", "pre_sub_module_forward_function"),   # ZeRO-3 all-gather wait (fwd)
    ("optimizer.parameter_offload", "pre_sub_module_backward_function"),  # ZeRO-3 all-gather wait (bwd)
    ("optimizer", "reduce_ready_partitions_and_remove_grads"),            # gradient reduce(-scatter) hook
    ("", "_backward_epilogue"),                                           # final reduce + stream syncs
)


class ComputeTimer:
    """Per micro-step: the wall-clock length of a region and the part of it spent inside
    DeepSpeed's wait points (``WAIT_POINTS``); compute = region - waits.

    ``begin()`` / ``end()`` bracket one micro-step's forward + backward; ``collect()`` returns
    ``[(wall_ms, wait_ms), ...]`` for the micro-steps since the last call (one device sync on
    CUDA). Windows nest (the epilogue calls the reduce hook): only the outermost one counts.
    Calls outside a region pass straight through, so evaluation and the optimizer step cost
    one attribute check per call.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.wrapped: list[str] = []
        self._active = False
        self._depth = 0
        self._start = None
        self._windows: list = []
        self._done: list = []         # (start, end, windows) per micro-step
        self._pool: list = []         # reusable CUDA events

    # timestamps: CUDA events on the current stream, or perf_counter seconds
    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def attach(self, engine) -> list[str]:
        """Wrap the wait points that ``engine`` has; returns their names (empty: none found,
        compute time then equals wall-clock time)."""
        for path, name in WAIT_POINTS:
            owner = engine
            for part in filter(None, path.split(".")):
                owner = getattr(owner, part, None)
            fn = getattr(owner, name, None) if owner is not None else None
            if fn is None or getattr(fn, "_ds_adaptive_wait_point", False):
                continue
            setattr(owner, name, self._wrap(fn))
            self.wrapped.append(f"{path + '.' if path else ''}{name}")
        return list(self.wrapped)

    def _wrap(self, fn):
        timer = self

        def wait_point(*args, **kwargs):
            if not timer._active:
                return fn(*args, **kwargs)
            timer._depth += 1
            t0 = timer._mark() if timer._depth == 1 else None
            try:
                return fn(*args, **kwargs)
            finally:
                timer._depth -= 1
                if t0 is not None:
                    timer._windows.append((t0, timer._mark()))

        wait_point._ds_adaptive_wait_point = True
        wait_point.__wrapped__ = fn
        return wait_point

    @property
    def active(self) -> bool:
        return self._active

    def begin(self) -> None:
        self._windows = []
        self._depth = 0
        self._start = self._mark()
        self._active = True

    def end(self) -> None:
        if not self._active:
            raise RuntimeError("ComputeTimer.end() without begin()")
        self._active = False
        self._done.append((self._start, self._mark(), self._windows))
        self._windows = []

    def collect(self) -> list[tuple[float, float]]:
        """``(wall_ms, wait_ms)`` of every micro-step ended since the last call."""
        if self.cuda and self._done:
            torch.cuda.synchronize()
        out = []
        for start, end, windows in self._done:
            out.append((self._ms(start, end), sum(self._ms(a, b) for a, b in windows)))
            if self.cuda:
                self._pool.extend([start, end, *(e for w in windows for e in w)])
        self._done = []
        return out


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


class StepMetrics:
    """Collects per-micro-step figures on each rank and gathers them once per optimizer step.

    Call order per optimizer step: ``start_step()``, then for each micro-step ``data_ready()``
    (batch on the device), ``backward_done()`` (after backward, before ``engine.step()``; optional,
    else the region ends at ``end_micro``) and ``end_micro(samples, tokens, quad)``, then
    ``end_step(step, loss_num, loss_den, lr)``, which every rank must call (it all-gathers).
    ``loss_num / loss_den`` summed over ranks is the step's loss. ``attach_engine(engine)`` once
    after ``deepspeed.initialize`` makes ``compute_ms`` / ``cv_step`` exclude the waits for other
    ranks (module docstring); ``wall_ms`` / ``cv_step_wall`` keep the wall-clock view.
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
        self._sync_setting = cfg.sync_timing
        self._use_sync = cfg.sync_timing is not False   # "auto": until attach_engine finds the event timer
        self._timer: Optional[ComputeTimer] = None
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._reset_step()
        self._step_t0 = time.perf_counter()
        self.peak_tflops = _peak_tflops(cfg, device)
        self.run_info["peak_tflops"] = self.peak_tflops
        self.last_micro_peak_gib = 0.0
        self.last_micro_reserved_gib = 0.0
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
            if cfg.wandb:

                self._wandb = WandbLogger.open(project=cfg.wandb_project, log_dir=self.log_dir,
                                               config=json_safe(self.run_info))

    def attach_engine(self, engine) -> list[str]:
        """Time compute without the waits for other ranks (see :class:`ComputeTimer`); returns
        the DeepSpeed wait points found (none: compute time stays wall-clock time)."""
        timer = ComputeTimer(self.device)
        found = timer.attach(engine)
        self._timer = timer if found else None
        if self._sync_setting == "auto":   # CUDA events time the compute: no sync needed
            self._use_sync = not (found and timer.cuda)
        self.run_info["sync_timing"] = self._use_sync
        self.run_info["timing"] = "compute" if found else "wall"
        self.run_info["timing_wait_points"] = found
        return found

    @property
    def timing(self) -> str:
        """``compute`` (waits for other ranks excluded) or ``wall``."""
        return "compute" if self._timer is not None else "wall"

    # per-rank recording -------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._micro = []            # (host_ms, samples, tokens, quad, model_flops, hw_flops)
        self._step_peak = 0.0       # max over the step's micro-steps of the allocated peak (bytes)
        self._data_ms = 0.0
        self._t_fetch = time.perf_counter()
        self._t_micro = None
        self._host_ms = None        # host wall-clock of the current micro-step's region

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
        self._host_ms = None
        if self._timer is not None:
            self._timer.begin()

    def backward_done(self) -> None:
        """Forward and backward of this micro-step are done (call before ``engine.step()``, whose
        optimizer work and collectives are the same on every rank and not the batch's compute)."""
        if self._t_micro is None:
            raise RuntimeError("StepMetrics.backward_done() without data_ready()")
        if self._timer is not None:
            self._timer.end()
        self._sync()
        self._host_ms = (time.perf_counter() - self._t_micro) * 1e3

    def end_micro(self, samples: int, tokens: int, quad: float, model_flops: float = 0.0,
                  hw_flops: float = 0.0) -> None:
        """This micro-step is done; sync so its kernels are counted, then stop the clock. ``model_flops`` /
        ``hw_flops``: the micro-batch's training FLOPs without / with recompute (``models/flops.py``),
        counted like samples (once per SP group). ``last_micro_peak_gib`` is then this micro-step's
        allocated-memory peak (the peak counter is reset for the next one; the step peak is their max)."""
        if self._t_micro is None:
            raise RuntimeError("StepMetrics.end_micro() without data_ready()")
        if self._host_ms is None:
            if self._timer is not None:
                self._timer.end()
            self._sync()
        now = time.perf_counter()
        host_ms = self._host_ms if self._host_ms is not None else (now - self._t_micro) * 1e3
        peak = float(self._acc.max_memory_allocated())  # on CPU this samples the RSS peak; on CUDA a counter
        self._step_peak = max(self._step_peak, peak)
        self.last_micro_peak_gib = peak / GIB
        self.last_micro_reserved_gib = (float(self._acc.max_memory_reserved()) / GIB
                                        if self.device.type == "cuda" else 0.0)
        self._acc.reset_peak_memory_stats()
        self._micro.append((host_ms, samples, tokens, quad, model_flops, hw_flops))
        self._t_micro = None
        self._host_ms = None
        self._t_fetch = now

    def _local_times(self) -> tuple[list[float], list[float]]:
        """(compute_ms, wall_ms) per micro-step of this rank."""
        if self._timer is None:
            wall = [m[0] for m in self._micro]
            return wall, wall
        timed = self._timer.collect()
        if len(timed) != len(self._micro):
            raise RuntimeError(f"ComputeTimer timed {len(timed)} micro-steps, StepMetrics recorded {len(self._micro)}")
        return [max(w - x, 0.0) for w, x in timed], [w for w, _ in timed]

    # global gather ------------------------------------------------------------------------
    def end_step(self, step: int, loss_num: float, loss_den: float, lr: float, *, log: bool = False,
                 skipped: bool = False) -> StepRecord:
        """Gather this step's figures from every rank (a collective); log on the writer rank every
        ``interval`` steps, at the run's first step, and when ``log`` is true (e.g. the last step)."""
        if len(self._micro) != self.gas:
            raise RuntimeError(f"step {step}: recorded {len(self._micro)} micro-steps, expected {self.gas} "
                               "(gradient_accumulation_steps)")
        count = 1.0 if self.count_this_rank else 0.0
        peak = max(self._step_peak, float(self._acc.max_memory_allocated()))
        compute_local, wall_local = self._local_times()
        g = self.gas
        local = compute_local + [m[1] * count for m in self._micro] + \
            [m[2] * count for m in self._micro] + [m[3] for m in self._micro] + wall_local + \
            [loss_num * count, loss_den * count, peak, self._data_ms,
             sum(m[4] for m in self._micro) * count, sum(m[5] for m in self._micro) * count]
        rows = self._gather(torch.tensor(local, dtype=torch.float64))
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
        wall = time.perf_counter() - self._step_t0
        rec = StepRecord(
            step=step,
            loss=sum(r[tail] for r in rows) / loss_den_all if loss_den_all > 0 else float("nan"),
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
            peak_mem_gib=[r[tail + 2] / GIB for r in rows],
            mem_capacity_gib=float(self._acc.total_memory()) / GIB,
            data_ms=max(r[tail + 3] for r in rows),
            cv_step_wall=sum(cv(c) for c in per_micro_wall) / g,
            wall_ms=[sum(w) for w in wall_ms],
            micro_compute_ms=per_micro_ms,
            micro_wall_ms=per_micro_wall,
            model_flops=sum(r[tail + 4] for r in rows),
            hw_flops=sum(r[tail + 5] for r in rows),
            peak_tflops=self.peak_tflops,
            world=len(rows),
            skipped=skipped,
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
            self._jsonl.write(json.dumps(json_safe(rec.as_dict()), allow_nan=False) + "\n")
            self._jsonl.flush()
        values = {f"train/{key}": getattr(rec, key) for key in (
            "loss", "lr", "cv_step", "cv_step_wall", "compute_cv", "idle_frac", "tokens_per_s", "samples_per_s",
            "mfu", "hfu")}
        values["train/peak_mem_gib_max"] = max(rec.peak_mem_gib)
        values["train/step_s"] = rec.wall_s
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, rec.step)
        if self._wandb is not None:
            self._wandb.scalars(rec.step, values)

    def log_scalars(self, step: int, values: dict) -> None:
        """Extra scalars (e.g. ``sparse/density``) to TensorBoard under their own names (writer rank only)."""
        if self.is_writer and self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
        if self.is_writer and self._wandb is not None:
            self._wandb.scalars(step, values)

    def log_image(self, tag: str, image, step: int, caption: str = "") -> None:
        """A uint8 ``[H, W, 3]`` image (e.g. a preview's frame strip) to TensorBoard and W&B (writer rank only)."""
        if not self.is_writer:
            return
        if self._tb is not None:
            self._tb.add_image(tag, image, step, dataformats="HWC")
        if self._wandb is not None:
            self._wandb.image(tag, image, step, caption)

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
        finite = [r.loss for r in h if math.isfinite(r.loss)]  # the trend of the steps that trained
        k = max(1, min(5, len(finite) // 2))
        first = sum(finite[:k]) / k if finite else float("nan")
        last = sum(finite[-k:]) / k if finite else float("nan")
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
            "timing": self.timing,
            "cv_step": sum(r.cv_step for r in measured) / len(measured) if measured else 0.0,
            "cv_step_wall": sum(r.cv_step_wall for r in measured) / len(measured) if measured else 0.0,
            "compute_cv": sum(r.compute_cv for r in measured) / len(measured) if measured else 0.0,
            "idle_frac": sum(r.idle_frac for r in measured) / len(measured) if measured else 0.0,
            "loss_window": k,
            "loss_first": first,
            "loss_last": last,
            "loss_fell": last < first,
            "losses": [r.loss for r in h],
            "peak_tflops": self.peak_tflops,
            "mfu": _utilisation(measured, "model_flops"),
            "hfu": _utilisation(measured, "hw_flops"),
            "skipped_steps": [r.step for r in h if r.skipped],
        }

    def write_summary(self, summary: dict) -> Optional[Path]:
        if not self.is_writer:
            return None
        path = self.log_dir / "summary.json"
        path.write_text(json.dumps(json_safe(summary), indent=2, allow_nan=False) + "\n")
        return path

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def _utilisation(records, attr: str) -> float:
    den = sum(r.wall_s * r.world * r.peak_tflops * 1e12 for r in records)
    return sum(getattr(r, attr) for r in records) / den if den > 0 else 0.0


def _peak_tflops(cfg: MetricsConfig, device: torch.device) -> float:
    """Dense bf16 peak of one GPU: the config's ``peak_tflops``, else the known-GPU table; 0 on CPU
    or an unknown GPU (MFU not reported)."""
    if cfg.peak_tflops:
        return float(cfg.peak_tflops)
    if device.type != "cuda":
        return 0.0

    try:
        return float(peak_tflops(torch.cuda.get_device_name(device)) or 0.0)
    except Exception:
        return 0.0


def json_safe(obj):
    """``obj`` with every non-finite float replaced by None (JSON has no NaN/Infinity: strict readers
    reject Python's bare ``NaN``)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


#: a run's per-micro-step compute prediction error over which the summary gives the ``ds-adaptive refit`` command
COMPUTE_REFIT_HINT = 0.05


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
        f"  balance          CV_step {100 * s['cv_step']:.1f}% ({s.get('timing', 'wall')} time; wall-clock "
        f"{100 * s.get('cv_step_wall', s['cv_step']):.1f}%), compute CV {100 * s['compute_cv']:.1f}%, "
        f"idle {100 * s['idle_frac']:.1f}%",
        f"  loss             first-{s['loss_window']} mean {s['loss_first']:.4f} -> last-{s['loss_window']} mean "
        f"{s['loss_last']:.4f} ({'falling' if s['loss_fell'] else 'NOT falling'})",
    ]
    if s.get("peak_tflops"):
        lines.append(f"  FLOPs            MFU {100 * s.get('mfu', 0.0):.1f}%, HFU {100 * s.get('hfu', 0.0):.1f}% "
                     f"(recompute excluded / included; dense bf16 peak {s['peak_tflops']:g} TFLOP/s per GPU)")
    cp = s.get("compute_prediction")
    if cp:
        off = cp["max_abs_rel_err"] > COMPUTE_REFIT_HINT and cp.get("refit")
        lines.append(f"  cost model       compute {cp['measured_over_predicted']:.3f}x the plan's prediction over "
                     f"{cp['micro_steps']} micro-steps (per micro-step max |err| {100 * cp['max_abs_rel_err']:.1f}%)"
                     + (f"; to plan with this run's costs: {cp['refit']} --out PROFILE.json" if off else ""))
    if s.get("nonfinite_steps"):
        n = s["nonfinite_steps"]
        lines.append(f"  non-finite       {len(n)} step(s) with a non-finite loss or gradient norm, update skipped "
                     f"(steps {n[:10]}{' ...' if len(n) > 10 else ''}); the loss trend leaves them out")
    if s.get("stopped"):
        st = s["stopped"]
        lines.append(f"  stopped          by {st['signal']} after step {st['step']}; checkpoint "
                     f"{st.get('checkpoint') or 'none (no --save)'}")
    sa = s.get("sparse_attention")
    if sa:
        be, calls = sa.get("backend") or {}, sa.get("layer_calls") or {}
        n_sparse = len((sa.get("layers") or {}).get("sparse", []))
        compiled = f", {be['graphs']} compiled graph(s) ({be.get('compile_s', 0.0):.1f} s)" if "graphs" in be else ""
        lines.append(f"  sparse attn      backend {be.get('name', '?')}, stage {sa.get('stage')}, {n_sparse} sparse "
                     f"layer(s); layer calls sparse {calls.get('sparse', 0)}, dense by cost "
                     f"{calls.get('dense_by_cost', 0)}; warm-up {sa.get('warmup_s', 0.0):.1f} s{compiled}")
    bf = s.get("block_fusion")
    if bf and bf.get("fallback"):
        lines.append(f"  block fusion     '{bf['mode']}' could not compile ({bf['fallback']}): the blocks ran eager")
    elif bf:
        later = (f", and {bf['later_warmup_s']:.1f} s for {bf['later_pairs']} new pair(s) of later plans"
                 if bf.get("later_pairs") else "")
        first = bf["warmup_s"] or 0.0
        lines.append(f"  block fusion     '{bf['mode']}': compiled before step 1 in {first:.1f} s{later}")
    if "eval_loss" in s:
        lines.append(f"  held-out loss    {s['eval_loss']:.4f} ({s.get('eval', {}).get('samples', '?')} samples x "
                     f"{s.get('eval', {}).get('timesteps', '?')} fixed timesteps)")
    lines.append("=" * 72)
    return "\n".join(lines)
