"""Triton kernels of block-sparse attention (forward, dQ, dK/dV, delta); imported only where triton imports.

Layout: q, k, v, out, dout, dq, dk, dv ``[B, S, H, D]`` by strides (last dim contiguous, rows 16-byte aligned);
``lse`` and ``delta`` ``[B, H, S]`` fp32 contiguous. The selection is the compact one of
:class:`~ds_adaptive.attention.selection.BlockSelection`: per (b, h, query block) ``kv_num`` blocks listed
ascending in ``kv_idx``; the dK/dV kernel walks the transposed lists (``q_num``, ``q_idx``: per key block the
query blocks that selected it), so no two programs write the same rows: no atomics (unless ``ATOMIC_DQ``, an
optional mode that adds dQ from the dK/dV kernel by fp32 atomics instead of running the dQ kernel: 5 GEMMs
instead of 7 per block pair, not deterministic).

Tiles move by tensor descriptors (TMA on Hopper): one descriptor per (b, h) row range ``[0, S) x D`` of each
operand, so the loads go to shared memory without per-element pointer tensors (pointer tiles cost ~128
registers each at 128 x 128 and made the backward spill), rows >= S read as zeros and are never written.
Each kernel gets a 128-byte-per-descriptor global scratch from ``triton.set_allocator`` (the host sets it).

``BLOCK`` is the selection's block (tokens per block); the tiles ``BLOCK_M`` (queries) and ``BLOCK_N`` (keys)
divide it: a program covers ``BLOCK_M`` queries of one query block and walks every selected key block in
``BLOCK // BLOCK_N`` tiles. Sequence length, head count, batch/head strides and the list strides are run-time
arguments that Triton never specialises on (``do_not_specialize``): one compiled kernel per (dtype, head dim,
block, tile config), whatever S and B are.

Ragged S (the last block partial): only the last key block holds keys >= S (read as 0). The forward and dQ
loops run the row's other blocks first and the last key block (if selected, it sits last: ascending lists)
in a separate loop over only its tiles that hold keys < S, where scores (forward) or probabilities (dQ) of
keys >= S are masked. Softmax in base 2: ``qk_scale = sm_scale * log2(e)``; ``lse`` is ``max + log2(sum)`` of
the scaled scores (log2 domain, internal to the op).
"""
import triton
import triton.language as tl

_RUNTIME_INTS = ["S", "H", "sq_b", "sk_b", "sv_b", "so_b", "sn_b", "sn_h", "si_b", "si_h", "si_q"]
"""Arguments that vary with S, B, H, density or the valid length: never specialised (no recompiles)."""


