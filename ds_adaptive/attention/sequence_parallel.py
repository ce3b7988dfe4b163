"""Sequence-wise block-sparse attention: a rank's query chunk against only the key blocks it selected.

The ``s`` ranks of a sequence-wise group (:class:`ds_adaptive.parallel.mesh.CPMesh`) hold the same heads
and consecutive chunks of ``T`` tokens (whole blocks: the runner pads the sequence so that a chunk is a set
of whole key blocks). Per layer call:

1. **scores** (:func:`shard_block_scores`): every rank pools its query blocks into summaries, the summaries
   are all-gathered (``1 / block`` of q), each rank scores all query blocks against *its own* key blocks
   (the same per-element computation as the one-process scores), and one equal all-to-all hands every
   rank the rows of its query blocks: ``[B, H, nq_local, nk]`` fp32;
2. **selection** (:func:`select_shard_blocks`): the top-k of those rows, the diagonal block (global index)
   and the sink kept as :func:`ds_adaptive.attention.selection.select_blocks` keeps them;
3. **fetch + kernel** (:func:`sequence_attention`): the union of the selected key blocks of the rank's
   query blocks, per (sample, head), is fetched block by block from their owners
   (:mod:`ds_adaptive.parallel.kv_gather`: counts, ids, then K and V stacked); the needed blocks are laid
   out in ascending global order in a compact key buffer, the selection is renumbered into it, and the
   block-sparse backend runs on (local queries, compact keys) through its ordinary interface. The
   backward of the fetch sends dK / dV back to the owners and sums them there.

A layer that runs dense in a sequence-wise mesh fetches every block (an all-gather of K and V) and runs
SDPA of the local queries against all keys.

Padding: ``valid`` real tokens; key blocks past them are never selected (``nk = ceil(valid / block)``);
the ragged last key block is placed last in the compact buffer so that the backend's ``valid_len`` masks
its padded keys; padded query rows give 0 (their output gradient is 0, so they add nothing to dK / dV).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_adaptive.attention.selection import BlockSelection, select_blocks
from ds_adaptive.parallel.kv_gather import BlockFetchPlan, CommCounter, fetch_blocks, units_of

__all__ = ["ShardGeometry", "shard_block_scores", "select_shard_blocks", "needed_blocks", "sequence_attention",
           "gather_full_keys"]


@dataclass(frozen=True)
class ShardGeometry:
    """Where a rank's chunk sits: ``valid`` real tokens of the sequence, ``block`` tokens per block, ``chunk``
    tokens per rank (a multiple of ``block``), rank ``rank`` of ``size``."""

    valid: int
    block: int
    chunk: int
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.chunk % self.block:
            raise ValueError(f"a sequence-wise chunk must be whole blocks: {self.chunk} tokens, block {self.block}")
        if self.valid > self.chunk * self.size:
            raise ValueError(f"{self.valid} real tokens do not fit {self.size} chunks of {self.chunk}")

    @property
    def chunk_blocks(self) -> int:
        return self.chunk // self.block

    @property
    def num_blocks(self) -> int:
        """nk = nq: blocks holding real tokens."""
        return math.ceil(self.valid / self.block)

    @property
    def first_block(self) -> int:
        return self.rank * self.chunk_blocks

    @property
    def real_query_blocks(self) -> int:
        """This rank's query blocks that hold real tokens."""
        return max(0, min(self.chunk_blocks, self.num_blocks - self.first_block))

    @property
    def real_tokens(self) -> int:
        """This rank's real tokens (its chunk's first ``real_tokens`` positions)."""
        return max(0, min(self.chunk, self.valid - self.rank * self.chunk))

    @property
    def last_block_tokens(self) -> int:
        """Real tokens of the last block (``block`` when the sequence is whole blocks)."""
        return self.valid - (self.num_blocks - 1) * self.block


