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
                  keep_diagonal: bool = True, keep_sink: bool = False) -> BlockSelection:
    """Top-k key blocks per query block.

    scores: [B, H, nq, nk] predicted block scores (any float dtype; higher = more attention).
    k_per_head: [H] ints in [1, nk]: key blocks per query block of each head.
    keep_diagonal: the query block's own key block (nq == nk) is always selected (it counts in k);
    keep_sink: key block 0 is always selected too.
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
    s = scores.float().clone()
    big = torch.finfo(torch.float32).max
    if keep_diagonal:
        s.diagonal(dim1=-2, dim2=-1).fill_(big)
    if keep_sink:
        s[..., 0] = big
    top = torch.topk(s, kmax, dim=-1, sorted=True).indices  # [B, H, nq, kmax]
    k_dev = k.to(s.device, non_blocking=True)
    # ascending block order inside each row's selection (K/V locality; flex_block_sparse_attention
    # relies on it to find the ragged last block at position kv_num - 1)
    valid = torch.arange(kmax, device=s.device) < k_dev.view(1, h, 1, 1)
    top = torch.where(valid, top, nk).sort(dim=-1).values
    kv_idx = torch.where(top < nk, top, 0).to(torch.int32).contiguous()
    kv_num = k_dev.view(1, h, 1).expand(b, h, nq).to(torch.int32).contiguous()
    return BlockSelection(kv_num=kv_num, kv_idx=kv_idx, block_size=block_size, seq_len=seq_len)


def pool_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean over blocks of consecutive tokens: [B, S, H, r] -> [B, H, n, r] fp32 (partial last block: its own mean)."""
    b, s, h, r = x.shape
    n = math.ceil(s / block_size)
    pad = n * block_size - s
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, 0, 0, 0, 0, pad))
    summed = xf.view(b, n, block_size, h, r).sum(2)  # [B, n, H, r]
    counts = torch.full((n,), float(block_size), device=x.device)
    counts[-1] = s - (n - 1) * block_size
    return (summed / counts.view(1, n, 1, 1)).transpose(1, 2)
