"""The trainer: a :class:`Trainer` drives one :class:`ds_adaptive.training.assemble.Run` with DeepSpeed.

    run = build_run(cfg, layout=Layout.detect(sp), device=device)
    trainer = Trainer(run)          # deepspeed.initialize, engine check, metrics, resume
    summary = trainer.fit()         # train_step() until trainer.steps, save(), evaluate()

The Trainer is the loop; each job around it is a collaborator of its own module:

* ``engine``: distributed init / shutdown, ``deepspeed.initialize`` and its checks, the micro-batch's forward
  and weighted backward, the optimizer step with the step's LR factor, ZeRO-3's forward-stack trim, release;
* ``batches``: the DataLoader over the planned batch sampler, one iterator per epoch;
* ``checkpointing``: save / resume / the ranks' shared checks / the run's continuation, and :class:`TrainState`
  (what a checkpoint carries besides weights and sampler);
* ``warmups`` (sparse attention and block fusion compile before step 1), ``rebalance`` (sparse densities back
  into the plan), ``nonfinite`` (the policy for non-finite steps), ``evaluation`` (the held-out loss),
  ``ema`` (the partitioned EMA of the weights), ``captions`` (caption dropout), ``validation`` (the held-out
  split scored during training), ``plot`` (the run's PNG),
  ``metrics_setup`` / ``metrics`` (the step records and logs), ``memory_log`` (predicted vs measured memory and
  compute), ``progress`` (the progress bar), ``summary`` (the run summary).

Unbiased gradients with variable batch sizes: DeepSpeed averages gradients over the DP ranks and
divides the loss by gradient_accumulation_steps (gas). With the sampler's global count W (samples,
or tokens with ``loss_weighting: tokens``) of the optimizer step, each micro-step backpropagates
``sum_i w_i * loss_i * dp * gas / W`` (``StepTotals.loss_weight``), so that the step's gradient is
the gradient of ``sum_i w_i * loss_i / W`` over all samples of all ranks: what one process would
compute on the same samples. Under Ulysses each rank's partial loss is also scaled by
``Layout.loss_scale`` (docs/ULYSSES.md). The objective itself is ``ds_adaptive.models.objective``.
"""
from __future__ import annotations

from pathlib import Path

import torch.nn.functional as F

from ds_adaptive.attention.telemetry import SparseTrainerHook
from ds_adaptive.ops.apply import ln_modulate_summary
from ds_adaptive.planning.memory import model_checkpoint_blocks
from ds_adaptive.training.assemble import Run
from ds_adaptive.training.batches import Batches
from ds_adaptive.training.captions import CaptionDropout
from ds_adaptive.training.checkpoint import CLIENT_STATE_KEY, tag_for
from ds_adaptive.training.checkpointing import Checkpointing, TrainState
from ds_adaptive.training.ema import EmaState
from ds_adaptive.training.engine import (backward_micro_batch, check_accumulation, init_distributed, optimizer_step,
                                         release_engine, shutdown_distributed, start_engine, trim_forward_stack)
from ds_adaptive.training.evaluation import EVAL_SEED_OFFSET, evaluate, held_out
from ds_adaptive.training.fusion_warmup import FusionWarmup
from ds_adaptive.training.lora import reseed_dropout
from ds_adaptive.training.memory_log import MemoryLog
from ds_adaptive.training.summary import format_summary
from ds_adaptive.training.metrics_setup import open_metrics
from ds_adaptive.training.nonfinite import NonFiniteError, NonFiniteGuard
from ds_adaptive.training.preempt import EXIT_PREEMPTED, StopRequest
from ds_adaptive.training.preview import PreviewRunner
from ds_adaptive.training.plot import draw_at_end
from ds_adaptive.training.progress import Progress
from ds_adaptive.training.rebalance import sparse_rebalance
from ds_adaptive.training.run_config import UsageError
from ds_adaptive.training.validation import ValidationRunner
from ds_adaptive.training.warmups import fusion_pairs, warm_block_fusion, warm_sparse

__all__ = ["Trainer", "TrainState", "backward_micro_batch", "evaluate", "init_distributed", "shutdown_distributed",
           "check_accumulation", "MemoryLog", "CLIENT_STATE_KEY", "EVAL_SEED_OFFSET", "NonFiniteError",
           "EXIT_PREEMPTED"]


