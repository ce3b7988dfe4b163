"""3D rotary position embedding of video DiTs (frame, row, column axes), shared by the model families.

``rope_table(grid, split)`` -> ``[S, Dh/2, 2]`` (cos, sin) per token; ``apply_rope(x, table)`` rotates the
channel pairs of ``x [B, S, H, Dh]``. Family-neutral: planted test data (``sparse/planted.py``) uses the same
functions as the model.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

Grid = tuple[int, int, int]
"""A latent token grid (frames, rows, columns) after patching."""


def rope_table(grid: Grid, split: tuple[int, int, int], theta: float = 10000.0,
               device: Optional[torch.device] = None) -> torch.Tensor:
    """Per-token 3D rotary table ``[S, Dh/2, 2]`` fp32, last dim (cos, sin); S = F*H*W in (f, h, w) order.

    Pair j of a head rotates by angle ``pos_axis * theta^(-2i/n_axis)``, where pairs
    ``[0, t)`` use the frame index, ``[t, t+h)`` the row, ``[t+h, t+h+w)`` the column
    (``split`` = (t, h, w) pairs, i the index inside the axis, n_axis = 2 * pairs of the axis).
    Angles and cos/sin are computed in fp64, then stored as fp32 (as diffusers / Wan).
    Row s of the table belongs to token s, so a sequence-parallel wrapper shards it along dim 0
    exactly like the tokens (pad rows are never looked at if their keys are masked).
    """
    parts = []
    for axis, (n, pairs) in enumerate(zip(grid, split)):
        rot = 2 * pairs
        inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64, device=device) / rot))
        ang = torch.outer(torch.arange(n, dtype=torch.float64, device=device), inv)  # [n, pairs]
        cs = torch.stack([ang.cos(), ang.sin()], dim=-1).float()  # [n, pairs, 2]
        view = [1, 1, 1, pairs, 2]
        view[axis] = n
        parts.append(cs.view(view).expand(*grid, pairs, 2))
    return torch.cat(parts, dim=3).reshape(math.prod(grid), sum(split), 2)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (2j, 2j+1) of x ``[B, S, H, Dh]`` by ``freqs [S, Dh/2, 2]``.

    Math in fp32, one rounding back to x.dtype.
    """
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # [B, S, H, Dh/2]
    cos = freqs[None, :, None, :, 0]
    sin = freqs[None, :, None, :, 1]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)
