"""Low-rank predictor of attention logits: per layer and head, rank-r projections of the head's own q and k.

``pred_logits = (q Wq_h) (k Wk_h)^T`` approximates ``q k^T / sqrt(Dh)`` of head h. The predictor
reads the real q / k of the layer (after RoPE and after the Ulysses all-to-all: head-local, no extra
communication) and never feeds anything back into the DiT: it is trained on detached tensors with
its own optimizer. Block scores for selection are the block means of the predicted logits, which by
linearity are ``mean_block(q Wq) . mean_block(k Wk)`` (cost O(S r) + O(nq nk r) per head).

Why q/k and not DSV's hidden-state projection: DSV projects the layer input x to rank-r "q'/k'",
which sees neither RoPE (the positional part of the logits, the source of spatio-temporal locality)
nor, under Ulysses, the full sequence of the local heads without an extra all-to-all.
``bench/kernels/sparse_predictor_compare.py`` measures both on planted data (see docs/SPARSE.md).

Parameters live in this module (fp32), outside the DiT's module tree, so ZeRO-3 never partitions
them; ``SparseAttentionRuntime`` all-reduces their gradients over DP x SP.
"""
from __future__ import annotations

import functools

from typing import Optional, Sequence

import torch
import torch.nn as nn

from ds_adaptive.attention.selection import pool_blocks



@functools.lru_cache(maxsize=256)
def _head_index(heads: tuple, device: torch.device) -> torch.Tensor:
    """The head ids as an index tensor on ``device``, made once per (placement, device): a head
    placement changes only at a re-plan, and a fresh tensor per call is a blocking host-to-device copy."""
    return torch.tensor(heads, dtype=torch.long, device=device)

