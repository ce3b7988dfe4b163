"""Guards the Triton block-sparse kernels on CUDA: bf16 / fp16 fwd+bwd vs an fp32 reference on odd shapes (blocks
64 and 128, head dims 64 and 128, B 1-3, valid_len, split and atomic dQ, the table's configs) within a multiple of
torch's own low-precision error, all blocks == dense SDPA, NaN-poisoned buffers, no compile for a new S or B, and the
``triton`` backend (registry, warm-up, efficiency curve); the fused pooled block scores (``triton_block_scores``) at
training sizes vs float64, within the torch path's own bf16 error, the same selection, strided views, no compile
for a new S or B, and the dispatch that picks them on CUDA."""
from __future__ import annotations

import math

import pytest
import torch

from ds_adaptive.attention.attention import dense_attention
from ds_adaptive.attention.backends import get_backend
from ds_adaptive.attention.kernels import (KernelConfig, TileConfig, compiled_kernels, config_for, reference_attention,
                                        triton_block_sparse_attention, triton_status)
from ds_adaptive.attention.kernels import triton_block_sparse as op
from ds_adaptive.attention.selection import BlockSelection, select_blocks

DEV = "cuda"
pytestmark = pytest.mark.skipif(not triton_status()[0], reason=f"needs triton: {triton_status()[1]}")

ATOMIC = KernelConfig(fwd=TileConfig(128, 64, 8, 3), dq=TileConfig(128, 64, 8, 3), dkdv=TileConfig(16, 128, 8, 4),
                      atomic_dq=True)
SMALL = KernelConfig(fwd=TileConfig(64, 32, 4, 3), dq=TileConfig(64, 32, 4, 3), dkdv=TileConfig(16, 64, 4, 3))


def _qkv(b, s, h, d, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(b, s, h, d, device=DEV, generator=g, dtype=torch.float32).to(dtype).requires_grad_(True)
            for _ in range(3)]


def _sel(b, h, s, bs, kph, seed):
    assert len(kph) == h, f"key blocks per head: one entry per head ({h}), got {kph}"
    n = math.ceil(s / bs)
    g = torch.Generator(device=DEV).manual_seed(seed)
    return select_blocks(torch.randn(b, h, n, n, device=DEV, generator=g), torch.tensor([min(x, n) for x in kph]),
                         seq_len=s, block_size=bs)


def _run(fn, q, k, v, dout):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def _err(a, b) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def _check(fn, sel, q, k, v, dout, valid, what, dense_yardstick=False) -> None:
    """fn (16-bit) vs the fp32 reference: error <= 3x torch's own 16-bit error (the masked reference computed in
    the 16-bit dtype throughout; with ``dense_yardstick`` also dense SDPA's 16-bit error) + a small floor."""
    dtype = q.dtype
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    exact = _run(lambda a, b, c: reference_attention(a, b, c, sel, valid_len=valid)[0], q32, k32, v32, dout.float())
    lowp = _run(lambda a, b, c: reference_attention(a, b, c, sel, valid_len=valid, work_dtype=dtype)[0],
                q, k, v, dout)
    yard = [_err(lo, e) for lo, e in zip(lowp, exact)]
    if dense_yardstick:
        sd_exact = _run(lambda a, b, c: dense_attention(a, b, c, valid_len=valid), q32, k32, v32, dout.float())
        sd_low = _run(lambda a, b, c: dense_attention(a, b, c, valid_len=valid), q, k, v, dout)
        yard = [max(y, _err(lo, e)) for y, lo, e in zip(yard, sd_low, sd_exact)]
    ours = _run(fn, q, k, v, dout)
    for name, a, e, y in zip(("out", "dq", "dk", "dv"), ours, exact, yard):
        assert a.dtype == dtype and torch.isfinite(a).all(), (what, name)
        bound = 3 * y + 1e-3 * float(e.detach().abs().max())
        assert _err(a, e) <= bound, (what, name, _err(a, e), bound)
    if valid is not None:
        assert all(float(t[:, valid:].abs().max()) == 0 for t in ours), (what, "padded rows")