def _gather_rows(x: torch.Tensor, group, counter: Optional[CommCounter], layer: Optional[int]) -> torch.Tensor:
    """All-gather ``[B, H, n, r]`` over the group along dim 2 (rank order)."""
    size = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    if counter is not None:
        counter.add(layer, "scores", x.numel() * x.element_size() * (size - 1))
    return torch.cat(parts, dim=2)


@torch.no_grad()
def shard_block_scores(q: torch.Tensor, k: torch.Tensor, geo: ShardGeometry, group, *,
                       summary: Callable[[torch.Tensor], torch.Tensor],
                       columns: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       counter: Optional[CommCounter] = None, layer: Optional[int] = None) -> torch.Tensor:
    """``[B, H, nq_local, nk]`` fp32 block scores of this rank's real query blocks against every real key block.

    q, k ``[B, T, H, Dh]`` (this rank's chunk). ``summary(q_real) -> [B, H, n, r]`` pools query blocks (the
    block-score kind's query side); ``columns(summaries, k_real) -> [B, H, n_all, nk_local]`` scores them
    against this rank's key blocks. Collectives over ``group`` (every rank calls, also one without real tokens).
    """
    n_own, nt = geo.chunk_blocks, geo.real_tokens
    qs = summary(q[:, :nt]) if nt else None
    probe = qs if qs is not None else summary(q[:, :1])  # shape and dtype of a summary row (a padding-only rank)
    rows = probe.new_zeros(probe.shape[0], probe.shape[1], n_own, probe.shape[3])
    if qs is not None:
        rows[:, :, :qs.shape[2]] = qs
    all_rows = _gather_rows(rows, group, counter, layer)  # [B, H, s * n_own, r]
    b, h = all_rows.shape[:2]
    cols = torch.full((b, h, all_rows.shape[2], n_own), float("-inf"), dtype=torch.float32, device=q.device)
    if nt:
        c = columns(all_rows, k[:, :nt])
        cols[..., :c.shape[-1]] = c
    send = cols.view(b, h, geo.size, n_own, n_own).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    if counter is not None:
        counter.add(layer, "scores", send.numel() * send.element_size() * (geo.size - 1) // geo.size)
    full = recv.permute(1, 2, 3, 0, 4).reshape(b, h, n_own, geo.size * n_own)
    return full[:, :, :geo.real_query_blocks, :geo.num_blocks].contiguous()


def select_shard_blocks(scores: torch.Tensor, k_per_head: torch.Tensor, geo: ShardGeometry, *,
                        keep_sink: bool = False) -> BlockSelection:
    """The top-k key blocks of this rank's query blocks (``scores [B, H, nq_local, nk]``, overwritten): the
    rows ``first_block ..`` of what :func:`select_blocks` selects over the whole sequence (the query
    block's own key block and, with ``keep_sink``, block 0 always kept). Key ids are global."""
    b, h, nq, nk = scores.shape
    k = torch.as_tensor(k_per_head).long().cpu().clamp(min=min(1 + int(keep_sink), nk))
    if nq == 0:
        return BlockSelection(torch.zeros(b, h, 0, dtype=torch.int32, device=scores.device),
                              torch.zeros(b, h, 0, int(k.max()), dtype=torch.int32, device=scores.device),
                              geo.block, geo.valid)
    rows = torch.arange(nq, device=scores.device)
    scores[:, :, rows, rows + geo.first_block] = torch.finfo(torch.float32).max
    return select_blocks(scores, k, seq_len=geo.valid, block_size=geo.block, keep_diagonal=False,
                         keep_sink=keep_sink, inplace=True)


def needed_blocks(selection: Optional[BlockSelection], batch: int, heads: int, nk: int, device) -> torch.Tensor:
    """``[B, H, nk]`` bool: the key blocks any of the rows of ``selection`` selected (None: every block)."""
    if selection is None:
        return torch.ones(batch, heads, nk, dtype=torch.bool, device=device)
    w = selection.kv_idx.shape[-1]
    valid = torch.arange(w, device=device) < selection.kv_num.unsqueeze(-1)
    idx = torch.where(valid, selection.kv_idx.long(), nk).flatten(2)
    out = torch.zeros(batch, heads, nk + 1, dtype=torch.bool, device=device)
    out.scatter_(-1, idx, True)
    return out[..., :nk]


def _fetch_plan(needed: torch.Tensor, geo: ShardGeometry, group, counter, layer):
    """The remote needed units' (b, h, block) and the plan that fetches them (collectives)."""
    b, h, nk = needed.shape
    owner_of = torch.arange(nk, device=needed.device) // geo.chunk_blocks
    remote = needed & (owner_of != geo.rank)
    bi, hi, j = remote.nonzero(as_tuple=True)
    owner = j // geo.chunk_blocks
    unit = (bi * h + hi) * geo.chunk_blocks + (j - owner * geo.chunk_blocks)
    plan = BlockFetchPlan.build(owner, unit, group=group, layer=layer, counter=counter)
    return (bi, hi, j), plan


def _compact_layout(needed: torch.Tensor, geo: ShardGeometry, n_rows: int, *, dense: bool):
    """``(slot_of [B, H, nk] int64, n_slots)``: the slot of every needed block in the compact buffer (ascending
    global order; the ragged last block in the last slot, so that ``valid_len`` masks its padded keys)."""
    b, h, nk = needed.shape
    ragged = geo.last_block_tokens < geo.block and not dense
    # with a ragged last block the last slot is its own: no other block may land there (valid_len cuts it)
    counts = needed[..., :nk - 1].sum(-1) + 1 if ragged else needed.sum(-1)
    n_slots = max(1, int(counts.max())) if needed.numel() else 1
    if not dense:
        n_slots = max(n_slots, n_rows + int(ragged))
    slot_of = needed.long().cumsum(-1) - 1
    if ragged:
        slot_of[..., nk - 1] = n_slots - 1
    return slot_of, n_slots


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: Optional[BlockSelection],
                       geo: ShardGeometry, group, *, kernel=None, density: Optional[float] = None,
                       counter: Optional[CommCounter] = None, layer: Optional[int] = None) -> torch.Tensor:
    """Attention of this rank's chunk q ``[B, T, H, Dh]`` over the key blocks its ``selection`` rows (global key
    ids, from :func:`select_shard_blocks`) select, k / v ``[B, T, H, Dh]`` the rank's own chunk; the other
    ranks' blocks are fetched. ``selection=None``: dense (every block). ``kernel``: a sparse-attention backend
    (``attention(q, k, v, selection, valid_len=, density=)``). Returns ``[B, T, H, Dh]`` in q's dtype, padded
    query rows 0; differentiable in q, k, v (the other ranks' dK / dV go back to them). Collectives over
    ``group``: every rank of it calls, in the same layer order."""
    b, t, h, d = q.shape
    nk, bs = geo.num_blocks, geo.block
    dense = selection is None
    needed = needed_blocks(selection, b, h, nk, q.device)
    (bi, hi, j), plan = _fetch_plan(needed, geo, group, counter, layer)
    k_units, v_units = units_of(k, bs), units_of(v, bs)
    k_recv, v_recv = fetch_blocks(k_units, v_units, plan)  # rows in plan.want order
    if counter is not None:
        counter.call(layer)
    nq = geo.real_query_blocks
    slot_of, n_slots = _compact_layout(needed, geo, nq, dense=dense)
    # the pool the compact buffer gathers from: own units, fetched units, one zero unit (empty slots)
    n_own = k_units.shape[0]
    zero = n_own + k_recv.shape[0]
    src = torch.full((b, h, n_slots), zero, dtype=torch.long, device=q.device)
    lb, lh, lj = (needed & ~_remote_mask(nk, geo, q.device)).nonzero(as_tuple=True)
    src[lb, lh, slot_of[lb, lh, lj]] = (lb * h + lh) * geo.chunk_blocks + (lj - geo.first_block)
    recv_pos = torch.empty_like(plan.order)
    recv_pos[plan.order] = torch.arange(plan.order.numel(), device=q.device)
    src[bi, hi, slot_of[bi, hi, j]] = n_own + recv_pos
    kc, vc = (_compact(torch.cat((u, r, u.new_zeros(1, bs, d))), src, b, h) for u, r in
              ((k_units, k_recv), (v_units, v_recv)))
    nt = geo.real_tokens
    if nt == 0:
        # a rank of padding only: its output is 0, but its backward must still run the fetch's (the others
        # send it their gradients of its blocks), so the output keeps a zero-valued edge to the buffers (and
        # to q: every parameter then gets a gradient, as under Ulysses)
        return q.new_zeros(b, t, h, d) + 0.0 * (kc.sum() + vc.sum() + q.sum())
    if dense:
        out = F.scaled_dot_product_attention(q[:, :nt].transpose(1, 2), kc[:, :geo.valid].transpose(1, 2),
                                             vc[:, :geo.valid].transpose(1, 2)).transpose(1, 2)
    else:
        sel = _renumber(selection, slot_of, n_slots, nk)
        qc = F.pad(q[:, :nq * bs], (0, 0, 0, 0, 0, n_slots * bs - nq * bs))
        ragged = geo.last_block_tokens < bs
        valid_len = (n_slots - 1) * bs + geo.last_block_tokens if ragged else None
        out = kernel.attention(qc, kc, vc, sel, valid_len=valid_len, density=density)[:, :nt]
    return F.pad(out, (0, 0, 0, 0, 0, t - nt)) if nt < t else out


