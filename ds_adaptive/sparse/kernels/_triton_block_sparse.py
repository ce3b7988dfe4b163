"""Triton kernels of block-sparse attention (forward, dQ, dK/dV); imported only where triton imports.

Layout: q, k, v, out, dout, dq, dk, dv ``[B, S, H, D]`` by strides (last dim contiguous); ``lse`` and
``delta`` ``[B, H, S]`` fp32 contiguous. The selection is the compact one of
:class:`~ds_adaptive.sparse.selection.BlockSelection`: per (b, h, query block) ``kv_num`` blocks listed
ascending in ``kv_idx``; backward's dK/dV kernel walks the transposed lists (``q_num``, ``q_idx``: per key
block the query blocks that selected it), so no two programs write the same rows: no atomics (unless
``ATOMIC_DQ``, an optional mode that adds dQ from the dK/dV kernel by fp32 atomics instead of running the
dQ kernel: 5 GEMMs instead of 7 per block pair, not deterministic).

``BLOCK`` is the selection's block (tokens per block); the tiles ``BLOCK_M`` (queries) and ``BLOCK_N``
(keys) divide it: a program covers ``BLOCK_M`` queries of one query block and walks every selected key
block in ``BLOCK // BLOCK_N`` tiles. Sequence length, batch/head strides and the list strides are run-time
arguments that Triton never specialises on (``do_not_specialize``): one compiled kernel per
(dtype, head dim, block, tile config), whatever S and B are.

Ragged S (the last block partial): only the last key block can hold keys >= S. The forward and dQ loops
run the row's unmasked blocks first and the last key block (if selected, it sits last: ascending lists)
in a separate masked loop over only its tiles that hold keys < S; every load of rows >= S is masked to
0. Softmax in base 2: ``qk_scale = sm_scale * log2(e)``, ``lse`` is ``max + log2(sum)`` of the scaled
scores (log2 domain, internal to the op).
"""
import triton
import triton.language as tl

_RUNTIME_INTS = ["S", "H", "sq_b", "sk_b", "sv_b", "so_b", "sn_b", "sn_h", "si_b", "si_h", "si_q"]
"""Arguments that vary with S, B, density or the valid length: never specialised (no recompiles)."""


@triton.jit
def _row_iters(idx_ptr, n, S, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Tile-iteration bounds of one row of ``n`` ascending blocks: [0, full) unmasked, [full, end) the
    ragged last block's tiles that hold tokens < S (empty unless that block is selected and partial)."""
    SPLIT: tl.constexpr = BLOCK // TILE
    nb = tl.cdiv(S, BLOCK)
    tail = S - (nb - 1) * BLOCK  # tokens in the last block, 1..BLOCK
    last = tl.load(idx_ptr + tl.maximum(n - 1, 0))
    ragged = ((n > 0) & (last == nb - 1) & (tail < BLOCK)).to(tl.int32)
    full = (n - ragged) * SPLIT
    return full, full + ragged * tl.cdiv(tail, TILE)


@triton.jit
def _program_tile(Q, H, S, sq_b, sq_s, sq_h, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """This program's (b, h, b * H + h, block, rows, row mask, tile of Q) for a grid (tiles of BLOCK_M rows,
    B * H); rows >= S read as 0. (The dK/dV kernel calls it with K and its key tiles.)"""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    qb = pid_m // (BLOCK // BLOCK_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < S
    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :], mask=rows[:, None], other=0.0)
    return b, h, bh, qb, offs_m, offs_d, rows, q


