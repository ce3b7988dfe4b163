"""Block-sparse attention by our Triton kernels: forward + backward, sequence length at run time.

:func:`triton_block_sparse_attention` takes ``q, k, v`` ``[B, S, H, Dh]`` (any strides with a contiguous
last dim; bf16 / fp16, fp32 for tests) and a compact
:class:`~ds_adaptive.attention.selection.BlockSelection` (blocks of ``block`` consecutive tokens, ragged
last block allowed) and returns ``[B, S, H, Dh]`` in q's dtype. ``valid_len``: positions >= valid_len
are padding, as in :func:`ds_adaptive.attention.attention.masked_attention_reference`: the real tokens
attend among themselves and padded rows give 0 (output and gradients).

* forward: one program per (query tile, b, h) walks the row's selected key blocks (online softmax in
  fp32, base 2) and saves the log-sum-exp ``[B, H, S]`` fp32 for backward;
* backward, FlashAttention-2's split without atomics: the dQ kernel (per query tile over its key
  blocks, computing ``delta = rowsum(out * dout)`` on the way) then the dK/dV kernel (per key tile over
  the query blocks that selected its block: :func:`~ds_adaptive.attention.attention.transpose_blocks`).
  ``KernelConfig.atomic_dq`` instead adds dQ from the dK/dV kernel by fp32 atomics (fewer GEMMs, not
  deterministic).

S, B and the lists' widths are run-time arguments Triton never specialises on: a new sequence length
or batch reuses the compiled kernels (one per dtype, head dim, block and tile config; the tile config
comes from :mod:`~ds_adaptive.attention.kernels.triton_configs`, never from S). The reference is
:func:`~ds_adaptive.attention.kernels.reference.reference_attention` (masked dense, any float dtype).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ds_adaptive.attention.attention import SparseKernelError, check_qkv, truncate_selection
from ds_adaptive.attention.kernels.triton_configs import KernelConfig, TileConfig, config_for
from ds_adaptive.attention.selection import BlockSelection
from ds_adaptive.attention.attention import transpose_blocks

LOG2E = 1.0 / math.log(2.0)
"""Softmax in base 2: scores are scaled by sm_scale * log2(e)."""

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Input dtypes (fp32 runs tl.dot in TF32 on a GPU: for tests; training uses bf16 / fp16)."""
HEAD_DIMS = (16, 32, 64, 128)
"""Head dims the kernels compile for (the tiles hold a whole head row)."""

_alloc = torch.empty
"""Allocator of every buffer the kernels write (the tests poison it with NaN)."""


def triton_status() -> tuple[bool, str]:
    """(True, version) when triton imports, else (False, why)."""
    try:
        import triton
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        return False, f"triton does not import: {type(exc).__name__}: {exc}"
    return True, triton.__version__


def _kernels():
    from ds_adaptive.attention.kernels import _triton_block_sparse
    return _triton_block_sparse


def interpreted() -> bool:
    """True when the kernels were built under ``TRITON_INTERPRET=1`` (they then run on CPU tensors)."""
    return type(_kernels().block_sparse_fwd).__name__ == "InterpretedFunction"


def compiled_kernels() -> int:
    """Compiled kernel variants in this process over the four kernels (a new S must not add one)."""
    return kernel_variants(_kernels().ALL_KERNELS)


def kernel_variants(kernels) -> int:
    """Compiled variants in this process of the given ``@triton.jit`` functions."""
    total = 0
    for fn in kernels:
        caches = getattr(fn, "device_caches", None)
        if caches is not None:  # triton >= 3.2: device -> (kernel_cache, ...)
            total += sum(len(c[0]) for c in caches.values())
        else:
            total += sum(len(c) for c in getattr(fn, "cache", {}).values())
    return total


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _prep(t: torch.Tensor) -> torch.Tensor:
    """``t`` if the tensor descriptors can read it in place (contiguous head dim, 16-byte aligned (b, h) rows),
    else a contiguous copy."""
    e = t.element_size()
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(t.stride(i) * e % 16 == 0 for i in range(3))
    return t if ok else t.contiguous()


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _launch(kernel, grid, *args, **kw) -> None:
    """Launch with the global scratch allocator the device-side tensor descriptors need (set per launch: it is
    context-local, and autograd runs the backward in its own threads)."""
    import triton

    triton.set_allocator(_scratch)
    kernel[grid](*args, **kw)


