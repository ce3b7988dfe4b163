"""Triton kernels of the q / k RMSNorm + RoPE (``ds_adaptive.ops.qk_norm_rope``); imported only where triton imports.

Rows of ``X [N, D]`` (N = B * S tokens, row r is token ``r % S`` of the rope table), D = H * Dh channels; the
norm is over all D channels, the rotation turns the adjacent channel pairs (2j, 2j + 1) of every head by the
table's row: ``F [S, Dh / 2, 2]`` fp32 (cos, sin). A program walks rows ``pid, pid + P, ...`` (P programs) and
holds a row as ``[BLOCK_P, 2]`` (pairs x even / odd): one load, one store, no strided access.

Forward (per row): ``rstd = 1 / sqrt(mean(x^2) + eps)`` in fp32, ``n = round(x * rstd * w)`` (rounded to the
input dtype, as ``F.rms_norm`` returns it), then ``out = round(rotate(n))`` in fp32; ``rstd`` is saved.
Backward: the rotation's transpose ``dn = rotate^T(dout)``, then RMSNorm's backward ``dx = rstd * (dn * w -
xhat * mean(dn * w * xhat))`` with ``xhat = x * rstd``; the weight's gradient ``sum_rows(dn * xhat)`` is
accumulated per program in fp32 and written as one partial row per program (the host sums the P rows).
N, S and the strides are run-time arguments, never specialised: one compiled kernel per dtype and D.
"""
import triton
import triton.language as tl

_RUNTIME_INTS = ["N", "S"]
"""Arguments that vary with the micro-batch: never specialised (no recompiles)."""


@triton.jit
def _pair_offsets(BLOCK_P: tl.constexpr, NP: tl.constexpr):
    """Offsets ``[BLOCK_P, 2]`` of the (even, odd) channels of each pair, and the pairs' mask."""
    p = tl.arange(0, BLOCK_P)
    offs = 2 * p[:, None] + tl.arange(0, 2)[None, :]
    return p, offs, (p < NP)[:, None] & (tl.arange(0, 2)[None, :] < 2)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def qk_norm_rope_fwd(X, W, F, Out, Rstd, N, S, eps, D: tl.constexpr, HALF_DH: tl.constexpr,
                     BLOCK_P: tl.constexpr):
    """Grid (P,): rows pid, pid + P, ... of X -> Out (X's dtype) and Rstd [N] fp32."""
    NP: tl.constexpr = D // 2
    p, offs, mask = _pair_offsets(BLOCK_P, NP)
    f_offs = 2 * (p % HALF_DH)[:, None] + tl.arange(0, 2)[None, :]
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    for r in range(tl.program_id(0), N, tl.num_programs(0)):
        row = tl.cast(r, tl.int64) * D
        x = tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, 1), 0) / D + eps)
        n = (x * rstd * w).to(Out.dtype.element_ty).to(tl.float32)
        cs = tl.load(F + tl.cast(r % S, tl.int64) * (2 * HALF_DH) + f_offs, mask=mask, other=0.0)
        c, s = tl.split(cs)
        ne, no = tl.split(n)
        out = tl.join(ne * c - no * s, ne * s + no * c)
        tl.store(Out + row + offs, out.to(Out.dtype.element_ty), mask=mask)
        tl.store(Rstd + r, rstd)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def qk_norm_rope_bwd(G, X, W, F, Rstd, DX, DW, N, S, D: tl.constexpr, HALF_DH: tl.constexpr,
                     BLOCK_P: tl.constexpr):
    """Grid (P,): rows pid, pid + P, ... -> DX (X's dtype); DW [P, D] fp32: this program's weight-gradient sum."""
    NP: tl.constexpr = D // 2
    p, offs, mask = _pair_offsets(BLOCK_P, NP)
    f_offs = 2 * (p % HALF_DH)[:, None] + tl.arange(0, 2)[None, :]
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_P, 2], dtype=tl.float32)
    for r in range(tl.program_id(0), N, tl.num_programs(0)):
        row = tl.cast(r, tl.int64) * D
        ge, go = tl.split(tl.load(G + row + offs, mask=mask, other=0.0).to(tl.float32))
        c, s = tl.split(tl.load(F + tl.cast(r % S, tl.int64) * (2 * HALF_DH) + f_offs, mask=mask, other=0.0))
        dn = tl.join(ge * c + go * s, go * c - ge * s)   # the rotation's transpose
        rstd = tl.load(Rstd + r)
        xhat = tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32) * rstd
        dw += dn * xhat
        dxhat = dn * w
        m = tl.sum(tl.sum(dxhat * xhat, 1), 0) / D
        tl.store(DX + row + offs, (rstd * (dxhat - xhat * m)).to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + tl.program_id(0).to(tl.int64) * D + offs, dw, mask=mask)


ALL_KERNELS = (qk_norm_rope_fwd, qk_norm_rope_bwd)