@triton.jit
def _row_list(Num, Idx, b, h, blk, S, sn_b, sn_h, si_b, si_h, si_q, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Block list of (b, h, blk): its pointer and tile-iteration bounds (:func:`_row_iters`)."""
    n = tl.load(Num + b * sn_b + h * sn_h + blk)
    idx_ptr = Idx + b * si_b + h * si_h + blk.to(tl.int64) * si_q
    full, end = _row_iters(idx_ptr, n, S, BLOCK, TILE)
    return idx_ptr, full, end


@triton.jit
def _load_kv(k_base, v_base, idx_ptr, it, S, sk_s, sv_s,
             BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr):
    """The it-th key tile of a row (tile it % SPLIT of its block it // SPLIT): k, v [BLOCK_N, HEAD_DIM] and
    the keys' mask (rows >= S read as 0 where MASK; unmasked loads elsewhere)."""
    SPLIT: tl.constexpr = BLOCK // BLOCK_N
    offs_d = tl.arange(0, HEAD_DIM)
    kb = tl.load(idx_ptr + it // SPLIT)
    offs_n = kb * BLOCK + (it % SPLIT) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = offs_n < S
    if MASK:
        k = tl.load(k_base + offs_n[:, None] * sk_s + offs_d[None, :], mask=keep[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * sv_s + offs_d[None, :], mask=keep[:, None], other=0.0)
    else:
        k = tl.load(k_base + offs_n[:, None] * sk_s + offs_d[None, :])
        v = tl.load(v_base + offs_n[:, None] * sv_s + offs_d[None, :])
    return k, v, keep


@triton.jit
def _fwd_loop(acc, l_i, m_i, q, k_base, v_base, idx_ptr, lo, hi, S, sk_s, sv_s, qk_scale,
              BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr):
    for it in range(lo, hi):
        k, v, keep = _load_kv(k_base, v_base, idx_ptr, it, S, sk_s, sv_s, BLOCK, BLOCK_N, HEAD_DIM, MASK)
        qk = tl.dot(q, tl.trans(k))
        if MASK:
            qk = tl.where(keep[None, :], qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def block_sparse_fwd(Q, K, V, Out, Lse, KvNum, KvIdx, S, H,
                     sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_s, so_h,
                     sn_b, sn_h, si_b, si_h, si_q, qk_scale,
                     BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Grid (ceil(S / BLOCK) * BLOCK / BLOCK_M, B * H): out and lse of BLOCK_M query rows."""
    b, h, bh, qb, offs_m, offs_d, rows, q = _program_tile(Q, H, S, sq_b, sq_s, sq_h, BLOCK, BLOCK_M, HEAD_DIM)
    idx_ptr, full, end = _row_list(KvNum, KvIdx, b, h, qb, S, sn_b, sn_h, si_b, si_h, si_q, BLOCK, BLOCK_N)
    k_base = K + b * sk_b + h * sk_h
    v_base = V + b * sv_b + h * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_base, v_base, idx_ptr, 0, full, S, sk_s, sv_s, qk_scale,
                              BLOCK, BLOCK_N, HEAD_DIM, False)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_base, v_base, idx_ptr, full, end, S, sk_s, sv_s, qk_scale,
                              BLOCK, BLOCK_N, HEAD_DIM, True)
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # a row with no block (never made by select_blocks): out 0
    out = acc / l_safe[:, None]
    tl.store(Out + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=rows[:, None])
    tl.store(Lse + bh.to(tl.int64) * S + offs_m, m_i + tl.math.log2(l_safe), mask=rows)


@triton.jit
def _dq_loop(dq, q, do, lse, delta, k_base, v_base, idx_ptr, lo, hi, S, sk_s, sv_s, qk_scale,
             BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr):
    for it in range(lo, hi):
        k, v, keep = _load_kv(k_base, v_base, idx_ptr, it, S, sk_s, sv_s, BLOCK, BLOCK_N, HEAD_DIM, MASK)
        qk = tl.dot(q, tl.trans(k))
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASK:  # keys >= S: exp2(0 - lse) may overflow; 0 * inf must not reach dq
            p = tl.where(keep[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def block_sparse_bwd_dq(Q, K, V, Out, DO, DQ, Lse, Delta, KvNum, KvIdx, S, H,
                        sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_s, so_h,
                        sn_b, sn_h, si_b, si_h, si_q, qk_scale, sm_scale,
                        BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_DIM: tl.constexpr):
    """Grid as the forward: delta = rowsum(out * dout) of BLOCK_M rows (stored for the dK/dV kernel,
    which runs after this one) and their dq over the row's key blocks. Out, DO, DQ share the so_* strides."""
    b, h, bh, qb, offs_m, offs_d, rows, q = _program_tile(Q, H, S, sq_b, sq_s, sq_h, BLOCK, BLOCK_M, HEAD_DIM)
    o_off = b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :]
    do = tl.load(DO + o_off, mask=rows[:, None], other=0.0)
    o = tl.load(Out + o_off, mask=rows[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row_off = bh.to(tl.int64) * S + offs_m
    tl.store(Delta + row_off, delta, mask=rows)
    lse = tl.load(Lse + row_off, mask=rows, other=0.0)
    idx_ptr, full, end = _row_list(KvNum, KvIdx, b, h, qb, S, sn_b, sn_h, si_b, si_h, si_q, BLOCK, BLOCK_N)
    k_base = K + b * sk_b + h * sk_h
    v_base = V + b * sv_b + h * sv_h
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dq = _dq_loop(dq, q, do, lse, delta, k_base, v_base, idx_ptr, 0, full, S, sk_s, sv_s, qk_scale,
                  BLOCK, BLOCK_N, HEAD_DIM, False)
    dq = _dq_loop(dq, q, do, lse, delta, k_base, v_base, idx_ptr, full, end, S, sk_s, sv_s, qk_scale,
                  BLOCK, BLOCK_N, HEAD_DIM, True)
    tl.store(DQ + o_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows[:, None])


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def block_sparse_bwd_dkdv(Q, K, V, DO, DK, DV, DQacc, Lse, Delta, QNum, QIdx, S, H,
                          sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_s, so_h,
                          sn_b, sn_h, si_b, si_h, si_q, qk_scale, sm_scale,
                          BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          HEAD_DIM: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """Grid (ceil(S / BLOCK) * BLOCK / BLOCK_N, B * H): dk, dv of BLOCK_N keys over the query blocks that
    selected their key block (QNum / QIdx: the transposed lists, sn_* / si_* their strides). DO, DK, DV
    (and the fp32 DQacc of ATOMIC_DQ) share the so_* strides. Rows >= S load as 0 (their p is then
    exp2(0 - 0) times a zero dout / zero q: no contribution)."""
    b, h, bh, kb, offs_n, offs_d, keys, k = _program_tile(K, H, S, sk_b, sk_s, sk_h, BLOCK, BLOCK_N, HEAD_DIM)
    v = tl.load(V + b * sv_b + h * sv_h + offs_n[:, None] * sv_s + offs_d[None, :], mask=keys[:, None], other=0.0)
    n = tl.load(QNum + b * sn_b + h * sn_h + kb)
    idx_ptr = QIdx + b * si_b + h * si_h + kb.to(tl.int64) * si_q
    q_base = Q + b * sq_b + h * sq_h
    o_base = b * so_b + h * so_h  # int64 once; the loop adds 32-bit offsets to pointers
    do_base = DO + o_base
    lse_base = Lse + bh.to(tl.int64) * S
    delta_base = Delta + bh.to(tl.int64) * S
    SPLIT: tl.constexpr = BLOCK // BLOCK_M
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for it in range(0, n * SPLIT):
        qb = tl.load(idx_ptr + it // SPLIT)
        offs_m = qb * BLOCK + (it % SPLIT) * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = offs_m < S
        q = tl.load(q_base + offs_m[:, None] * sq_s + offs_d[None, :], mask=rows[:, None], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * so_s + offs_d[None, :], mask=rows[:, None], other=0.0)
        lse = tl.load(lse_base + offs_m, mask=rows, other=0.0)
        delta = tl.load(delta_base + offs_m, mask=rows, other=0.0)
        qkT = tl.dot(k, tl.trans(q))
        pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
        if ATOMIC_DQ:  # keys >= S: exp2(0 - lse) may overflow and would reach dq through k = 0
            pT = tl.where(keys[:, None], pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(dsT.to(k.dtype)), k) * sm_scale
            tl.atomic_add(DQacc + o_base + offs_m[:, None] * so_s + offs_d[None, :], dq, mask=rows[:, None])
    o_off = o_base + offs_n[:, None] * so_s + offs_d[None, :]
    tl.store(DK + o_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=keys[:, None])
    tl.store(DV + o_off, dv.to(DV.dtype.element_ty), mask=keys[:, None])


@triton.jit(do_not_specialize=["S", "H", "so_b"])
def block_sparse_delta(Out, DO, Delta, S, H, so_b, so_s, so_h, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """delta = rowsum(out * dout) for the ATOMIC_DQ mode (the split mode's dQ kernel computes it itself)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < S
    off = b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :]
    o = tl.load(Out + off, mask=rows[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=rows[:, None], other=0.0).to(tl.float32)
    tl.store(Delta + bh.to(tl.int64) * S + offs_m, tl.sum(o * do, 1), mask=rows)


ALL_KERNELS = (block_sparse_fwd, block_sparse_bwd_dq, block_sparse_bwd_dkdv, block_sparse_delta)
