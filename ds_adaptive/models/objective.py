"""The training objective in one place: rectified flow matching as Wan trains it.

For a clean latent ``x0`` and noise ``eps``: ``x_t = (1 - sigma) x0 + sigma eps``, target
``eps - x0``, ``sigma = shift*u / (1 + (shift-1)*u)`` with ``u ~ U(0, 1)``, timestep
``1000 * sigma``. A model's :class:`ds_adaptive.models.family.ObjectiveOptions` may restrict the noise
levels to ``sigma_range`` (an expert of a mixture, e.g. Wan 2.2 A14B's high-noise expert on
sigma >= 0.875): ``u`` is then uniform on the interval whose shifted sigma lies in the range, i.e. the
full distribution conditioned on it.

Image-to-video (``ObjectiveOptions.first_frame_ratio``, Wan 2.2 TI2V's I2V path in diffusers): a
video sample drawn for it (per-sample seed) keeps its first latent frame clean in ``x_t`` (the
conditioning image), gets one timestep per token with 0 on that frame's tokens (``timestep [B, S]``),
and its loss is the MSE over the other frames. Images are never conditioned. Every sample's ``(u, eps)`` comes from its own generator seeded by
(seed, epoch, sample index), so a sample's loss does not depend on which rank or micro-batch it
lands in, the ranks of a Ulysses group draw the same noise, and a resumed run draws what the
straight run would have.

Caption dropout (``adaptive_load.caption_dropout``): a sample's caption is replaced by the empty prompt's
embedding (or zeros) with probability ``rate``, drawn from its own stream seeded by (seed, epoch, index), apart
from the noise draws (:func:`caption_dropout_draws`, :func:`drop_captions`): the unconditional branch of
classifier-free guidance stays trained, and a resumed run drops the captions of the straight run.

Held-out evaluation uses ``EVAL_TIMESTEPS`` fixed ``u = lo + (hi - lo) (k + 0.5) / EVAL_TIMESTEPS`` (the
model's u interval, (0, 1) by default) and noise seeded by (seed, k, index): a pure function of the weights.

Weighting (unbiased gradients with variable batch sizes) is the planner's
``StepTotals.loss_weight``; the trainer multiplies by ``Layout.loss_scale`` under SP.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

EVAL_TIMESTEPS = 4
"""Fixed timesteps per held-out sample: u = (k + 0.5) / EVAL_TIMESTEPS, k = 0..EVAL_TIMESTEPS-1."""


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """63-bit seed of one sample's (u, eps) draw."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def shifted_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Wan's timestep shift: ``sigma = shift*u / (1 + (shift-1)*u)`` (same shape as ``u``)."""
    return shift * u / (1 + (shift - 1) * u)


def draw_noise(x0: torch.Tensor, indices, *, seed: int, epoch: int,
               u_range: tuple[float, float] = (0.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``u [B]`` (uniform on ``u_range``) and ``eps`` (like ``x0`` [B, ...], fp32), each row from
    its own generator."""
    b = x0.shape[0]
    lo, hi = u_range
    u = torch.empty(b, device=x0.device)
    eps = torch.empty_like(x0)
    for row, idx in enumerate(torch.as_tensor(indices).tolist()):
        g = torch.Generator(device=x0.device)
        g.manual_seed(sample_seed(seed, epoch, idx))
        u[row] = lo + (hi - lo) * torch.rand((), generator=g, device=x0.device)
        eps[row] = torch.randn(x0.shape[1:], generator=g, device=x0.device)
    return u, eps


def _u_range(objective, shift: float) -> tuple[float, float]:
    return (0.0, 1.0) if objective is None else objective.u_range(shift)


def first_frame_draws(indices, *, seed: int, epoch: int, ratio: float) -> torch.Tensor:
    """``[B]`` bool: which samples are trained image-to-video, each from its own stream (seeded by (seed,
    epoch, index), apart from the noise draws), with probability ``ratio``."""
    out = [np.random.default_rng(np.random.SeedSequence([seed, epoch, int(i), 0x1F2F])).random() < ratio
           for i in torch.as_tensor(indices).tolist()]
    return torch.tensor(out, dtype=torch.bool)


