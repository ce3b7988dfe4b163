"""The pooled log-sum-exp block scores by a fused Triton kernel: the logits never reach memory.

:func:`triton_pooled_lse_scores` computes what :func:`ds_adaptive.attention.scores.pooled_lse_scores_torch`
(the torch reference and the CPU path) does, ``out[b, h, i, j] = log sum_{t in key block j} exp(qbar_i .
k_t / sqrt(Dh))`` with ``qbar_i`` the mean query of query block i (a partial last block: its own mean), for
q, k ``[B, S, H, Dh]`` (any strides with a contiguous last dim, e.g. a head slice) -> ``[B, H, nq, nk]``
fp32. The mean queries are pooled by torch exactly as the reference pools them (one read of q, fp32 sums,
scaled, rounded to k's dtype); the kernel (:mod:`._triton_block_scores`) then keeps the logits in registers:
the torch path writes ``nq x S`` 16-bit logits per head and reads them back in fp32 (memory bound), the
kernel reads K about ``nq / BLOCK_Q`` times from L2 and writes only the ``nq x nk`` scores. Its logits are
fp32 (the reference rounds them to k's dtype before the log-sum-exp): the scores agree within that rounding.

:func:`scores_unsupported` says why the kernel cannot run for given inputs (None: it can);
:func:`ds_adaptive.attention.scores.pooled_lse_scores` is the one dispatch point (kernel where it can run on
CUDA, else the torch reference).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ds_adaptive.attention.attention import SparseKernelError
from ds_adaptive.attention.kernels.triton_block_sparse import _launch, _prep, interpreted, triton_status
from ds_adaptive.attention.selection import pooled_queries

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Input dtypes (fp32 runs tl.dot in TF32 on a GPU: for tests; training passes bf16 / fp16)."""
HEAD_DIMS = (16, 32, 64, 128)
"""Head dims the kernel compiles for (a tile holds whole rows)."""
BLOCKS = (16, 32, 64, 128)
"""Selection blocks (tokens) the kernel takes: one key block is one tile."""

_alloc = torch.empty
"""Allocator of the output (the tests poison it with NaN)."""