class Trainer:
    """Trains ``run`` with DeepSpeed: :meth:`train_step` one optimizer step, :meth:`save` /
    :meth:`resume` checkpoints (sampler state in DeepSpeed's client_state), :meth:`evaluate` the
    held-out loss, :meth:`fit` the whole loop. Construction initialises the engine (and resumes
    when ``run.cfg.trainer.resume`` is set)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.opts = o = run.cfg.trainer
        self.layout = run.layout
        self.is_main = run.layout.rank == 0
        self.stop = StopRequest.install()   # SIGTERM/SIGINT/SIGHUP: finish the step, save, exit EXIT_PREEMPTED
        self.state = TrainState()
        # DSV sparse attention: build_run installed its runtime on the model (after Ulysses, before
        # deepspeed.initialize: the predictor lives outside the engine's parameters); the hook logs, steps and
        # checkpoints it. None when off.
        self.sparse = (SparseTrainerHook(run.sparse, run.cfg.adaptive_load.metrics.log_dir, self.is_main)
                       if run.sparse is not None else None)
        self.engine, self._fwd_stack_base = start_engine(run)
        self.ema = EmaState.attach(run, self.engine, self.log)       # None without adaptive_load.ema
        self.captions = CaptionDropout.attach(run)                    # None without adaptive_load.caption_dropout
        self.batches = Batches(run, o.workers)
        self.checkpoints = Checkpointing(run, self.engine, sparse=self.sparse, log=self.log, ema=self.ema)
        self.nonfinite = NonFiniteGuard(o.nonfinite, o.nonfinite_limit, log=self.log,
                                        fp16=bool((run.ds_config.get("fp16") or {}).get("enabled")))
        self._shapes = run.sampler.shapes   # the dataset's shapes as planned (ids into its distinct shapes)
        for note in run.notes + ([self.captions.describe()] if self.captions is not None else []):
            self.log(f"ds_adaptive.train: {note}")
        if o.resume:
            self.resume(o.resume)
            if self.global_step >= o.steps:
                raise UsageError(f"--resume {o.resume}: the checkpoint is at step {self.global_step} and "
                                 f"--steps is {o.steps}: nothing left to train; pass --steps greater than "
                                 f"{self.global_step} to continue")
        self.metrics = open_metrics(run, self.engine, self.log, resumed_step=self.global_step if o.resume else None)
        if self.sparse is not None:
            warm_sparse(self.sparse, run.sampler, dtype=run.dtype, log=self.log)
        self.fusion = FusionWarmup.attach(run, self.log)   # None with block fusion off
        warm_block_fusion(self.fusion, run.sampler, sp=self.layout.sp_size, epoch=self.epoch,
                          pin_memory=self.batches.pin_memory)
        self.preview = PreviewRunner.attach(run, engine=self.engine, metrics=self.metrics, log=self.log,
                                            weights=self.ema.swapped if self.ema is not None else None)
        self.validation = ValidationRunner.attach(run, engine=self.engine, metrics=self.metrics, log=self.log,
                                                  ema=self.ema)
        self.ckpt_policy = run.cfg.adaptive_load.recompute.blocks
        mcfg = run.cfg.adaptive_load.metrics
        self.memory_log = MemoryLog(run.sampler, run.zero_stage, self.layout.world, mcfg.log_dir,
                                    self.is_main and run.device.type == "cuda", compute_log=self.is_main and mcfg.jsonl)

    # where the run is (TrainState, what a checkpoint carries)
    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def step_in_epoch(self) -> int:
        return self.state.step_in_epoch

    @property
    def nonfinite_steps(self) -> list:
        return self.state.nonfinite_steps

    @property
    def run_id(self) -> str:
        return self.state.run_id

    def log(self, msg: str) -> None:
        if self.is_main:
            print(msg, flush=True)

    # ------------------------------------------------------------------ one optimizer step
    def train_step(self):
        """One optimizer step (gas micro-steps); returns the metrics record of the step."""
        run, sampler, st = self.run, self.run.sampler, self.state
        sampler.set_epoch(st.epoch)  # before the step's totals: at an epoch boundary they are the new epoch's
        if self.fusion is not None:   # a new plan (epoch, re-plan): compile for its new pairs now, not mid-step
            self.fusion.before_step(sampler.plan, lambda: fusion_pairs(sampler.plan, self.layout.sp_size), st.epoch)
        totals = sampler.step_totals(st.step_in_epoch)
        factor = sampler.lr_scale(st.step_in_epoch)
        self.metrics.start_step()
        loss_num, loss_den = None, 0.0   # loss_num: a device tensor, read once after the step's micro-steps
        step_lr = None
        for micro in range(run.gas):
            num, den, lr = self._micro_step(micro, totals, factor)
            step_lr = lr if lr is not None else step_lr
            loss_num = num if loss_num is None else loss_num + num
            loss_den += den
        st.global_step += 1
        st.step_in_epoch += 1
        applied = bool(self.engine.was_step_applied())  # False: DeepSpeed skipped a non-finite update
        if self.ema is not None:
            self.ema.after_step(st.global_step)
        rec = self.metrics.end_step(st.global_step, float(loss_num), loss_den, step_lr,
                                    log=st.global_step == self.opts.steps, skipped=not applied)
        self.memory_log.end_step(rec)
        self.nonfinite.check(rec, applied, st.nonfinite_steps)
        if rec.samples != totals.samples:
            raise RuntimeError(f"step {st.global_step}: the ranks processed {rec.samples} samples but the "
                               f"sampler's step_totals said {totals.samples}; the plan is inconsistent")
        interval = run.cfg.adaptive_load.metrics.interval
        if self.sparse is not None and (st.global_step % interval == 0 or st.global_step == self.opts.steps):
            self.sparse.log(st.global_step, self.metrics)
        if self.sparse is not None and sparse_rebalance(self.sparse, run, epoch=st.epoch,
                                                        step_in_epoch=st.step_in_epoch,
                                                        global_step=st.global_step, log=self.log):
            self.batches.restart()  # the re-planned rest of the epoch: samples stay exactly once
        if st.step_in_epoch >= sampler.steps_per_epoch:
            st.epoch += 1
            st.step_in_epoch = 0
            self.batches.restart()
        return rec

    def _micro_step(self, micro: int, totals, factor: float) -> tuple:
        """One micro-batch: fetch, forward + weighted backward, the engine's step (the optimizer's at the last
        micro-step, with the LR factor); returns (loss numerator tensor, denominator, the LR or None)."""
        run, sampler, metrics, st = self.run, self.run.sampler, self.metrics, self.state
        # (a new DataLoader iterator draws from the global RNG)
        batch = self.batches.next(micro, epoch=st.epoch, step_in_epoch=st.step_in_epoch)
        if run.lora is not None and run.lora.dropout > 0:  # dropout masks: (seed, step, micro, rank)
            reseed_dropout(self.opts.seed, st.global_step, micro, self.layout.rank)
        latents = batch["latents"].to(run.device, non_blocking=True)
        context = batch["context"].to(run.device, non_blocking=True)
        context = F.pad(context, (0, 0, 0, run.text_len - context.shape[1]))
        if self.captions is not None:   # per sample, from (seed, epoch, index): the same after a resume
            context = self.captions.apply(context, batch["index"], st.epoch)
        metrics.data_ready()
        shape = self._shapes[int(batch["index"][0])]
        tokens = shape.tokens
        plan_ckpt = None
        if self.ckpt_policy == "auto":  # the plan's count for this rank's batch (same on its SP group)
            plan_ckpt = sampler.checkpoint_blocks(st.step_in_epoch, micro)
            run.model.set_checkpoint_blocks(model_checkpoint_blocks(plan_ckpt, sampler.cost.num_layers,
                                                                    run.model_config.num_layers))
        num, den = backward_micro_batch(
            self.engine, latents, context, batch["index"], totals, tokens_per_sample=tokens, layout=self.layout,
            by=run.cfg.adaptive_load.optimization.loss_weighting, epoch=st.epoch, seed=self.opts.seed,
            shift=self.opts.shift, dtype=run.dtype, objective=run.objective, patch_size=run.model_config.patch_size)
        metrics.backward_done()
        trim_forward_stack(self._fwd_stack_base)  # the early-stopped recomputes' leftovers (no forward runs now)
        lr = None
        if micro == run.gas - 1:
            lr = optimizer_step(self.engine, factor)
            if self.sparse is not None:
                self.sparse.after_step()  # predictor step, schedule, profiler
        else:
            self.engine.step()  # no optimizer step inside the accumulation window
        b = latents.shape[0]
        n_ckpt = run.model.checkpointed_blocks() if run.model.training else 0
        flops = run.preset.flops(run.model_config, tokens, b, n_ckpt,   # model and hardware FLOPs (MFU / HFU)
                                 kept_attention=run.plan.checkpoint_attention == "keep")
        metrics.end_micro(b, b * tokens, float(b * tokens ** 2), *flops)
        self.memory_log.record(st.global_step + 1, micro, shape, b, n_ckpt if plan_ckpt is None else plan_ckpt,
                               metrics.last_micro_peak_gib, metrics.last_micro_reserved_gib)
        return num, den, lr

    # ------------------------------------------------------------------ checkpoints and evaluation
    def save(self) -> None:
        """A complete checkpoint ``global_step{N}`` in ``--save`` (:meth:`Checkpointing.save`)."""
        self.checkpoints.save(self.state)

    def resume(self, path: str) -> None:
        """Load ``path`` (the --save directory: its newest complete checkpoint, falling back from a corrupt or
        incomplete ``latest``; or DIR/global_stepN: that one): weights, optimizer, scheduler, sampler position."""
        self.checkpoints.resume(path, self.state)
        self.batches.restart()

    def evaluate(self, num_samples: int) -> dict:
        """Held-out loss on ``num_samples`` synthetic samples of the run's shape mix (seed + EVAL_SEED_OFFSET)."""
        return held_out(self.run, self.engine, num_samples)

    # ------------------------------------------------------------------ the loop
    def close(self) -> None:
        """Close the logs, restore the signal handlers and free the engine (:func:`release_engine`): what a
        process that builds another run after this one calls (``fit`` ends the process's own run without it).
        The trainer is unusable after."""
        self.metrics.close()
        self.memory_log.close()
        self.stop.uninstall()
        self.batches.restart()
        engine, self.engine = self.engine, None
        if engine is not None:
            release_engine(engine)

    def fit(self) -> dict:
        """Train until ``trainer.steps``, saving every ``save_every`` steps and at the end; then the
        held-out loss (``eval_samples``). On SIGTERM/SIGINT/SIGHUP every rank stops after the same
        step, saves (with ``--save``) and the summary's ``stopped`` says so (the CLI exits
        ``EXIT_PREEMPTED``). Returns the summary (identical on every rank)."""
        o, st = self.opts, self.state
        progress = Progress(self.is_main, o.steps, st.global_step, self.run.cfg.adaptive_load.metrics.interval)
        last_saved = st.global_step
        stopped = None
        try:
            while st.global_step < o.steps:
                if self.stop.agreed(self.run.device):
                    stopped = {"signal": self.stop.signal_name, "step": st.global_step}
                    break
                rec = self.train_step()
                progress.update(rec, o.steps)
                if self.preview is not None:  # every rank: ZeRO-3 gathers parameters collectively
                    self.preview.after_step(st.global_step, last=st.global_step == o.steps)
                if self.validation is not None:  # every rank, likewise
                    self.validation.after_step(st.global_step, last=st.global_step == o.steps)
                if o.save and o.save_every and st.global_step % o.save_every == 0:
                    self.save()
                    last_saved = st.global_step
            self.batches.restart()
            if o.save and last_saved != st.global_step:
                self.save()
        finally:
            progress.close()
            self.metrics.close()
            self.memory_log.close()
        summary = self._summary(stopped)
        if self.is_main:
            path = self.metrics.write_summary(summary)
            print(format_summary(summary))
            print(f"summary written to {path}", flush=True)
            if self.run.cfg.adaptive_load.metrics.plot:
                draw_at_end(self.run.cfg.adaptive_load.metrics.log_dir, self.log)
        return summary

    def _summary(self, stopped) -> dict:
        """The run summary: the metrics' totals and each collaborator's part; ``stopped`` (a signal) said once."""
        o, st = self.opts, self.state
        summary = self.metrics.summary()
        summary["final_step"] = st.global_step
        summary["memory_prediction"] = self.memory_log.summary()
        compute = self.memory_log.compute_summary(self.metrics.history, int(summary.get("warmup_steps", 1)))
        if compute is not None:
            summary["compute_prediction"] = compute
        summary["nonfinite_steps"] = list(st.nonfinite_steps)
        if self.fusion is not None:
            summary["block_fusion"] = self.fusion.summary()
        summary.update(ln_modulate_summary(self.run.cfg.adaptive_load.fused_ln_modulate))
        if self.sparse is not None:
            self.sparse.finish(summary)
        if self.run.lora is not None:
            summary["lora"] = {k: v for k, v in self.run.lora.client_state().items() if k not in ("base", "modules")}
        if self.preview is not None:
            summary["preview"] = self.preview.summary()
        if self.ema is not None:
            summary["ema"] = self.ema.summary()
        if self.captions is not None:   # every rank: one all-reduce
            summary.update(self.captions.summary(self.run.device))
        if self.validation is not None:
            summary.update(self.validation.summary())
        if stopped is not None:
            stopped["checkpoint"] = str(Path(o.save) / tag_for(st.global_step)) if o.save else None
            stopped["exit_code"] = EXIT_PREEMPTED
            summary["stopped"] = stopped
            self.log(f"ds_adaptive: {stopped['signal']}: stopped after step {st.global_step} of {o.steps}; "
                     + (f"checkpoint {stopped['checkpoint']}; continue with --resume {o.save}" if o.save else
                        "no --save directory was given, so nothing was saved: the progress of this run is lost")
                     + f" (exit {EXIT_PREEMPTED})")
        elif o.eval_samples:
            summary.update(self.evaluate(o.eval_samples))
        return summary
