"""Synthetic q / k with planted spatio-temporal structure (tests, benchmarks).

Token ``i`` at grid position ``p_i = (f, h, w)`` gets random Fourier features
``phi(p) = [cos(p W), sin(p W)] / sqrt(Dh/2)`` with ``W ~ N(0, bandwidth_h^2)`` per head, so
``q_i . k_j = temperature * mean_m cos((p_i - p_j) . w_m)``: attention peaks at the query's own
position and decays with 3D distance, more sharply for heads with a larger bandwidth — the
locality that trained video DiTs show. Returned in the order of ``order`` (cube order if given).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ds_adaptive.sparse.cube_order import CubeOrder


def planted_qk(grid: Sequence[int], num_heads: int, head_dim: int, *, batch: int = 1,
               bandwidths: Optional[Sequence[float]] = None, temperature: float = 40.0, noise: float = 0.1,
               order: Optional[CubeOrder] = None, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``[B, S, H, Dh]`` with planted locality (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid
    pos = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    pos = pos.reshape(-1, 3).float()  # raster order
    if bandwidths is None:
        bandwidths = [0.3 + 0.5 * i / max(1, num_heads - 1) for i in range(num_heads)]
    half = head_dim // 2
    qs, ks = [], []
    for b in range(batch):
        qh, kh = [], []
        for hd in range(num_heads):
            wmat = torch.randn(3, half, generator=g) * bandwidths[hd]
            ang = pos @ wmat
            phi = torch.cat([ang.cos(), ang.sin()], -1) / math.sqrt(half)
            # logits = q.k / sqrt(Dh): scale q so they equal temperature * mean cos
            qh.append(temperature * math.sqrt(head_dim) * (phi + noise * torch.randn(phi.shape, generator=g) / math.sqrt(half)))
            kh.append(phi + noise * torch.randn(phi.shape, generator=g) / math.sqrt(half))
        qs.append(torch.stack(qh, 1))
        ks.append(torch.stack(kh, 1))
    q, k = torch.stack(qs), torch.stack(ks)  # [B, S, H, Dh]
    if order is not None:
        q, k = order.to_cube(q, tuple(grid)), order.to_cube(k, tuple(grid))
    return q.to(dtype), k.to(dtype)