def _list_args(num: torch.Tensor, idx: torch.Tensor):
    num = num.to(torch.int32).contiguous()
    idx = idx.to(torch.int32)
    idx = idx if idx.stride(-1) == 1 else idx.contiguous()
    return num, idx, (num.stride(0), num.stride(1), idx.stride(0), idx.stride(1), idx.stride(2))


def block_sparse_forward(q, k, v, kv_num, kv_idx, *, block: int, seq: int, config: KernelConfig):
    """Raw forward on the first ``seq`` tokens: (out ``[B, S, H, Dh]`` (rows >= seq not written), lse
    ``[B, H, seq]`` fp32, log2 domain of the scaled scores)."""
    kern = _kernels()
    b, s_full, h, d = q.shape
    out = _alloc((b, s_full, h, d), dtype=q.dtype, device=q.device)
    lse = _alloc((b, h, seq), dtype=torch.float32, device=q.device)
    num, idx, lists = _list_args(kv_num, kv_idx)
    t = config.fwd
    grid = (math.ceil(seq / block) * (block // t.block_m), b * h)
    _launch(kern.block_sparse_fwd, grid, q, k, v, out, lse, num, idx, seq, h, *_strides(q), *_strides(k),
            *_strides(v), *_strides(out), *lists, (1.0 / math.sqrt(d)) * LOG2E, BLOCK=block, BLOCK_M=t.block_m,
            BLOCK_N=t.block_n, HEAD_DIM=d, num_warps=t.num_warps, num_stages=t.num_stages)
    return out, lse


class BackwardLaunch:
    """One backward's buffers and block lists (the kv lists, their transpose for dK/dV); its kernels launch
    one by one (:meth:`run` in order; ``bench/kernels/sparse_backends.py`` times each alone). Rows >= ``seq`` of the
    gradients are not written. ``out`` is the forward's (contiguous); ``dout`` is made contiguous like it."""

    def __init__(self, q, k, v, out, lse, dout, kv_num, kv_idx, *, block: int, seq: int):
        # dout shares out's strides (contiguous) and, like every descriptor base, 16-byte alignment
        if not (dout.is_contiguous() and dout.data_ptr() % 16 == 0):
            dout = dout.clone(memory_format=torch.contiguous_format)
        self.q, self.k, self.v, self.out, self.lse, self.dout = q, k, v, out, lse, dout
        self.block, self.seq = block, seq
        b, s_full, h, d = q.shape
        self.shape = (b, s_full, h, d)
        self.dq, self.dk, self.dv = (_alloc((b, s_full, h, d), dtype=q.dtype, device=q.device) for _ in range(3))
        self.delta = _alloc((b, h, seq), dtype=torch.float32, device=q.device)
        self.num, self.idx, self.kv_lists = _list_args(kv_num, kv_idx)
        self.nb = math.ceil(seq / block)
        self.q_num, self.q_idx, self.q_lists = _list_args(*transpose_blocks(self.num, self.idx, self.nb))
        self.common = (seq, h, *_strides(q), *_strides(k), *_strides(v), *_strides(out))
        self.sm_scale = 1.0 / math.sqrt(d)

    def run_delta(self) -> None:
        """delta = rowsum(out * dout), before the dQ / dK/dV kernels."""
        b, _, h, d = self.shape
        _launch(_kernels().block_sparse_delta, (math.ceil(self.seq / 64), b * h), self.out, self.dout, self.delta,
                self.seq, h, *_strides(self.out), BLOCK_M=64, HEAD_DIM=d)

    def run_dq(self, t: TileConfig) -> None:
        """dq (split mode; after :meth:`run_delta`)."""
        b, _, h, d = self.shape
        grid = (self.nb * (self.block // t.block_m), b * h)
        _launch(_kernels().block_sparse_bwd_dq, grid, self.q, self.k, self.v, self.dout, self.dq, self.lse,
                self.delta, self.num, self.idx, *self.common, *self.kv_lists, self.sm_scale * LOG2E, self.sm_scale,
                BLOCK=self.block, BLOCK_M=t.block_m, BLOCK_N=t.block_n, HEAD_DIM=d, num_warps=t.num_warps,
                num_stages=t.num_stages)

    def run_dkdv(self, t: TileConfig, atomic: bool) -> None:
        """dk, dv (and, ``atomic``, dq by fp32 atomics into a zeroed scratch, then cast)."""
        b, s_full, h, d = self.shape
        dq_acc = torch.zeros((b, s_full, h, d), dtype=torch.float32, device=self.q.device) if atomic else self.dq
        grid = (self.nb * (self.block // t.block_n), b * h)
        _launch(_kernels().block_sparse_bwd_dkdv, grid, self.q, self.k, self.v, self.dout, self.dk, self.dv, dq_acc,
                self.lse, self.delta, self.q_num, self.q_idx, *self.common, *self.q_lists, self.sm_scale * LOG2E,
                self.sm_scale, BLOCK=self.block, BLOCK_M=t.block_m, BLOCK_N=t.block_n, HEAD_DIM=d,
                ATOMIC_DQ=atomic, TMA_REDUCE=not interpreted(), num_warps=t.num_warps, num_stages=t.num_stages)
        if atomic:
            self.dq.copy_(dq_acc)

    def run(self, config: KernelConfig):
        """(dq, dk, dv)."""
        self.run_delta()
        if not config.atomic_dq:
            self.run_dq(config.dq)
        self.run_dkdv(config.dkdv, config.atomic_dq)
        return self.dq, self.dk, self.dv


def block_sparse_backward(q, k, v, out, lse, dout, kv_num, kv_idx, *, block: int, seq: int,
                          config: KernelConfig):
    """Raw backward on the first ``seq`` tokens: (dq, dk, dv) ``[B, S, H, Dh]`` in q's dtype (rows >= seq
    not written); see :class:`BackwardLaunch`."""
    return BackwardLaunch(q, k, v, out, lse, dout, kv_num, kv_idx, block=block, seq=seq).run(config)


class _TritonBlockSparse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kv_num, kv_idx, block, seq, config):
        out, lse = block_sparse_forward(q, k, v, kv_num, kv_idx, block=block, seq=seq, config=config)
        if seq < q.shape[1]:
            out[:, seq:].zero_()
        ctx.save_for_backward(q, k, v, out, lse, kv_num, kv_idx)
        ctx.block, ctx.seq, ctx.config = block, seq, config
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, kv_num, kv_idx = ctx.saved_tensors
        grads = block_sparse_backward(q, k, v, out, lse, dout, kv_num, kv_idx, block=ctx.block, seq=ctx.seq,
                                      config=ctx.config)
        if ctx.seq < q.shape[1]:
            for g in grads:
                g[:, ctx.seq:].zero_()
        return (*grads, None, None, None, None, None)


def check_inputs(q: torch.Tensor, selection: BlockSelection) -> None:
    """Raise :class:`SparseKernelError` for inputs the kernels do not take (dtype, head dim, block, device)."""
    d, bs = q.shape[-1], selection.block_size
    if q.dtype not in DTYPES:
        raise SparseKernelError(f"triton block-sparse attention takes {[str(t) for t in DTYPES]}, got {q.dtype}")
    if d not in HEAD_DIMS:
        raise SparseKernelError(f"triton block-sparse attention takes head dim in {HEAD_DIMS}, got {d}")
    if bs < 16 or bs > 128 or bs & (bs - 1):
        raise SparseKernelError(f"triton block-sparse attention takes blocks of 16..128 tokens (a power of two), got {bs}")
    if not q.is_cuda and not (q.device.type == "cpu" and interpreted()):
        raise SparseKernelError(f"triton block-sparse attention needs CUDA tensors (got {q.device}); CPU tensors run "
                                "only under the Triton interpreter (TRITON_INTERPRET=1 before the kernels import)")


def triton_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, *,
                                  valid_len: Optional[int] = None, density: Optional[float] = None,
                                  config: Optional[KernelConfig] = None) -> torch.Tensor:
    """Block-sparse attention of ``q, k, v`` ``[B, S, H, Dh]`` over ``selection``; ``[B, S, H, Dh]`` in q's dtype.

    ``density``: the selection's share of key blocks (host-known; picks the measured tile config's density
    bucket); ``config``: explicit tiles (overrides the table). Differentiable in q, k, v.
    """
    check_qkv(q, k, v, selection)
    check_inputs(q, selection)
    s = q.shape[1]
    seq = s if valid_len is None else min(int(valid_len), s)
    if seq < 1:
        raise ValueError(f"valid_len must be >= 1, got {valid_len}")
    sel = truncate_selection(selection, seq) if seq < s else selection
    cfg = (config or config_for(q.shape[-1], sel.block_size, density, q.device)).check(sel.block_size)
    q, k, v = _prep(q), _prep(k), _prep(v)
    return _TritonBlockSparse.apply(q, k, v, sel.kv_num, sel.kv_idx, sel.block_size, seq, cfg)

