"""Exact attention statistics on a subsample of query rows: block mass, density, recall.

All functions take head-local ``q, k`` ``[B, S, H, Dh]`` (after RoPE, after the Ulysses
all-to-all) and a ``[n]`` int64 tensor of sampled query positions; they compute the exact
logits of those rows only (``[B, H, n, S]`` fp32, ``n << S``), never the S x S matrix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ds_adaptive.attention.selection import BlockSelection


ROWS_PER_BLOCK = 8
"""Profiled query rows per sampled query block (:func:`sample_rows` with ``block_size``)."""


def sample_rows(seq_len: int, n: int, *, generator: Optional[torch.Generator] = None,
                valid_len: Optional[int] = None, device=None) -> torch.Tensor:
    """``min(n, valid)`` distinct query positions in ``[0, valid_len)``, sorted, int64."""
    valid = seq_len if valid_len is None else min(valid_len, seq_len)
    n = min(n, valid)
    rows = torch.randperm(valid, generator=generator)[:n].sort().values
    return rows.to(device)


def sample_row_groups(seq_len: int, n: int, block_size: int, *, generator: Optional[torch.Generator] = None,
                      valid_len: Optional[int] = None, device=None,
                      per_block: int = ROWS_PER_BLOCK) -> tuple[torch.Tensor, int]:
    """``(rows, per_block)``: ``per_block`` random rows (sorted) from each of ``n // per_block`` random
    query blocks that lie wholly in the valid tokens, block after block (what :func:`profile_rows`
    needs to measure a query block's need); every row of the whole blocks (``per_block = block_size``)
    when ``n`` covers them; ``(sample_rows(...), 1)`` when no whole block is valid or fewer than
    ``per_block`` rows are asked for. Drawn on the host: no device sync."""
    valid = seq_len if valid_len is None else min(valid_len, seq_len)
    whole = valid // block_size
    if whole < 1 or n < per_block or per_block > block_size or per_block < 2:
        return sample_rows(seq_len, n, generator=generator, valid_len=valid_len, device=device), 1
    if n >= whole * block_size:  # every row of every whole block (no draw: the same on every rank)
        return torch.arange(whole * block_size).to(device), block_size
    blocks = torch.randperm(whole, generator=generator)[:n // per_block].sort().values
    picks = torch.stack([torch.randperm(block_size, generator=generator)[:per_block] for _ in range(len(blocks))])
    rows = (blocks[:, None] * block_size + picks.sort(dim=1).values).reshape(-1)
    return rows.to(device), per_block


def exact_logits(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, *,
                 valid_len: Optional[int] = None) -> torch.Tensor:
    """``[B, H, n, S]`` fp32 scaled logits ``q[rows] k^T / sqrt(Dh)``; keys >= valid_len get -inf."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    qs = q[:, rows].float().transpose(1, 2)  # [B, H, n, Dh]
    logits = torch.matmul(qs, k.float().permute(0, 2, 3, 1)) * scale  # [B, H, n, S]
    if valid_len is not None and valid_len < k.shape[1]:
        logits[..., valid_len:] = float("-inf")
    return logits


def block_mass(logits: torch.Tensor, block_size: int) -> torch.Tensor:
    """Softmax mass of each key block: ``[B, H, n, S]`` logits -> ``[B, H, n, nk]`` fp32 (rows sum to 1)."""
    p = torch.softmax(logits.float(), dim=-1)
    s = p.shape[-1]
    nk = math.ceil(s / block_size)
    pad = nk * block_size - s
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    return p.view(*p.shape[:-1], nk, block_size).sum(-1)


def blocks_needed(mass: torch.Tensor, target: float) -> torch.Tensor:
    """``[..., nk]`` block masses -> ``[...]`` int64: fewest blocks whose mass sums to >= target."""
    srt = mass.sort(dim=-1, descending=True).values
    csum = srt.cumsum(-1)
    # blocks strictly below the target, plus the one that crosses it
    return ((csum < target - 1e-7).sum(-1) + 1).clamp(max=mass.shape[-1])


@dataclass
class RowStats:
    """What one profiling pass measured for one layer (local heads)."""

    density: torch.Tensor
    """[H] fp32: mean share of key blocks needed to hold ``mass`` of the softmax, per head (per
    sampled query block: the blocks its rows share, as a block selection selects them)."""
    recall: Optional[torch.Tensor]
    """[H] fp32: mean softmax mass inside the selected key blocks (None without a selection)."""


def profile_rows(logits: torch.Tensor, rows: torch.Tensor, block_size: int, mass: float,
                 selection: Optional[BlockSelection] = None, per_block: int = 1) -> RowStats:
    """Density per head (and recall of ``selection``) from the exact logits of sampled rows.

    When ``rows`` come in groups of ``per_block`` > 1 from one query block each
    (:func:`sample_row_groups`), a head's density is what a query block needs: the fewest key blocks
    whose mass, averaged over the group's rows, reaches ``mass`` (a block selection gives all rows of
    a query block the same key blocks, so per-row needs understate it: on sharp RoPE windows the
    selection then kept ~0.9 at a 0.99 target; tests/unit/attention/test_sparse_mass.py). Otherwise per row."""
    bm = block_mass(logits, block_size)  # [B, H, n, nk]
    nk = bm.shape[-1]
    n = rows.numel()
    need_of = bm.view(*bm.shape[:2], n // per_block, per_block, nk).mean(3) if per_block > 1 else bm
    density = (blocks_needed(need_of, mass).float() / nk).mean(dim=(0, 2))
    recall = None
    if selection is not None:
        qblk = torch.div(rows, block_size, rounding_mode="floor").to(bm.device)
        dense = selection.dense_block_mask()[:, :, qblk]  # [B, H, n, nk]
        recall = (bm * dense).sum(-1).mean(dim=(0, 2))
    return RowStats(density=density, recall=recall)
