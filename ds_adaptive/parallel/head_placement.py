"""Apply a density-balanced head placement around Ulysses attention (the permutation comes from
:mod:`ds_adaptive.parallel.placement`).

DeepSpeed's DistributedAttention scatters the head axis (dim 2 of ``[B, S/sp, H, Dh]``) in
contiguous chunks: SP rank ``r`` attends with heads ``[r*k, (r+1)*k)``. :func:`place_heads` wraps
an attention fn so that q, k, v are permuted along the head axis *before* the all-to-all
(``x[:, :, perm]``) and the output is un-permuted after it (``out[:, :, inverse(perm)]``): rank
``r`` then attends with original heads ``perm[r*k:(r+1)*k]``, every rank keeps ``k`` heads (the
all-to-all stays even), and the result equals the unpermuted attention exactly (attention is per
head; ``index_select`` is differentiable, so gradients follow).

Per-head state that travels with heads: Wan's q/k RMSNorm acts on the full ``dim`` before the
head split (outside the attention fn) and RoPE is the same for every head, so nothing else
moves. A sparse attention core that keeps per-head state (densities, selection, a per-head
predictor) needs to know which original heads it holds: ``head_ids_kwarg="head_ids"`` passes the
tuple of this rank's original head ids to the wrapped fn (it reaches the local attention through
DistributedAttention's kwargs).

    from ds_adaptive.parallel.placement import plan_head_placement
    placement = plan_head_placement(densities.density, sp.sp_size, dense_layers=densities.dense_layers)
    apply_head_placement(model, placement, sp)      # per block; re-call when the densities change
    remove_head_placement(model)                    # back to the model's attention fn

When the sparse-attention profiler publishes new densities (the same table on every rank),
:func:`update_sparse_balance` does both halves at once: the sampler re-plans with the sparse cost
(``update_densities``) and the model's head placement is re-planned and re-applied.

With sparse attention off, pass ``placement=None`` (or an identity placement): blocks run the
model's attention fn unwrapped.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ds_adaptive.parallel.placement import (HeadPlacement, check_placement, inverse_permutation, plan_head_placement,
                                            rank_heads)
from ds_adaptive.models.family import set_plain_attr
from ds_adaptive.core.contracts import load_densities

__all__ = ["permute_heads", "place_heads", "apply_head_placement", "remove_head_placement", "current_placement",
           "update_sparse_balance"]

_PLACEMENT_ATTR = "_ds_adaptive_head_placement"


def permute_heads(x: torch.Tensor, perm: Sequence[int], dim: int = 2) -> torch.Tensor:
    """``x`` with its head axis reordered: position ``j`` holds head ``perm[j]`` (differentiable)."""
    idx = torch.as_tensor(list(perm), dtype=torch.long, device=x.device)
    return x.index_select(dim, idx)


def place_heads(attn_fn: Callable[..., torch.Tensor], perm: Optional[Sequence[int]], *, sp_size: int = 1,
                sp_rank: int = 0, head_ids_kwarg: Optional[str] = None) -> Callable[..., torch.Tensor]:
    """``attn_fn(q, k, v, **kw)`` (``[B, S, H, Dh]``, e.g. the Ulysses attention) with the heads placed
    by ``perm`` before it and restored after it. ``perm=None`` or the identity returns ``attn_fn``
    itself (no copies). ``head_ids_kwarg``: pass this rank's original head ids
    (``perm[sp_rank*k:(sp_rank+1)*k]``) to ``attn_fn`` under that keyword."""
    if perm is None:
        return attn_fn
    perm = [int(h) for h in perm]
    check_placement(perm, len(perm), sp_size)
    if perm == list(range(len(perm))) and head_ids_kwarg is None:
        return attn_fn
    inv = inverse_permutation(perm)
    mine = tuple(rank_heads(perm, sp_size, sp_rank))
    cache: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}

    def placed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if q.shape[2] != len(perm):
            raise ValueError(f"head placement is for {len(perm)} heads, q has {q.shape[2]} (dim 2 of [B, S, H, Dh])")
        if q.device not in cache:
            cache[q.device] = (torch.as_tensor(perm, dtype=torch.long, device=q.device),
                               torch.as_tensor(inv, dtype=torch.long, device=q.device))
        fwd, back = cache[q.device]
        if head_ids_kwarg is not None:
            kwargs[head_ids_kwarg] = mine
        out = attn_fn(q.index_select(2, fwd), k.index_select(2, fwd), v.index_select(2, fwd), **kwargs)
        return out.index_select(2, back)

    placed_attention.perm = tuple(perm)
    placed_attention.__wrapped__ = attn_fn
    return placed_attention


def apply_head_placement(model, placement: Optional[HeadPlacement], sp, *,
                         head_ids_kwarg: Optional[str] = None) -> None:
    """Give every block of ``model`` (a DiffusionTransformer; Ulysses installed or not) its layer's placement
    around the model's current attention fn (``model.attention_fn``, e.g. the Ulysses attention of
    :func:`ds_adaptive.parallel.apply_ulysses`; call this after it: ``model.set_attention`` resets every
    block). Idempotent; call again with a new placement when the densities change; ``None`` restores
    the plain fn on every block.

    ``sp``: the :class:`ds_adaptive.core.layout.Layout` of the model's SP group (for the rank's head ids) and the
    degree the placement must have been planned for."""
    base = model.attention_fn            # set_attention's fn (placement wraps it per block, never replaces it)
    per_layer = getattr(base, "for_layer", None)  # a per-layer fn (the sparse runtime): block i wraps for_layer(i)
    if placement is not None and placement.sp != sp.sp_size:
        raise ValueError(f"head placement planned for sp={placement.sp}, the SP group has sp={sp.sp_size}")
    if placement is not None and placement.num_layers != len(model.blocks):
        raise ValueError(f"head placement has {placement.num_layers} layers, the model {len(model.blocks)} blocks")
    heads = model.config.num_heads
    for layer, block in enumerate(model.blocks):
        perm = None if placement is None else placement.perm(layer, heads)
        fn = per_layer(layer) if per_layer is not None else base
        set_plain_attr(block, "attn_fn", place_heads(fn, perm, sp_size=sp.sp_size, sp_rank=sp.sp_rank,
                                                      head_ids_kwarg=head_ids_kwarg))
    set_plain_attr(model, _PLACEMENT_ATTR, placement)


def remove_head_placement(model) -> None:
    """Every block back to the model's attention fn (undo :func:`apply_head_placement`)."""
    per_layer = getattr(model.attention_fn, "for_layer", None)
    for i, block in enumerate(model.blocks):
        set_plain_attr(block, "attn_fn", per_layer(i) if per_layer is not None else model.attention_fn)
    set_plain_attr(model, _PLACEMENT_ATTR, None)


