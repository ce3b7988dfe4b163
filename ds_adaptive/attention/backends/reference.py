"""The ``reference`` backend: masked dense attention in plain torch (S x S scores; tests and CPU).

Exact by construction and differentiable everywhere torch is, so it is the reference every other
backend is tested against, and ``auto``'s loud last resort on a device with no block-sparse kernel
(a CPU run). It materialises ``[B, H, S, S]``: sequences over :data:`REFERENCE_MAX_TOKENS` are refused.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ds_adaptive.attention.attention import SparseKernelError, check_qkv, split_valid
from ds_adaptive.attention.backends.base import BackendSupport, SparseAttentionBackend
from ds_adaptive.attention.backends.registry import register_backend
from ds_adaptive.attention.selection import BlockSelection
from ds_adaptive.core.contracts import KernelEfficiency

__all__ = ["ReferenceBackend", "masked_attention_reference", "REFERENCE_MAX_TOKENS"]

REFERENCE_MAX_TOKENS = 16384
"""The masked reference materialises [B, H, S, S]: refuse longer sequences (use a block-sparse backend)."""


def masked_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, *,
                               valid_len: Optional[int] = None) -> torch.Tensor:
    """Masked dense attention in q's dtype (fp32 softmax for 16-bit inputs); differentiable.
    q, k, v ``[B, S, H, Dh]`` -> ``[B, S, H, Dh]``, padded query rows past ``valid_len`` 0."""
    check_qkv(q, k, v, selection)
    q, k, v, sel, pad = split_valid(q, k, v, selection, valid_len)
    s = q.shape[1]
    if s > REFERENCE_MAX_TOKENS:
        raise SparseKernelError(
            f"the masked reference would materialise {s}x{s} scores per head; use a block-sparse "
            "adaptive_load.sparse_attention.backend ('auto' on a GPU) (limit REFERENCE_MAX_TOKENS = "
            f"{REFERENCE_MAX_TOKENS})")
    mask = sel.token_mask()  # [B, H, S, S]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = torch.matmul(qt.to(work), kt.to(work).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.matmul(p, vt.to(work)).to(q.dtype).transpose(1, 2)
    return F.pad(out, (0, 0, 0, 0, 0, pad)) if pad else out


@register_backend
class ReferenceBackend(SparseAttentionBackend):
    """Masked dense torch on any device, fwd+bwd; no speed-up (g = 1 at every density)."""

    name = "reference"
    support = BackendSupport(
        device_types=("cpu", "cuda"), backward_device_types=("cpu", "cuda"),
        dtypes=(torch.float64, torch.float32, torch.bfloat16, torch.float16), block_sizes=tuple(range(16, 1025, 16)),
        head_dims=None, runtime_shapes=True, materialises_scores=True, max_tokens=REFERENCE_MAX_TOKENS,
        notes="masked dense torch (S^2 memory): the exactness reference and the CPU path")

    def attention(self, q, k, v, selection, *, valid_len=None, density=None):
        return masked_attention_reference(q, k, v, selection, valid_len=valid_len)

    def shipped_efficiency(self, device, *, dtype, head_dim, block_size):
        # the whole S x S at every density: never cheaper than dense
        return KernelEfficiency((1e-6, 1.0), (1.0, 1.0), source="reference: masked dense, no speed-up")
