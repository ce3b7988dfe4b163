"""Train Wan 2.1 with DeepSpeed (ZeRO-3) on mixed image + video latents, batched by AdaptiveLoad.

    deepspeed launch/train_wan.py --deepspeed_config launch/configs/zero3_adaptive.json --model wan2.1-1.3b
    bash launch/train_wan.sh                      # the embedded default on this machine

Objective (Wan 2.1 / rectified flow): for a clean latent x0 and noise eps,
``x_t = (1 - sigma) x0 + sigma eps``, target ``eps - x0``, ``sigma = shift*u / (1 + (shift-1)*u)``
with ``u ~ U(0, 1)``, timestep ``1000 * sigma``. Every sample's (u, eps) is drawn from its own
generator seeded by (seed, epoch, sample index), so a sample's loss does not depend on which
rank or micro-batch it lands in, and a resumed run draws what the straight run would have.

Unbiased gradients with variable batch sizes: DeepSpeed averages gradients over the DP ranks
and divides the loss by gradient_accumulation_steps (gas). With the sampler's global count
W (samples, or tokens with ``loss_weighting: tokens``) of the optimizer step, each micro-step
backpropagates ``sum_i w_i * loss_i * dp * gas / W``, so that the step's gradient is the
gradient of ``sum_i w_i * loss_i / W`` over all samples of all ranks: what one process would
compute on the same samples.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from .config import (AdaptiveLoadConfig, ConfigError, load_adaptive_config, prepare_ds_config,
                     read_ds_config, require_block)
from .data import DataError, build_dataset, collate_latents
from .metrics import StepMetrics, format_summary
from .models.flops import wan_train_flops
from .shapes import MAX_TEXT_LEN, ShapeError

CLIENT_STATE_KEY = "ds_adaptive"
EVAL_SEED_OFFSET = 1_000_003   # held-out samples: the synthetic dataset with seed + this offset
EVAL_TIMESTEPS = 4             # u = (k + 0.5) / EVAL_TIMESTEPS, k = 0..EVAL_TIMESTEPS-1


class UsageError(ValueError):
    """A command-line flag combination the trainer cannot run."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-adaptive train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")
    p.add_argument("--deepspeed_config", "--deepspeed-config", required=True,
                   help="DeepSpeed json with the 'adaptive_load' block (see launch/configs/)")
    p.add_argument("--deepspeed", action="store_true", help="accepted for DeepSpeed launcher compatibility")
    from .models.wan import WAN_CONFIGS

    p.add_argument("--model", default="tiny", choices=sorted(WAN_CONFIGS), help="Wan preset (default: %(default)s)")
    p.add_argument("--layers", type=int, default=None, help="override the number of transformer blocks")
    p.add_argument("--steps", type=int, default=20, help="train until this global optimizer step")
    p.add_argument("--data", default="synthetic",
                   help="'synthetic' (the embedded default) or a directory written by 'ds-adaptive synth'")
    p.add_argument("--num-samples", type=int, default=None, help="size of the synthetic dataset (default 10000)")
    p.add_argument("--shapes", default=None,
                   help="shape-distribution json of the synthetic data (default: adaptive_load.sampler.shapes, "
                        "else the shipped mixed Wan set)")
    p.add_argument("--shift", type=float, default=5.0, help="timestep shift of the flow-matching sampler (Wan: 5)")
    p.add_argument("--seed", type=int, default=0, help="model init, data and noise seed")
    p.add_argument("--sp", type=int, default=None,
                   help="Ulysses sequence-parallel degree (default: the ds_config's sequence_parallel_size, else 1)")
    p.add_argument("--fused-ln-modulate", action=argparse.BooleanOptionalAction, default=None,
                   help="override adaptive_load.fused_ln_modulate")
    p.add_argument("--grad-ckpt", nargs="?", const="all", default=None, choices=["auto", "all", "none"],
                   help="activation checkpointing: 'auto' (per micro-batch the fewest blocks that fit the memory "
                        "budget, from the plan), 'all' (every block; the value of a bare --grad-ckpt) or 'none'; "
                        "default: adaptive_load.sampler.checkpointing (auto)")
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader workers per rank (default: 2 on GPU, 0 on CPU)")
    p.add_argument("--log-dir", default=None, help="override adaptive_load.metrics.log_dir")
    p.add_argument("--compute-timing", action=argparse.BooleanOptionalAction, default=True,
                   help="time each rank's compute without ZeRO's waits for other ranks (CV_step; default on); "
                        "--no-compute-timing: wall-clock time only")
    p.add_argument("--eval-samples", type=int, default=0,
                   help="after training, the flow-matching loss on this many held-out synthetic samples at "
                        f"{EVAL_TIMESTEPS} fixed timesteps with fixed noise (summary 'eval_loss'; default 0: off)")
    p.add_argument("--save", default=None, help="checkpoint directory")
    p.add_argument("--save-interval", type=int, default=0,
                   help="save every N steps (0: only at the end, when --save is given)")
    p.add_argument("--resume", default=None,
                   help="resume from the latest checkpoint of this --save directory, or from DIR/global_stepN")
    return p


