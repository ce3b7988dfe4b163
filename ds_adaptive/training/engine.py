"""The DeepSpeed engine of a run and what the training loop asks of it.

    rank, world, device = init_distributed(local_rank)      # the process group (NCCL on GPU, gloo on CPU)
    engine, stack_base = start_engine(run)                   # deepspeed.initialize + the engine checks
    num, den = backward_micro_batch(engine, latents, ...)    # one micro-batch: forward + weighted backward
    trim_forward_stack(stack_base)                            # ZeRO-3's leftovers after a micro-batch
    lr = optimizer_step(engine, factor)                       # the boundary step with this step's LR factor
    release_engine(engine); shutdown_distributed(barrier=ok)

Unbiased gradients with variable batch sizes: see :func:`backward_micro_batch` and ``ds_adaptive.training.trainer``.
"""
from __future__ import annotations

import os

import torch

from ds_adaptive.core.layout import Layout
from ds_adaptive.core.ports import free_port
from ds_adaptive.models.objective import flow_matching_losses
from ds_adaptive.training.run_config import UsageError

__all__ = ["init_distributed", "shutdown_distributed", "start_engine", "release_engine", "forward_stack",
           "trim_forward_stack", "backward_micro_batch", "optimizer_step", "check_accumulation"]


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
    engine of the process stayed alive (the third arm of bench/sparse_train_ab.py on an H200 ran ~10 GiB over
    its predicted memory: the two earlier arms' Wan 1.3B x 8 blocks, ~5.9 GiB each, and OOMed).
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


# --- one micro-batch -------------------------------------------------------------------------

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


# --- the engine --------------------------------------------------------------------------------

def start_engine(run) -> tuple:
    """``deepspeed.initialize`` of ``run``'s model with ``run.ds_config`` (trainable parameters only), then the
    checks that the engine is the one the plan assumes: DeepSpeed reduces over all dp*sp ranks
    (``Layout.check_engine``) and runs the sampler's micro-steps per optimizer step (:func:`check_accumulation`).
    Returns ``(engine, forward-stack base)``: the stack's length after set-up, what :func:`trim_forward_stack`
    keeps."""
    import deepspeed

    model = run.model
    engine, _, _, _ = deepspeed.initialize(model=model, config=run.ds_config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    run.layout.check_engine(engine)  # DeepSpeed must reduce over all dp*sp ranks (else a clear error)
    stack = forward_stack()
    base = len(stack) if stack is not None else 0
    check_accumulation(engine, run.plan)
    return engine, base


def optimizer_step(engine, factor: float) -> float:
    """The engine's boundary step with the LR scaled by ``factor`` for this step only (the
    scheduler, if any, sets the next step's LR itself); returns the LR the step used."""
    groups = engine.optimizer.param_groups
    base = [g["lr"] for g in groups]
    if factor != 1.0:
        for g in groups:
            g["lr"] *= factor
    lr = groups[0]["lr"]
    engine.step()
    if factor != 1.0 and engine.lr_scheduler is None:
        for g, b in zip(groups, base):
            g["lr"] = b
    return lr


def check_accumulation(engine, plan) -> None:
    """DeepSpeed's gradient_accumulation_steps must be the sampler's micro-steps per optimizer step (``plan.gas``,
    the run's :class:`ds_adaptive.core.run_plan.RunPlan`): the engine divides the loss by it and steps the
    optimizer at its boundary, the plan's loss weights and batches assume the sampler's count. Raises
    :class:`UsageError` naming both values."""
    ds_gas = int(engine.gradient_accumulation_steps())
    if ds_gas != plan.gas:
        raise UsageError(
            f"DeepSpeed runs gradient_accumulation_steps {ds_gas} but the batch sampler planned "
            f"{plan.gas} micro-steps per optimizer step; build the engine from Run.ds_config "
            "(build_run writes the sampler's count there for \"gradient_accumulation_steps\": \"auto\"), or set "
            f"gradient_accumulation_steps to {plan.gas} in the ds_config")
