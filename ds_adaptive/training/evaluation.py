"""The held-out loss: a pure function of the weights, comparable across runs and checkpoints.

    loss = evaluate(engine, dataset, layout=..., seed=..., shift=..., dtype=..., device=..., text_len=...)
    out = held_out(run, engine, num_samples=64)     # {"eval_loss", "eval": {samples, timesteps, seed, s}}

The held-out samples are the synthetic dataset of the run's shape mix with seed + :data:`EVAL_SEED_OFFSET`; each
is scored at ``EVAL_TIMESTEPS`` fixed timesteps with fixed noise (``ds_adaptive.models.objective.eval_inputs``).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ds_adaptive.core.layout import Layout
from ds_adaptive.data import build_dataset
from ds_adaptive.models.objective import EVAL_TIMESTEPS, eval_inputs, mean_mse

__all__ = ["EVAL_SEED_OFFSET", "evaluate", "held_out"]

EVAL_SEED_OFFSET = 1_000_003   # held-out samples: the synthetic dataset with seed + this offset


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


def held_out(run, engine, num_samples: int) -> dict:
    """Held-out loss on ``num_samples`` synthetic samples of the run's shape mix (seed + EVAL_SEED_OFFSET)."""
    opts = run.cfg.trainer
    seed = opts.seed + EVAL_SEED_OFFSET
    held = build_dataset("synthetic", num_samples=num_samples, seed=seed, spec=run.preset.input_spec,
                         shapes=run.cfg.adaptive_load.sampler.shapes or run.preset.shapes)
    t0 = time.perf_counter()
    loss = evaluate(engine, held, layout=run.layout, seed=seed, shift=opts.shift, dtype=run.dtype,
                    device=run.device, text_len=run.text_len, objective=run.objective)
    return {"eval_loss": loss, "eval": {"samples": num_samples, "timesteps": EVAL_TIMESTEPS, "seed": seed,
                                        "s": time.perf_counter() - t0}}