def _remote_mask(nk: int, geo: ShardGeometry, device) -> torch.Tensor:
    return torch.arange(nk, device=device) // geo.chunk_blocks != geo.rank


def _compact(pool: torch.Tensor, src: torch.Tensor, b: int, h: int) -> torch.Tensor:
    """``pool [N, block, Dh]`` gathered at ``src [B, H, n]`` -> ``[B, n * block, H, Dh]`` (differentiable)."""
    n, bs, d = src.shape[-1], pool.shape[1], pool.shape[2]
    x = pool.index_select(0, src.reshape(-1)).view(b, h, n, bs, d)
    return x.permute(0, 2, 3, 1, 4).reshape(b, n * bs, h, d)


def _renumber(selection: BlockSelection, slot_of: torch.Tensor, n_slots: int, nk: int) -> BlockSelection:
    """The selection's rows with key ids as compact slots, padded with one-block rows to ``n_slots`` rows."""
    b, h, nq, w = selection.kv_idx.shape
    valid = torch.arange(w, device=slot_of.device) < selection.kv_num.unsqueeze(-1)
    idx = torch.gather(slot_of, 2, selection.kv_idx.long().clamp(max=nk - 1).flatten(2)).view(b, h, nq, w)
    idx = torch.where(valid, idx, 0).to(torch.int32)
    kv_idx = torch.zeros(b, h, n_slots, w, dtype=torch.int32, device=slot_of.device)
    kv_num = torch.ones(b, h, n_slots, dtype=torch.int32, device=slot_of.device)
    kv_idx[:, :, :nq] = idx
    kv_num[:, :, :nq] = selection.kv_num
    return BlockSelection(kv_num=kv_num, kv_idx=kv_idx, block_size=selection.block_size,
                          seq_len=n_slots * selection.block_size)


def gather_full_keys(k: torch.Tensor, geo: ShardGeometry, group, *, counter: Optional[CommCounter] = None,
                     layer: Optional[int] = None) -> torch.Tensor:
    """Every rank's real keys ``[B, valid, H, Dh]`` in sequence order (detached, for the profiler's exact
    logits on profiling steps; bytes counted as ``profile``). A collective over ``group``."""
    size = dist.get_world_size(group)
    parts = [torch.empty_like(k) for _ in range(size)]
    dist.all_gather(parts, k.detach().contiguous(), group=group)
    if counter is not None:
        counter.add(layer, "profile", k.numel() * k.element_size() * (size - 1))
    return torch.cat(parts, dim=1)[:, :geo.valid]