def current_placement(model) -> Optional[HeadPlacement]:
    """The placement :func:`apply_head_placement` installed (None: none)."""
    return getattr(model, _PLACEMENT_ATTR, None)


def update_sparse_balance(densities, *, model=None, sp=None, sampler=None, at_step: Optional[int] = None,
                          measured_at: Optional[int] = None, enabled: bool = True,
                          head_ids_kwarg: Optional[str] = None) -> Optional[HeadPlacement]:
    """Hand new per-layer x head densities (``DensityMap`` / dict / json / metrics.jsonl path) to both
    balancers: ``sampler.update_densities(densities, at_step, measured_at=...)`` (if a sampler is given:
    next epoch boundary, or the re-plan point ``at_step``) and, if ``model`` and ``sp`` are given, a new
    density-balanced head placement applied to the model now (``enabled=False``: sparse attention is
    off, every block back to the plain attention). Call on every rank with the same densities.
    Returns the placement applied (None when none)."""
    dm = load_densities(densities)
    if sampler is not None:
        sampler.update_densities(dm, at_step, measured_at=measured_at)
    if model is None:
        return None
    if sp is None:
        raise ValueError("update_sparse_balance(model=...) needs sp (the Layout of the model's SP group)")
    placement = None
    if enabled and sp.sp_size > 1:
        dm = dm.with_num_layers(len(model.blocks)) if dm.num_layers > len(model.blocks) else dm
        placement = plan_head_placement(dm.density, sp.sp_size, dense_layers=dm.dense_layers)
        placement = None if placement.is_identity() else placement
    apply_head_placement(model, placement, sp, head_ids_kwarg=head_ids_kwarg)
    return placement