# (B, S, H, D, block, key blocks per head, valid_len, dtype, config): ragged S, rows with one block and every block
CASES = [
    (1, 4093, 3, 128, 128, (1, 4, 99), None, torch.bfloat16, None),
    (2, 1000, 3, 128, 128, (1, 2, 99), 937, torch.bfloat16, None),
    (3, 777, 3, 128, 128, (2, 1, 3), None, torch.bfloat16, ATOMIC),
    (2, 1000, 3, 128, 64, (1, 5, 99), 970, torch.bfloat16, None),
    (1, 1500, 3, 64, 64, (1, 3, 99), None, torch.bfloat16, None),
    (2, 1000, 3, 64, 128, (1, 2, 99), None, torch.float16, None),
    (1, 2000, 3, 128, 64, (2, 7, 99), 1999, torch.float16, SMALL),
]


@pytest.mark.parametrize("b,s,h,d,bs,kph,valid,dtype,cfg", CASES)
def test_matches_fp32_reference_fwd_bwd(monkeypatch, b, s, h, d, bs, kph, valid, dtype, cfg) -> None:
    # every buffer the kernels write starts as NaN: a missed row or a read of an unwritten entry shows
    monkeypatch.setattr(op, "_alloc", lambda *a, **kw: torch.full(*a, float("nan"), **kw))
    q, k, v = _qkv(b, s, h, d, dtype, seed=s + d)
    dout = torch.randn(b, s, h, d, device=DEV, dtype=dtype)
    sel = _sel(b, h, s, bs, kph, seed=bs)
    _check(lambda x, y, z: triton_block_sparse_attention(x, y, z, sel, valid_len=valid, config=cfg, density=0.1),
           sel, q, k, v, dout, valid, (b, s, h, d, bs, str(dtype), cfg and cfg.short()))


@pytest.mark.parametrize("bs", [64, 128])
def test_all_blocks_equals_dense_sdpa(bs) -> None:
    b, s, h, d = 2, 1000, 3, 128
    q, k, v = _qkv(b, s, h, d, torch.bfloat16, seed=bs)
    dout = torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16)
    sel = BlockSelection.full(b, h, s, bs, device=DEV)
    _check(lambda x, y, z: triton_block_sparse_attention(x, y, z, sel), sel, q, k, v, dout, None, ("all", bs),
           dense_yardstick=True)


def test_packed_qkv_views_and_negative_control() -> None:
    """q, k, v as strided views of one [B, S, 3, H, D] tensor (a fused projection) give the contiguous result;
    a different selection gives a different output."""
    b, s, h, d, bs = 2, 999, 3, 128, 128
    qkv = torch.randn(b, s, 3, h, d, device=DEV, dtype=torch.bfloat16)
    sel, other = _sel(b, h, s, bs, (2, 2, 2), seed=1), _sel(b, h, s, bs, (2, 2, 2), seed=2)
    with torch.no_grad():
        a = triton_block_sparse_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], sel)
        c = triton_block_sparse_attention(*(qkv[:, :, i].contiguous() for i in range(3)), sel)
        o = triton_block_sparse_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], other)
    assert torch.equal(a, c)
    assert _err(a, o) > 1e-2


def test_new_sequence_length_or_batch_compiles_nothing() -> None:
    """After one warm call per config, new (B, S, valid_len) pairs, ragged or not, reuse the compiled kernels
    (S, B and the list widths are never specialised)."""
    h, d, bs = 12, 128, 128
    cfg = config_for(d, bs, 0.1, DEV)

    def call(b, s, valid=None, k=3):
        q, k_, v = _qkv(b, s, h, d, torch.bfloat16, seed=s)
        sel = _sel(b, h, s, bs, (k,) * h, seed=s)
        out = triton_block_sparse_attention(q, k_, v, sel, valid_len=valid, config=cfg)
        out.float().sum().backward()

    call(1, 1000)
    torch.cuda.synchronize()
    before = compiled_kernels()
    for b, s, valid, k in [(1, 4096, None, 1), (2, 4093, 4000, 5), (3, 1024, None, 8), (1, 17, None, 1),
                           (2, 3000, 2999, 24), (1, 8193, None, 2)]:
        call(b, s, valid, k)
    torch.cuda.synchronize()
    assert compiled_kernels() == before