# --- distributed setup -----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(local_rank: int) -> tuple[int, int, torch.device]:
    """Initialise torch.distributed via DeepSpeed (NCCL on GPU, gloo on CPU); a plain
    ``python -m ds_adaptive.train`` becomes a world of one."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
    acc = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", local_rank))
    if acc.device_name() == "cuda":
        acc.set_device(local_rank)
    deepspeed.init_distributed(dist_backend=acc.communication_backend_name(), verbose=False)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device(acc.device_name(local_rank)) if acc.device_name() == "cuda" else torch.device("cpu")
    return rank, world, device


# --- objective -------------------------------------------------------------------------------

def sample_seed(seed: int, epoch: int, index: int) -> int:
    """63-bit seed of one sample's (u, eps) draw."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def flow_matching_losses(model, latents: torch.Tensor, context: torch.Tensor, indices: torch.Tensor, *,
                         epoch: int, seed: int, shift: float, dtype: torch.dtype,
                         sharded: bool = False) -> torch.Tensor:
    """Per-sample flow-matching MSE ``[B]`` (fp32) of ``model`` on clean latents ``[B,16,T',H',W']``;
    ``sharded`` (a model under ``apply_ulysses``): this rank's part of it, summing to it over the SP group."""
    x0 = latents.float()
    b = x0.shape[0]
    u = torch.empty(b, device=x0.device)
    eps = torch.empty_like(x0)
    for row, idx in enumerate(indices.tolist()):
        g = torch.Generator(device=x0.device)
        g.manual_seed(sample_seed(seed, epoch, idx))
        u[row] = torch.rand((), generator=g, device=x0.device)
        eps[row] = torch.randn(x0.shape[1:], generator=g, device=x0.device)
    sigma = shift * u / (1 + (shift - 1) * u)
    s = sigma.view(b, 1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * eps
    if sharded:
        return model(x_t.to(dtype), sigma * 1000.0, context.to(dtype), target=eps - x0)
    pred = model(x_t.to(dtype), sigma * 1000.0, context.to(dtype))
    return (pred.float() - (eps - x0)).pow(2).flatten(1).mean(1)


def backward_micro_batch(engine, latents: torch.Tensor, context: torch.Tensor, indices: torch.Tensor, totals, *,
                         tokens_per_sample: int, dp_size: int, by: str, epoch: int, seed: int, shift: float,
                         dtype: torch.dtype, sp=None) -> tuple[float, float]:
    """Forward and weighted backward of one micro-batch (all samples of one shape).

    The mean per-sample loss is scaled by ``totals.loss_weight`` (local share of the optimizer
    step's global samples or tokens x dp_size x micro-steps), which undoes DeepSpeed's DP mean and
    its 1/gradient_accumulation_steps, so that the step's gradient is the weighted mean over every
    sample of the step. Returns ``(sum_i w_i * loss_i, sum_i w_i)`` of this micro-batch (detached),
    with ``w_i`` 1 (samples) or the sample's tokens.
    """
    sharded = sp is not None and sp.enabled
    per_sample = flow_matching_losses(engine, latents, context, indices, epoch=epoch, seed=seed, shift=shift,
                                      dtype=dtype, sharded=sharded)
    b = per_sample.shape[0]
    weight = totals.loss_weight(b, b * tokens_per_sample, dp_size, by)
    if sharded:  # x sp: DeepSpeed averages gradients over all dp*sp ranks (docs/ULYSSES.md)
        weight *= sp.loss_scale
    engine.backward(per_sample.mean() * weight)
    w = float(tokens_per_sample) if by == "tokens" else 1.0
    if sharded:  # the SP ranks' partial losses sum to the per-sample losses
        per_sample = sp.group_sum(per_sample)
    return float(per_sample.detach().sum()) * w, b * w


@torch.no_grad()
def evaluate(engine, dataset, *, dp_rank: int, dp_size: int, seed: int, shift: float, dtype: torch.dtype,
             device: torch.device) -> float:
    """Mean flow-matching loss over every sample of ``dataset`` (held out from training), each at
    ``EVAL_TIMESTEPS`` fixed u with noise seeded by (seed, k, index): a pure function of the
    weights, comparable across runs. Sample j goes to DP rank j % dp_size; every rank runs the same
    number of forwards (ZeRO-3 gathers parameters collectively), padding with weight-0 repeats."""
    n = len(dataset)
    mine = list(range(dp_rank, n, dp_size))
    per_rank = -(-n // dp_size)
    k = EVAL_TIMESTEPS
    u = (torch.arange(k, dtype=torch.float32, device=device) + 0.5) / k
    sigma = shift * u / (1 + (shift - 1) * u)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    was_training = engine.training
    engine.eval()
    try:
        for j in range(per_rank):
            idx = mine[j] if j < len(mine) else mine[-1] if mine else 0
            sample = dataset[idx]
            x0 = sample["latents"].to(device).float().unsqueeze(0).expand(k, *sample["latents"].shape)
            eps = torch.empty_like(x0)
            for row in range(k):
                g = torch.Generator(device=device)
                g.manual_seed(sample_seed(seed, row, idx))
                eps[row] = torch.randn(x0.shape[1:], generator=g, device=device)
            ctx = sample["context"].to(device)
            ctx = F.pad(ctx, (0, 0, 0, MAX_TEXT_LEN - ctx.shape[0])).unsqueeze(0).expand(k, -1, -1)
            s = sigma.view(k, 1, 1, 1, 1)
            pred = engine(((1 - s) * x0 + s * eps).to(dtype), sigma * 1000.0, ctx.to(dtype))
            loss = (pred.float() - (eps - x0)).pow(2).mean()
            weight = 1.0 if j < len(mine) else 0.0
            total += torch.stack([loss.double() * weight, torch.tensor(weight, dtype=torch.float64, device=device)])
    finally:
        engine.train(was_training)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(total)
    return float(total[0] / total[1])


# --- helpers ---------------------------------------------------------------------------------

def _resolve_relative(path: Optional[str], config_path: str) -> Optional[str]:
    """A relative path from the ds_config is tried next to the config first, then from the CWD."""
    if path is None or os.path.isabs(path):
        return path
    beside = Path(config_path).parent / path
    return str(beside) if beside.exists() else path


def _validate_sp(sp: int, model: str, world: int) -> None:
    """Check ``--sp`` against the model and the world size, before any process group exists."""
    from .models.wan import get_wan_config

    if sp is None:
        return
    if sp < 1:
        raise UsageError(f"--sp must be >= 1, got {sp}")
    heads = get_wan_config(model).num_heads
    if heads % sp:
        raise UsageError(f"--sp {sp} must divide the attention heads of {model} ({heads}): Ulysses gives each "
                         "rank of a group heads/sp heads")
    if world % sp:
        raise UsageError(f"--sp {sp} must divide the number of ranks ({world})")


def _build_model(args, cfg: AdaptiveLoadConfig, ds_cfg: dict):
    import deepspeed

    from .models.wan import WanModel, get_wan_config

    overrides = {"num_layers": args.layers} if args.layers else {}
    wcfg = get_wan_config(args.model, **overrides)
    torch.manual_seed(args.seed)  # same init on every rank (ZeRO-3 partitions what each rank builds)
    stage = int((ds_cfg.get("zero_optimization") or {}).get("stage", 0))
    with deepspeed.zero.Init(config_dict_or_path=ds_cfg, enabled=stage == 3):
        model = WanModel(wcfg)
    # 'all' / 'none' fixed; 'auto': the trainer sets model.set_checkpoint_blocks(n) per micro-batch
    model.gradient_checkpointing = args.grad_ckpt == "all"
    # Explicit both ways: the fused op only when asked for (loaded / JIT-built now, not inside
    # the first step), the torch reference otherwise.
    from ds_adaptive.patches.deepspeed import enable_from_ds_config

    model.set_ln_modulate(enable_from_ds_config({"adaptive_load": {"fused_ln_modulate": cfg.fused_ln_modulate}}))
    return model, wcfg


def _ensure_optimizer(ds_cfg: dict, rank: int) -> dict:
    if "optimizer" not in ds_cfg:
        ds_cfg = dict(ds_cfg)
        ds_cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}}
        if rank == 0:
            print("ds_adaptive.train: the ds_config has no 'optimizer'; using AdamW(lr=1e-4) "
                  "(add an 'optimizer' section to choose)")
    return ds_cfg


