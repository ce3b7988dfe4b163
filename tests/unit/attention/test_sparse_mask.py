"""The BlockMask built directly from a compact selection (no from_kv_blocks), its q-side transpose, the
host-parked selection cache and the kernel-options table: exact integer checks on awkward grids (CPU)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from ds_adaptive.attention import kernel_options as ko
from ds_adaptive.attention.attention import transpose_blocks
from ds_adaptive.attention.backends.flex import block_mask_from_selection
from ds_adaptive.attention.runtime import _HostCopy
from ds_adaptive.attention.selection import BlockSelection, select_blocks


def _lists_to_dense(num, idx, ncols):
    """[..., rows] counts + [..., rows, w] lists -> [..., rows, ncols] int (python loop: the reference)."""
    out = torch.zeros(*num.shape, ncols, dtype=torch.int64)
    for pos in torch.cartesian_prod(*[torch.arange(n) for n in num.shape]).view(-1, num.dim()).tolist():
        cnt = int(num[tuple(pos)])
        row = idx[tuple(pos)][:cnt].tolist()
        assert len(set(row)) == cnt and row == sorted(row), (pos, row)  # distinct, ascending
        out[tuple(pos)][row] = 1
    return out


def _selection(b, h, s, bs, ks, seed, keep_sink=False):
    n = math.ceil(s / bs)
    g = torch.Generator().manual_seed(seed)
    return select_blocks(torch.randn(b, h, n, n, generator=g), torch.tensor(ks), seq_len=s, block_size=bs,
                         keep_sink=keep_sink)


@pytest.mark.parametrize("b,h,nq,ncols,w", [(1, 1, 1, 1, 1), (2, 3, 7, 7, 4), (1, 2, 9, 13, 13)])
def test_transpose_blocks_equals_the_dense_transpose(b, h, nq, ncols, w) -> None:
    g = torch.Generator().manual_seed(nq * 31 + ncols)
    dense = torch.rand(b, h, nq, ncols, generator=g) < 0.4
    dense[..., 0, 0] = True
    num = dense.sum(-1).to(torch.int32)
    idx = torch.argsort(dense.int(), dim=-1, descending=True, stable=True).to(torch.int32)[..., :max(w, int(num.max()))]
    q_num, q_idx = transpose_blocks(num, idx, ncols)
    assert q_num.dtype == q_idx.dtype == torch.int32 and q_idx.shape == (b, h, ncols, nq) and q_idx.is_contiguous()
    assert torch.equal(_lists_to_dense(q_num, q_idx, nq), dense.transpose(-1, -2).long())


def _check_mask(sel: BlockSelection, pad_to_block: bool) -> None:
    bm = block_mask_from_selection(sel, pad_to_block=pad_to_block)
    s, bs, n = sel.seq_len, sel.block_size, sel.num_blocks
    want = sel.dense_block_mask().long()  # [B, H, nq, nk]
    ragged = pad_to_block and s % bs != 0
    assert bm.seq_lengths == ((n * bs, n * bs) if ragged else (s, s)) and tuple(bm.BLOCK_SIZE) == (bs, bs)
    full = _lists_to_dense(bm.full_kv_num_blocks, bm.full_kv_indices, n)
    part = _lists_to_dense(bm.kv_num_blocks, bm.kv_indices, n)
    assert torch.equal(full + part, want)  # every selected block once, as full or partial
    last = torch.zeros(n, dtype=torch.int64)
    last[-1] = 1
    assert torch.equal(part, want * last if ragged else torch.zeros_like(want))  # partial: only the ragged last block
    z = torch.tensor(0)
    assert bm.mask_mod(z, z, z, torch.tensor(s - 1)) and (not ragged or not bm.mask_mod(z, z, z, torch.tensor(s)))
    qf = _lists_to_dense(bm.full_q_num_blocks, bm.full_q_indices, n)
    qp = _lists_to_dense(bm.q_num_blocks, bm.q_indices, n)
    assert torch.equal(qf, full.transpose(-1, -2)) and torch.equal(qp, part.transpose(-1, -2))
    for t in (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, bm.q_num_blocks,
              bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices):
        assert t.dtype == torch.int32 and t.is_contiguous()
    assert bm.full_kv_indices.shape[-1] == n  # a fixed width: the compiled kernel does not depend on k
    kv_only = block_mask_from_selection(sel, pad_to_block=pad_to_block, with_q=False)
    assert kv_only.q_indices is None and kv_only.full_q_indices is None
    assert torch.equal(kv_only.full_kv_indices, bm.full_kv_indices)


@pytest.mark.parametrize("b,h,s,bs,ks", [(2, 3, 1000, 128, [1, 3, 8]), (1, 2, 37 * 16 + 5, 16, [5, 38]),
                                         (1, 1, 512, 128, [2]), (2, 2, 129, 128, [1, 2]), (1, 1, 100, 128, [1])])
@pytest.mark.parametrize("pad", [True, False])
def test_block_mask_matches_the_selection(b, h, s, bs, ks, pad) -> None:
    _check_mask(_selection(b, h, s, bs, ks, seed=s + bs), pad)
    _check_mask(_selection(b, h, s, bs, ks, seed=s + 1, keep_sink=True), pad)
    _check_mask(BlockSelection.full(b, h, s, bs), pad)


def test_block_mask_matches_from_kv_blocks() -> None:
    """Same lists as torch's own BlockMask.from_kv_blocks (its generic dense transpose) on a ragged grid."""
    from torch.nn.attention.flex_attention import BlockMask
    sel = _selection(2, 3, 1000, 128, [1, 3, 8], seed=5)
    ours = block_mask_from_selection(sel, pad_to_block=False)
    ref = BlockMask.from_kv_blocks(torch.zeros_like(sel.kv_num), torch.zeros_like(sel.flex_indices()), sel.kv_num,
                                   sel.flex_indices(), BLOCK_SIZE=128, seq_lengths=(1000, 1000))
    assert torch.equal(ours.full_q_num_blocks, ref.full_q_num_blocks)
    for r in range(ours.full_q_indices.shape[-2]):
        cnt = ours.full_q_num_blocks[..., r]
        for i, c in enumerate(cnt.flatten().tolist()):
            bi, hi = divmod(i, 3)
            assert torch.equal(ours.full_q_indices[bi, hi, r, :c], ref.full_q_indices[bi, hi, r, :c])