class LowRankPredictor(nn.Module):
    """``wq, wk``: ``[L, H, Dh, r]`` fp32 parameters (all heads of every layer, replicated)."""

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, rank: int = 16, seed: int = 0):
        super().__init__()
        if rank < 1 or rank > head_dim:
            raise ValueError(f"sparse_attention.predictor_rank must be in [1, head_dim={head_dim}], got {rank}")
        g = torch.Generator().manual_seed(seed)
        # orthonormal columns scaled so that q P P^T k ~ a projection of q k^T / sqrt(Dh) at init
        basis = torch.linalg.qr(torch.randn(num_layers * num_heads, head_dim, head_dim, generator=g))[0][..., :rank]
        basis = basis.reshape(num_layers, num_heads, head_dim, rank) * head_dim ** -0.25
        self.wq = nn.Parameter(basis.clone())
        self.wk = nn.Parameter(basis.clone())
        self.rank = rank

    @staticmethod
    def head_weights(w: torch.Tensor, layer: int, heads: "int | Sequence[int]", n: int) -> torch.Tensor:
        """``w[layer]`` of the local heads ``[n, Dh, r]``: ``heads`` is the first head of a contiguous
        slice (an int) or the original head id of each local head (a Ulysses head placement)."""
        if isinstance(heads, int):
            return w[layer, heads:heads + n]
        return w[layer].index_select(0, _head_index(tuple(heads), w.device))

    def project(self, layer: int, x: torch.Tensor, which: str, head_offset: "int | Sequence[int]" = 0) -> torch.Tensor:
        """x ``[B, S, Hl, Dh]`` (local heads ``head_offset .. head_offset+Hl``, or the head ids
        ``head_offset``) -> ``[B, S, Hl, r]`` fp32."""
        w = self.head_weights(self.wq if which == "q" else self.wk, layer, head_offset, x.shape[2])
        return torch.einsum("bshd,hdr->bshr", x.float(), w)

    @torch.no_grad()
    def block_scores(self, layer: int, q: torch.Tensor, k: torch.Tensor, block_size: int,
                     head_offset: "int | Sequence[int]" = 0, mode: str = "mean") -> torch.Tensor:
        """``[B, H, nq, nk]`` fp32 block scores (higher = more attention). ``mode="mean"``: block means
        of the predicted logits; ``"lse"``: log-sum-exp over each key block of the predicted logits of
        the query block's mean projection.

        ``mean``: by linearity the block means of q / k are pooled first (one fp32-accumulating pass
        over q and k, no copy of them) and projected in fp32 ([B, H, n, Dh] x [H, Dh, r]): a handful
        of small kernels. ``lse`` projects every key in k's dtype (fp32 accumulation)."""
        return self.key_columns(layer, self.query_summary(layer, q, block_size, head_offset), k, block_size,
                                head_offset, mode=mode)

    @torch.no_grad()
    def query_summary(self, layer: int, q: torch.Tensor, block_size: int,
                      head_offset: "int | Sequence[int]" = 0) -> torch.Tensor:
        """``[B, H, nq, r]`` fp32: each query block's mean query projected (what both modes score with)."""
        wq = self.head_weights(self.wq, layer, head_offset, q.shape[2])
        return torch.matmul(pool_blocks(q, block_size), wq)

    @torch.no_grad()
    def key_columns(self, layer: int, qp: torch.Tensor, k: torch.Tensor, block_size: int,
                    head_offset: "int | Sequence[int]" = 0, mode: str = "mean") -> torch.Tensor:
        """Block scores of query summaries ``qp [B, H, n, r]`` (:meth:`query_summary`) against the key blocks of
        k ``[B, S_k, H, Dh]``: ``[B, H, n, ceil(S_k / block)]`` fp32. A sequence-wise rank computes its own key
        blocks' columns for every query block this way."""
        wk = self.head_weights(self.wk, layer, head_offset, k.shape[2])
        if mode == "mean":
            kp = torch.matmul(pool_blocks(k, block_size), wk)
            return torch.matmul(qp, kp.transpose(-1, -2))
        kt = torch.einsum("bshd,hdr->bshr", k, wk.to(k.dtype))
        # "lse": log-sum-exp over each key block of the mean query's predicted logits to every key
        # (closer to the block's softmax mass than the mean logit; O(nq * S * r) per head)
        logits = torch.matmul(qp, kt.float().transpose(1, 2).transpose(-1, -2))  # [B, H, nq, S]
        s = logits.shape[-1]
        nk = -(-s // block_size)
        if nk * block_size != s:
            logits = torch.nn.functional.pad(logits, (0, nk * block_size - s), value=float("-inf"))
        return torch.logsumexp(logits.view(*logits.shape[:-1], nk, block_size), dim=-1)

    def loss(self, layer: int, q_rows: torch.Tensor, k: torch.Tensor, logits: torch.Tensor,
             head_offset: "int | Sequence[int]" = 0, valid_len: Optional[int] = None, cos_weight: float = 0.9) -> torch.Tensor:
        """Loss of the predicted rows against the exact ones.

        q_rows ``[B, n, Hl, Dh]`` sampled queries, k ``[B, S, Hl, Dh]``, logits ``[B, Hl, n, S]`` exact
        scaled logits of those rows. ``cos_weight * (1 - cos(pred, exact)) + (1 - cos_weight) *
        mean(((pred - exact) / std(exact))^2)`` per row, averaged: the cosine term fits the shape of the
        row, the MSE on rows normalised by the exact row's spread fits its scale. Keys >= valid_len
        are left out. Inputs are detached here.
        """
        s = k.shape[1] if valid_len is None else min(valid_len, k.shape[1])
        qp = self.project(layer, q_rows.detach(), "q", head_offset).transpose(1, 2)  # [B, H, n, r]
        kp = self.project(layer, k[:, :s].detach(), "k", head_offset).transpose(1, 2)  # [B, H, s, r]
        pred = torch.matmul(qp, kp.transpose(-1, -2))
        exact = logits[..., :s].detach().float()
        cos = torch.nn.functional.cosine_similarity(pred, exact, dim=-1, eps=1e-6)
        std = exact.std(dim=-1, keepdim=True).clamp_min(1e-6)
        mse = ((pred - exact) / std).square().mean(-1)
        return (cos_weight * (1.0 - cos) + (1.0 - cos_weight) * mse).mean()


def count_parameters(num_layers: int, num_heads: int, head_dim: int, rank: int) -> int:
    return 2 * num_layers * num_heads * head_dim * rank


__all__ = ["LowRankPredictor", "count_parameters"]