def _collate_unpadded(samples: list) -> dict:
    return collate_latents(samples, pad_text_to=None)


def _checkpoint_location(path: str) -> tuple[str, Optional[str]]:
    """``--resume DIR`` (the --save directory: its 'latest' checkpoint) or ``DIR/global_stepN`` (that one)."""
    p = Path(path)
    if (p / "latest").is_file():
        return str(p), None
    if p.is_dir() and any(p.glob("*model_states.pt")):
        return str(p.parent), p.name
    raise UsageError(f"--resume {path}: no DeepSpeed checkpoint there (neither a 'latest' file nor *model_states.pt); "
                     "pass the directory given to --save, or one of its global_stepN subdirectories")


def _checkpoint_state(sampler, global_step: int, epoch: int, step_in_epoch: int, args, world: int) -> dict:
    return {CLIENT_STATE_KEY: {
        "global_step": global_step, "epoch": epoch, "step_in_epoch": step_in_epoch,
        "sampler": sampler.state_dict(step_in_epoch), "seed": args.seed, "model": args.model,
        "layers": args.layers, "data": args.data, "world_size": world,
    }}


class _MemoryLog:
    """Predicted vs measured peak memory per micro-batch (writer rank on GPU): ``memory.jsonl`` in the log
    dir, one line per micro-step: shape, B, checkpointed blocks, predicted static + activation memory
    (the plan's memory model) and the measured allocated peak of that micro-step."""

    def __init__(self, sampler, zero_stage: int, shard_ranks: int, log_dir: str, enabled: bool) -> None:
        self.cost = sampler.cost
        self.static = self.cost.profile.static_memory_gib(zero_stage, shard_ranks)
        self.errors: list[float] = []
        self.file = None
        if enabled:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(log_dir) / "memory.jsonl", "a")

    def record(self, step: int, micro: int, shape, batch: int, ckpt: int, measured_gib: float,
               reserved_gib: float = 0.0) -> None:
        if self.file is None:
            return
        act = float(self.cost.ckpt_memory(shape, batch, ckpt))
        pred = self.static + act
        self.errors.append((pred - measured_gib) / measured_gib if measured_gib > 0 else 0.0)
        self.file.write(json.dumps({"step": step, "micro": micro, "shape": str(shape), "tokens": int(shape.tokens),
                                    "B": batch, "ckpt_blocks": ckpt, "static_gib": self.static, "act_gib": act,
                                    "predicted_gib": pred, "measured_gib": measured_gib,
                                    "reserved_gib": reserved_gib}) + "\n")
        self.file.flush()

    def summary(self) -> dict:
        e = self.errors
        return {"micro_steps": len(e), "max_abs_rel_err": max((abs(x) for x in e), default=0.0),
                "mean_rel_err": sum(e) / len(e) if e else 0.0}

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


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


