"""Validation on a held-out split of the run's own data (``adaptive_load.validation``), during training.

    plan = plan_validation(held_out.sample_shapes(), cost, m_mem=..., dp_size=..., timesteps=4)
    loss = score(engine, held_out, plan, layout=..., seed=..., ...)      # every rank: a collective
    runner = ValidationRunner.attach(run, engine=..., metrics=..., log=..., ema=...)   # None when off
    runner.after_step(step, last=step == steps)                         # every rank, between optimizer steps

**The split** is ``build_run``'s (``ds_adaptive.data.split``): the training sampler plans the training view only,
so a held-out sample is never in a training batch. **What is scored:** every held-out sample at ``timesteps``
fixed ``u`` on the model's noise interval with noise seeded by (seed, k, sample index in the dataset)
(``ds_adaptive.models.objective.eval_inputs``): a pure function of the weights, comparable across steps, runs and
world sizes. The loss is the mean over every (sample, timestep) row of its MSE, the same weight for every sample.

**Planning.** The rows are the units: a batch holds rows of one shape, at most as many as fit the training plan's
memory budget ``m_mem`` with the memory model of a training micro-batch at its fewest-memory checkpoint count
(more than a no-grad forward holds: a plan at 95% of the GPU stays there) and, where the plan has one, its compute
budget ``m_comp``. Batches are dealt to the data-parallel ranks by predicted cost (the costliest first, to the
least loaded rank), so every rank scores its share in parallel; every rank runs the same number of forwards
(ZeRO-3 gathers parameters collectively), padding with a weight-0 batch. Under Ulysses the ``sp`` ranks of a group
score their DP rank's batches together. A row over the budget even alone follows ``sampler.oversize``: an error
naming the sample, or skipped with a count.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ds_adaptive.core.config import ConfigError
from ds_adaptive.models.objective import eval_inputs, per_sample_mse
from ds_adaptive.planning.memory import fewest_memory_blocks

__all__ = ["ValidationPlan", "ValidationError", "plan_validation", "score", "ValidationRunner", "VALIDATION_LOG"]

VALIDATION_LOG = "validation.jsonl"
"""One line per validation round in the log directory (what ``ds-adaptive plot`` draws)."""


class ValidationError(ConfigError):
    """A held-out sample the memory plan cannot score; the message names it and what to do."""


@dataclass(frozen=True)
class Batch:
    """Rows ``(sample, k)`` of one shape; ``weight`` 0 for a padding batch."""

    shape_id: int
    rows: tuple
    cost: float
    memory_gib: float
    weight: float = 1.0


@dataclass
class ValidationPlan:
    """The rows dealt out: ``ranks[r]`` the batches of DP rank ``r``, each rank ``forwards`` of them (padded)."""

    ranks: list
    forwards: int
    samples: int
    rows: int
    timesteps: int
    budget_gib: float
    skipped: list = field(default_factory=list)
    """Samples left out (over the budget at one row, with ``sampler.oversize: skip``)."""

    @property
    def predicted_gib(self) -> float:
        """The largest batch's predicted memory (GiB)."""
        return max((b.memory_gib for r in self.ranks for b in r), default=0.0)

    def rank_costs(self) -> list[float]:
        """Predicted cost of each DP rank's real batches (the cost model's unit)."""
        return [sum(b.cost * b.weight for b in r) for r in self.ranks]


def _row_cap(cost, shape, n_rows: int, m_mem: float, m_comp: Optional[float]) -> tuple[int, np.ndarray, np.ndarray]:
    """(largest rows per batch within the budgets, memory [GiB] and cost of 0..n_rows rows)."""
    bs = np.arange(n_rows + 1)
    n_ckpt = fewest_memory_blocks(cost, shape)
    mem = np.asarray(cost.ckpt_memory(shape, np.maximum(bs, 1), n_ckpt), float)
    comp = np.asarray(cost.ckpt_cost(shape, np.maximum(bs, 1), 0), float)
    ok = mem <= m_mem * (1 + 1e-12)
    if m_comp is not None:
        ok &= (comp <= m_comp * (1 + 1e-12)) | (bs == 1)   # one row over m_comp runs alone, as training's samples
    ok[0] = True
    cap = int(np.flatnonzero(ok)[-1]) if ok[1:].any() else 0
    return cap, mem, comp


