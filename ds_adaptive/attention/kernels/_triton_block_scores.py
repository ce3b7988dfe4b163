"""Triton kernel of the pooled log-sum-exp block scores; imported only where triton imports.

``out[b, h, i, j] = log sum_{t in key block j} exp(qbar[b, h, i] . k[b, t, h])`` with ``qbar`` the query
blocks' mean queries already scaled by ``1 / sqrt(Dh)`` and rounded to k's dtype (the host pools them, one
read of q). Layout: ``Qbar [B, H, NQ, D]`` and ``K [B, S, H, D]`` by strides (last dim contiguous), ``Out
[B, H, NQ, NK]`` fp32 contiguous.

A program holds ``BLOCK_Q`` mean queries of one (b, h) in registers and walks a range of key blocks: per key
block one ``[BLOCK_Q, D] x [D, BLOCK]`` tensor-core product, the row max and the row sum of ``exp2`` (fp32, base
2: ``x * log2(e) - max * log2(e)`` is one FMA), and one stored column. The logits never leave registers. The
grid's fastest axis is the query tile, so the programs that run together read the same key blocks (from L2).
K tiles move by a tensor descriptor (TMA on Hopper; rows >= S read as zeros): the ragged last key block runs
in a separate step whose keys >= S are masked to -inf. S, NQ, NK, H and the strides are run-time arguments
(never specialised): one compiled kernel per (dtype, head dim, block, tile config), whatever S and B are.
"""
import triton
import triton.language as tl

_RUNTIME_INTS = ["S", "NQ", "NK", "H", "KEY_BLOCKS", "sq_b", "sq_h", "sq_n", "sk_b", "sk_s", "sk_h"]
"""Arguments that vary with S, B, H or the grid: never specialised (no recompiles)."""


@triton.jit
def _block_lse(qbar, k_desc, j, S, LOG2E: tl.constexpr, LN2: tl.constexpr, BLOCK: tl.constexpr,
               MASK: tl.constexpr):
    """Natural-log log-sum-exp over key block j of each row's logits ``qbar . k_t`` ([BLOCK_Q] fp32)."""
    k = k_desc.load([j * BLOCK, 0])
    x = tl.dot(qbar, tl.trans(k))
    if MASK:  # the ragged last block: keys >= S (read as zeros) do not count
        x = tl.where((j * BLOCK + tl.arange(0, BLOCK) < S)[None, :], x, float("-inf"))
    m = tl.max(x, 1)
    p = tl.math.exp2(x * LOG2E - (m * LOG2E)[:, None])
    return m + tl.math.log2(tl.sum(p, 1)) * LN2


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def pooled_lse_scores_kernel(Qbar, K, Out, S, NQ, NK, H, KEY_BLOCKS, sq_b, sq_h, sq_n, sk_b, sk_s, sk_h,
                             BLOCK: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Grid (ceil(NQ / BLOCK_Q), ceil(NK / KEY_BLOCKS), B * H): key blocks [j0, j0 + KEY_BLOCKS) of BLOCK_Q rows."""
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    bh = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = rows < NQ
    dims = tl.arange(0, HEAD_DIM)
    qbar = tl.load(Qbar + b * sq_b + h * sq_h + rows.to(tl.int64)[:, None] * sq_n + dims[None, :],
                   mask=row_ok[:, None], other=0.0)
    k_desc = tl.make_tensor_descriptor(K + b * sk_b + h * sk_h, shape=[S, HEAD_DIM], strides=[sk_s, 1],
                                       block_shape=[BLOCK, HEAD_DIM])
    out_rows = Out + bh.to(tl.int64) * NQ * NK + rows.to(tl.int64) * NK
    j0 = tl.program_id(1) * KEY_BLOCKS
    j1 = tl.minimum(j0 + KEY_BLOCKS, NK)
    full = tl.minimum(j1, S // BLOCK)  # key blocks < full hold BLOCK keys each
    for j in range(j0, full):
        tl.store(out_rows + j, _block_lse(qbar, k_desc, j, S, LOG2E, LN2, BLOCK, False), mask=row_ok)
    if full < j1:  # the ragged last key block is in this program's range
        tl.store(out_rows + full, _block_lse(qbar, k_desc, full, S, LOG2E, LN2, BLOCK, True), mask=row_ok)


ALL_KERNELS = (pooled_lse_scores_kernel,)