# --- the trainer -----------------------------------------------------------------------------

def train(args: argparse.Namespace) -> dict:
    """Run the training job; returns the summary (identical on every rank)."""
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if args.save_interval < 0:
        raise UsageError(f"--save-interval must be >= 0, got {args.save_interval}")
    _validate_sp(args.sp, args.model, int(os.environ.get("WORLD_SIZE", "1")))
    if args.data != "synthetic" and (args.shapes or args.num_samples is not None):
        raise UsageError(f"--shapes and --num-samples describe the synthetic dataset; --data {args.data} "
                         "reads its samples and shapes from its index.json")
    # under SP the engine returns the gathered output: every rank of a group scores its DP rank's samples
    if args.eval_samples < 0 or (args.eval_samples and args.data != "synthetic"):
        raise UsageError(f"--eval-samples {args.eval_samples}: held-out evaluation needs a count >= 0 and "
                         "--data synthetic (the held-out set is drawn from its shape mix)")
    cfg = load_adaptive_config(args.deepspeed_config)
    require_block(args.deepspeed_config, [f"--{'' if args.fused_ln_modulate else 'no-'}fused-ln-modulate"]
                  if args.fused_ln_modulate is not None else [])
    if args.fused_ln_modulate is not None:
        cfg.fused_ln_modulate = args.fused_ln_modulate
    args.grad_ckpt = args.grad_ckpt or cfg.sampler.checkpointing
    raw = read_ds_config(args.deepspeed_config)
    from .balance.memory import configure_allocator

    alloc_msg = configure_allocator()   # before the first CUDA allocation
    if os.environ.get("RANK", "0") == "0":
        print(alloc_msg, flush=True)

    rank, world, device = init_distributed(args.local_rank)
    # DeepSpeed 0.19 still calls torch.distributed's renamed collectives (one FutureWarning per call
    # site and rank); and one copy of our own warnings is enough.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    if rank != 0:
        warnings.filterwarnings("ignore", category=UserWarning, module=r"ds_adaptive")
    from .models.wan import get_wan_config
    from .parallel import apply_ulysses, init_sequence_parallel, strip_mesh_keys

    sp = init_sequence_parallel(args.sp, ds_config=raw, num_heads=get_wan_config(args.model).num_heads)
    args.sp, dp_size = sp.sp_size, sp.dp_size
    on_gpu = device.type == "cuda"
    # no DeepSpeed (dp, sp) mesh: DeepSpeed 0.19.8's mesh breaks ZeRO-3 checkpoints (docs/ULYSSES.md)
    ds_cfg = _ensure_optimizer(prepare_ds_config(strip_mesh_keys(raw), dp_size=dp_size, on_gpu=on_gpu), rank)
    gas = ds_cfg["gradient_accumulation_steps"]
    dtype = torch.bfloat16 if ds_cfg["bf16"]["enabled"] else (
        torch.float16 if (ds_cfg.get("fp16") or {}).get("enabled") else torch.float32)

    if args.data == "synthetic":
        shapes = args.shapes or _resolve_relative(cfg.sampler.shapes, args.deepspeed_config)
        dataset = build_dataset("synthetic", num_samples=args.num_samples or 10000, shapes=shapes, seed=args.seed)
    else:
        if cfg.sampler.shapes and rank == 0:
            print(f"ds_adaptive.train: note: adaptive_load.sampler.shapes ({cfg.sampler.shapes}) describes the "
                  f"synthetic dataset; --data {args.data} takes its shapes from its index.json", flush=True)
        dataset = build_dataset(args.data)
    model, wcfg = _build_model(args, cfg, ds_cfg)
    if sp.enabled:
        apply_ulysses(model, sp)  # sequence sharding + DistributedAttention; forward(..., target=) -> shard loss

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from .balance.cost import ProfileDepthError
    from .balance.sampler import build_batch_sampler

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad], config=ds_cfg)
    sp.check_engine(engine)  # DeepSpeed must reduce over all dp*sp ranks (else a clear error)
    topology = sp.topology
    gpu_mem_gib = get_accelerator().total_memory(device.index or 0) / 2**30 if on_gpu else None
    sample_shapes = dataset.sample_shapes()
    zero_stage = int((ds_cfg.get("zero_optimization") or {}).get("stage", 0))
    if "zero_stage" in cfg.sampler.model_fields_set and cfg.sampler.zero_stage != zero_stage:
        raise ConfigError(f"adaptive_load.sampler.zero_stage is {cfg.sampler.zero_stage} but the ds_config's "
                          f"zero_optimization.stage is {zero_stage}; the trainer plans memory for the stage it "
                          "runs: drop sampler.zero_stage (it is for `ds-adaptive simulate`) or make them agree")
    build = dict(enabled=cfg.enabled, gpu_mem_gib=gpu_mem_gib, model_name=args.model, zero_stage=zero_stage,
                 checkpointing=args.grad_ckpt, profile_log=(lambda m: print(f"ds_adaptive.train: {m}", flush=True))
                 if rank == 0 else None)
    try:  # --layers: plan with the profile rescaled to the trained depth (costs, activations, static memory)
        sampler = build_batch_sampler(cfg.sampler, sample_shapes, topology, micro_steps_per_step=gas,
                                      num_layers=args.layers, **build)
    except ProfileDepthError as exc:
        if rank == 0:
            print(f"ds_adaptive.train: warning: {exc}; planning with the profile's full-depth costs and memory "
                  "(conservative: smaller micro-batches than --layers needs)", flush=True)
        sampler = build_batch_sampler(cfg.sampler, sample_shapes, topology, micro_steps_per_step=gas, **build)
    prof = sampler.cost.profile
    if prof.rescaled_from_layers is not None and rank == 0:
        print(f"ds_adaptive.train: profile '{cfg.sampler.profile}' describes {prof.rescaled_from_layers} blocks; "
              f"rescaled to --layers {prof.num_layers} for planning (Profile.with_num_layers: block compute and "
              f"activation terms x {prof.num_layers}/{prof.rescaled_from_layers}, embed/head kept, static memory "
              f"of {prof.params / 1e9:.3f}B params)", flush=True)
    mem_log = _MemoryLog(sampler, zero_stage, dp_size * args.sp, args.log_dir or cfg.metrics.log_dir,
                         rank == 0 and on_gpu)
    if sampler.micro_steps_per_step != gas:
        raise RuntimeError(f"the batch sampler plans {sampler.micro_steps_per_step} micro-steps per step, "
                           f"DeepSpeed runs {gas}")

    global_step, epoch, step_in_epoch = 0, 0, 0
    if args.resume:
        load_dir, tag = _checkpoint_location(args.resume)
        load_path, client = engine.load_checkpoint(load_dir, tag=tag)
        if load_path is None:
            raise UsageError(f"--resume {args.resume}: DeepSpeed could not load a checkpoint from it")
        state = (client or {}).get(CLIENT_STATE_KEY)
        if state is None:
            raise UsageError(f"--resume {args.resume}: the checkpoint {load_path} was not written by ds_adaptive "
                             f"(client_state has no '{CLIENT_STATE_KEY}')")
        sampler.load_state_dict(state["sampler"])
        global_step, epoch, step_in_epoch = state["global_step"], state["epoch"], state["step_in_epoch"]
        if rank == 0:
            print(f"resumed from {load_path}: step {global_step} (epoch {epoch}, step {step_in_epoch} of the epoch)")

    log_dir = args.log_dir or cfg.metrics.log_dir
    run_info = {
        "model": args.model, "layers": wcfg.num_layers, "world_size": world, "dp_size": dp_size, "sp": args.sp,
        "device": device.type, "dtype": str(dtype).replace("torch.", ""), "gradient_accumulation_steps": gas,
        "adaptive_load": cfg.enabled, "sampler": type(sampler).__name__, "sampler_mode":
            cfg.sampler.mode if cfg.enabled else "tokens", "fused_ln_modulate": cfg.fused_ln_modulate,
        "grad_ckpt": args.grad_ckpt, "profile": sampler.cost.profile.name,
        "checkpoint_source": sampler.cost.profile.checkpoint_source, "data": args.data, "dataset": dataset.describe(),
        "loss_weighting": cfg.sampler.loss_weighting, "plan": sampler.epoch_stats(),
    }
    if cfg.fused_ln_modulate:
        from .ops.ln_modulate import op_status

        run_info["ln_modulate_op"] = op_status()
    metrics = StepMetrics(cfg.metrics, micro_steps_per_step=gas, device=device, log_dir=log_dir,
                          is_writer=rank == 0, count_this_rank=topology.sp_rank == 0, run_info=run_info)
    if args.compute_timing:
        metrics.attach_engine(engine)
    if rank == 0:
        print(f"ds_adaptive: {args.model} ({wcfg.num_layers} blocks, dim {wcfg.dim}) on {world} {device.type} "
              f"rank(s), {run_info['dtype']}, gas {gas}; {dataset.describe()}; sampler {run_info['sampler']} "
              f"({sampler.steps_per_epoch} steps/epoch); logs in {log_dir}", flush=True)

    workers = args.workers if args.workers is not None else (2 if on_gpu else 0)
    weighting = cfg.sampler.loss_weighting
    progress = _Progress(rank == 0, args.steps, global_step, cfg.metrics.interval)
    last_saved = global_step
    opt_groups = engine.optimizer.param_groups
    try:
        while global_step < args.steps:
            sampler.set_epoch(epoch)  # a no-op for the epoch just resumed
            if sampler.steps_per_epoch < 1:
                raise DataError(f"the batch sampler planned no optimizer step for epoch {epoch} "
                                f"({len(dataset)} samples, {dp_size} DP ranks, gas {gas}); use more samples")
            # Contexts travel padded to the batch's longest prompt and are zero-padded to Wan's 512 on the
            # device: the model sees the same input, the host moves ~4x fewer bytes.
            loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=_collate_unpadded,
                                                 num_workers=workers, pin_memory=on_gpu)
            batches = iter(loader)
            while step_in_epoch < sampler.steps_per_epoch and global_step < args.steps:
                totals = sampler.step_totals(step_in_epoch)
                metrics.start_step()
                loss_num, loss_den = 0.0, 0.0
                factor = sampler.lr_scale(step_in_epoch)
                for micro in range(gas):
                    try:
                        batch = next(batches)
                    except StopIteration:
                        raise RuntimeError(f"the batch sampler ran out after {micro} micro-step(s) of step "
                                           f"{step_in_epoch} of epoch {epoch}, but reported "
                                           f"{sampler.steps_per_epoch} steps x {gas} micro-steps") from None
                    latents = batch["latents"].to(device, non_blocking=True)
                    context = batch["context"].to(device, non_blocking=True)
                    context = F.pad(context, (0, 0, 0, MAX_TEXT_LEN - context.shape[1]))
                    metrics.data_ready()
                    tokens = sample_shapes[int(batch["index"][0])].tokens
                    if args.grad_ckpt == "auto":   # the plan's count for this rank's batch (same on its SP group)
                        model.set_checkpoint_blocks(sampler.checkpoint_blocks(step_in_epoch, micro))
                    num, den = backward_micro_batch(engine, latents, context, batch["index"], totals,
                                                    tokens_per_sample=tokens, dp_size=dp_size, by=weighting,
                                                    epoch=epoch, seed=args.seed, shift=args.shift, dtype=dtype,
                                                    sp=sp)
                    metrics.backward_done()
                    b = latents.shape[0]
                    if micro == gas - 1:
                        base = [g["lr"] for g in opt_groups]
                        if factor != 1.0:
                            for g in opt_groups:
                                g["lr"] *= factor
                        step_lr = opt_groups[0]["lr"]
                    engine.step()
                    if micro == gas - 1 and factor != 1.0 and engine.lr_scheduler is None:
                        for g, lr in zip(opt_groups, base):
                            g["lr"] = lr
                    loss_num += num
                    loss_den += den
                    n_ckpt = model.checkpointed_blocks() if model.training else 0
                    flops = wan_train_flops(wcfg, tokens, b, n_ckpt)
                    metrics.end_micro(b, b * tokens, float(b * tokens ** 2), *flops)
                    mem_log.record(global_step + 1, micro, sample_shapes[int(batch["index"][0])], b, n_ckpt,
                                   metrics.last_micro_peak_gib, metrics.last_micro_reserved_gib)
                global_step += 1
                step_in_epoch += 1
                rec = metrics.end_step(global_step, loss_num, loss_den, step_lr,
                                       log=global_step == args.steps)
                if rec.samples != totals.samples:
                    raise RuntimeError(f"step {global_step}: the ranks processed {rec.samples} samples but the "
                                       f"sampler's step_totals said {totals.samples}; the plan is inconsistent")
                progress.update(rec, args.steps)
                if args.save and args.save_interval and global_step % args.save_interval == 0:
                    _save(engine, args, sampler, global_step, epoch, step_in_epoch, world)
                    last_saved = global_step
            del batches, loader
            if step_in_epoch >= sampler.steps_per_epoch:
                epoch += 1
                step_in_epoch = 0
        if args.save and last_saved != global_step:
            _save(engine, args, sampler, global_step, epoch, step_in_epoch, world)
    finally:
        progress.close()
        metrics.close()
        mem_log.close()

    summary = metrics.summary()
    summary["final_step"] = global_step
    summary["memory_prediction"] = mem_log.summary()
    summary.update(_ln_modulate_ran(cfg.fused_ln_modulate))
    if args.eval_samples:
        held_out = build_dataset("synthetic", num_samples=args.eval_samples, shapes=shapes,
                                 seed=args.seed + EVAL_SEED_OFFSET)
        t0 = time.perf_counter()
        summary["eval_loss"] = evaluate(engine, held_out, dp_rank=topology.dp_rank, dp_size=dp_size,
                                        seed=args.seed + EVAL_SEED_OFFSET, shift=args.shift, dtype=dtype, device=device)
        summary["eval"] = {"samples": args.eval_samples, "timesteps": EVAL_TIMESTEPS,
                           "seed": args.seed + EVAL_SEED_OFFSET, "s": time.perf_counter() - t0}
    if rank == 0:
        path = metrics.write_summary(summary)
        print(format_summary(summary))
        print(f"summary written to {path}", flush=True)
    return summary


