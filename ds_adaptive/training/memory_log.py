"""Predicted vs measured memory and compute per micro-step: ``memory.jsonl`` and ``compute.jsonl`` (:class:`MemoryLog`).

``ds-adaptive refit`` and ``bench/micro_batch_mfu.py`` read ``compute.jsonl``; the run summary's
``memory_prediction`` / ``compute_prediction`` hold the plan's models against what the run measured.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from ds_adaptive.calibration.refit import COMPUTE_LOG

__all__ = ["MemoryLog"]


class MemoryLog:
    """Predicted vs measured peak memory and compute per micro-batch (writer rank), in the log dir:

    - ``memory.jsonl`` (on a GPU), one line per micro-step, written when it ends: shape, B, checkpointed blocks,
      predicted static + activation memory (the plan's memory model, ``ds_adaptive.planning.memory``) and the
      measured allocated peak of that micro-step; with the calibrated cost model also the plan's predicted compute
      time (``predicted_ms``), which :meth:`compute_summary` holds against the step records' compute windows;
    - ``compute.jsonl``, one line per micro-step, written when its step ends (its window is read then): shape, B,
      checkpointed blocks, this rank's compute window (``compute_ms``) and the step's wall time (``step_wall_ms``),
      with ``predicted_ms`` as above. Every step, not every ``metrics.interval``-th: ``ds-adaptive refit`` and
      ``bench/micro_batch_mfu.py`` read it."""

    def __init__(self, sampler, zero_stage: int, shard_ranks: int, log_dir: str, enabled: bool,
                 compute_log: Optional[bool] = None) -> None:
        """``enabled``: write ``memory.jsonl`` (the writer rank on a GPU); ``compute_log``: write ``compute.jsonl``
        (default: as ``enabled``; the trainer writes it on the writer rank on any device)."""
        self.sampler = sampler
        self.static = self.cost.profile.static_memory_gib(zero_stage, shard_ranks)
        self.errors: list[float] = []
        self.predicted_ms: dict[tuple[int, int], float] = {}
        self.world, self.log_dir = int(shard_ranks), log_dir
        self.file = self.compute_file = None
        self._pending: list[dict] = []   # this step's micro-steps, for compute.jsonl when the step ends
        if enabled or compute_log:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        if enabled:
            self.file = open(Path(log_dir) / "memory.jsonl", "a")
        if enabled if compute_log is None else compute_log:
            self.compute_file = open(Path(log_dir) / COMPUTE_LOG, "a")

    @property
    def cost(self):
        """The sampler's cost model now (sparse attention's density updates replace it)."""
        return self.sampler.cost

    def record(self, step: int, micro: int, shape, batch: int, ckpt: int, measured_gib: float,
               reserved_gib: float = 0.0) -> None:
        if self.file is None and self.compute_file is None:
            return
        line = {"step": step, "micro": micro, "shape": str(shape), "tokens": int(shape.tokens), "B": batch,
                "ckpt_blocks": ckpt}
        if self.cost.mode == "calibrated":
            line["predicted_ms"] = self.predicted_ms[step, micro] = float(self.cost.ckpt_cost(shape, batch, ckpt))
        if self.compute_file is not None:
            self._pending.append(dict(line))
        if self.file is None:
            return
        act = float(self.cost.ckpt_memory(shape, batch, ckpt))
        pred = self.static + act
        self.errors.append((pred - measured_gib) / measured_gib if measured_gib > 0 else 0.0)
        line.update({"static_gib": self.static, "act_gib": act, "predicted_gib": pred, "measured_gib": measured_gib,
                     "reserved_gib": reserved_gib})
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def end_step(self, rec) -> None:
        """``compute.jsonl``: the step's micro-steps with this rank's compute windows (``rec.micro_compute_ms``)."""
        pending, self._pending = self._pending, []
        if self.compute_file is None:
            return
        windows = rec.micro_compute_ms
        if len(windows) != len(pending):
            raise RuntimeError(f"step {rec.step}: {len(windows)} compute windows for {len(pending)} recorded "
                               "micro-steps; the memory log and the metrics disagree")
        for line, ranks in zip(pending, windows):
            self.compute_file.write(json.dumps({**line, "compute_ms": float(ranks[0]),
                                                "step_wall_ms": 1e3 * float(rec.wall_s)}) + "\n")
        self.compute_file.flush()

    def compute_summary(self, history, warmup_steps: int) -> Optional[dict]:
        """This rank's compute windows after ``warmup_steps`` (the step records' ``micro_compute_ms``, rank 0's)
        against the plan's predicted compute: micro-steps, total measured / predicted, largest and mean |predicted /
        measured - 1|, and on one GPU the ``ds-adaptive refit`` command that fits the profile to this run. None
        without predictions (not the writer, not on a GPU, or a cost model not in ms)."""
        pairs = [(self.predicted_ms[r.step, m], ranks[0]) for r in history[warmup_steps:]
                 for m, ranks in enumerate(r.micro_compute_ms) if (r.step, m) in self.predicted_ms and ranks[0] > 0]
        if not pairs:
            return None
        pred, meas = np.array(pairs).T
        err = np.abs(pred / meas - 1)
        pr = self.cost.profile
        out = {"micro_steps": len(pairs), "measured_over_predicted": float(meas.sum() / pred.sum()),
               "max_abs_rel_err": float(err.max()), "mean_abs_rel_err": float(err.mean())}
        if self.world == 1 and self.cost.sp == 1:
            out["refit"] = (f"ds-adaptive refit {self.log_dir} --profile {pr.name} --ln-modulate {pr.ln_modulate} "
                            f"--block-fusion {pr.block_fusion}")
        return out

    def summary(self) -> dict:
        e = self.errors
        return {"micro_steps": len(e), "max_abs_rel_err": max((abs(x) for x in e), default=0.0),
                "mean_rel_err": sum(e) / len(e) if e else 0.0}

    def close(self) -> None:
        for name in ("file", "compute_file"):
            f = getattr(self, name)
            if f is not None:
                f.close()
                setattr(self, name, None)