def test_triton_backend_runs_and_warms_up() -> None:
    be = get_backend("triton")
    assert be.unsupported(DEV, dtype=torch.bfloat16, head_dim=128, block_size=128) is None
    be.warmup([(1, 5000), (2, 3000)], num_heads=3, head_dim=128, dtype=torch.bfloat16, device=DEV, block_size=128)
    before = compiled_kernels()
    q, k, v = _qkv(2, 3001, 3, 128, torch.bfloat16, seed=0)
    sel = _sel(2, 3, 3001, 128, (2, 3, 4), seed=0)
    out = be.attention(q, k, v, sel, valid_len=2990, density=float(sel.density().mean()))
    out.float().sum().backward()
    torch.cuda.synchronize()
    assert compiled_kernels() == before
    with torch.no_grad():
        ref = triton_block_sparse_attention(q, k, v, sel, valid_len=2990, density=float(sel.density().mean()))
    assert torch.equal(out, ref)
    curve = be.efficiency(DEV)
    assert 0 < curve(0.1) <= 1 and be.stats()["compiled_kernels"] >= 3


def _tiny_wan_step(backend: str):
    from ds_adaptive.models.testing import random_init_
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.models.wan_config import WanConfig
    from ds_adaptive.attention.runtime import SparseAttentionRuntime

    cfg = WanConfig(dim=256, ffn_dim=512, num_heads=2, num_layers=3)
    model = random_init_(WanModel(cfg), seed=0).to(DEV).to_dtype(torch.bfloat16)
    model.gradient_checkpointing = True
    # only layer 1 sparse: its selection comes from the same inputs under both backends
    rt = SparseAttentionRuntime({"forced_density": 0.25, "dense_layers": [0, 2], "backend": backend}, num_layers=3,
                                num_heads=2, head_dim=128, device=DEV)
    rt.install(model)
    g = torch.Generator(device=DEV).manual_seed(0)
    lat = torch.randn(2, 16, 5, 32, 46, device=DEV, generator=g)  # 5x16x23 = 1840 tokens: a ragged last block
    out = model(lat, torch.tensor([100.0, 700.0], device=DEV), torch.randn(2, 8, 4096, device=DEV, generator=g))
    out.float().square().mean().backward()
    return model, rt, out