CAPTION_DROPOUT_STREAM = 0xCA9D
"""Tag of the caption-dropout stream in a sample's seed sequence (the first-frame draws use 0x1F2F)."""


def caption_dropout_draws(indices, *, seed: int, epoch: int, rate: float) -> torch.Tensor:
    """``[B]`` bool: which samples train without their caption, each from its own stream (seeded by (seed, epoch,
    index, :data:`CAPTION_DROPOUT_STREAM`)), with probability ``rate``."""
    out = [np.random.default_rng(np.random.SeedSequence([seed, epoch, int(i), CAPTION_DROPOUT_STREAM])).random() < rate
           for i in torch.as_tensor(indices).tolist()]
    return torch.tensor(out, dtype=torch.bool)


def drop_captions(context: torch.Tensor, dropped: torch.Tensor, empty: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``context`` ``[B, L, text_dim]`` with the rows ``dropped`` ``[B]`` replaced by ``empty`` ``[L0 <= L,
    text_dim]`` zero-padded to ``L`` (as the trainer pads every caption), or by zeros when ``empty`` is None. A new
    tensor when a row is dropped, ``context`` itself otherwise."""
    dropped = torch.as_tensor(dropped, dtype=torch.bool, device=context.device)
    if not bool(dropped.any()):
        return context
    b, length, dim = context.shape
    row = context.new_zeros(length, dim)
    if empty is not None:
        if empty.dim() != 2 or empty.shape[1] != dim or empty.shape[0] > length:
            raise ValueError(f"the empty-prompt embedding must be [L <= {length}, {dim}], got {list(empty.shape)}")
        row[: empty.shape[0]] = empty.to(device=context.device, dtype=context.dtype)
    return torch.where(dropped[:, None, None], row.expand(b, length, dim), context)


def condition_first_frame(x0: torch.Tensor, x_t: torch.Tensor, timestep: torch.Tensor, cond: torch.Tensor,
                          patch_size) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Image-to-video inputs for the samples ``cond`` ``[B]`` of a video batch ``x0`` ``[B, C, T', H', W']``:
    ``(x_t, timestep [B, S], mask [B, 1, T', H', W'])`` with their first latent frame clean in ``x_t``, timestep 0
    on its tokens (raster order: the first ``H'/ph * W'/pw`` tokens) and 0 in the loss mask there."""
    pt, ph, pw = (int(v) for v in patch_size)
    if pt != 1:
        raise ValueError(f"first-frame conditioning needs a time patch of 1 (one latent frame per token frame), "
                         f"the model's patch is {tuple(patch_size)}")
    b, _, t, h, w = x0.shape
    per_frame = (h // ph) * (w // pw)
    x_t = x_t.clone()
    x_t[cond, :, 0] = x0[cond, :, 0]
    steps = timestep[:, None].expand(b, t * per_frame).clone()
    steps[cond, :per_frame] = 0.0
    mask = torch.ones(b, 1, t, h, w, device=x0.device)
    mask[cond, :, 0] = 0.0
    return x_t, steps, mask


def noisy_inputs(x0: torch.Tensor, u: torch.Tensor, eps: torch.Tensor, *,
                 shift: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_t, timestep, target)`` of clean latents ``x0`` [B, C, T', H', W'] (fp32) at ``u`` [B] with ``eps``."""
    sigma = shifted_sigma(u, shift)
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - s) * x0 + s * eps, sigma * 1000.0, eps - x0


def per_sample_mse(pred, target: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-sample MSE ``[B]`` (fp32) of a prediction against the full ``target`` [B, C, T', H', W'].

    ``pred`` is the model's full output (same shape as ``target``), or under sequence parallelism this
    rank's ``ds_adaptive.parallel.LocalOutput``: then the result is this rank's part, ``sum over the
    shard's real tokens of (pred - target)^2 / elements per sample``, which sums to the per-sample MSE
    over the SP group (padding tokens are excluded by the shard's valid length). ``mask`` ``[B, 1, T', H',
    W']`` (1: counts, 0: left out, e.g. a clean conditioning frame): the mean over the counted elements.
    """
    if isinstance(pred, torch.Tensor):
        if pred.shape != target.shape:
            raise ValueError(f"prediction {list(pred.shape)} and target {list(target.shape)} differ in shape")
        if mask is None:
            return (pred.float() - target).pow(2).flatten(1).mean(1)
        se = (pred.float() - target).pow(2) * mask
        return se.flatten(1).sum(1) / (mask.flatten(1).sum(1) * target.shape[1])
    if target.dim() != 5 or target.shape[0] != pred.tokens.shape[0]:
        raise ValueError(f"target must be [B, C, T', H', W'] with B={pred.tokens.shape[0]}, got {list(target.shape)}")
    se = (pred.valid_tokens.float() - pred.shard_target(target).float()).square()   # [B, valid, P*C]
    if mask is None:
        return se.sum(dim=(1, 2)) / int(np.prod(target.shape[1:]))
    m = pred.shard_target(mask).repeat_interleave(target.shape[1], dim=-1)  # (pt ph pw c), c fastest
    return (se * m).sum(dim=(1, 2)) / (mask.flatten(1).sum(1) * target.shape[1])


def flow_matching_losses(model, latents: torch.Tensor, context: torch.Tensor, indices, *, epoch: int, seed: int,
                         shift: float, dtype: torch.dtype, local: bool = False, objective=None,
                         patch_size=(1, 2, 2)) -> torch.Tensor:
    """Per-sample flow-matching MSE ``[B]`` (fp32) of ``model`` (the DiT or its DeepSpeed engine) on clean
    latents ``[B, C, T', H', W']``. ``local`` (under sequence parallelism): this rank's part of it,
    summing to it over the SP group. ``objective``: the model's ``ObjectiveOptions`` (None: defaults);
    ``patch_size``: the model's (its tokens per latent frame, for first-frame conditioning)."""
    x0 = latents.float()
    u, eps = draw_noise(x0, indices, seed=seed, epoch=epoch, u_range=_u_range(objective, shift))
    x_t, timestep, target = noisy_inputs(x0, u, eps, shift=shift)
    mask = None
    if objective is not None and objective.first_frame_ratio > 0 and x0.shape[2] > 1:
        cond = first_frame_draws(indices, seed=seed, epoch=epoch, ratio=objective.first_frame_ratio)
        if bool(cond.any()):
            x_t, timestep, mask = condition_first_frame(x0, x_t, timestep, cond.to(x0.device), patch_size)
    kwargs = {"local": True} if local else {}
    pred = model(x_t.to(dtype), timestep, context.to(dtype), **kwargs)
    return per_sample_mse(pred, target, mask)


def eval_inputs(latents: torch.Tensor, index: int, *, seed: int, shift: float, timesteps: int = EVAL_TIMESTEPS,
                objective=None, rows=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_t, timestep, target)`` of one held-out sample ``latents`` [C, T', H', W'] at the ``timesteps``
    fixed u values of the model's u interval (a batch of ``timesteps`` rows), noise seeded by (seed, k, index).
    ``rows``: only the timesteps ``k`` in it (in its order; default all), each row as in the full batch."""
    device = latents.device
    k = timesteps
    ks = list(range(k)) if rows is None else [int(r) for r in rows]
    lo, hi = _u_range(objective, shift)
    u = lo + (hi - lo) * ((torch.tensor(ks, dtype=torch.float32, device=device) + 0.5) / k)
    x0 = latents.float().unsqueeze(0).expand(len(ks), *latents.shape)
    eps = torch.empty_like(x0)
    for row, kk in enumerate(ks):
        g = torch.Generator(device=device)
        g.manual_seed(sample_seed(seed, kk, index))
        eps[row] = torch.randn(x0.shape[1:], generator=g, device=device)
    return noisy_inputs(x0, u, eps, shift=shift)


def mean_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over every element (fp32 scalar): the held-out loss of one sample's batch."""
    return (pred.float() - target).pow(2).mean()


