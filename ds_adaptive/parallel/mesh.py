"""The 2-D context-parallel mesh of an SP group: head-wise size ``h`` x sequence-wise size ``s`` = ``sp``.

DSV's hybrid sparsity-aware context parallelism arranges the SP group of every layer as a mesh: the ``h``
ranks of a *head-wise* group (Ulysses) exchange heads by an all-to-all, the ``s`` ranks of a *sequence-wise*
group hold the same heads and different chunks of the sequence and fetch only the key blocks their queries
selected (:mod:`ds_adaptive.parallel.kv_gather`). ``h = sp, s = 1`` is Ulysses; ``h = 1, s = sp`` is pure
sequence-wise attention (no head count limit).

Rank placement (fixed; the residual stream is sharded by ``sp_rank`` as under Ulysses)::

    sp_rank = seq_rank * h + head_rank          head-wise groups: h consecutive ranks (intra-node first)
    head-wise group of seq_rank j: sp ranks j*h .. j*h + h-1      -> after its all-to-all a rank holds
                                                                    the contiguous chunk j of S/s tokens
    sequence-wise group of head_rank i: sp ranks i, h+i, 2h+i, ...-> the same H/h heads, chunks 0..s-1

Process groups are created once per distinct ``(h, s)`` for every SP group of the world
(:func:`create_meshes`, a collective every rank runs at install time: different DP groups may pick
different meshes in the same step) and reused. :class:`HeadAllToAll` is the head-wise all-to-all (counted
in bytes; the ``heads`` mode keeps DeepSpeed's DistributedAttention).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ds_adaptive.core.layout import Layout
from ds_adaptive.parallel.kv_gather import CommCounter

__all__ = ["CPMesh", "mesh_shapes", "create_meshes", "single_mesh", "heads_to_seq", "seq_to_heads", "HeadAllToAll"]


@dataclass(frozen=True)
class CPMesh:
    """This rank's place in an ``(h, s)`` mesh of its SP group and the two process groups it talks over
    (None where the size is 1, or without torch.distributed)."""

    heads: int
    """h: head-wise (Ulysses) size; each rank of a head-wise group attends with H / h heads."""
    seq: int
    """s: sequence-wise size; each rank of a sequence-wise group holds S / s tokens of the same heads."""
    head_rank: int = 0
    seq_rank: int = 0
    head_group: object = None
    seq_group: object = None

    @property
    def size(self) -> int:
        return self.heads * self.seq

    @property
    def shape(self) -> tuple[int, int]:
        return (self.heads, self.seq)

    def head_slice(self, num_heads: int) -> tuple[int, ...]:
        """The (original) head ids this rank attends with: ``[head_rank * H/h, (head_rank+1) * H/h)``."""
        n = num_heads // self.heads
        return tuple(range(self.head_rank * n, (self.head_rank + 1) * n))


def mesh_shapes(sp: int, num_heads: int) -> list[tuple[int, int]]:
    """Every ``(h, s)`` with ``h * s = sp`` and ``h`` dividing the heads, h descending (Ulysses first when
    it exists)."""
    return [(h, sp // h) for h in range(sp, 0, -1) if sp % h == 0 and num_heads % h == 0]


def single_mesh() -> CPMesh:
    """The one-rank mesh (no SP)."""
    return CPMesh(1, 1)


_MESHES: dict = {}


def _all_sp_groups(layout: Layout) -> list[tuple[int, ...]]:
    """Every SP group of the world as its global ranks in sp_rank order (one all_gather_object)."""
    mine = tuple(dist.get_process_group_ranks(layout.sp_group)) if layout.sp_group is not None else (layout.rank,)
    groups: list = [None] * dist.get_world_size()
    dist.all_gather_object(groups, mine)
    return sorted(set(tuple(g) for g in groups))


def create_meshes(layout: Layout, shapes: Sequence[tuple[int, int]]) -> dict[tuple[int, int], CPMesh]:
    """This rank's :class:`CPMesh` for each ``(h, s)`` of ``shapes`` (``h * s == layout.sp_size``); the groups
    are made once per (SP groups, shape) and cached. A collective: every rank of the world calls it with the
    same shapes, in the same order."""
    sp = layout.sp_size
    bad = [shp for shp in shapes if shp[0] * shp[1] != sp]
    if bad:
        raise ValueError(f"mesh shapes {bad} do not multiply to the SP degree {sp} (h x s = sp)")
    if sp == 1 or not (dist.is_available() and dist.is_initialized()):
        return {tuple(shp): CPMesh(shp[0], shp[1]) for shp in shapes}
    all_groups = _all_sp_groups(layout)
    out = {}
    for h, s in shapes:
        key = (tuple(all_groups), h, s)
        if key not in _MESHES:
            _MESHES[key] = _new_mesh(all_groups, layout, h, s)
        out[(h, s)] = _MESHES[key]
    return out


def _new_mesh(all_groups, layout: Layout, h: int, s: int) -> CPMesh:
    """Create the head-wise and sequence-wise groups of every SP group (same order on every rank)."""
    head_group = seq_group = None
    head_rank, seq_rank = layout.sp_rank % h, layout.sp_rank // h
    for ranks in all_groups:
        for j in range(s):
            members = [ranks[j * h + i] for i in range(h)]
            g = dist.new_group(members) if h > 1 else None
            if layout.rank in members and h > 1:
                head_group = g
        for i in range(h):
            members = [ranks[j * h + i] for j in range(s)]
            g = dist.new_group(members) if s > 1 else None
            if layout.rank in members and s > 1:
                seq_group = g
    return CPMesh(h, s, head_rank, seq_rank, head_group, seq_group)


# ============================================================================== the head-wise all-to-all
def seq_to_heads(x: torch.Tensor, group, h: int) -> torch.Tensor:
    """``[B, L, *mid, H, Dh]`` (this rank's L tokens, all heads; ``mid`` e.g. the stacked q / k / v) ->
    ``[B, h*L, *mid, H/h, Dh]`` (the group's h*L tokens in rank order, this rank's head chunk): one equal
    all-to-all (not differentiable; see :class:`HeadAllToAll`)."""
    b, n, *mid, heads, d = x.shape
    m = math.prod(mid)
    send = x.reshape(b, n, m, h, heads // h, d).permute(3, 0, 1, 2, 4, 5).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4, 5).reshape(b, h * n, *mid, heads // h, d)


def heads_to_seq(x: torch.Tensor, group, h: int) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: ``[B, h*L, *mid, H/h, Dh]`` -> ``[B, L, *mid, H, Dh]``."""
    b, n, *mid, hh, d = x.shape
    m = math.prod(mid)
    send = x.reshape(b, h, n // h, m, hh, d).permute(1, 0, 2, 3, 4, 5).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 3, 0, 4, 5).reshape(b, n // h, *mid, h * hh, d)


class HeadAllToAll(torch.autograd.Function):
    """``seq_to_heads`` (``forward=True``) or ``heads_to_seq``, differentiable (the backward is the other
    one); bytes sent to the other ranks go to ``counter`` (``heads`` forward, ``heads_grad`` backward):
    ``numel * element_size * (h - 1) / h`` each way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, h: int, to_heads: bool, counter: Optional[CommCounter],
                layer: Optional[int]):
        ctx.group, ctx.h, ctx.to_heads, ctx.counter, ctx.layer = group, h, to_heads, counter, layer
        if counter is not None:
            counter.add(layer, "heads", x.numel() * x.element_size() * (h - 1) // h)
        return seq_to_heads(x, group, h) if to_heads else heads_to_seq(x, group, h)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.counter is not None:
            ctx.counter.add(ctx.layer, "heads_grad", g.numel() * g.element_size() * (ctx.h - 1) // ctx.h)
        g = g.contiguous()
        out = heads_to_seq(g, ctx.group, ctx.h) if ctx.to_heads else seq_to_heads(g, ctx.group, ctx.h)
        return out, None, None, None, None, None