def test_host_copy_round_trips_and_reuses_its_buffers() -> None:
    cache = _HostCopy()
    a = _selection(2, 3, 1000, 128, [1, 3, 8], seed=1)
    cache.put(4, a)
    bufs = cache._bufs[4]
    got = cache.get(4)
    assert torch.equal(got.kv_num, a.kv_num) and torch.equal(got.kv_idx, a.kv_idx)
    assert (got.block_size, got.seq_len) == (128, 1000)
    b = _selection(2, 3, 1000, 128, [2, 3, 8], seed=2)
    cache.put(4, b)
    assert cache._bufs[4] is bufs and torch.equal(cache.get(4).kv_idx, b.kv_idx)  # same shape: buffers reused
    c = _selection(1, 1, 512, 128, [2], seed=3)
    cache.put(4, c)
    assert torch.equal(cache.get(4).kv_idx, c.kv_idx)


def _table(**over):
    t = {"device": "NVIDIA H200", "capability": [9, 0], "head_dim": 128, "dtype": "bfloat16",
         "buckets": [{"max_density": 0.075, "options": {"fwd_BLOCK_M": 64, "bwd_num_warps": 4},
                      "measured": [{"seq": 32760, "density": 0.05, "ms": 3.5, "default_ms": 3.9}]},
                     {"max_density": 1.0, "options": {"fwd_num_stages": 2},
                      "measured": [{"seq": 32760, "density": 0.1, "ms": 6.5, "default_ms": 6.8}]}]}
    t.update(over)
    return t


def test_shipped_kernel_table_is_well_formed() -> None:
    t = ko.load_table()
    ko.validate_table(t)
    assert json.loads(ko.TABLE_PATH.read_text()) == t
    for b in t["buckets"]:  # a bucket's options were measured no slower than torch's defaults (mean ratio)
        ratio = sum(m["ms"] / m["default_ms"] for m in b["measured"]) / len(b["measured"])
        assert ratio <= 1.0 + 1e-9 and (b["options"] or ratio == 1.0), b


@pytest.mark.parametrize("bad,match", [
    ({"dtype": "bfloat17"}, "dtype"),
    ({"buckets": [{"max_density": 0.5, "options": {"fwd_BLOCK_M": 48}, "measured": []}]}, "power of two"),
    ({"buckets": [{"max_density": 0.5, "options": None, "measured": []}]}, "must be a dict"),
    ({"buckets": [{"max_density": 0.5, "options": {"BLOCK_Q": 64}, "measured": []}]}, "unknown option"),
    ({"buckets": [{"max_density": 0.5, "options": {"fwd_num_warps": 4}, "measured": [{"seq": 1}]}]}, "positive"),
    ({"buckets": [{"max_density": 0.5, "options": {"fwd_num_warps": 4},
                   "measured": [{"seq": 1, "density": 0.6, "ms": 1, "default_ms": 1}]}]}, "outside the bucket"),
])
def test_kernel_table_errors_name_the_field(bad, match) -> None:
    with pytest.raises(ko.KernelTableError, match=match):
        ko.validate_table(_table(**bad))
    t = _table()
    t["buckets"] = t["buckets"][::-1]
    with pytest.raises(ko.KernelTableError, match="ascend"):
        ko.validate_table(t)


def test_options_for_picks_the_bucket_only_on_the_measured_device() -> None:
    old = ko.use_table(_table())
    try:
        assert ko.options_for(0.05, head_dim=128, dtype=torch.bfloat16, device="cpu") is None  # not the GPU
        ko.use_table(_table(device="cpu-test", capability=None))
        # a matching CUDA device is needed; on CPU every lookup is None (torch's defaults)
        assert ko.options_for(0.05, head_dim=64, dtype=torch.bfloat16, device="cpu") is None
    finally:
        ko.use_table(old)


@pytest.mark.parametrize("s,bs", [(37, 8), (48, 16), (5, 16)])
def test_pool_blocks_and_mean_block_scores_equal_fp64_references(s, bs) -> None:
    from ds_adaptive.attention.predictor import LowRankPredictor
    from ds_adaptive.attention.selection import pool_blocks
    g = torch.Generator().manual_seed(s)
    q, k = (torch.randn(2, s, 3, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    n = math.ceil(s / bs)
    ref = torch.stack([q[:, i * bs:(i + 1) * bs].double().mean(1) for i in range(n)], 2)  # [B, H, n, D]
    assert torch.allclose(pool_blocks(q, bs).double(), ref, atol=1e-6, rtol=0)
    pred = LowRankPredictor(2, 4, 32, rank=8, seed=1)
    got = pred.block_scores(1, q, k, bs, head_offset=1)
    wq, wk = (w[1, 1:4].double() for w in (pred.wq.detach(), pred.wk.detach()))
    logits = torch.einsum("bshd,hdr,bthe,her->bhst", q.double(), wq, k.double(), wk)  # [B, H, S, S]
    want = torch.stack([torch.stack([logits[..., i * bs:(i + 1) * bs, j * bs:(j + 1) * bs].mean((-1, -2))
                                     for j in range(n)], -1) for i in range(n)], -2)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4)
