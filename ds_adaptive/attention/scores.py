"""Block scores of the selection: the pooled log-sum-exp of each query block against each key block, by the fused
Triton kernel where it runs (:mod:`ds_adaptive.attention.kernels.triton_block_scores`) or the torch reference
(:func:`pooled_lse_scores_torch`); :func:`pooled_lse_scores` is the one dispatch point.
"""
from __future__ import annotations

import time

import torch

from ds_adaptive.attention.kernels.triton_block_scores import scores_unsupported, triton_pooled_lse_scores
from ds_adaptive.attention.selection import SelectionError, pooled_queries

SCORE_CHUNK_ELEMS = 1 << 26
"""Query-key logits of :func:`pooled_lse_scores_torch` held at once (64 Mi elements: 128 MiB in bf16)."""

SCORE_IMPLS = ("auto", "torch", "triton")
"""``pooled_lse_scores(impl=)``: ``auto`` = the fused Triton kernel on CUDA where it runs, else torch."""


@torch.no_grad()
def pooled_lse_scores(q: torch.Tensor, k: torch.Tensor, block_size: int, *,
                      chunk_elems: int = SCORE_CHUNK_ELEMS, impl: str = "auto") -> torch.Tensor:
    """Block scores from the real q and k: for query block i and key block j, the log-sum-exp over
    the keys of block j of the block's mean query's scaled logits, ``log sum_{t in j} exp(qbar_i .
    k_t / sqrt(Dh))`` (the log of the block's softmax mass up to the row's normaliser, for the mean
    query). q, k ``[B, S, H, Dh]`` -> ``[B, H, nq, nk]`` fp32.

    No predictor: the logits are exact for the mean query, so what a block holds (a sink, a far
    region, the local window through RoPE) is seen as attention sees it. Cost per head
    ``nq * S * Dh`` multiply-adds (tensor cores) and ``nq * S`` exps.

    The one dispatch point of the two implementations: ``impl="auto"`` runs the fused Triton kernel
    (:func:`ds_adaptive.attention.kernels.triton_block_scores.triton_pooled_lse_scores`: logits kept in
    registers) on CUDA tensors it takes (triton importable; head dim, block and dtype it compiles for),
    else :func:`pooled_lse_scores_torch` (the reference; CPU). ``"torch"`` / ``"triton"`` force one
    (``"triton"`` on CPU tensors only under ``TRITON_INTERPRET=1``). ``chunk_elems``: the torch path's
    logits held at once."""
    if impl not in SCORE_IMPLS:
        raise SelectionError(f"impl must be one of {SCORE_IMPLS}, got {impl!r}")
    if impl == "auto" and q.is_cuda:
        impl = "triton" if scores_unsupported(q, k, block_size, allow_interpreter=False) is None else "torch"
    if impl == "triton":
        return triton_pooled_lse_scores(q, k, block_size)
    return pooled_lse_scores_torch(q, k, block_size, chunk_elems=chunk_elems)


def warm_pooled_lse_scores(device, dtype: torch.dtype, heads: int, head_dim: int, block_size: int) -> float:
    """One tiny :func:`pooled_lse_scores` call on ``device`` (compiles the Triton kernel where the dispatch picks it:
    once, S and B are run-time arguments); seconds spent."""
    t0 = time.perf_counter()
    x = torch.zeros(1, block_size + 1, heads, head_dim, device=device, dtype=dtype)
    pooled_lse_scores(x, x, block_size)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - t0


@torch.no_grad()
def pooled_lse_scores_torch(q: torch.Tensor, k: torch.Tensor, block_size: int, *,
                            chunk_elems: int = SCORE_CHUNK_ELEMS) -> torch.Tensor:
    """:func:`pooled_lse_scores` in torch (the reference of the Triton kernel and the CPU path): the
    logits in q's dtype by matmul, then an fp32 log-sum-exp per key block, in query chunks of at most
    ``chunk_elems`` logits (memory bounded whatever S; memory bound in time: the logits round-trip)."""
    return lse_columns(pooled_queries(q, block_size, k.dtype), k, block_size, chunk_elems=chunk_elems)


@torch.no_grad()
def lse_columns(qbar: torch.Tensor, k: torch.Tensor, block_size: int, *,
                chunk_elems: int = SCORE_CHUNK_ELEMS) -> torch.Tensor:
    """The pooled log-sum-exp of given (already scaled) query summaries against the key blocks of ``k``:
    qbar ``[B, H, n, Dh]`` (k's dtype), k ``[B, S_k, H, Dh]`` -> ``[B, H, n, ceil(S_k / block)]`` fp32 (a
    partial last key block over its own keys). :func:`pooled_lse_scores_torch` is this with every query
    block's mean; a sequence-wise rank computes its own key blocks' columns for all query blocks."""
    b, h, n, _ = qbar.shape
    s = k.shape[1]
    nb = -(-s // block_size)
    full = s // block_size
    kt = k.permute(0, 2, 3, 1)  # [B, H, Dh, S] (a view)
    out = torch.empty(b, h, n, nb, dtype=torch.float32, device=k.device)
    step = max(1, chunk_elems // max(1, b * h * s))
    for i in range(0, n, step):
        lg = torch.matmul(qbar[:, :, i:i + step], kt)  # [B, H, c, S]
        c = lg.shape[2]
        if full:
            out[:, :, i:i + c, :full] = torch.logsumexp(
                lg[..., :full * block_size].unflatten(-1, (full, block_size)).float(), dim=-1)
        if full < nb:
            out[:, :, i:i + c, full] = torch.logsumexp(lg[..., full * block_size:].float(), dim=-1)
    return out