def test_tiny_wan_step_with_checkpointing_matches_the_reference_backend() -> None:
    """The runtime with backend 'triton' (selection, checkpoint recompute, backward through the kernels) vs the
    masked dense 'reference' backend on the same model and batch: same blocks, outputs and gradients within bf16."""
    m1, rt1, out1 = _tiny_wan_step("triton")
    m2, rt2, out2 = _tiny_wan_step("reference")
    assert rt1.backend_choice.backend.name == "triton" and rt2.backend_choice.backend.name == "reference"
    assert torch.equal(rt1.cached_selection(1).kv_idx, rt2.cached_selection(1).kv_idx)
    rel = float((out1.float() - out2.float()).norm() / out2.float().norm())
    assert torch.isfinite(out1).all() and rel < 3e-2, rel
    for (n, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert (p1.grad is None) == (p2.grad is None), n
        if p1.grad is not None:
            diff = float((p1.grad.float() - p2.grad.float()).norm())
            assert diff <= 0.1 * float(p2.grad.float().norm()) + 1e-6, (n, diff)


# ------------------------------------------------------------------ the fused pooled block scores
def _scores64(q, k, block):
    """The pooled log-sum-exp scores in float64 on the GPU, one head at a time: [B, H, nq, nk]."""
    s, d = q.shape[1], q.shape[-1]
    heads = []
    for hd in range(q.shape[2]):
        qh, kh = q[:, :, hd].double(), k[:, :, hd].double()  # [B, S, D]
        qbar = torch.stack([qh[:, i:i + block].mean(1) for i in range(0, s, block)], 1)  # [B, nq, D]
        lg = torch.einsum("bid,bsd->bis", qbar, kh) / math.sqrt(d)
        nb = math.ceil(s / block)
        pad = nb * block - s
        lg = torch.nn.functional.pad(lg, (0, pad), value=float("-inf")) if pad else lg
        heads.append(torch.logsumexp(lg.unflatten(-1, (nb, block)), -1))
        del lg
    return torch.stack(heads, 1)


def _structured_qk(b, s, h, d, dtype, seed):
    """Local windows of per-head width (random Fourier features of the position) + noise: realistic logit spread."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    pos = torch.arange(s, device=DEV, dtype=torch.float32)
    w = torch.randn(h, d // 2, device=DEV, generator=g) * torch.logspace(-3.0, -1.3, h, device=DEV)[:, None]
    ang = pos[:, None, None] * w[None]
    phi = torch.cat([ang.cos(), ang.sin()], -1) / math.sqrt(d // 2)
    noise = lambda: 0.3 * torch.randn(b, s, h, d, device=DEV, generator=g) / math.sqrt(d // 2)  # noqa: E731
    return (14.0 * math.sqrt(d) * (phi + noise())).to(dtype), (phi + noise()).to(dtype)


# (B, S, H, Dh, block, dtype): a Wan 1.3B clip at 64-token blocks, a wide micro-batch at 128, small head dim, S < block
SCORE_CASES = [
    (1, 32760, 12, 128, 64, torch.bfloat16),
    (3, 14040, 12, 128, 128, torch.bfloat16),
    (2, 4093, 3, 64, 64, torch.float16),
    (2, 100, 3, 128, 128, torch.bfloat16),
]


@pytest.mark.parametrize("b,s,h,d,block,dtype", SCORE_CASES)
def test_pooled_scores_kernel_matches_fp64_and_selects_like_the_torch_path(monkeypatch, b, s, h, d, block, dtype):
    from ds_adaptive.attention.kernels import triton_block_scores as sc
    from ds_adaptive.attention.selection import blocks_for_density
    from ds_adaptive.attention.scores import pooled_lse_scores, pooled_lse_scores_torch

    monkeypatch.setattr(sc, "_alloc", lambda *a, **kw: torch.full(*a, float("nan"), **kw))
    q, k = _structured_qk(b, s, h, d, dtype, seed=s)
    got = pooled_lse_scores(q, k, block)  # the dispatch: the kernel on CUDA
    assert torch.equal(got, sc.triton_pooled_lse_scores(q, k, block))
    assert torch.isfinite(got).all(), "an entry not written (NaN poison)"
    exact = _scores64(q, k, block)
    ref = pooled_lse_scores_torch(q, k, block)
    torch_err = _err(ref, exact)
    assert _err(got, exact) <= 2 * torch_err + 1e-3 * float(exact.abs().max()), (_err(got, exact), torch_err)
    # the selection: the kernel's top-k is the float64 scores' top-k up to near-ties, at least as well as torch's
    nk = math.ceil(s / block)
    kph = blocks_for_density(torch.full((h,), 0.1), nk)
    masks = [select_blocks(x.float(), kph, seq_len=s, block_size=block).dense_block_mask() for x in (got, ref, exact)]
    agree = [float((m & masks[2]).sum()) / float(masks[2].sum()) for m in masks[:2]]
    assert agree[0] >= min(0.995, agree[1] - 1e-3), agree


def test_pooled_scores_kernel_reads_strided_views_and_compiles_once() -> None:
    """q, k as head slices of a packed [B, S, 3, H, D] projection give the contiguous result; new S and B after one
    warm call reuse the compiled kernel."""
    from ds_adaptive.attention.kernels import _triton_block_scores as kmod
    from ds_adaptive.attention.kernels.triton_block_scores import triton_pooled_lse_scores
    from ds_adaptive.attention.kernels.triton_block_sparse import kernel_variants

    qkv = torch.randn(2, 3001, 3, 6, 128, device=DEV, dtype=torch.bfloat16) * 3
    q, k = qkv[:, :, 0, 1:4], qkv[:, :, 1, 2:5]
    a = triton_pooled_lse_scores(q, k, 64)
    assert torch.equal(a, triton_pooled_lse_scores(q.contiguous(), k.contiguous(), 64))
    torch.cuda.synchronize()
    before = kernel_variants(kmod.ALL_KERNELS)
    for b, s in [(1, 4096), (3, 1000), (1, 17), (2, 12345)]:
        x = torch.randn(b, s, 3, 128, device=DEV, dtype=torch.bfloat16)
        triton_pooled_lse_scores(x, x, 64)
    torch.cuda.synchronize()
    assert kernel_variants(kmod.ALL_KERNELS) == before