def _ln_modulate_ran(requested: bool) -> dict:
    """What the model's LayerNorm-modulate sites really ran: the fused op only when it was asked for
    (adaptive_load.fused_ln_modulate) and every call took it; on the CPU, or when the op could not load,
    it falls back to the torch reference and the summary says so."""
    from .ops.ln_modulate import call_counts

    calls = call_counts() if requested else {"fused": 0, "reference": 0}
    ran = ("fused op" if calls["fused"] and not calls["reference"] else
           "fused op and torch reference" if calls["fused"] else "torch reference")
    return {"fused_ln_modulate": ran == "fused op", "fused_ln_modulate_requested": requested,
            "ln_modulate": ran, "ln_modulate_calls": calls}


def _save(engine, args, sampler, global_step: int, epoch: int, step_in_epoch: int, world: int) -> None:
    t0 = time.perf_counter()
    engine.save_checkpoint(args.save, tag=f"global_step{global_step}",
                           client_state=_checkpoint_state(sampler, global_step, epoch, step_in_epoch, args, world))
    if torch.distributed.get_rank() == 0:
        print(f"saved checkpoint step {global_step} to {args.save} ({time.perf_counter() - t0:.1f} s)", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from .balance.cost import ProfileError, SequenceParallelError
    from .models.wan import WanConfigError
    from .balance.planner import OversizeSampleError, PlanError
    from .balance.sampler import SamplerStateError
    from .models.weights import WanWeightsError

    ok = False
    try:
        train(args)
        ok = True
    except (ConfigError, DataError, ShapeError, UsageError, FileNotFoundError, WanConfigError, PlanError,
            ProfileError, SequenceParallelError, SamplerStateError, OversizeSampleError, WanWeightsError) as exc:
        # These come from the config, the plan or the files, which every rank sees alike: one message
        # (rank 0's), not one per rank; a DataError may be one rank's own sample, so every rank says it.
        rank = int(os.environ.get("RANK", "0") or 0)
        if rank == 0 or isinstance(exc, DataError):
            print(f"ds-adaptive train: error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        _shutdown_distributed(barrier=ok)
    return 0


def _shutdown_distributed(*, barrier: bool) -> None:
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


if __name__ == "__main__":
    sys.exit(main())
