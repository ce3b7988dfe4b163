"""Per-step metrics of a training run: :class:`StepMetrics` records each rank's micro-steps, gathers them once per
optimizer step into a :class:`~ds_adaptive.training.balance.StepRecord` (the balance figures) and writes the logs
(metrics.jsonl, TensorBoard, W&B) and the summary.

The pieces: ``ds_adaptive.training.timers`` (compute time without the waits for other ranks),
``ds_adaptive.training.balance`` (the figures of one step across ranks), ``ds_adaptive.training.summary`` (run
totals and the printed block). Their names are importable from here too.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ds_adaptive.core.config import MetricsConfig
from ds_adaptive.planning.devices import peak_tflops
from ds_adaptive.training.balance import GIB, StepRecord, cv, step_record
from ds_adaptive.training.summary import COMPUTE_REFIT_HINT, format_summary, json_safe, summarize
from ds_adaptive.training.timers import WAIT_POINTS, ComputeTimer
from ds_adaptive.training.wandb_log import WandbLogger

__all__ = ["StepMetrics", "truncate_jsonl", "StepRecord", "ComputeTimer", "WAIT_POINTS", "cv", "json_safe", "format_summary",
           "summarize", "step_record", "GIB", "COMPUTE_REFIT_HINT"]


def _accelerator():
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


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
        local = compute_local + [m[1] * count for m in self._micro] + \
            [m[2] * count for m in self._micro] + [m[3] for m in self._micro] + wall_local + \
            [loss_num * count, loss_den * count, peak, self._data_ms,
             sum(m[4] for m in self._micro) * count, sum(m[5] for m in self._micro) * count]
        rows = self._gather(torch.tensor(local, dtype=torch.float64))
        rec = step_record(step, rows, self.gas, lr=lr, wall_s=time.perf_counter() - self._step_t0,
                          mem_capacity_gib=float(self._acc.total_memory()) / GIB, peak_tflops=self.peak_tflops,
                          skipped=skipped)
        self.history.append(rec)
        first = log or len(self.history) == 1
        board = first or step % self.cfg.interval == 0
        line = first or step % (self.cfg.jsonl_interval or self.cfg.interval) == 0   # metrics.jsonl: every step
        if self.is_writer and (board or line):
            self.write(rec, jsonl=line, board=board)
        return rec

    def _gather(self, local: torch.Tensor) -> list[list[float]]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [local.tolist()]
        t = local.to(self.device)
        out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t)
        return [o.cpu().tolist() for o in out]

    # output -------------------------------------------------------------------------------
    def write(self, rec: StepRecord, *, jsonl: bool = True, board: bool = True) -> None:
        """Append ``rec`` to metrics.jsonl (``jsonl``) and TensorBoard / W&B (``board``) (writer rank only)."""
        if not self.is_writer:
            return
        if self._jsonl is not None and jsonl:
            self._jsonl.write(json.dumps(json_safe(rec.as_dict()), allow_nan=False) + "\n")
            self._jsonl.flush()
        values = {f"train/{key}": getattr(rec, key) for key in (
            "loss", "lr", "cv_step", "cv_step_wall", "compute_cv", "idle_frac", "tokens_per_s", "samples_per_s",
            "mfu", "hfu")}
        values["train/peak_mem_gib_max"] = max(rec.peak_mem_gib)
        values["train/step_s"] = rec.wall_s
        if not board:
            return
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
        """Run totals (:func:`ds_adaptive.training.summary.summarize` of ``history``)."""
        return summarize(self.history, self.run_info, timing=self.timing, peak_tflops=self.peak_tflops,
                         warmup_steps=warmup_steps)

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


def truncate_jsonl(path, step: int) -> int:
    """Drop the lines of ``path`` (a metrics.jsonl) whose ``step`` is above ``step``, and a cut-off last line: a run
    resumed from ``step`` writes those steps again, each once. Returns the lines dropped (0 when no file)."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text("".join(x + "\n" for x in kept))
        os.replace(tmp, path)
    return dropped