@triton.jit
def _tile_desc(base, S, s_row, TILE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Descriptor of one (b, h) slice ``[S, HEAD_DIM]`` (row stride ``s_row``) in tiles of TILE rows."""
    return tl.make_tensor_descriptor(base, shape=[S, HEAD_DIM], strides=[s_row, 1], block_shape=[TILE, HEAD_DIM])


@triton.jit
def _program(H, S, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """This program's (b, h, b * H + h, block, first row, rows, row mask) for a grid (tiles of TILE rows, B * H)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    blk = pid // (BLOCK // TILE)
    start = pid * TILE
    offs = start + tl.arange(0, TILE)
    return b, h, bh, blk, start, offs, offs < S


@triton.jit
def _row_list(Num, Idx, b, h, blk, S, sn_b, sn_h, si_b, si_h, si_q, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Block list of (b, h, blk): its pointer and tile-iteration bounds: [0, full) the row's whole blocks,
    [full, end) the tiles of the ragged last block that hold tokens < S (none unless selected and partial)."""
    n = tl.load(Num + b * sn_b + h * sn_h + blk)
    idx_ptr = Idx + b * si_b + h * si_h + blk.to(tl.int64) * si_q
    SPLIT: tl.constexpr = BLOCK // TILE
    nb = tl.cdiv(S, BLOCK)
    tail = S - (nb - 1) * BLOCK  # tokens in the last block, 1..BLOCK
    last = tl.load(idx_ptr + tl.maximum(n - 1, 0))
    ragged = ((n > 0) & (last == nb - 1) & (tail < BLOCK)).to(tl.int32)
    full = (n - ragged) * SPLIT
    return idx_ptr, full, full + ragged * tl.cdiv(tail, TILE)


@triton.jit
def _list_tile(idx_ptr, it, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """First row of the it-th tile of a block list (tile it % SPLIT of block it // SPLIT)."""
    SPLIT: tl.constexpr = BLOCK // TILE
    return tl.load(idx_ptr + it // SPLIT) * BLOCK + (it % SPLIT) * TILE


@triton.jit
def _fwd_loop(acc, l_i, m_i, q, k_desc, v_desc, idx_ptr, lo, hi, S, qk_scale,
              BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    for it in range(lo, hi):
        start = _list_tile(idx_ptr, it, BLOCK, BLOCK_N)
        k = k_desc.load([start, 0])
        v = v_desc.load([start, 0])
        qk = tl.dot(q, tl.trans(k))
        if MASK:
            qk = tl.where((start + tl.arange(0, BLOCK_N) < S)[None, :], qk, float("-inf"))
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
    b, h, bh, qb, row0, offs_m, rows = _program(H, S, BLOCK, BLOCK_M)
    q = _tile_desc(Q + b * sq_b + h * sq_h, S, sq_s, BLOCK_M, HEAD_DIM).load([row0, 0])
    k_desc = _tile_desc(K + b * sk_b + h * sk_h, S, sk_s, BLOCK_N, HEAD_DIM)
    v_desc = _tile_desc(V + b * sv_b + h * sv_h, S, sv_s, BLOCK_N, HEAD_DIM)
    idx_ptr, full, end = _row_list(KvNum, KvIdx, b, h, qb, S, sn_b, sn_h, si_b, si_h, si_q, BLOCK, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_desc, v_desc, idx_ptr, 0, full, S, qk_scale, BLOCK, BLOCK_N, False)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_desc, v_desc, idx_ptr, full, end, S, qk_scale, BLOCK, BLOCK_N, True)
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # a row with no block (never made by select_blocks): out 0
    out = acc / l_safe[:, None]
    _tile_desc(Out + b * so_b + h * so_h, S, so_s, BLOCK_M, HEAD_DIM).store([row0, 0], out.to(Out.dtype.element_ty))
    tl.store(Lse + bh.to(tl.int64) * S + offs_m, m_i + tl.math.log2(l_safe), mask=rows)


@triton.jit
def _dq_loop(dq, q, do, lse, delta, k_desc, v_desc, idx_ptr, lo, hi, S, qk_scale,
             BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    for it in range(lo, hi):
        start = _list_tile(idx_ptr, it, BLOCK, BLOCK_N)
        k = k_desc.load([start, 0])
        v = v_desc.load([start, 0])
        qk = tl.dot(q, tl.trans(k))
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASK:  # keys >= S read as 0: exp2(0 - lse) may overflow; 0 * inf must not reach dq
            p = tl.where((start + tl.arange(0, BLOCK_N) < S)[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def block_sparse_bwd_dq(Q, K, V, DO, DQ, Lse, Delta, KvNum, KvIdx, S, H,
                        sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_s, so_h,
                        sn_b, sn_h, si_b, si_h, si_q, qk_scale, sm_scale,
                        BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_DIM: tl.constexpr):
    """Grid as the forward: dq of BLOCK_M rows over the row's key blocks (delta from :func:`block_sparse_delta`,
    which runs first: computing it here would keep dO in registers for the elementwise product and spill).
    DO and DQ share the so_* strides."""
    b, h, bh, qb, row0, offs_m, rows = _program(H, S, BLOCK, BLOCK_M)
    q = _tile_desc(Q + b * sq_b + h * sq_h, S, sq_s, BLOCK_M, HEAD_DIM).load([row0, 0])
    do = _tile_desc(DO + b * so_b + h * so_h, S, so_s, BLOCK_M, HEAD_DIM).load([row0, 0])
    row_off = bh.to(tl.int64) * S + offs_m
    lse = tl.load(Lse + row_off, mask=rows, other=0.0)
    delta = tl.load(Delta + row_off, mask=rows, other=0.0)
    k_desc = _tile_desc(K + b * sk_b + h * sk_h, S, sk_s, BLOCK_N, HEAD_DIM)
    v_desc = _tile_desc(V + b * sv_b + h * sv_h, S, sv_s, BLOCK_N, HEAD_DIM)
    idx_ptr, full, end = _row_list(KvNum, KvIdx, b, h, qb, S, sn_b, sn_h, si_b, si_h, si_q, BLOCK, BLOCK_N)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dq = _dq_loop(dq, q, do, lse, delta, k_desc, v_desc, idx_ptr, 0, full, S, qk_scale, BLOCK, BLOCK_N, False)
    dq = _dq_loop(dq, q, do, lse, delta, k_desc, v_desc, idx_ptr, full, end, S, qk_scale, BLOCK, BLOCK_N, True)
    _tile_desc(DQ + b * so_b + h * so_h, S, so_s, BLOCK_M, HEAD_DIM).store([row0, 0],
                                                                           (dq * sm_scale).to(DQ.dtype.element_ty))


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def block_sparse_bwd_dkdv(Q, K, V, DO, DK, DV, DQacc, Lse, Delta, QNum, QIdx, S, H,
                          sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_s, so_h,
                          sn_b, sn_h, si_b, si_h, si_q, qk_scale, sm_scale,
                          BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          HEAD_DIM: tl.constexpr, ATOMIC_DQ: tl.constexpr, TMA_REDUCE: tl.constexpr):
    """Grid (ceil(S / BLOCK) * BLOCK / BLOCK_N, B * H): dk, dv of BLOCK_N keys over the query blocks that
    selected their key block (QNum / QIdx: the transposed lists, sn_* / si_* their strides). DO, DK, DV (and
    the fp32 DQacc of ATOMIC_DQ) share the so_* strides. Query rows >= S read as 0 with lse = delta = 0, so
    their p = exp2(0) = 1 meets a zero dout and a zero q: no contribution. ATOMIC_DQ adds each step's dq tile
    into the fp32 DQacc by a TMA bulk reduction (TMA_REDUCE; rows >= S skipped by the descriptor) or, where the
    interpreter has no descriptor reductions, by per-element atomics."""
    b, h, bh, kb, key0, offs_n, keys = _program(H, S, BLOCK, BLOCK_N)
    k = _tile_desc(K + b * sk_b + h * sk_h, S, sk_s, BLOCK_N, HEAD_DIM).load([key0, 0])
    v = _tile_desc(V + b * sv_b + h * sv_h, S, sv_s, BLOCK_N, HEAD_DIM).load([key0, 0])
    q_desc = _tile_desc(Q + b * sq_b + h * sq_h, S, sq_s, BLOCK_M, HEAD_DIM)
    do_desc = _tile_desc(DO + b * so_b + h * so_h, S, so_s, BLOCK_M, HEAD_DIM)
    n = tl.load(QNum + b * sn_b + h * sn_h + kb)
    idx_ptr = QIdx + b * si_b + h * si_h + kb.to(tl.int64) * si_q
    lse_base = Lse + bh.to(tl.int64) * S
    delta_base = Delta + bh.to(tl.int64) * S
    dq_base = DQacc + b * so_b + h * so_h
    if ATOMIC_DQ and TMA_REDUCE:
        dq_desc = _tile_desc(dq_base, S, so_s, BLOCK_M, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for it in range(0, n * (BLOCK // BLOCK_M)):
        row0 = _list_tile(idx_ptr, it, BLOCK, BLOCK_M)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        rows = offs_m < S
        q = q_desc.load([row0, 0])
        do = do_desc.load([row0, 0])
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
            if TMA_REDUCE:
                dq_desc.atomic_add([row0, 0], dq)
            else:
                tl.atomic_add(dq_base + offs_m[:, None] * so_s + tl.arange(0, HEAD_DIM)[None, :], dq,
                              mask=rows[:, None])
    _tile_desc(DK + b * so_b + h * so_h, S, so_s, BLOCK_N, HEAD_DIM).store([key0, 0],
                                                                           (dk * sm_scale).to(DK.dtype.element_ty))
    _tile_desc(DV + b * so_b + h * so_h, S, so_s, BLOCK_N, HEAD_DIM).store([key0, 0], dv.to(DV.dtype.element_ty))


@triton.jit(do_not_specialize=["S", "H", "so_b"])
def block_sparse_delta(Out, DO, Delta, S, H, so_b, so_s, so_h, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """delta = rowsum(out * dout) of BLOCK_M rows (fp32), before the dQ / dK/dV kernels."""
    b, h, bh, _, row0, offs_m, rows = _program(H, S, BLOCK_M, BLOCK_M)
    o = _tile_desc(Out + b * so_b + h * so_h, S, so_s, BLOCK_M, HEAD_DIM).load([row0, 0]).to(tl.float32)
    do = _tile_desc(DO + b * so_b + h * so_h, S, so_s, BLOCK_M, HEAD_DIM).load([row0, 0]).to(tl.float32)
    tl.store(Delta + bh.to(tl.int64) * S + offs_m, tl.sum(o * do, 1), mask=rows)


ALL_KERNELS = (block_sparse_fwd, block_sparse_bwd_dq, block_sparse_bwd_dkdv, block_sparse_delta)
