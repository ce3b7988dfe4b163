"""Block selection: per query block, the top-k key blocks by predicted score (k per head).

Shapes: ``B`` batch, ``H`` (local) heads, ``nq = nk = ceil(S / block)`` blocks of consecutive
(cube-ordered) tokens. A selection is stored FlexAttention-style but compact: ``kv_num [B, H, nq]``
int32 blocks per query block and ``kv_idx [B, H, nq, kmax]`` int32 block indices (ascending) whose
first ``kv_num`` entries are the selected blocks (the rest is padding, never read); kmax <= nk is
the largest k, so a layer's cached selection costs O(nq * k), not O(nq * nk).
``attention.block_mask_from_selection`` widens it to what ``BlockMask.from_kv_blocks`` takes
(we pass the blocks as *full* blocks: no mask_mod runs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


class SelectionError(ValueError):
    """Invalid selection arguments (k per head, densities, shapes)."""


@dataclass
class BlockSelection:
    """Selected key blocks per (sample, head, query block)."""

    kv_num: torch.Tensor
    """[B, H, nq] int32: number of selected key blocks of each query block."""
    kv_idx: torch.Tensor
    """[B, H, nq, kmax] int32 (kmax <= nk): selected key-block indices first (``kv_idx[..., :kv_num]``), ascending."""
    block_size: int
    """Tokens per block (query and key)."""
    seq_len: int
    """S: tokens (the last block may be partial)."""

    @property
    def num_blocks(self) -> int:
        """nk = nq = ceil(seq_len / block_size)."""
        return math.ceil(self.seq_len / self.block_size)

    def flex_indices(self) -> torch.Tensor:
        """``[B, H, nq, nk]`` int32 contiguous: kv_idx widened with zeros (BlockMask.from_kv_blocks' layout)."""
        pad = self.num_blocks - self.kv_idx.shape[-1]
        return torch.nn.functional.pad(self.kv_idx, (0, pad)).contiguous() if pad else self.kv_idx.contiguous()

    def density(self) -> torch.Tensor:
        """[H] share of (query block, key block) pairs selected, averaged over the batch."""
        return self.kv_num.float().mean(dim=(0, 2)) / self.num_blocks

    def dense_block_mask(self) -> torch.Tensor:
        """[B, H, nq, nk] bool: True where a key block is selected."""
        nk = self.num_blocks
        valid = torch.arange(self.kv_idx.shape[-1], device=self.kv_idx.device) < self.kv_num.unsqueeze(-1)
        idx = torch.where(valid, self.kv_idx.long(), nk)
        dense = torch.zeros(*self.kv_idx.shape[:-1], nk + 1, dtype=torch.bool, device=self.kv_idx.device)
        dense.scatter_(-1, idx, True)
        return dense[..., :nk]

    def token_mask(self) -> torch.Tensor:
        """[B, H, S, S] bool token-level mask (for the masked dense reference; S^2 memory)."""
        m = self.dense_block_mask()
        s, bs = self.seq_len, self.block_size
        return m.repeat_interleave(bs, dim=-2).repeat_interleave(bs, dim=-1)[..., :s, :s]

    @classmethod
    def from_dense(cls, mask: torch.Tensor, block_size: int, seq_len: int) -> "BlockSelection":
        """From a [B, H, nq, nk] bool block mask."""
        m = mask.to(torch.int32)
        kv_num = m.sum(-1, dtype=torch.int32)
        kv_idx = torch.argsort(m, dim=-1, descending=True, stable=True).to(torch.int32)
        return cls(kv_num=kv_num.contiguous(), kv_idx=kv_idx.contiguous(), block_size=block_size, seq_len=seq_len)

    @classmethod
    def full(cls, batch: int, heads: int, seq_len: int, block_size: int, device=None) -> "BlockSelection":
        """Every key block for every query block (== dense attention)."""
        n = math.ceil(seq_len / block_size)
        kv_num = torch.full((batch, heads, n), n, dtype=torch.int32, device=device)
        kv_idx = torch.arange(n, dtype=torch.int32, device=device).expand(batch, heads, n, n).contiguous()
        return cls(kv_num=kv_num, kv_idx=kv_idx, block_size=block_size, seq_len=seq_len)


def blocks_for_density(density: torch.Tensor | Sequence[float], num_blocks: int, *,
                       min_density: float = 0.0, max_density: float = 1.0) -> torch.Tensor:
    """[H] int64 key blocks per query block: ``ceil(clamp(density) * nk)``, at least 1, at most nk."""
    d = torch.as_tensor(density, dtype=torch.float64)
    if d.dim() != 1:
        raise SelectionError(f"density must be one value per head ([H]), got shape {list(d.shape)}")
    if not 0.0 <= min_density <= max_density <= 1.0:
        raise SelectionError(f"need 0 <= min_density ({min_density}) <= max_density ({max_density}) <= 1")
    d = d.clamp(min_density, max_density)
    return torch.ceil(d * num_blocks - 1e-9).long().clamp(1, num_blocks)


def select_blocks(scores: torch.Tensor, k_per_head: torch.Tensor, *, seq_len: int, block_size: int,
                  keep_diagonal: bool = True, keep_sink: bool = False, inplace: bool = False) -> BlockSelection:
    """Top-k key blocks per query block.

    scores: [B, H, nq, nk] predicted block scores (any float dtype; higher = more attention).
    k_per_head: [H] ints in [1, nk]: key blocks per query block of each head.
    keep_diagonal: the query block's own key block (nq == nk) is always selected (it counts in k);
    keep_sink: key block 0 is always selected too. ``inplace``: fp32 ``scores`` may be overwritten
    (saves a copy; the runtime passes its own fresh scores). No host sync: k is validated on the host.
    """
    b, h, nq, nk = scores.shape
    k = torch.as_tensor(k_per_head).long().cpu()  # validated on the host: no device sync
    if k.shape != (h,):
        raise SelectionError(f"k_per_head must have one entry per head ({h}), got shape {list(k.shape)}")
    if int(k.min()) < 1 or int(k.max()) > nk:
        raise SelectionError(f"k_per_head must be in [1, {nk}] (key blocks), got {k.tolist()}")
    forced = int(keep_diagonal) + int(keep_sink)
    if nq != nk and keep_diagonal:
        raise SelectionError(f"keep_diagonal needs nq == nk, got {nq} query and {nk} key blocks")
    k = k.clamp(min=min(forced, nk)) if forced else k
    kmax = int(k.max())
    s = scores if inplace and scores.dtype == torch.float32 else scores.float().clone()
    big = torch.finfo(torch.float32).max
    if keep_diagonal:
        s.diagonal(dim1=-2, dim2=-1).fill_(big)
    if keep_sink:
        s[..., 0] = big
    one_k = int(k.min()) == kmax  # one k for all heads (e.g. forced density): no padding entries
    # (per-head k: by score, so that a head's first k entries are its top k)
    top = torch.topk(s, kmax, dim=-1, sorted=not one_k).indices  # [B, H, nq, kmax]
    # ascending block order inside each row's selection (K/V locality; block_mask_from_selection
    # relies on it to find the ragged last block at position kv_num - 1)
    if one_k:
        kv_idx = top.to(torch.int32).sort(dim=-1).values
        kv_num = torch.full((b, h, nq), kmax, dtype=torch.int32, device=s.device)
        return BlockSelection(kv_num=kv_num, kv_idx=kv_idx, block_size=block_size, seq_len=seq_len)
    k_dev = k.to(s.device, non_blocking=True)
    valid = torch.arange(kmax, device=s.device) < k_dev.view(1, h, 1, 1)
    top = torch.where(valid, top, nk).sort(dim=-1).values
    kv_idx = torch.where(top < nk, top, 0).to(torch.int32).contiguous()
    kv_num = k_dev.view(1, h, 1).expand(b, h, nq).to(torch.int32).contiguous()
    return BlockSelection(kv_num=kv_num, kv_idx=kv_idx, block_size=block_size, seq_len=seq_len)


def pool_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean over blocks of consecutive tokens: [B, S, H, r] -> [B, H, n, r] fp32 (partial last block: its own mean).

    Sums in fp32 straight from x's dtype (no fp32 copy, no padding copy of x)."""
    b, s, h, r = x.shape
    full = s // block_size
    parts = []
    if full:
        parts.append(x[:, :full * block_size].reshape(b, full, block_size, h, r).sum(2, dtype=torch.float32)
                     .div_(block_size))
    if full * block_size < s:
        parts.append(x[:, full * block_size:].sum(1, keepdim=True, dtype=torch.float32).div_(s - full * block_size))
    out = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
    return out.transpose(1, 2)


def pooled_queries(q: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The query blocks' mean queries scaled by ``1 / sqrt(Dh)``, in ``dtype``: [B, S, H, Dh] -> [B, H, nq, Dh]
    (a strided view order; what both pooled-score paths multiply with the keys)."""
    return pool_blocks(q, block_size).mul_(q.shape[-1] ** -0.5).to(dtype)
