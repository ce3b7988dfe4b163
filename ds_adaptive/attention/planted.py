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

from ds_adaptive.attention.cube_order import CubeOrder
from ds_adaptive.models.rope import apply_rope, rope_table


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


PLANTED_KINDS = ("local", "far", "sink", "mixed")
"""Head kinds of :func:`planted_rope_qk`."""


def planted_rope_qk(grid: Sequence[int], num_heads: int, head_dim: int, *, kinds: Optional[Sequence[str]] = None,
                    batch: int = 1, temperature: float = 14.0, far_gain: float = 9.0, sink_gain: float = 11.0,
                    noise: float = 0.3, order: Optional[CubeOrder] = None, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``[B, S, H, Dh]`` whose attention has the structure of a video DiT, through Wan's 3D RoPE.

    Per head, built in the rotary frame and then rotated by the model's ``rope_table`` (the model's
    ``apply_rope``), so every position dependence is RoPE's own:

    * ``local``: q = k = a constant vector on the higher-frequency rotary pairs of all three axes
      (plus per-token noise of relative size ``noise``): the logit is ``temperature`` x the mean of
      ``cos(omega_p * delta)``, a 3D window around the query with RoPE's ripples;
    * ``far``: local, plus two far regions of the video (a corner box of rows x columns in every
      frame each) whose keys carry a content vector on the lowest-frequency pairs (nearly
      position-free) that every query matches: +``far_gain`` logits to those keys from everywhere;
    * ``sink``: local, plus a sink: the first 8 tokens (frame 0, row 0) with +``sink_gain``;
    * ``mixed``: all three.

    ``kinds``: one per head (default: the four in turn). Returned in the order of ``order`` (cube
    order if given). Deterministic in ``seed``.
    """
    kinds = list(kinds) if kinds is not None else [PLANTED_KINDS[i % len(PLANTED_KINDS)] for i in range(num_heads)]
    if len(kinds) != num_heads or any(k not in PLANTED_KINDS for k in kinds):
        raise ValueError(f"kinds must be {num_heads} of {PLANTED_KINDS}, got {kinds}")
    f, h, w = (int(x) for x in grid)
    s = f * h * w
    hw = head_dim // 6
    split = (head_dim // 2 - 2 * hw, hw, hw)
    starts = (0, split[0], split[0] + split[1])
    low = [starts[a] + split[a] - 1 - j for a in range(3) for j in range(3)]  # the 3 slowest pairs per axis
    local = [p for p in range(head_dim // 2) if p not in low]
    far_pairs, sink_pairs = low[0::2], low[1::2]
    table = rope_table((f, h, w), split)
    pos = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 3)
    far = (((pos[:, 1] < max(1, h // 4)) & (pos[:, 2] >= w - max(1, w // 4)))
           | ((pos[:, 1] >= h - max(1, h // 4)) & (pos[:, 2] < max(1, w // 4))))
    sink = torch.zeros(s, dtype=torch.bool)
    sink[:min(8, s)] = True
    g = torch.Generator().manual_seed(seed)
    root = math.sqrt(head_dim)

    def on(pairs, vec):  # a [P] real vector on pairs -> [Dh] channels (the pair's first channel)
        out = torch.zeros(head_dim)
        out[torch.tensor(pairs) * 2] = vec
        return out

    qs, ks = [], []
    for _ in range(batch):
        qh, kh = [], []
        for kind in kinds:
            a = math.sqrt(temperature * root / len(local))
            base = on(local, torch.full((len(local),), a))
            q = base + noise * a * torch.randn(s, head_dim, generator=g) * on(local, torch.ones(len(local))).sign()
            k = base + noise * a * torch.randn(s, head_dim, generator=g) * on(local, torch.ones(len(local))).sign()
            for want, pairs, mask, gain in (("far", far_pairs, far, far_gain), ("sink", sink_pairs, sink, sink_gain)):
                if kind in (want, "mixed"):
                    u = torch.randn(len(pairs), generator=g)
                    u = on(pairs, u / u.norm())
                    q = q + gain * root * u
                    k = k + mask[:, None].float() * u
            qh.append(q)
            kh.append(k)
        qs.append(torch.stack(qh, 1))
        ks.append(torch.stack(kh, 1))
    q = apply_rope(torch.stack(qs), table)
    k = apply_rope(torch.stack(ks), table)
    if order is not None:
        q, k = order.to_cube(q, (f, h, w)), order.to_cube(k, (f, h, w))
    return q.to(dtype), k.to(dtype)
