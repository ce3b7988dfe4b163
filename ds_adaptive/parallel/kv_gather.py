"""Fetch whole KV blocks from their owners over a sequence-wise group, and send their gradients back.

Sequence-wise sparse attention (DSV's "critical KV gather", by blocks): the ``s`` ranks of a sequence-wise
group each own a contiguous chunk of ``n_own`` key blocks of every (sample, head); a rank's queries select
some blocks it does not own, and only those travel. A *unit* is one block of one (sample, head): ``block``
tokens x ``Dh`` of K and the same of V. Unit ids are local to their owner: ``(b * H + h) * n_own + j``
(``j`` the block inside the owner's chunk).

Three uneven all-to-alls per forward (:class:`BlockFetchPlan` builds the first two once per layer call):

1. counts: how many units this rank wants from each owner (int64, one per peer);
2. ids: the wanted unit ids (int64), so that each owner knows what to send to whom;
3. data: the wanted units, K and V stacked (``[N, 2, block, Dh]`` in the activation dtype).

The backward (:class:`FetchBlocks`) sends the units' gradients back along the reverse route and sums them
into the owner's dK / dV (``index_add``: a unit fetched by several ranks gets the sum of their gradients).
Nothing here knows about attention or selections: the caller says which units it wants.

Bytes are counted per layer by a :class:`CommCounter` (sent by this rank, excluding what it keeps), split by
kind: ``counts``, ``ids``, ``kv`` (forward data), ``kv_grad`` (backward data), so a test can compare them with
the cost model's prediction (``ds_adaptive.planning.context_parallel``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["CommCounter", "BlockFetchPlan", "FetchBlocks", "fetch_blocks", "units_of", "from_units"]


@dataclass
class CommCounter:
    """Bytes this rank sent to other ranks, per layer and kind (``counts``, ``ids``, ``kv``, ``kv_grad``,
    ``scores``, ``heads`` (head-wise all-to-all, forward), ``heads_grad`` (its backward), ``profile``),
    summed since the last :meth:`reset`; ``calls`` counts the layer calls that moved anything."""

    bytes: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)

    def add(self, layer: Optional[int], kind: str, nbytes: int) -> None:
        if layer is None:
            return
        row = self.bytes.setdefault(layer, {})
        row[kind] = row.get(kind, 0) + int(nbytes)

    def call(self, layer: Optional[int]) -> None:
        if layer is not None:
            self.calls[layer] = self.calls.get(layer, 0) + 1

    def layer_total(self, layer: int, kinds: Optional[tuple[str, ...]] = None) -> int:
        row = self.bytes.get(layer, {})
        return sum(v for k, v in row.items() if kinds is None or k in kinds)

    def total(self, kinds: Optional[tuple[str, ...]] = None) -> int:
        return sum(self.layer_total(layer, kinds) for layer in self.bytes)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def as_dict(self) -> dict:
        return {"bytes": {str(k): dict(v) for k, v in sorted(self.bytes.items())},
                "calls": {str(k): v for k, v in sorted(self.calls.items())}}


def units_of(x: torch.Tensor, block: int) -> torch.Tensor:
    """``[B, T, H, Dh]`` (T = n_own * block) -> ``[B * H * n_own, block, Dh]`` units (a copy), id ``(b*H + h)*n_own + j``."""
    b, t, h, d = x.shape
    if t % block:
        raise ValueError(f"a sequence-wise chunk must be whole blocks: {t} tokens, block {block}")
    return x.view(b, t // block, block, h, d).permute(0, 3, 1, 2, 4).reshape(b * h * (t // block), block, d)


def from_units(u: torch.Tensor, b: int, h: int) -> torch.Tensor:
    """Inverse of :func:`units_of`: ``[B * H * n, block, Dh]`` -> ``[B, n * block, H, Dh]``."""
    n = u.shape[0] // (b * h)
    return u.view(b, h, n, u.shape[1], u.shape[2]).permute(0, 2, 3, 1, 4).reshape(b, n * u.shape[1], h, u.shape[2])


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


@dataclass
class BlockFetchPlan:
    """Who sends which units to whom, for one layer call (built once; the backward reuses it).

    ``want``: the unit ids this rank receives, grouped by owner in owner order (``[N_recv]`` int64);
    ``recv_counts[r]``: how many of them come from owner r (this rank's own entry is 0: it keeps its blocks);
    ``send_ids``: the local unit ids this rank sends, grouped by destination; ``send_counts[r]``: how many
    go to rank r. Host lists: the all-to-alls need their split sizes on the host (one sync per plan)."""

    want: torch.Tensor
    recv_counts: list
    send_ids: torch.Tensor
    send_counts: list
    group: object
    order: Optional[torch.Tensor] = None
    """``want[p]`` is the caller's wanted unit ``order[p]`` (the argsort that grouped them by owner)."""
    layer: Optional[int] = None
    counter: Optional[CommCounter] = None

    @classmethod
    def build(cls, owner: torch.Tensor, unit: torch.Tensor, *, group, layer: Optional[int] = None,
              counter: Optional[CommCounter] = None) -> "BlockFetchPlan":
        """From the wanted units' owners and ids (``[N]`` int64 each, owners != this rank, any order; ids on
        their owner): exchanges the counts and the ids (collectives over ``group``: every rank calls it)."""
        size, me = _world(group)
        if owner.numel() and bool((owner == me).any()):
            raise ValueError(f"rank {me} asked itself for blocks it owns")
        order = torch.argsort(owner * (unit.max() + 1 if unit.numel() else 1) + unit, stable=True)
        owner, want = owner[order], unit[order].contiguous()
        recv = torch.bincount(owner, minlength=size).to(torch.int64)
        send = torch.empty_like(recv)
        dist.all_to_all_single(send, recv, group=group)
        recv_counts, send_counts = recv.tolist(), send.tolist()
        send_ids = torch.empty(sum(send_counts), dtype=torch.int64, device=want.device)
        dist.all_to_all_single(send_ids, want, send_counts, recv_counts, group=group)
        if counter is not None:
            counter.add(layer, "counts", 8 * (size - 1))
            counter.add(layer, "ids", 8 * sum(recv_counts))
        return cls(want, recv_counts, send_ids, send_counts, group, order, layer, counter)

    @property
    def n_recv(self) -> int:
        return sum(self.recv_counts)


def _exchange(send: torch.Tensor, out_counts: list, in_counts: list, group) -> torch.Tensor:
    """Uneven all-to-all of ``[N, ...]`` rows: ``in_counts[r]`` rows of ``send`` go to rank r, ``out_counts[r]``
    rows come from rank r."""
    tail = send.shape[1:]
    out = send.new_empty((sum(out_counts), *tail))
    dist.all_to_all_single(out, send.contiguous(), out_counts, in_counts, group=group)
    return out


class FetchBlocks(torch.autograd.Function):
    """``(k_units, v_units [N_own_total, block, Dh], plan) -> (k, v [N_recv, block, Dh])``: the wanted units
    of the other ranks (``plan.want`` order). Backward: their gradients back to the owners, summed into
    the owners' unit gradients (the adjoint of the gather)."""

    @staticmethod
    def forward(ctx, k_units: torch.Tensor, v_units: torch.Tensor, plan: BlockFetchPlan):
        ctx.plan, ctx.n_own = plan, k_units.shape[0]
        send = torch.stack((k_units.index_select(0, plan.send_ids), v_units.index_select(0, plan.send_ids)), 1)
        recv = _exchange(send, plan.recv_counts, plan.send_counts, plan.group)
        if plan.counter is not None:
            plan.counter.add(plan.layer, "kv", send.numel() * send.element_size())
        return recv[:, 0], recv[:, 1]

    @staticmethod
    def backward(ctx, dk: Optional[torch.Tensor], dv: Optional[torch.Tensor]):
        plan = ctx.plan
        n = plan.n_recv
        like = dk if dk is not None else dv
        dk = torch.zeros_like(like) if dk is None else dk
        dv = torch.zeros_like(like) if dv is None else dv
        grad = torch.stack((dk, dv), 1) if n else like.new_empty((0, 2, *like.shape[1:]))
        back = _exchange(grad, plan.send_counts, plan.recv_counts, plan.group)
        if plan.counter is not None:
            plan.counter.add(plan.layer, "kv_grad", grad.numel() * grad.element_size())
        dk_own = like.new_zeros((ctx.n_own, *like.shape[1:])).index_add_(0, plan.send_ids, back[:, 0])
        dv_own = like.new_zeros((ctx.n_own, *like.shape[1:])).index_add_(0, plan.send_ids, back[:, 1])
        return dk_own, dv_own, None


def fetch_blocks(k_units: torch.Tensor, v_units: torch.Tensor, plan: BlockFetchPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`FetchBlocks` (differentiable in both unit tensors)."""
    return FetchBlocks.apply(k_units, v_units, plan)