@dataclass(frozen=True)
class ScoreTiles:
    """Launch shape of the scores kernel."""

    block_q: int = 64
    """Mean queries per program (rows of the tensor-core tile; a power of two >= 16)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 3
    """Software-pipelining depth of the K-block loads."""
    min_programs: int = 2048
    """The key blocks of a (b, h) are split over programs until the grid has at least this many (fills the
    GPU when B * H * query tiles is small); a program keeps at least ``min_key_blocks``."""
    min_key_blocks: int = 8
    """Fewest key blocks a program walks (amortises its mean-query load)."""

    def check(self) -> "ScoreTiles":
        """Raise :class:`SparseKernelError` naming a field the kernel cannot compile."""
        if not isinstance(self.block_q, int) or self.block_q < 16 or self.block_q & (self.block_q - 1):
            raise SparseKernelError(f"ScoreTiles.block_q must be a power of two >= 16, got {self.block_q!r}")
        if self.num_warps not in (1, 2, 4, 8, 16) or not 1 <= self.num_stages <= 6:
            raise SparseKernelError(f"ScoreTiles needs num_warps in 1..16 (a power of two) and num_stages in 1..6, "
                                    f"got {self.num_warps!r}, {self.num_stages!r}")
        if self.min_programs < 1 or self.min_key_blocks < 1:
            raise SparseKernelError(f"ScoreTiles.min_programs and min_key_blocks must be >= 1, got "
                                    f"{self.min_programs!r}, {self.min_key_blocks!r}")
        return self

    def key_blocks(self, nq: int, nk: int, bh: int) -> int:
        """Key blocks per program for ``nq`` query blocks, ``nk`` key blocks and ``bh`` = B * H."""
        base = bh * math.ceil(nq / self.block_q)
        splits = max(1, min(math.ceil(self.min_programs / base), nk // self.min_key_blocks))
        return math.ceil(nk / splits)

    def short(self) -> str:
        return f"q{self.block_q}w{self.num_warps}s{self.num_stages}"


def default_tiles(head_dim: int, block: int) -> ScoreTiles:
    """The tile config for a head dim and block: the fp32 logits tile ``64 x block`` takes 32 registers a thread
    at 4 warps for 64-token blocks; 128-token blocks use 8 warps (the same per thread). Unmeasured starting
    point: ``bench/kernels/sparse_select_cost.py --sweep`` times the alternatives."""
    return ScoreTiles(block_q=64, num_warps=8 if block >= 128 else 4)


def scores_unsupported(q: torch.Tensor, k: torch.Tensor, block_size: int, *,
                       allow_interpreter: bool = True) -> Optional[str]:
    """Why :func:`triton_pooled_lse_scores` cannot run on these inputs (None: it can). CPU tensors run only under
    the Triton interpreter (``TRITON_INTERPRET=1`` before the kernels import) and ``allow_interpreter``."""
    d = q.shape[-1]
    if q.dim() != 4 or k.shape != q.shape:
        return f"q and k must both be [B, S, H, Dh], got {list(q.shape)} and {list(k.shape)}"
    if q.dtype not in DTYPES or k.dtype != q.dtype:
        return f"triton pooled scores take q and k of one dtype in {[str(t) for t in DTYPES]}, got {q.dtype}, {k.dtype}"
    if d not in HEAD_DIMS:
        return f"triton pooled scores take head dims {list(HEAD_DIMS)}, got {d}"
    if block_size not in BLOCKS:
        return f"triton pooled scores take blocks of {list(BLOCKS)} tokens, got {block_size}"
    if q.device != k.device:
        return f"q and k on different devices ({q.device}, {k.device})"
    if q.is_cuda:
        ok, why = triton_status()
        return None if ok else why
    if q.device.type == "cpu" and allow_interpreter and triton_status()[0] and interpreted():
        return None
    return (f"triton pooled scores need CUDA tensors (got {q.device}); CPU tensors run only under the Triton "
            "interpreter (TRITON_INTERPRET=1 before the kernels import)")


def _kernel():
    from ds_adaptive.attention.kernels import _triton_block_scores
    return _triton_block_scores.pooled_lse_scores_kernel


@torch.no_grad()
def triton_pooled_lse_scores(q: torch.Tensor, k: torch.Tensor, block_size: int, *,
                             tiles: Optional[ScoreTiles] = None) -> torch.Tensor:
    """Pooled log-sum-exp block scores of q, k ``[B, S, H, Dh]`` -> ``[B, H, nq, nk]`` fp32 (see the module
    docstring). Raises :class:`SparseKernelError` for inputs the kernel does not take (:func:`scores_unsupported`)."""
    why = scores_unsupported(q, k, block_size)
    if why is not None:
        raise SparseKernelError(why)
    b, s, h, d = q.shape
    nb = -(-s // block_size)
    t = (tiles or default_tiles(d, block_size)).check()
    qbar = pooled_queries(q, block_size, k.dtype)  # [B, H, nq, Dh] (strided), scaled by 1/sqrt(Dh)
    k = _prep(k)  # in place where its tensor descriptor can read it (a head slice can), else a copy
    out = _alloc((b, h, nb, nb), dtype=torch.float32, device=q.device)
    kb = t.key_blocks(nb, nb, b * h)
    grid = (math.ceil(nb / t.block_q), math.ceil(nb / kb), b * h)
    _launch(_kernel(), grid, qbar, k, out, s, nb, nb, h, kb, qbar.stride(0), qbar.stride(1), qbar.stride(2),
            k.stride(0), k.stride(1), k.stride(2), BLOCK=block_size, BLOCK_Q=t.block_q, HEAD_DIM=d,
            num_warps=t.num_warps, num_stages=t.num_stages)
    return out
