"""The trainer: a :class:`Trainer` drives one :class:`ds_adaptive.training.assemble.Run` with DeepSpeed.

    run = build_run(cfg, layout=Layout.detect(sp), device=device)
    trainer = Trainer(run)          # deepspeed.initialize, engine check, metrics, resume
    summary = trainer.fit()         # train_step() until trainer.steps, save(), evaluate()

Unbiased gradients with variable batch sizes: DeepSpeed averages gradients over the DP ranks and
divides the loss by gradient_accumulation_steps (gas). With the sampler's global count W (samples,
or tokens with ``loss_weighting: tokens``) of the optimizer step, each micro-step backpropagates
``sum_i w_i * loss_i * dp * gas / W`` (``StepTotals.loss_weight``), so that the step's gradient is
the gradient of ``sum_i w_i * loss_i / W`` over all samples of all ranks: what one process would
compute on the same samples. Under Ulysses each rank's partial loss is also scaled by
``Layout.loss_scale`` (docs/ULYSSES.md). The objective itself is ``ds_adaptive.models.objective``.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from ds_adaptive.core.ports import free_port
from ds_adaptive.training.checkpoint import (CLIENT_STATE_KEY, CheckpointError, check_checkpoint, find_resumable, last_good, read_marker, step_of, tag_for,
                         write_checkpoint)
from ds_adaptive.data import DataError, build_dataset, collate_latents
from ds_adaptive.core.layout import Layout
from ds_adaptive.training.lora import CLIENT_KEY as LORA_KEY, reseed_dropout, resume_problem
from ds_adaptive.training.metrics import StepMetrics, format_summary
from ds_adaptive.training.fusion_warmup import FusionWarmup
from ds_adaptive.planning.memory import model_checkpoint_blocks
from ds_adaptive.calibration.refit import COMPUTE_LOG
from ds_adaptive.ops.apply import ln_modulate_summary
from ds_adaptive.models.objective import EVAL_TIMESTEPS, eval_inputs, flow_matching_losses, mean_mse
from ds_adaptive.training.preview import PreviewRunner
from ds_adaptive.training.preempt import EXIT_PREEMPTED, StopRequest, ignore_stop_signals
from ds_adaptive.training.assemble import Run, leaf_block_count
from ds_adaptive.core.config import ConfigError
from ds_adaptive.training.run_config import UsageError
from ds_adaptive.attention.telemetry import SparseTrainerHook
from ds_adaptive.ops.ln_modulate import op_status

__all__ = ["Trainer", "backward_micro_batch", "evaluate", "init_distributed", "shutdown_distributed",
           "check_accumulation", "MemoryLog", "CLIENT_STATE_KEY", "EVAL_SEED_OFFSET", "NonFiniteError", "EXIT_PREEMPTED"]

EVAL_SEED_OFFSET = 1_000_003   # held-out samples: the synthetic dataset with seed + this offset


class NonFiniteError(RuntimeError):
    """The run stops on non-finite steps (``--nonfinite stop``, or more than ``--nonfinite-limit``)."""


# --- distributed setup -----------------------------------------------------------------------

def init_distributed(local_rank: int) -> tuple[int, int, torch.device]:
    """Initialise torch.distributed via DeepSpeed (NCCL on GPU, gloo on CPU); a plain
    ``python -m ds_adaptive.cli.train`` becomes a world of one."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port("127.0.0.1"))))
    acc = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", local_rank))
    if acc.device_name() == "cuda":
        acc.set_device(local_rank)
    deepspeed.init_distributed(dist_backend=acc.communication_backend_name(), verbose=False)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device(acc.device_name(local_rank)) if acc.device_name() == "cuda" else torch.device("cpu")
    return rank, world, device


