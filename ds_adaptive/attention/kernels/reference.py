"""Masked dense reference of the block-sparse kernels: output and log-sum-exp, in any float dtype.

The kernels' tests run it in float64 (the exact answer) and in the kernels' low precision (torch's own
rounding error, the yardstick of the bounds). Same semantics as
:func:`ds_adaptive.attention.attention.masked_attention_reference` (``valid_len``: padded rows give 0),
plus the natural-log log-sum-exp of each row's scaled scores ``[B, H, valid]`` that the kernels save.
S^2 memory: test sizes only.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ds_adaptive.attention.attention import truncate_selection
from ds_adaptive.attention.selection import BlockSelection


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, *,
                        valid_len: Optional[int] = None, work_dtype: Optional[torch.dtype] = None):
    """(out ``[B, S, H, Dh]`` in q's dtype, lse ``[B, H, valid]`` in ``work_dtype``); differentiable.

    ``work_dtype``: the dtype of the scores, softmax and PV (default: q's, fp32 for 16-bit inputs)."""
    s = q.shape[1]
    seq = s if valid_len is None else min(valid_len, s)
    sel = truncate_selection(selection, seq) if seq < s else selection
    work = work_dtype or (torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype)
    qt, kt, vt = (t[:, :seq].transpose(1, 2).to(work) for t in (q, k, v))
    scores = torch.matmul(qt, kt.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~sel.token_mask(), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), vt).to(q.dtype).transpose(1, 2)
    return (F.pad(out, (0, 0, 0, 0, 0, s - seq)) if seq < s else out), lse
