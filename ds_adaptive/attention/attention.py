"""Shared pieces of the sparse-attention ops: shape checks, the padding (``valid_len``) handling,
dense SDPA, and the error type. The block-sparse kernels are backends
(:mod:`ds_adaptive.attention.backends`: ``flex``, ``reference``, ...).

All functions take ``q, k, v`` ``[B, S, H, Dh]`` (the model's attention-fn layout) and return
``[B, S, H, Dh]``. ``valid_len``: positions >= valid_len are padding (Ulysses pads S to a multiple
of the SP degree): like ``parallel.ulysses.valid_len_attention`` the real tokens are attended among
themselves and padded query rows give 0.

* :func:`dense_attention`: SDPA (cuDNN / flash), what a layer runs where sparse would not pay.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ds_adaptive.attention.selection import BlockSelection

__all__ = ["SparseKernelError", "check_qkv", "dense_attention", "split_valid", "truncate_selection", "transpose_blocks"]


class SparseKernelError(RuntimeError):
    """The block-sparse kernel cannot run as configured (shape budget, device, fallback guard)."""


def truncate_selection(selection: BlockSelection, valid_len: int) -> BlockSelection:
    """The selection restricted to the first ``valid_len`` tokens (blocks past them dropped)."""
    n = math.ceil(valid_len / selection.block_size)
    if n == selection.num_blocks:
        return BlockSelection(selection.kv_num, selection.kv_idx, selection.block_size, valid_len)
    dense = selection.dense_block_mask()[..., :n, :n]
    dense.diagonal(dim1=-2, dim2=-1).fill_(True)  # a row whose blocks were all padding keeps its own
    return BlockSelection.from_dense(dense, selection.block_size, valid_len)


def split_valid(q, k, v, selection: BlockSelection, valid_len: Optional[int]):
    """``(q, k, v, selection, pad)`` restricted to the first ``valid_len`` tokens; ``pad``: the
    padded rows the caller appends (as zeros) to the output."""
    s = q.shape[1]
    if valid_len is None or valid_len >= s:
        return q, k, v, selection, 0
    if valid_len < 1:
        raise ValueError(f"valid_len must be >= 1, got {valid_len}")
    return q[:, :valid_len], k[:, :valid_len], v[:, :valid_len], truncate_selection(selection, valid_len), s - valid_len


def check_qkv(q, k, v, selection: BlockSelection) -> None:
    """q, k, v ``[B, S, H, Dh]`` alike and ``selection`` for (B, H, ceil(S / block)) over S tokens."""
    b, s, h, _ = q.shape
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k, v must be [B, S, H, Dh] alike, got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if selection.seq_len != s or tuple(selection.kv_num.shape) != (b, h, math.ceil(s / selection.block_size)):
        raise ValueError(f"selection is for {tuple(selection.kv_num.shape)} (B, H, blocks) over {selection.seq_len} "
                         f"tokens, q is {list(q.shape)} with block {selection.block_size}")


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    valid_len: Optional[int] = None) -> torch.Tensor:
    """SDPA on the real tokens (cuDNN / flash on CUDA), padded query rows 0."""
    s = q.shape[1]
    if valid_len is not None and valid_len < s:
        q, k, v = q[:, :valid_len], k[:, :valid_len], v[:, :valid_len]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return F.pad(out, (0, 0, 0, 0, 0, s - q.shape[1])) if q.shape[1] < s else out


def transpose_blocks(kv_num: torch.Tensor, kv_idx: torch.Tensor, num_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The transposed block lists: for each key block, the query blocks that selected it.

    kv_num ``[B, H, nq]``, kv_idx ``[B, H, nq, w]`` (first ``kv_num`` entries valid, any order) ->
    ``(q_num [B, H, num_cols] int32, q_idx [B, H, num_cols, nq] int32)``, query blocks ascending,
    entries past ``q_num`` 0. A handful of vectorised kernels, no host sync (a bool scatter, an int32
    cumsum, one scatter of the positions), unlike ``BlockMask.from_kv_blocks``' vmapped dense
    transpose and argsort.
    """
    b, h, nq, w = kv_idx.shape
    valid = torch.arange(w, device=kv_idx.device) < kv_num.unsqueeze(-1)
    dense = torch.zeros(b, h, nq, num_cols + 1, dtype=torch.bool, device=kv_idx.device)
    dense.scatter_(-1, torch.where(valid, kv_idx.long(), num_cols), True)
    dense_t = dense[..., :num_cols].transpose(-1, -2)  # [B, H, nk, nq] view
    pos = dense_t.cumsum(-1, dtype=torch.int32)
    q_num = pos[..., -1].contiguous()
    q_idx = torch.zeros(b, h, num_cols, nq + 1, dtype=torch.int32, device=kv_idx.device)
    rows = torch.arange(nq, dtype=torch.int32, device=kv_idx.device).expand(b, h, num_cols, nq)
    q_idx.scatter_(-1, torch.where(dense_t, pos - 1, nq).long(), rows)
    return q_num, q_idx[..., :nq].contiguous()