def shutdown_distributed(*, barrier: bool) -> None:
    """Leave the process group in order. Without this, a rank that exits while another is still in
    a collective (or with gloo's threads alive) can abort at interpreter exit ("terminate called
    without an active exception"). The barrier, after a successful run only (after an error another
    rank may never arrive), makes the ranks leave together."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if barrier:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def release_engine(engine) -> None:
    """Free a DeepSpeed engine's model, gradients and optimizer state for the rest of the process (several
    runs in one process: benches, tests). ``del engine`` is not enough under ZeRO-3: DeepSpeed keeps the model
    on its module-level forward stack (``parameter_offload.FWD_MODULE_STACK``: the model appended at set-up
    and never popped, and submodules whose checkpointed recompute pushed without a pop) and in the ``functools.lru_cache`` of ``PartitionedParameterCoordinator.__params_to_release``
    (keyed by the coordinator and the submodules), and the parameters' hooks hold the optimizer: every
    engine of the process stayed alive (the third arm of bench/training/sparse_train_ab.py once ran out of memory:
    it held the two earlier arms' engines besides its own).
    ``engine.destroy()`` removes the hooks; this also drops those references. The engine is unusable after."""
    import gc

    module = getattr(engine, "module", None)
    engine.destroy()
    try:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    except ImportError:  # pragma: no cover - a DeepSpeed without ZeRO-3 offload modules
        gc.collect()
        return
    stack = forward_stack()
    if stack is not None and module is not None:   # the model, and submodules a recompute left there
        mine = {id(m) for m in module.modules()}
        stack[:] = [m for m in stack if id(m) not in mine]
    cached = vars(PartitionedParameterCoordinator).get("_PartitionedParameterCoordinator__params_to_release")
    for cell in getattr(cached, "__closure__", None) or ():   # the lru_cache under DeepSpeed's nvtx wrapper
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()
    gc.collect()


def forward_stack():
    """DeepSpeed ZeRO-3's module-level forward stack (``parameter_offload.FWD_MODULE_STACK``), or None."""
    try:
        from deepspeed.runtime.zero import parameter_offload
    except ImportError:  # pragma: no cover - a DeepSpeed without ZeRO-3 offload modules
        return None
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    return stack if isinstance(stack, list) else None


def trim_forward_stack(base: int) -> int:
    """Drop what a micro-batch left on DeepSpeed's forward stack above ``base`` (its length after the engine's
    set-up); returns how many entries were dropped. ZeRO-3 pushes a module in its pre-forward hook and pops it
    in its post-forward hook; an activation-checkpoint recompute that torch stops early (non-reentrant
    checkpointing stops once the saved tensors it needs are rebuilt) never runs the post-forward hook, so every
    checkpointed block left one entry per micro-step: the list grew for the whole run and its top, which
    DeepSpeed reads to register a module's external parameters, was a stale block. Between micro-batches no
    forward is running: everything above ``base`` is such a leftover."""
    stack = forward_stack()
    if stack is None or len(stack) <= base:
        return 0
    n = len(stack) - base
    del stack[base:]
    return n


# --- one micro-batch and the held-out loss ---------------------------------------------------

def backward_micro_batch(engine, latents: torch.Tensor, context: torch.Tensor, indices: torch.Tensor, totals, *,
                         tokens_per_sample: int, layout: Layout, by: str, epoch: int, seed: int, shift: float,
                         dtype: torch.dtype, objective=None, patch_size=(1, 2, 2)) -> tuple[torch.Tensor, float]:
    """Forward and weighted backward of one micro-batch (all samples of one shape).

    The mean per-sample loss is scaled by ``totals.loss_weight`` (local share of the optimizer
    step's global samples or tokens x dp_size x micro-steps), which undoes DeepSpeed's DP mean and
    its 1/gradient_accumulation_steps, and by ``layout.loss_scale`` under SP. Returns
    ``(sum_i w_i * loss_i, sum_i w_i)`` of this micro-batch, ``w_i`` 1 (samples) or the sample's tokens;
    under SP the full per-sample losses (summed over the group). The first is a detached 0-d fp32 tensor on the
    device: reading it (``float``) waits for the backward, so the trainer reads a step's sum once, after its last
    micro-step, and the host queues the next micro-step while the GPU finishes this one. ``objective``: the
    model's ``ObjectiveOptions`` (None: the defaults); ``patch_size``: the model's.
    """
    sharded = layout.sp_enabled
    per_sample = flow_matching_losses(engine, latents, context, indices, epoch=epoch, seed=seed, shift=shift,
                                      dtype=dtype, local=sharded, objective=objective, patch_size=patch_size)
    b = per_sample.shape[0]
    weight = totals.loss_weight(b, b * tokens_per_sample, layout.dp_size, by)
    if sharded:  # x sp: DeepSpeed averages gradients over all dp*sp ranks (docs/ULYSSES.md)
        weight *= layout.loss_scale
    engine.backward(per_sample.mean() * weight)
    w = float(tokens_per_sample) if by == "tokens" else 1.0
    per_sample = layout.group_sum(per_sample)  # the SP ranks' partial losses sum to the per-sample losses
    return per_sample.detach().sum(dtype=torch.float32) * w, b * w


@torch.no_grad()
def evaluate(engine, dataset, *, layout: Layout, seed: int, shift: float, dtype: torch.dtype,
             device: torch.device, text_len: int, objective=None) -> float:
    """Mean flow-matching loss over every sample of ``dataset`` (held out from training), each at
    ``EVAL_TIMESTEPS`` fixed u with noise seeded by (seed, k, index): a pure function of the
    weights, comparable across runs. Sample j goes to DP rank j % dp_size; every rank runs the same
    number of forwards (ZeRO-3 gathers parameters collectively), padding with weight-0 repeats.
    Under SP the engine returns the gathered output: every rank of a group scores its DP rank's samples.
    Contexts are zero-padded to ``text_len``; ``objective``: the model's options (its noise range)."""
    n, dp_rank, dp_size = len(dataset), layout.dp_rank, layout.dp_size
    mine = list(range(dp_rank, n, dp_size))
    total = torch.zeros(2, dtype=torch.float64, device=device)
    was_training = engine.training
    engine.eval()
    try:
        for j in range(-(-n // dp_size)):
            idx = mine[j] if j < len(mine) else mine[-1] if mine else 0
            sample = dataset[idx]
            x_t, timestep, target = eval_inputs(sample["latents"].to(device), idx, seed=seed, shift=shift,
                                                objective=objective)
            ctx = sample["context"].to(device)
            ctx = F.pad(ctx, (0, 0, 0, text_len - ctx.shape[0])).unsqueeze(0).expand(EVAL_TIMESTEPS, -1, -1)
            loss = mean_mse(engine(x_t.to(dtype), timestep, ctx.to(dtype)), target)
            weight = 1.0 if j < len(mine) else 0.0
            total += torch.stack([loss.double() * weight, torch.tensor(weight, dtype=torch.float64, device=device)])
    finally:
        engine.train(was_training)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(total)
    return float(total[0] / total[1])


def check_accumulation(engine, sampler) -> None:
    """DeepSpeed's gradient_accumulation_steps must be the sampler's micro-steps per optimizer step: the
    engine divides the loss by it and steps the optimizer at its boundary, the plan's loss weights and
    batches assume the sampler's count. Raises :class:`UsageError` naming both values."""
    ds_gas = int(engine.gradient_accumulation_steps())
    if ds_gas != sampler.micro_steps_per_step:
        raise UsageError(
            f"DeepSpeed runs gradient_accumulation_steps {ds_gas} but the batch sampler planned "
            f"{sampler.micro_steps_per_step} micro-steps per optimizer step; build the engine from Run.ds_config "
            "(build_run writes the sampler's count there for \"gradient_accumulation_steps\": \"auto\"), or set "
            f"gradient_accumulation_steps to {sampler.micro_steps_per_step} in the ds_config")


# --- the trainer -----------------------------------------------------------------------------

class Trainer:
    """Trains ``run`` with DeepSpeed: :meth:`train_step` one optimizer step, :meth:`save` /
    :meth:`resume` checkpoints (sampler state in DeepSpeed's client_state), :meth:`evaluate` the
    held-out loss, :meth:`fit` the whole loop. Construction initialises the engine (and resumes
    when ``run.cfg.trainer.resume`` is set)."""

    def __init__(self, run: Run) -> None:
        import deepspeed

        self.run = run
        self.opts = run.cfg.trainer
        self.layout = run.layout
        self.is_main = run.layout.rank == 0
        self.stop = StopRequest.install()   # SIGTERM/SIGINT/SIGHUP: finish the step, save, exit EXIT_PREEMPTED
        self.nonfinite_steps: list[int] = []
        # The run id in every checkpoint marker (retention deletes only this run's checkpoints); a resume from
        # --save continues the run of the checkpoint it loads. Every rank draws it; rank 0's is the one written.
        self.run_id = uuid.uuid4().hex[:12]
        self.last_saved_step = 0
        model = run.model
        self.sparse = self._attach_sparse(run)
        self.engine, _, _, _ = deepspeed.initialize(model=model, config=run.ds_config,
                                                    model_parameters=[p for p in model.parameters()
                                                                      if p.requires_grad])
        self.layout.check_engine(self.engine)  # DeepSpeed must reduce over all dp*sp ranks (else a clear error)
        stack = forward_stack()
        self._fwd_stack_base = len(stack) if stack is not None else 0  # what trim_forward_stack keeps
        check_accumulation(self.engine, run.sampler)
        self.global_step, self.epoch, self.step_in_epoch = 0, 0, 0
        self._batches = None
        self._shapes = run.dataset.sample_shapes()
        for note in run.notes:
            self.log(f"ds_adaptive.train: {note}")
        if self.opts.resume:
            self.resume(self.opts.resume)
            if self.global_step >= self.opts.steps:
                raise UsageError(f"--resume {self.opts.resume}: the checkpoint is at step {self.global_step} and "
                                 f"--steps is {self.opts.steps}: nothing left to train; pass --steps greater than "
                                 f"{self.global_step} to continue")
        self.metrics = self._build_metrics()
        if self.sparse is not None:
            self._warm_sparse()
        self.fusion = FusionWarmup.attach(run, self.log)   # None with block fusion off
        self._warm_block_fusion()
        self.preview = PreviewRunner.attach(run, engine=self.engine, metrics=self.metrics, log=self.log)
        self.ckpt_policy = run.cfg.adaptive_load.sampler.checkpointing
        mcfg = run.cfg.adaptive_load.metrics
        self.memory_log = MemoryLog(run.sampler, run.zero_stage, self.layout.world, mcfg.log_dir,
                                    self.is_main and run.device.type == "cuda", compute_log=self.is_main and mcfg.jsonl)

    # ------------------------------------------------------------------ setup
    def _attach_sparse(self, run: Run):
        """DSV sparse attention (``adaptive_load.sparse_attention``): ``build_run`` installed its runtime
        on the model (after Ulysses, before ``deepspeed.initialize``: the predictor lives outside the
        engine's parameters); the hook logs, steps and checkpoints it. None when off."""
        if run.sparse is None:
            return None

        return SparseTrainerHook(run.sparse, run.cfg.adaptive_load.metrics.log_dir, self.is_main)

    def _warm_sparse(self) -> None:
        """Before step 1: the sparse backend compiles for the plan's (B, S) micro-batches (shapes are
        dynamic: a handful of graphs whatever the plan; a re-plan adds none); the time is in the
        summary (``sparse_attention.warmup_s``)."""
        cost = self.run.sampler.cost
        shapes = {(b, cost.padded_tokens(shape)) for b, shape in self._planned_micro_batches()}
        t0 = time.perf_counter()
        spent = self.sparse.runtime.warmup(shapes, dtype=self.run.dtype)
        if spent:
            self.log(f"ds_adaptive: sparse attention warm-up: {spent:.1f} s ({time.perf_counter() - t0:.1f} s with "
                     f"planning) for {len(shapes)} planned (batch, tokens) pairs")

    def _planned_micro_batches(self) -> set:
        """The distinct (B, shape) of the current epoch's planned micro-batches."""
        plan = self.run.sampler.plan
        sizes = plan.batch_offsets[1:] - plan.batch_offsets[:-1]
        return {(int(b), plan.shapes[int(j)]) for b, j in zip(sizes, plan.batch_shape)}

    def _fusion_pairs(self) -> set:
        """The (B, tokens per rank) pairs of the current plan's micro-batches (what block fusion compiles for)."""
        sp = self.layout.sp_size
        return {(b, shape.padded_tokens(sp) // sp) for b, shape in self._planned_micro_batches()}

    def _warm_block_fusion(self) -> None:
        """Before step 1: ``adaptive_load.block_fusion`` compiles its pieces for the plan's (B, tokens per rank)
        pairs (torch specialises B = 1, Inductor some element counts), so that no step compiles; ``train_step``
        does the same for pairs a later plan adds (:class:`FusionWarmup`)."""
        if self.fusion is None:
            return
        if self._pin_memory():   # the loader's pin-memory thread sets the process's threads to 1 (torch), and the
            torch.set_num_threads(1)   # compiled graphs guard on the count: set it now, as training will have it
        self.fusion.before_step(self.run.sampler.plan, self._fusion_pairs, self.epoch)
        planned = self.run.sampler.cost.profile.block_fusion
        if self.fusion.fallback and planned != "off":
            raise ConfigError(f"adaptive_load.block_fusion '{self.fusion.mode}' could not compile here, but the plan "
                              f"counts its smaller activations (profile '{self.run.sampler.cost.profile.name}' entries "
                              f"for block fusion '{planned}'): eager blocks could run out of memory. Install a working "
                              "triton, or set adaptive_load.block_fusion to 'off'")

    def _pin_memory(self) -> bool:
        """Whether the DataLoader pins host memory (on CUDA)."""
        return self.run.device.type == "cuda"

    def log(self, msg: str) -> None:
        if self.is_main:
            print(msg, flush=True)

    def _build_metrics(self) -> StepMetrics:
        run, al = self.run, self.run.cfg.adaptive_load
        log_dir = al.metrics.log_dir
        info = {
            "model": self.opts.model, "layers": run.model_config.num_layers, "objective": run.objective.as_dict(),
            "world_size": self.layout.world,
            "dp_size": self.layout.dp_size, "sp": self.layout.sp_size, "device": run.device.type,
            "dtype": str(run.dtype).replace("torch.", ""), "gradient_accumulation_steps": run.gas,
            "adaptive_load": al.enabled, "sampler": type(run.sampler).__name__,
            "sampler_mode": al.sampler.mode if al.enabled else "tokens", "fused_ln_modulate": al.fused_ln_modulate,
            "grad_ckpt": al.sampler.checkpointing, "checkpoint_attention": run.sampler.cost.checkpoint_attention,
            "profile": run.profile.name,
            "checkpoint_source": run.profile.checkpoint_source, "data": self.opts.data,
            "dataset": run.dataset.describe(),
            "loss_weighting": al.sampler.loss_weighting, "plan": run.sampler.epoch_stats(),
            "zero3_leaf_blocks": leaf_block_count(run.model),
        }
        if al.fused_ln_modulate:

            info["ln_modulate_op"] = op_status()
        metrics = StepMetrics(al.metrics, micro_steps_per_step=run.gas, device=run.device, log_dir=log_dir,
                              is_writer=self.is_main, count_this_rank=self.layout.sp_rank == 0, run_info=info)
        if self.opts.compute_timing:
            metrics.attach_engine(self.engine)
        w = run.model_config
        self.log(f"ds_adaptive: {self.opts.model} ({w.num_layers} blocks, dim {w.dim}) on {self.layout.world} "
                 f"{run.device.type} rank(s), {info['dtype']}, gas {run.gas}; {run.dataset.describe()}; sampler "
                 f"{info['sampler']} ({run.sampler.steps_per_epoch} steps/epoch); logs in {log_dir}")
        return metrics

    # ------------------------------------------------------------------ one optimizer step
    def _next_batch(self, micro: int) -> dict:
        sampler = self.run.sampler
        if self._batches is None:
            sampler.set_epoch(self.epoch)  # a no-op for the epoch just resumed
            if sampler.steps_per_epoch < 1:
                raise DataError(f"the batch sampler planned no optimizer step for epoch {self.epoch} "
                                f"({len(self.run.dataset)} samples, {self.layout.dp_size} DP ranks, gas "
                                f"{self.run.gas}); use more samples")
            workers = self.opts.workers if self.opts.workers is not None else (2 if self.run.device.type == "cuda"
                                                                               else 0)
            # Contexts travel padded to the batch's longest prompt and are zero-padded to the model's text
            # length (Wan: 512) on the device: the model sees the same input, the host moves ~4x fewer bytes.
            loader = torch.utils.data.DataLoader(self.run.dataset, batch_sampler=sampler,
                                                 collate_fn=_collate_unpadded, num_workers=workers,
                                                 pin_memory=self._pin_memory(),
                                                 worker_init_fn=ignore_stop_signals if workers else None)
            self._batches = iter(loader)
        try:
            return next(self._batches)
        except DataError as exc:  # from a DataLoader worker the message carries the worker's traceback
            raise DataError(_worker_message(str(exc))) from None
        except StopIteration:
            raise RuntimeError(f"the batch sampler ran out after {micro} micro-step(s) of step {self.step_in_epoch} "
                               f"of epoch {self.epoch}, but reported {sampler.steps_per_epoch} steps x "
                               f"{self.run.gas} micro-steps") from None

    def _optimizer_step(self, factor: float) -> float:
        """The engine's boundary step with the LR scaled by ``factor`` for this step only (the
        scheduler, if any, sets the next step's LR itself); returns the LR the step used."""
        groups = self.engine.optimizer.param_groups
        base = [g["lr"] for g in groups]
        if factor != 1.0:
            for g in groups:
                g["lr"] *= factor
        lr = groups[0]["lr"]
        self.engine.step()
        if factor != 1.0 and self.engine.lr_scheduler is None:
            for g, b in zip(groups, base):
                g["lr"] = b
        return lr

    def train_step(self):
        """One optimizer step (gas micro-steps); returns the metrics record of the step."""
        run, sampler, metrics = self.run, self.run.sampler, self.metrics
        sampler.set_epoch(self.epoch)  # before the step's totals: at an epoch boundary they are the new epoch's
        if self.fusion is not None:   # a new plan (epoch, re-plan): compile for its new pairs now, not mid-step
            self.fusion.before_step(sampler.plan, self._fusion_pairs, self.epoch)
        totals = sampler.step_totals(self.step_in_epoch)
        factor = sampler.lr_scale(self.step_in_epoch)
        metrics.start_step()
        loss_num, loss_den = None, 0.0   # loss_num: a device tensor, read once after the step's micro-steps
        step_lr = None
        for micro in range(run.gas):
            batch = self._next_batch(micro)  # (a new DataLoader iterator draws from the global RNG)
            if run.lora is not None and run.lora.dropout > 0:  # dropout masks: (seed, step, micro, rank)
                reseed_dropout(self.opts.seed, self.global_step, micro, self.layout.rank)
            latents = batch["latents"].to(run.device, non_blocking=True)
            context = batch["context"].to(run.device, non_blocking=True)
            context = F.pad(context, (0, 0, 0, run.text_len - context.shape[1]))
            metrics.data_ready()
            shape = self._shapes[int(batch["index"][0])]
            tokens = shape.tokens
            plan_ckpt = None
            if self.ckpt_policy == "auto":  # the plan's count for this rank's batch (same on its SP group)
                plan_ckpt = sampler.checkpoint_blocks(self.step_in_epoch, micro)
                run.model.set_checkpoint_blocks(model_checkpoint_blocks(plan_ckpt, sampler.cost.num_layers,
                                                                        run.model_config.num_layers))
            num, den = backward_micro_batch(
                self.engine, latents, context, batch["index"], totals, tokens_per_sample=tokens, layout=self.layout,
                by=run.cfg.adaptive_load.sampler.loss_weighting, epoch=self.epoch, seed=self.opts.seed,
                shift=self.opts.shift, dtype=run.dtype, objective=run.objective,
                patch_size=run.model_config.patch_size)
            metrics.backward_done()
            trim_forward_stack(self._fwd_stack_base)  # the early-stopped recomputes' leftovers (no forward runs now)
            if micro == run.gas - 1:
                step_lr = self._optimizer_step(factor)
                if self.sparse is not None:
                    self.sparse.after_step()  # predictor step, schedule, profiler
            else:
                self.engine.step()  # no optimizer step inside the accumulation window
            loss_num = num if loss_num is None else loss_num + num
            loss_den += den
            b = latents.shape[0]
            n_ckpt = run.model.checkpointed_blocks() if run.model.training else 0
            flops = run.preset.flops(run.model_config, tokens, b, n_ckpt,   # model and hardware FLOPs (MFU / HFU)
                                     kept_attention=run.sampler.cost.checkpoint_attention == "keep")
            metrics.end_micro(b, b * tokens, float(b * tokens ** 2), *flops)
            self.memory_log.record(self.global_step + 1, micro, shape, b, n_ckpt if plan_ckpt is None else plan_ckpt,
                                   metrics.last_micro_peak_gib, metrics.last_micro_reserved_gib)
        self.global_step += 1
        self.step_in_epoch += 1
        applied = bool(self.engine.was_step_applied())  # False: DeepSpeed skipped a non-finite update
        rec = metrics.end_step(self.global_step, float(loss_num), loss_den, step_lr, log=self.global_step == self.opts.steps,
                               skipped=not applied)
        self.memory_log.end_step(rec)
        self._check_finite(rec, applied)
        if rec.samples != totals.samples:
            raise RuntimeError(f"step {self.global_step}: the ranks processed {rec.samples} samples but the "
                               f"sampler's step_totals said {totals.samples}; the plan is inconsistent")
        interval = run.cfg.adaptive_load.metrics.interval
        if self.sparse is not None and (self.global_step % interval == 0 or self.global_step == self.opts.steps):
            self.sparse.log(self.global_step, metrics)
        if self.sparse is not None:
            self._sparse_rebalance()
        if self.step_in_epoch >= sampler.steps_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0
            self._batches = None
        return rec

    def _sparse_rebalance(self) -> None:
        """Hand changed sparse-attention densities to the sampler (re-plan from the next step of this
        epoch, or from the next epoch at its end) and the Ulysses head placement; a re-plan inside the
        epoch restarts the loader at that step (samples stay exactly once, as after a resume)."""
        sampler = self.run.sampler
        ends = self.step_in_epoch >= sampler.steps_per_epoch
        rec = self.sparse.rebalance(sampler, model=self.run.model, layout=self.layout,
                                    at_step=None if ends else self.step_in_epoch, measured_at=self.global_step)
        if rec is None:
            return
        if not rec["sampler"]:
            what = "the sampler plans dense costs"
        elif rec["at_step"] is None:
            what = "the sampler re-plans from the next epoch (or keeps its plan where that is predicted faster)"
        elif sampler.density_updates and sampler.density_updates[-1].get("kept"):
            tps = sampler.density_updates[-1]["predicted_tokens_per_s"]
            comp = sampler.density_updates[-1]["predicted_compute_tokens_per_s"]
            what = (f"the sampler keeps its plan (predicted {tps['kept']:,.0f} tokens/s under the new cost, a re-plan "
                    f"{tps['replan']:,.0f}; on compute alone {comp['kept']:,.0f} vs {comp['replan']:,.0f}); its "
                    f"batches go on")
        else:
            what = f"the sampler re-planned epoch {self.epoch} from its step {rec['at_step']}"
            self._batches = None
        heads = "; heads re-placed" if rec["placement"] is not None else ""
        self.log(f"ds_adaptive: step {self.global_step}: sparse-attention densities changed (max "
                 f"{rec['max_change']:.3f}): {what}{heads}")

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        """A complete checkpoint ``global_step{N}`` in ``--save`` (sampler state in DeepSpeed's
        client_state); ``latest`` moves after every rank's files are on disk (``ds_adaptive.training.checkpoint``),
        then the oldest beyond ``--keep-checkpoints`` are deleted."""
        t0 = time.perf_counter()
        state = {CLIENT_STATE_KEY: {
            "global_step": self.global_step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
            "sampler": self.run.sampler.state_dict(self.step_in_epoch), "seed": self.opts.seed,
            "model": self.opts.model, "layers": self.opts.layers, "data": self.opts.data,
            "world_size": self.layout.world, "nonfinite_steps": list(self.nonfinite_steps)}}
        if self.sparse is not None:
            state.update(self.sparse.client_state())
        if self.run.lora is not None:  # adapters only: the frozen base is rebuilt (seed / --init-from) on resume
            state[CLIENT_STATE_KEY][LORA_KEY] = self.run.lora.client_state()
        # "good": every step since the previous checkpoint was finite; retention never deletes the newest good one
        window = [s for s in self.nonfinite_steps if s > self.last_saved_step]
        write_checkpoint(self.engine, self.opts.save, tag_for(self.global_step), state, step=self.global_step,
                         keep=self.opts.keep_checkpoints, run_id=self.run_id, good=not window,
                         nonfinite_steps=window, log=self.log, exclude_frozen=self.run.lora is not None)
        self.last_saved_step = self.global_step
        self.log(f"saved checkpoint step {self.global_step} to {self.opts.save} ({time.perf_counter() - t0:.1f} s)"
                 + (f"; not marked good: non-finite step(s) {window[-5:]} since the previous checkpoint" if window
                    else ""))

    def resume(self, path: str) -> None:
        """Load ``path`` (the --save directory: its newest complete checkpoint, falling back from a
        corrupt or incomplete ``latest``; or DIR/global_stepN: that one): weights, optimizer,
        scheduler, sampler position."""
        load_dir, tag = _checkpoint_location(path)
        if tag is None:
            try:
                tag, skipped = find_resumable(load_dir, check=self._check_shared)
            except CheckpointError as exc:
                raise UsageError(f"--resume {path}: {exc}") from None
            for note in skipped:
                self.log(f"ds_adaptive: --resume {path}: {note}; falling back to an older checkpoint")
        else:
            problem = self._check_shared(Path(load_dir) / tag, need_marker=False)
            if problem is not None:
                raise UsageError(f"--resume {path}: {problem}; pass the --save directory to fall back to the "
                                 "newest complete checkpoint")
        try:  # a LoRA checkpoint has no frozen base weights: the module state is not loaded strictly
            load_path, client = self.engine.load_checkpoint(load_dir, tag=tag, load_module_strict=self.run.lora is None)
        except (RuntimeError, OSError, EOFError, KeyError, ValueError) as exc:
            lora = resume_problem(self.run.lora, Path(load_dir) / tag)  # LoRA vs full fine-tuning, named
            raise UsageError(f"--resume {path}: " + (lora or f"DeepSpeed could not load checkpoint {tag} "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")) from None
        if load_path is None:
            raise UsageError(f"--resume {path}: DeepSpeed could not load a checkpoint from it")
        state = (client or {}).get(CLIENT_STATE_KEY)
        if state is None:
            raise UsageError(f"--resume {path}: the checkpoint {load_path} was not written by ds_adaptive "
                             f"(client_state has no '{CLIENT_STATE_KEY}')")
        lora = resume_problem(self.run.lora, Path(load_dir) / tag, state)
        if lora is not None:
            raise UsageError(f"--resume {path}: {lora}")
        self.run.sampler.load_state_dict(state["sampler"])
        if self.sparse is not None:
            self.sparse.load(client, model=self.run.model, layout=self.layout)
        self.global_step, self.epoch, self.step_in_epoch = state["global_step"], state["epoch"], state["step_in_epoch"]
        self.nonfinite_steps = list(state.get("nonfinite_steps", []))
        self.last_saved_step = self.global_step
        self._batches = None
        self.log(f"resumed from {load_path}: step {self.global_step} (epoch {self.epoch}, step {self.step_in_epoch} "
                 "of the epoch)")
        self._continue_run(Path(load_dir), tag)

    def _check_shared(self, tag_dir: Path, need_marker: bool = True) -> Optional[str]:
        """:func:`check_checkpoint` with the reading shared by the ranks (rank r reads files r, r + world, ...;
        a collective): the first problem any rank found, on every rank."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return check_checkpoint(tag_dir, need_marker=need_marker)
        mine = check_checkpoint(tag_dir, need_marker=need_marker, part=(dist.get_rank(), dist.get_world_size()))
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
        return next((p for p in found if p is not None), None)

    def _continue_run(self, load_dir: Path, tag: str) -> None:
        """After a resume: keep the run id of a checkpoint loaded from --save (its retention goes on), and say
        when the loaded checkpoint is not marked good (non-finite steps before it), naming the last good one."""
        marker = read_marker(load_dir / tag) or {}
        if self.opts.save and Path(self.opts.save).resolve() == load_dir.resolve() and marker.get("run_id"):
            self.run_id = marker["run_id"]
        if not marker.get("good", True):
            good = last_good(load_dir, marker.get("run_id"))
            self.log(f"ds_adaptive: note: {tag} was saved after non-finite step(s) {marker.get('nonfinite_steps')} "
                     "(their updates were skipped); the last checkpoint whose steps were all finite is "
                     + (f"{good}: --resume {load_dir / good} goes back to it" if good else "none"))

    # ------------------------------------------------------------------ non-finite steps
    def _check_finite(self, rec, applied: bool) -> None:
        """After the optimizer step: a non-finite loss (any rank: ``rec.loss`` is global) or gradient
        norm is counted. DeepSpeed's ZeRO optimizers skip the update themselves when the global
        gradient norm is inf/NaN (zeroed gradients, no LR-scheduler step, ``engine.skipped_steps``);
        ``engine.was_step_applied()`` says whether it did. A non-finite step that was applied anyway
        (an optimizer without that check) has corrupted the weights: the run stops."""
        fp16 = bool((self.run.ds_config.get("fp16") or {}).get("enabled"))
        bad = not math.isfinite(rec.loss) or (not applied and not fp16)  # fp16: overflow skips are loss scaling
        if not bad:
            return
        self.nonfinite_steps.append(rec.step)
        what = f"loss {rec.loss}" if not math.isfinite(rec.loss) else "gradient norm not finite"
        if applied:
            raise NonFiniteError(f"step {rec.step}: {what}, and the optimizer applied the update (this ds_config's "
                                 "optimizer does not skip non-finite steps; use ZeRO stage 3, or set "
                                 "'bf16': {'check_grad_overflow': true} with stage 1/2): the weights are no longer "
                                 "finite; resume from the last checkpoint")
        self.log(f"ds_adaptive: step {rec.step}: {what}: update skipped ({len(self.nonfinite_steps)} non-finite "
                 f"step(s) so far)")
        if self.opts.nonfinite == "stop":
            raise NonFiniteError(f"step {rec.step}: {what} (--nonfinite stop); the update was not applied; resume "
                                 "from the last checkpoint or use --nonfinite skip")
        if len(self.nonfinite_steps) > self.opts.nonfinite_limit:
            raise NonFiniteError(f"{len(self.nonfinite_steps)} non-finite steps (steps {self.nonfinite_steps[-5:]} "
                                 f"the last), more than --nonfinite-limit {self.opts.nonfinite_limit}: the run "
                                 "diverged; lower the learning rate or check the data")

    # ------------------------------------------------------------------ evaluation and the loop
    def evaluate(self, num_samples: int) -> dict:
        """Held-out loss on ``num_samples`` synthetic samples of the run's shape mix (seed + EVAL_SEED_OFFSET)."""
        seed = self.opts.seed + EVAL_SEED_OFFSET
        run = self.run
        held_out = build_dataset("synthetic", num_samples=num_samples, seed=seed, spec=run.preset.input_spec,
                                 shapes=run.cfg.adaptive_load.sampler.shapes or run.preset.shapes)
        t0 = time.perf_counter()
        loss = evaluate(self.engine, held_out, layout=self.layout, seed=seed, shift=self.opts.shift,
                        dtype=run.dtype, device=run.device, text_len=run.text_len, objective=run.objective)
        return {"eval_loss": loss, "eval": {"samples": num_samples, "timesteps": EVAL_TIMESTEPS, "seed": seed,
                                            "s": time.perf_counter() - t0}}

    def close(self) -> None:
        """Close the logs, restore the signal handlers and free the engine (:func:`release_engine`): what a
        process that builds another run after this one calls (``fit`` ends the process's own run without it).
        The trainer is unusable after."""
        self.metrics.close()
        self.memory_log.close()
        self.stop.uninstall()
        self._batches = None
        engine, self.engine = self.engine, None
        if engine is not None:
            release_engine(engine)

    def fit(self) -> dict:
        """Train until ``trainer.steps``, saving every ``save_every`` steps and at the end; then the
        held-out loss (``eval_samples``). On SIGTERM/SIGINT/SIGHUP every rank stops after the same
        step, saves (with ``--save``) and the summary's ``stopped`` says so (the CLI exits
        ``EXIT_PREEMPTED``). Returns the summary (identical on every rank)."""
        o = self.opts
        progress = _Progress(self.is_main, o.steps, self.global_step, self.run.cfg.adaptive_load.metrics.interval)
        last_saved = self.global_step
        stopped = None
        try:
            while self.global_step < o.steps:
                if self.stop.agreed(self.run.device):
                    stopped = {"signal": self.stop.signal_name, "step": self.global_step}
                    break
                rec = self.train_step()
                progress.update(rec, o.steps)
                if self.preview is not None:  # every rank: ZeRO-3 gathers parameters collectively
                    self.preview.after_step(self.global_step, last=self.global_step == o.steps)
                if o.save and o.save_every and self.global_step % o.save_every == 0:
                    self.save()
                    last_saved = self.global_step
            self._batches = None
            if o.save and last_saved != self.global_step:
                self.save()
        finally:
            progress.close()
            self.metrics.close()
            self.memory_log.close()
        summary = self.metrics.summary()
        summary["final_step"] = self.global_step
        summary["memory_prediction"] = self.memory_log.summary()
        compute = self.memory_log.compute_summary(self.metrics.history, int(summary.get("warmup_steps", 1)))
        if compute is not None:
            summary["compute_prediction"] = compute
        summary["nonfinite_steps"] = list(self.nonfinite_steps)
        if self.fusion is not None:
            summary["block_fusion"] = self.fusion.summary()
        summary.update(ln_modulate_summary(self.run.cfg.adaptive_load.fused_ln_modulate))
        if self.sparse is not None:
            self.sparse.finish(summary)
        if self.run.lora is not None:
            summary["lora"] = {k: v for k, v in self.run.lora.client_state().items() if k not in ("base", "modules")}
        if self.preview is not None:
            summary["preview"] = self.preview.summary()
        if stopped is not None:
            stopped["checkpoint"] = str(Path(o.save) / tag_for(self.global_step)) if o.save else None
            stopped["exit_code"] = EXIT_PREEMPTED
            summary["stopped"] = stopped
            self.log(f"ds_adaptive: {stopped['signal']}: stopped after step {self.global_step} of {o.steps}; "
                     + (f"checkpoint {stopped['checkpoint']}; continue with --resume {o.save}" if o.save else
                        "no --save directory was given, so nothing was saved: the progress of this run is lost")
                     + f" (exit {EXIT_PREEMPTED})")
        elif o.eval_samples:
            summary.update(self.evaluate(o.eval_samples))
        if self.is_main:
            path = self.metrics.write_summary(summary)
            print(format_summary(summary))
            print(f"summary written to {path}", flush=True)
        return summary


class MemoryLog:
    """Predicted vs measured peak memory and compute per micro-batch (writer rank), in the log dir:

    - ``memory.jsonl`` (on a GPU), one line per micro-step, written when it ends: shape, B, checkpointed blocks,
      predicted static + activation memory (the plan's memory model, ``ds_adaptive.planning.memory``) and the
      measured allocated peak of that micro-step; with the calibrated cost model also the plan's predicted compute
      time (``predicted_ms``), which :meth:`compute_summary` holds against the step records' compute windows;
    - ``compute.jsonl``, one line per micro-step, written when its step ends (its window is read then): shape, B,
      checkpointed blocks, this rank's compute window (``compute_ms``) and the step's wall time (``step_wall_ms``),
      with ``predicted_ms`` as above. Every step, not every ``metrics.interval``-th: ``ds-adaptive refit`` and
      ``bench/training/micro_batch_mfu.py`` read it."""

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


def _worker_message(msg: str) -> str:
    """The original message of an exception re-raised by a DataLoader worker ("Caught X in DataLoader
    worker process N. Original Traceback ...: X: <message>")."""
    if "Original Traceback" not in msg:
        return msg
    last = msg.rstrip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


def _collate_unpadded(samples: list) -> dict:
    return collate_latents(samples, pad_text_to=None)


def _checkpoint_location(path: str) -> tuple[str, Optional[str]]:
    """``--resume DIR`` (the --save directory: its 'latest' checkpoint) or ``DIR/global_stepN`` (that one)."""
    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"--resume {path}: no such directory; pass the directory given to --save, or one of its "
                         "global_stepN subdirectories")
    if (p / "latest").is_file() or any(step_of(c.name) is not None for c in p.iterdir() if c.is_dir()):
        return str(p), None
    if any(p.glob("*model_states.pt")):
        return str(p.parent), p.name
    raise UsageError(f"--resume {path}: no DeepSpeed checkpoint there (neither a 'latest' file, a global_stepN "
                     "directory nor *model_states.pt); pass the directory given to --save, or one of its "
                     "global_stepN subdirectories")


class _Progress:
    """tqdm on an interactive rank 0; plain log lines every ``interval`` steps otherwise."""

    def __init__(self, enabled: bool, total: int, initial: int, interval: int) -> None:
        self.enabled, self.interval, self.bar, self.first = enabled, interval, None, True
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def update(self, rec, total: int) -> None:
        if not self.enabled:
            return
        msg = (f"loss {rec.loss:.4f}  {rec.tokens_per_s:,.0f} tok/s  {rec.samples} samples  "
               f"CV_step {100 * rec.cv_step:.1f}%  peak {max(rec.peak_mem_gib):.2f} GiB")
        if self.bar is not None:
            self.bar.set_postfix_str(msg, refresh=False)
            self.bar.update(1)
        elif rec.step % self.interval == 0 or rec.step == total or self.first:
            print(f"step {rec.step}/{total}  {msg}  ({rec.wall_s:.2f} s)", flush=True)
        self.first = False

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

