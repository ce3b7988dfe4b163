"""Token order of the latent token grid in 3D cubes, so that consecutive tokens are spatio-temporally local.

The Wan patch embedding emits tokens in raster order ``(f, h, w)`` of the token grid ``(F, H, W)``.
Block-sparse attention works on blocks of ``block_size`` consecutive tokens; in raster order a
128-token block is a thin strip of one row, whose keys are needed by very different queries. In
cube order the grid is cut into cubes of ``(cf, ch, cw)`` tokens (ragged at the far edges: the last
cube along an axis is shorter when the axis does not divide), cubes are visited in raster order of
the cube grid and the tokens inside a cube in raster order, so a block is (one or part of) a
compact 3D neighbourhood.

Conventions: ``perm`` is a ``[S]`` int64 tensor with ``ordered = raster[:, perm]`` (position ``i``
of the cube order holds raster token ``perm[i]``); ``inv`` is its inverse
(``raster = ordered[:, inv]``). Pure functions of (grid, cube); cached.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

Grid = tuple[int, int, int]


class CubeOrderError(ValueError):
    """An invalid grid or cube size."""


def _check(name: str, v: tuple) -> tuple[int, int, int]:
    if len(v) != 3 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in v):
        raise CubeOrderError(f"{name} must be 3 ints >= 1 (frames, height, width), got {v!r}")
    return tuple(int(n) for n in v)


@functools.lru_cache(maxsize=64)
def _cube_perm(grid: Grid, cube: Grid) -> tuple[torch.Tensor, torch.Tensor]:
    f, h, w = grid
    idx = torch.arange(f * h * w, dtype=torch.int64).view(f, h, w)
    parts = []
    # cube grid in raster order; tokens within a cube in raster order (ragged cubes at the far edges)
    for f0 in range(0, f, cube[0]):
        for h0 in range(0, h, cube[1]):
            for w0 in range(0, w, cube[2]):
                parts.append(idx[f0:f0 + cube[0], h0:h0 + cube[1], w0:w0 + cube[2]].reshape(-1))
    perm = torch.cat(parts)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), dtype=torch.int64)
    return perm, inv


def cube_permutation(grid: Grid, cube: Grid) -> torch.Tensor:
    """``[S]`` int64: raster index of the token at each cube-order position (``ordered = x[perm]``)."""
    return _cube_perm(_check("grid", tuple(grid)), _check("cube", tuple(cube)))[0]


def inverse_permutation(grid: Grid, cube: Grid) -> torch.Tensor:
    """``[S]`` int64 inverse of :func:`cube_permutation` (``raster = ordered[inv]``)."""
    return _cube_perm(_check("grid", tuple(grid)), _check("cube", tuple(cube)))[1]


def num_blocks(seq_len: int, block_size: int) -> int:
    """Blocks of ``block_size`` consecutive tokens covering ``seq_len`` (the last may be partial)."""
    return math.ceil(seq_len / block_size)


def block_boundaries(seq_len: int, block_size: int) -> torch.Tensor:
    """``[n_blocks + 1]`` int64 token offsets of the blocks (last = seq_len)."""
    b = torch.arange(0, seq_len, block_size, dtype=torch.int64)
    return torch.cat([b, torch.tensor([seq_len], dtype=torch.int64)])


@dataclass(frozen=True)
class CubeOrder:
    """Applies the cube token order of one cube size to tokens / RoPE tables of any grid.

    ``WanModel.set_token_order(CubeOrder(cube))`` permutes the tokens once after the patch
    embedding and the rotary table the same way, and restores raster order before unpatchify.
    """

    cube: Grid = (2, 8, 8)
    """(frames, rows, columns) of a cube in tokens."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "cube", _check("cube", tuple(self.cube)))

    def perm(self, grid: Grid, device=None) -> torch.Tensor:
        return cube_permutation(tuple(grid), self.cube).to(device)

    def inv(self, grid: Grid, device=None) -> torch.Tensor:
        return inverse_permutation(tuple(grid), self.cube).to(device)

    def to_cube(self, x: torch.Tensor, grid: Grid, dim: int = 1) -> torch.Tensor:
        """Raster -> cube order along ``dim`` (``x.shape[dim] == F*H*W``)."""
        self._check_len(x, grid, dim)
        return x.index_select(dim, self.perm(grid, x.device))

    def to_raster(self, x: torch.Tensor, grid: Grid, dim: int = 1) -> torch.Tensor:
        """Cube -> raster order along ``dim``."""
        self._check_len(x, grid, dim)
        return x.index_select(dim, self.inv(grid, x.device))

    @staticmethod
    def _check_len(x: torch.Tensor, grid: Grid, dim: int) -> None:
        if x.shape[dim] != math.prod(grid):
            raise CubeOrderError(f"tensor has {x.shape[dim]} tokens along dim {dim}, grid {tuple(grid)} has "
                                 f"{math.prod(grid)}: apply the token order to the full (unsharded, unpadded) sequence")
