"""Shared pieces of the sparse-attention ops: shape checks, the padding (``valid_len``) handling,
dense SDPA, and the error type. The block-sparse kernels are backends
(:mod:`ds_adaptive.attention.backends`: ``flex``, ``reference``, ...); their functions stay importable
from here under their old names.

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

__all__ = ["SparseKernelError", "check_qkv", "dense_attention", "split_valid", "truncate_selection",
           "block_mask_from_selection", "flex_block_sparse_attention", "masked_attention_reference",
           "transpose_blocks", "compiled_graphs", "REFERENCE_MAX_TOKENS"]

# moved to the backends; importable from here as before (PEP 562: resolved on first access)
_MOVED = {"block_mask_from_selection": "flex", "flex_block_sparse_attention": "flex", "transpose_blocks": "flex",
          "compiled_graphs": "flex", "masked_attention_reference": "reference", "REFERENCE_MAX_TOKENS": "reference"}


def __getattr__(name: str):
    mod = _MOVED.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"ds_adaptive.attention.backends.{mod}"), name)


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
