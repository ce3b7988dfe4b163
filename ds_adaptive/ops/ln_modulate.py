"""LayerNorm-Modulate: ``y = LayerNorm(x) * (1 + scale) + shift`` (adaLN).

PLACEHOLDER MODULE (issue 5 replaces it with the torch.library custom op, the
autograd path and the fused CUDA kernel). The torch reference below is the
contract: its signature and numerics are what the model calls.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def ln_modulate_reference(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
                          weight: Optional[torch.Tensor] = None,
                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Torch reference. x [B, S, D]; shift/scale [B, 1, D], [B, D] or [B, S, D] (any dtype).

    Statistics and the modulation are computed in fp32, rounded once to x.dtype
    (diffusers' WanTransformer3DModel numerics).
    """
    if shift.dim() == 2:
        shift = shift.unsqueeze(1)
    if scale.dim() == 2:
        scale = scale.unsqueeze(1)
    xf = x.float()
    y = F.layer_norm(xf, (x.shape[-1],), None if weight is None else weight.float(),
                     None if bias is None else bias.float(), eps)
    y = y * (1 + scale.float()) + shift.float()
    return y.to(x.dtype)


def ln_modulate(x, shift, scale, eps: float = 1e-6, weight=None, bias=None):
    """Public entry point (fused op when available; the reference until issue 5 lands)."""
    return ln_modulate_reference(x, shift, scale, eps, weight, bias)