def plan_validation(shapes: Sequence, cost, *, m_mem: float, dp_size: int, timesteps: int,
                    m_comp: Optional[float] = None, oversize: str = "error") -> ValidationPlan:
    """Plan ``timesteps`` rows of every held-out sample (``shapes[i]``: sample ``i``'s shape) into batches within
    the training plan's budgets, dealt to ``dp_size`` ranks (see the module doc). A pure function of its inputs:
    the same on every rank."""
    by_shape: dict = {}
    for i, s in enumerate(shapes):
        by_shape.setdefault(s, []).append(i)
    uniq = sorted(by_shape, key=lambda s: (s.tokens, str(s)))
    batches, skipped = [], []
    for u, shape in enumerate(uniq):
        ids = by_shape[shape]
        rows = [(i, k) for i in ids for k in range(timesteps)]
        cap, mem, comp = _row_cap(cost, shape, len(rows), m_mem, m_comp)
        if cap < 1:
            msg = (f"held-out sample {ids[0]} (shape {shape}, {shape.tokens} tokens) does not fit the memory budget "
                   f"m_mem {m_mem:.3f} GiB even as one row (predicted {mem[1]:.3f} GiB); {len(ids)} held-out "
                   "sample(s) of this shape. Raise sampler.m_mem, use a higher Ulysses degree, or set "
                   "sampler.oversize: \"skip\"")
            if oversize == "error":
                raise ValidationError(msg)
            skipped.extend(ids)
            continue
        n_batches = -(-len(rows) // cap)
        size = -(-len(rows) // n_batches)   # even batches: no small leftover batch
        for lo in range(0, len(rows), size):
            part = tuple(rows[lo:lo + size])
            batches.append(Batch(u, part, float(comp[len(part)]), float(mem[len(part)])))
    ranks: list = [[] for _ in range(dp_size)]
    load = [0.0] * dp_size
    for b in sorted(batches, key=lambda b: (-b.cost, b.shape_id, b.rows)):
        r = min(range(dp_size), key=lambda j: (load[j], j))
        ranks[r].append(b)
        load[r] += b.cost
    forwards = max((len(r) for r in ranks), default=0)
    if batches:
        cheapest = min(batches, key=lambda b: (b.cost, b.shape_id, b.rows))
        pad = Batch(cheapest.shape_id, cheapest.rows[:1], cheapest.cost, cheapest.memory_gib, weight=0.0)
        for r in ranks:
            r.extend([pad] * (forwards - len(r)))
    return ValidationPlan(ranks=ranks, forwards=forwards, samples=len(shapes) - len(skipped),
                          rows=sum(len(b.rows) for b in batches), timesteps=timesteps, budget_gib=float(m_mem),
                          skipped=sorted(skipped))


def _batch_inputs(dataset, batch: Batch, *, seed: int, shift: float, timesteps: int, objective, text_len: int,
                  device: torch.device):
    """``(x_t, timestep, target, context)`` of one batch's rows, noise seeded by each sample's dataset index."""
    by_sample: dict = {}
    for i, k in batch.rows:
        by_sample.setdefault(i, []).append(k)
    xs, ts, tgts, ctxs = [], [], [], []
    for i, ks in by_sample.items():
        sample = dataset[i]
        index = dataset.source_index(i) if hasattr(dataset, "source_index") else i
        x_t, t, target = eval_inputs(sample["latents"].to(device), index, seed=seed, shift=shift,
                                     timesteps=timesteps, objective=objective, rows=ks)
        ctx = sample["context"].to(device)
        if ctx.shape[0] > text_len:
            raise ValidationError(f"held-out sample {index} has a {ctx.shape[0]}-token context, longer than the "
                                  f"model's text length {text_len}")
        ctx = F.pad(ctx, (0, 0, 0, text_len - ctx.shape[0]))   # zero padding, as training pads every caption
        xs.append(x_t)
        ts.append(t)
        tgts.append(target)
        ctxs.append(ctx.unsqueeze(0).expand(len(ks), -1, -1))
    return torch.cat(xs), torch.cat(ts), torch.cat(tgts), torch.cat(ctxs)


@torch.no_grad()
def score(engine, dataset, plan: ValidationPlan, *, layout, seed: int, shift: float, dtype: torch.dtype,
          device: torch.device, text_len: int, objective=None) -> dict:
    """The mean flow-matching loss over the plan's rows (every rank: a collective): ``{"loss", "rows",
    "samples", "forwards"}``. This DP rank scores its batches; the sums meet in one all-reduce."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    count = 1.0 if layout.sp_rank == 0 else 0.0   # an SP group's ranks all see the group's (gathered) losses
    was_training = engine.training
    engine.eval()
    try:
        for b in plan.ranks[layout.dp_rank]:
            x_t, t, target, ctx = _batch_inputs(dataset, b, seed=seed, shift=shift, timesteps=plan.timesteps,
                                                objective=objective, text_len=text_len, device=device)
            rows = per_sample_mse(engine(x_t.to(dtype), t, ctx.to(dtype)), target)
            w = b.weight * count
            total += torch.stack([rows.double().sum() * w, torch.tensor(len(b.rows) * w, dtype=torch.float64,
                                                                       device=device)])
    finally:
        engine.train(was_training)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(total)
    loss = float(total[0] / total[1]) if float(total[1]) > 0 else float("nan")
    return {"loss": loss, "rows": int(round(float(total[1]))), "samples": plan.samples, "forwards": plan.forwards}


class ValidationRunner:
    """Scores the run's held-out split every ``validation.every`` steps and after the last (every rank holds one)."""

    def __init__(self, run, cfg, *, engine, metrics, log: Callable[[str], None], ema=None) -> None:
        self.run, self.cfg, self.engine, self.metrics, self.log, self.ema = run, cfg, engine, metrics, log, ema
        self.dataset = run.validation
        # m_comp: the sampler's budget now, which pairs with run.cost (a resumed run with sparse rebalancing and
        # m_comp auto has both moved on from the start-up plan); m_mem and oversize never change
        p = run.plan
        self.plan = plan_validation(self.dataset.sample_shapes(), run.cost, m_mem=p.m_mem,
                                    dp_size=run.layout.dp_size, timesteps=cfg.timesteps,
                                    m_comp=run.sampler.params.m_comp, oversize=p.oversize)
        self.records: list[dict] = []
        self.is_writer = run.layout.rank == 0
        self.path = Path(run.cfg.adaptive_load.metrics.log_dir) / VALIDATION_LOG
        skipped = f"; {len(self.plan.skipped)} over the budget skipped" if self.plan.skipped else ""
        log(f"ds_adaptive.validation: {len(self.dataset)} held-out samples (seed {cfg.seed}, never in a training "
            f"batch) x {cfg.timesteps} fixed timesteps = {self.plan.rows} rows in {self.plan.forwards} forward(s) "
            f"per rank, every {cfg.every} steps and at the end (largest batch predicted "
            f"{self.plan.predicted_gib:.2f} GiB of m_mem {self.plan.budget_gib:.2f}){skipped}")

    @classmethod
    def attach(cls, run, *, engine, metrics, log: Callable[[str], None], ema=None) -> Optional["ValidationRunner"]:
        """The runner of ``run`` (None when ``adaptive_load.validation`` is null)."""
        cfg = run.cfg.adaptive_load.validation
        if cfg is None:
            return None
        return cls(run, cfg, engine=engine, metrics=metrics, log=log, ema=ema if cfg.ema else None)

    def after_step(self, step: int, *, last: bool = False) -> Optional[dict]:
        """Score at multiples of ``every`` and after the last step (once); every rank."""
        if step % self.cfg.every and not last:
            return None
        if self.records and self.records[-1]["step"] == step:
            return None
        return self.validate(step)

    def _score(self) -> dict:
        run = self.run
        return score(self.engine, self.dataset, self.plan, layout=run.layout, seed=self.cfg.seed,
                     shift=run.cfg.trainer.shift, dtype=run.dtype, device=run.device, text_len=run.text_len,
                     objective=run.objective)

    def validate(self, step: int) -> dict:
        """One round at ``step`` (a collective): the trained weights, and the EMA's when it is kept."""
        t0 = time.perf_counter()
        out = self._score()
        rec = {"step": int(step), "loss": out["loss"], "samples": out["samples"], "rows": out["rows"],
               "forwards": out["forwards"]}
        if self.ema is not None:
            with self.ema.swapped():
                rec["loss_ema"] = self._score()["loss"]
        rec["seconds"] = time.perf_counter() - t0
        self.records.append(rec)
        if self.is_writer:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            self.metrics.log_scalars(step, {"validation/loss": rec["loss"], **(
                {"validation/loss_ema": rec["loss_ema"]} if "loss_ema" in rec else {})})
            ema = f", EMA {rec['loss_ema']:.4f}" if "loss_ema" in rec else ""
            self.log(f"ds_adaptive.validation: step {step}: loss {rec['loss']:.4f}{ema} ({rec['samples']} samples x "
                     f"{self.plan.timesteps} timesteps, {rec['seconds']:.2f} s)")
        return rec

    def summary(self) -> dict:
        """For the run summary: ``validation_loss`` (the last round's) and the rounds."""
        if not self.records:
            return {}
        last = self.records[-1]
        out = {"validation_loss": last["loss"],
               "validation": {"samples": len(self.dataset), "scored": last["samples"], "skipped": self.plan.skipped,
                              "timesteps": self.plan.timesteps, "seed": self.cfg.seed, "every": self.cfg.every,
                              "forwards_per_rank": self.plan.forwards, "predicted_gib": self.plan.predicted_gib,
                              "budget_gib": self.plan.budget_gib,
                              "rounds": [{k: r[k] for k in ("step", "loss", "loss_ema") if k in r}
                                         for r in self.records]}}
        if "loss_ema" in last:
            out["validation_loss_ema"] = last["loss_ema"]
        return out
