"""Flow-matching Euler sampler: the exact inverse of the training objective (``ds_adaptive.models.objective``).

Training draws ``u ~ U(0, 1)``, ``sigma = shift*u / (1 + (shift-1)*u)``, ``x_t = (1 - sigma) x0 + sigma eps``,
timestep ``1000 * sigma`` and regresses the velocity ``eps - x0 = dx_t / dsigma``. Sampling integrates that
ODE from pure noise (sigma = 1) to data (sigma = 0) on the same shifted schedule::

    u_k = 1 - k / K,   sigma_k = shifted_sigma(u_k, shift),   k = 0..K        (sigma_0 = 1, sigma_K = 0)
    x_{k+1} = x_k + (sigma_{k+1} - sigma_k) * v(x_k, 1000 * sigma_k)

This is diffusers' ``FlowMatchEulerDiscreteScheduler(shift=shift)`` stepped over the sigmas ``u_0..u_{K-1}``
(it applies the shift itself and appends the final 0; tests/unit/training/test_preview.py checks the two agree). With a
velocity that is exactly ``eps - x0`` the Euler steps land on ``x0`` for any K (the path is straight).

Classifier-free guidance: ``v = v_uncond + g * (v_cond - v_uncond)``; both branches run as one batch of
2B (``batch_cfg``) or as two forwards of B.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ds_adaptive.models.objective import shifted_sigma

VelocityFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``fn(x [B, 16, T', H', W'], timestep [B] fp32 in [0, 1000], context [B, L, 4096]) -> velocity like x``."""


def sigma_schedule(steps: int, shift: float) -> torch.Tensor:
    """The ``steps + 1`` sigmas (fp64, from 1 to 0) of a K-step Euler sampler with Wan's timestep shift."""
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    u = 1.0 - torch.arange(steps + 1, dtype=torch.float64) / steps
    return shifted_sigma(u, float(shift))


def initial_noise(latent_shape, seed: int) -> torch.Tensor:
    """fp32 noise ``[1, *latent_shape]`` from a CPU generator seeded by ``seed``: the same on every device."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    return torch.randn((1, *latent_shape), generator=g, dtype=torch.float32)


@torch.no_grad()
def euler_sample(velocity: VelocityFn, noise: torch.Tensor, context: torch.Tensor, *, steps: int, shift: float,
                 guidance_scale: float = 1.0, negative: Optional[torch.Tensor] = None, batch_cfg: bool = True,
                 dtype: Optional[torch.dtype] = None, callback: Optional[Callable[[int], None]] = None) -> torch.Tensor:
    """Integrate from ``noise`` (``[B, 16, T', H', W']``, sigma = 1) to sigma = 0; returns fp32 latents.

    ``context``: ``[B, L, 4096]``; ``negative``: the unconditional context (same shape; default zeros), used
    when ``guidance_scale`` > 1. ``dtype``: the model's input dtype (default the context's). The state ``x``
    is kept in fp32; each step casts it to ``dtype`` for the model. ``callback(k)`` after step k."""
    sigmas = sigma_schedule(steps, shift)
    dtype = dtype or context.dtype
    x = noise.float()
    b = x.shape[0]
    cfg = guidance_scale != 1.0
    if cfg:
        negative = torch.zeros_like(context) if negative is None else negative
        if negative.shape != context.shape:
            raise ValueError(f"negative context {list(negative.shape)} must match the context {list(context.shape)}")
    ctx = context.to(dtype)
    both = torch.cat([ctx, negative.to(dtype)]) if cfg and batch_cfg else None
    for k in range(steps):
        s, s_next = float(sigmas[k]), float(sigmas[k + 1])
        t = torch.full((b,), 1000.0 * s, dtype=torch.float32, device=x.device)
        xin = x.to(dtype)
        if not cfg:
            v = velocity(xin, t, ctx).float()
        elif batch_cfg:
            v_c, v_u = velocity(torch.cat([xin, xin]), torch.cat([t, t]), both).float().chunk(2)
            v = v_u + guidance_scale * (v_c - v_u)
        else:
            v_c = velocity(xin, t, ctx).float()
            v_u = velocity(xin, t, negative.to(dtype)).float()
            v = v_u + guidance_scale * (v_c - v_u)
        x = x + (s_next - s) * v
        if callback is not None:
            callback(k)
    return x
