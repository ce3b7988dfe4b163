"""Guards the fused ln_modulate CUDA op: forward and every gradient vs an fp64 reference, layouts, edges."""
from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest
import torch

lnm = importlib.import_module("ds_adaptive.ops.ln_modulate")

CUDA = torch.device("cuda")
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
COMBOS = [(BF16, F32), (BF16, BF16), (F16, F32), (F16, F16), (F32, F32)]
DS = [8, 100, 1000, 1536, 3072, 5120, 8192]
BS = [(1, 129), (3, 37), (16, 17)]  # odd S
# Test ids name the modulation layout, so that `-k per_token` selects every per-token case (bench/gpu/gpu_check.sh's
# pertoken step) and `-k per_sample` every per-sample one.
LAYOUT_IDS = ["per_sample", "per_token"]


def layout_id(per_token: bool) -> str:
    return LAYOUT_IDS[int(per_token)]


@pytest.fixture(autouse=True)
def _fused(monkeypatch):
    monkeypatch.setenv(lnm.ENV_VAR, "fused")


@pytest.fixture(scope="module", autouse=True)
def _op():
    return lnm.load_op(strict=True)


# Kernel generations (DS_ADAPTIVE_LN_MODULATE_KERNELS): every correctness test below that takes the
# `kernels` fixture runs with all-v1 and all-v2 policies; tests without it run the default policy.
GENS = ["v1", "v2"]


@pytest.fixture
def kernels(request):
    prev = lnm.kernel_policy()
    lnm.set_kernel_policy(request.param)
    yield request.param
    lnm.set_kernel_policy(prev)


# ------------------------------------------------------------------------------------------------
# fp64 reference, written independently of the op (explicit mean / biased variance)
# ------------------------------------------------------------------------------------------------
def ref64(x, shift, scale, eps, weight=None, bias=None):
    x = x.double()
    d = x.shape[-1]
    mean = x.sum(-1, keepdim=True) / d
    var = ((x - mean) ** 2).sum(-1, keepdim=True) / d
    h = (x - mean) / torch.sqrt(var + eps)
    if weight is not None:
        h = h * weight.double()
    if bias is not None:
        h = h + bias.double()
    if shift.dim() == 2:
        shift, scale = shift[:, None], scale[:, None]
    return h * (1 + scale.double()) + shift.double()


def make(B, S, D, xdt, mdt, per_token, affine, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)

    def rn(*shape):
        return torch.randn(*shape, generator=g, device=CUDA)

    x = (rn(B, S, D) * 1.5 + 0.5).to(xdt)
    if per_token:  # Wan 2.2-style [B, S, 6, D] table: views with strides (S*6D, 6D, 1)
        table = (rn(B, S, 6, D) * 0.5).to(mdt)
        shift, scale = table[:, :, 2], table[:, :, 4]
    else:  # [B, 6, D] table: [B, 1, D] views with strides (6D, D, 1)
        table = (rn(B, 6, D) * 0.5).to(mdt)
        shift, scale = table[:, 2:3], table[:, 4:5]
    weight = bias = None
    if affine:
        weight = (1 + 0.2 * rn(D)).to(mdt)
        bias = (0.2 * rn(D)).to(mdt)
    dy = rn(B, S, D).to(xdt)
    return x, shift, scale, weight, bias, dy


def fresh(t):
    """A copy of t that requires grad and keeps t's layout: a view (strided modulation slice,
    non-contiguous x) is re-created on a cloned base (clone() alone would densify it)."""
    if t._base is not None:
        base = t._base.detach().clone().requires_grad_()
        return base.as_strided(t.size(), t.stride(), t.storage_offset() - t._base.storage_offset())
    return t.detach().clone().requires_grad_()


def run(fn, x, shift, scale, weight, bias, dy, eps=1e-6):
    """y and grads of fn w.r.t. x, shift, scale (and weight, bias), on fresh copies in t's layout."""
    leaves = [fresh(t) for t in (x, shift, scale)]
    assert all(a.stride() == t.stride() for a, t in zip(leaves, (x, shift, scale)))
    aff = [t.detach().clone().requires_grad_() for t in (weight, bias) if t is not None]
    w = aff[0] if weight is not None else None
    b = aff[1] if bias is not None else None
    y = fn(leaves[0], leaves[1], leaves[2], eps, w, b)
    grads = torch.autograd.grad(y, leaves + aff, dy.to(y.dtype))
    return [y.detach()] + list(grads)


def assert_close_to_fp64(outs, torch_outs, ref_outs, names, rel_atol=2e-5):
    """Flash-attention style: |ours - ref| <= 2 |torch_lowp - ref| + small atol, per output."""
    for name, o, t, r in zip(names, outs, torch_outs, ref_outs):
        assert o.shape == r.shape, f"{name}: shape {tuple(o.shape)} != {tuple(r.shape)}"
        assert o.dtype == t.dtype, f"{name}: dtype {o.dtype} != torch's {t.dtype}"
        assert torch.isfinite(o).all(), f"{name}: non-finite values"
        err = (o.double() - r).abs().max().item()
        err_torch = (t.double() - r).abs().max().item()
        atol = rel_atol * (r.abs().max().item() + 1e-3)
        assert err <= 2 * err_torch + atol, f"{name}: max err {err:.3g} > 2 x torch's {err_torch:.3g} + {atol:.2g}"


def check(B, S, D, xdt, mdt, per_token, affine, seed=0, shift=None, scale=None):
    x, sh, sc, w, b, dy = make(B, S, D, xdt, mdt, per_token, affine, seed)
    sh = sh if shift is None else shift(sh)
    sc = sc if scale is None else scale(sc)
    ours = run(lnm.ln_modulate, x, sh, sc, w, b, dy)
    low = run(lnm.ln_modulate_reference, x, sh, sc, w, b, dy)
    ref = run(ref64, x.double(), sh.double(), sc.double(), None if w is None else w.double(),
              None if b is None else b.double(), dy.double())
    names = ["y", "dx", "dshift", "dscale"] + (["dweight", "dbias"] if affine else [])
    assert_close_to_fp64(ours, low, ref, names)
    return ours


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernels", GENS, indirect=True)
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("per_token", [False, True], ids=LAYOUT_IDS)
@pytest.mark.parametrize("xdt,mdt", COMBOS, ids=[f"x{str(a)[6:]}-m{str(b)[6:]}" for a, b in COMBOS])
@pytest.mark.parametrize("B,S", BS, ids=[f"B{b}S{s}" for b, s in BS])
@pytest.mark.parametrize("D", DS)
def test_matches_fp64(D, B, S, xdt, mdt, per_token, affine, kernels):
    check(B, S, D, xdt, mdt, per_token, affine, seed=D * 7 + B)


@pytest.mark.parametrize("kernels", GENS, indirect=True)
@pytest.mark.parametrize("D", [1536, 5120, 1000, 3072])
@pytest.mark.parametrize("per_token", [False, True], ids=LAYOUT_IDS)
def test_long_sequences_multi_row_tiles(D, per_token, kernels):
    """S large enough that every backward tile spans many rows (and the fwd grid is persistent)."""
    check(2, 9001, D, BF16, F32, per_token, affine=True, seed=3)
    check(3, 4099, D, BF16, F32, per_token, affine=False, seed=4)


@pytest.mark.parametrize("kernels", GENS, indirect=True)
def test_wan_1_3b_shape(kernels):
    check(1, 32760, 1536, BF16, F32, per_token=False, affine=False, seed=11)


@pytest.mark.parametrize("kernels", GENS, indirect=True)
@pytest.mark.parametrize("B,S,D,per_token", [(16, 1560, 1536, False), (1, 8190, 5120, False),
                                             (1, 8190, 5120, True), (1, 32760, 1536, True)],
                         ids=["per_sample-16x1560x1536", "per_sample-1x8190x5120", "per_token-1x8190x5120",
                              "per_token-1x32760x1536"])
def test_wan_shapes(B, S, D, per_token, kernels):
    check(B, S, D, BF16, F32, per_token=per_token, affine=False, seed=12)


@pytest.mark.parametrize("kernels", GENS, indirect=True)
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("per_token", [False, True], ids=LAYOUT_IDS)
@pytest.mark.parametrize("xdt,mdt", COMBOS, ids=[f"x{str(a)[6:]}-m{str(b)[6:]}" for a, b in COMBOS])
@pytest.mark.parametrize("D", [1152, 2304, 4096])
def test_dit_widths(D, xdt, mdt, per_token, affine, kernels):
    """The DiT widths with their own (H200-tuned) configurations, e.g. D = 1152's 4-byte 96x6 forward."""
    check(3, 37, D, xdt, mdt, per_token, affine, seed=D + 7)
    check(1, 301, D, xdt, mdt, per_token, affine, seed=D + 8)


@pytest.mark.parametrize("kernels", GENS, indirect=True)
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("B,S", [(2000, 3), (700, 1), (300, 7)])
def test_many_short_samples(B, S, affine, kernels):
    """More samples than resident CTAs: backward CTAs loop over several tiles (v2: one per sample,
    crossing tile boundaries inside the staged pipeline), forward deals rows round-robin."""
    check(B, S, 1536, BF16, F32, per_token=False, affine=affine, seed=B + S)
    check(B, S, 5120, BF16, F32, per_token=False, affine=affine, seed=B + S + 1)
    check(B, S, 1152, BF16, F32, per_token=False, affine=affine, seed=B + S + 2)   # one-warp v2 forward, masked


@pytest.mark.parametrize("kernels", GENS, indirect=True)
@pytest.mark.parametrize("xdt", [BF16, F32])
def test_largest_d_and_shared_memory_fallback(xdt, kernels):
    """Largest vectorised D: v2's per-token stages would exceed shared memory there (fp32
    modulation of 16-bit x), so the launcher falls back to v1; results must not change."""
    D = lnm.MAX_D_VEC16 if xdt == BF16 else lnm.MAX_D_ANY
    for per_token in (False, True):
        check(2, 5, D, xdt, F32, per_token=per_token, affine=True, seed=5)


def test_kernel_policy_selects_the_generation(_op):
    x, sh, sc, w, b, dy = make(2, 9, 1536, BF16, F32, False, False)
    _, shp, scp, _, _, _ = make(2, 9, 1536, BF16, F32, True, False)
    prev = lnm.kernel_policy()
    try:
        default = dict(zip(lnm.POLICY_KEYS, _op.default_kernels()))
        assert lnm.set_kernel_policy("default") == default
        for spec, want in (("v1", (1, 1, 1, 1)), ("v2", (2, 2, 2, 2)), ("fwd_token=v2,bwd_sample=v2,v1", None),
                           ("v1,fwd_token=v2,bwd_sample=v2", (1, 2, 2, 1))):
            if want is None:  # later items override earlier ones: the trailing v1 wins
                assert set(lnm.set_kernel_policy(spec).values()) == {1}
                continue
            pol = lnm.set_kernel_policy(spec)
            ps, pt = _op.describe(x, sc), _op.describe(x, scp)
            # describe: [..., 6] fwd generation, [7] bwd generation
            assert (ps[6], pt[6], ps[7], pt[7]) == want, (spec, pol, ps, pt)
        with pytest.raises(ValueError):
            lnm.set_kernel_policy("fwd=v3")
    finally:
        lnm.set_kernel_policy(prev)
    # the scalar path (unaligned, D odd) has no v2 kernels: v1 whatever the policy
    lnm.set_kernel_policy("v2")
    try:
        xo = torch.randn(2, 9, 1001, device=CUDA, dtype=BF16)
        so = torch.randn(2, 1, 1001, device=CUDA)
        d = _op.describe(xo, so)
        assert d[6] == 1 and d[7] == 1
    finally:
        lnm.set_kernel_policy(prev)


@pytest.mark.parametrize("per_token", [False, True], ids=LAYOUT_IDS)
@pytest.mark.parametrize("D", [1536, 5120, 8192])
def test_v1_and_v2_agree(D, per_token):
    """Same inputs through both generations: y to one bf16 rounding, gradients to fp32 summation
    order (the fp64 tests bound each generation; this one catches a generation-specific slip that
    both fp64 bounds might tolerate)."""
    x, sh, sc, w, b, dy = make(3, 517, D, BF16, F32, per_token, True, seed=D)
    prev = lnm.kernel_policy()
    res = {}
    try:
        for gen in GENS:
            lnm.set_kernel_policy(gen)
            res[gen] = run(lnm.ln_modulate, x, sh, sc, w, b, dy)
    finally:
        lnm.set_kernel_policy(prev)
    names = ["y", "dx", "dshift", "dscale", "dweight", "dbias"]
    for name, u, v in zip(names, res["v1"], res["v2"]):
        assert u.shape == v.shape and u.dtype == v.dtype, name
        if u.dtype == BF16:
            torch.testing.assert_close(u.float(), v.float(), atol=2e-2, rtol=1e-2, msg=name)
        else:
            scale = v.abs().max().item() + 1e-6
            err = (u - v).abs().max().item()
            assert err <= 1e-4 * scale, f"{name}: v1 vs v2 max diff {err:.3g} (scale {scale:.3g})"


def test_modulation_layouts():
    B, S, D = 3, 41, 1536
    # [B, D] (2-D), contiguous [B, 1, D], B broadcast [1, 1, D], mixed per-sample / per-token
    check(B, S, D, BF16, F32, False, False, shift=lambda t: t[:, 0], scale=lambda t: t[:, 0])
    check(B, S, D, BF16, F32, False, False, shift=lambda t: t.contiguous(), scale=lambda t: t.contiguous())
    check(B, S, D, BF16, F32, False, True, shift=lambda t: t[:1], scale=lambda t: t[:1])
    x, sh, sc, w, b, dy = make(B, S, D, BF16, F32, False, False)
    per_tok = torch.randn(B, S, D, device=CUDA) * 0.5
    check(B, S, D, BF16, F32, False, False, scale=lambda t: per_tok)
    # shift and scale of different dtypes (fp32 + bf16): computed with fp32 modulation
    check(B, S, D, BF16, F32, True, False, scale=lambda t: t.to(BF16))
    # unaligned views (offset by one element): scalar path
    big = torch.randn(B, 6, D + 1, device=CUDA) * 0.5
    check(B, S, D, BF16, F32, False, False, shift=lambda t: big[:, 0:1, 1:], scale=lambda t: big[:, 3:4, 1:])


@pytest.mark.parametrize("layout", ["row_strided", "transposed", "last_dim_strided", "unaligned"])
def test_non_contiguous_x(layout):
    B, S, D = 3, 37, 1000
    x, sh, sc, w, b, dy = make(B, S, D, BF16, F32, False, True)
    if layout == "row_strided":
        xs = torch.zeros(B, S, D + 24, device=CUDA, dtype=BF16)[..., :D]
    elif layout == "transposed":
        xs = torch.zeros(S, B, D, device=CUDA, dtype=BF16).transpose(0, 1)
    elif layout == "last_dim_strided":
        xs = torch.zeros(B, D, S, device=CUDA, dtype=BF16).transpose(1, 2)
    else:
        xs = torch.zeros(B, S, D + 1, device=CUDA, dtype=BF16)[..., 1:]
    xs.copy_(x)
    assert not xs.is_contiguous()
    strided = run(lnm.ln_modulate, xs, sh, sc, w, b, dy)
    contiguous = run(lnm.ln_modulate, x, sh, sc, w, b, dy)
    for u, v in zip(strided, contiguous):
        if layout == "unaligned":  # scalar path: same math, another summation order
            torch.testing.assert_close(u.float(), v.float(), atol=2e-2, rtol=1e-2)
        else:  # same kernel reading through strides (or a contiguous copy): bitwise equal
            assert torch.equal(u, v)


@pytest.mark.parametrize("B,S,D", [(3, 7, 1), (4, 1, 1536), (1, 1, 8), (0, 5, 64), (2, 0, 1536)])
@pytest.mark.parametrize("per_token", [False, True], ids=LAYOUT_IDS)
def test_edge_sizes(B, S, D, per_token):
    x, sh, sc, w, b, dy = make(B, S, D, BF16, F32, per_token, True)
    ours = run(lnm.ln_modulate, x, sh, sc, w, b, dy)
    ref = run(lnm.ln_modulate_reference, x, sh, sc, w, b, dy)
    for o, r in zip(ours, ref):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert torch.isfinite(o).all()
        torch.testing.assert_close(o.float(), r.float(), atol=2e-2, rtol=2e-2)


def _poison_allocator(nbytes):
    """Fill the caching allocator's free blocks with NaN: small-pool (<= 1 MiB) segments and one
    large block, which the op's next allocations (outputs, workspace) then reuse."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    small = [torch.full((256 * 1024,), float("nan"), device=CUDA) for _ in range(48)]
    large = torch.full((nbytes // 4 + 1024,), float("nan"), device=CUDA)
    del small, large
    torch.cuda.synchronize()


@pytest.mark.parametrize("kernels", GENS, indirect=True)
@pytest.mark.parametrize("B,S,D", [(1, 32760, 1536), (2, 517, 1536), (3, 37, 3072), (1, 129, 5120)])
def test_per_token_gradient_of_the_table(B, S, D, kernels):
    """Per-token modulation as a training step differentiates it: shift / scale are chunks of a [B, S, 6, D]
    fp32 table that requires grad (Wan 2.2 style), the gradient lands in the table (its other chunks zero);
    every gradient vs fp64 within 2x torch's own low-precision error (bench/kernels/ln_modulate_per_token.py times
    this path)."""
    g = torch.Generator(device=CUDA).manual_seed(S + D)
    x0 = (torch.randn(B, S, D, generator=g, device=CUDA) * 1.5 + 0.5).to(BF16)
    t0 = torch.randn(B, S, 6, D, generator=g, device=CUDA) * 0.5
    dy = torch.randn(B, S, D, generator=g, device=CUDA).to(BF16)

    def grads(fn, xdt, tdt):
        x, table = x0.to(xdt).requires_grad_(), t0.to(tdt).requires_grad_()
        c = table.chunk(6, dim=2)
        y = fn(x, c[2].squeeze(2), c[4].squeeze(2), 1e-6)
        return [y.detach()] + list(torch.autograd.grad(y, [x, table], dy.to(y.dtype)))

    ours = grads(lnm.ln_modulate, BF16, F32)
    assert_close_to_fp64(ours, grads(lnm.ln_modulate_reference, BF16, F32),
                         grads(ref64, torch.float64, torch.float64), ["y", "dx", "dtable"])
    dtable = ours[2]
    assert dtable[:, :, [0, 1, 3, 5]].abs().max() == 0 and dtable[:, :, 2].abs().max() > 0


POISON_CASES = [(1536, False), (1000, True), (100, False), (5120, True), (5120, False), (1536, True), (3072, False)]


@pytest.mark.parametrize("kernels", GENS, indirect=True)
@pytest.mark.parametrize("D,per_token", POISON_CASES, ids=[f"{layout_id(t)}-D{d}" for d, t in POISON_CASES])
def test_poisoned_outputs_fully_written(D, per_token, kernels):
    B, S = 3, 53
    x, sh, sc, w, b, dy = make(B, S, D, BF16, F32, per_token, True)
    _poison_allocator(64 * B * S * D)
    probe = torch.empty(B * S * D, dtype=BF16, device=CUDA)
    assert probe.isnan().any(), "poisoning did not reach the allocator's free blocks"
    del probe
    _poison_allocator(64 * B * S * D)
    outs = run(lnm.ln_modulate, x, sh, sc, w, b, dy)
    for name, o in zip(["y", "dx", "dshift", "dscale", "dweight", "dbias"], outs):
        assert torch.isfinite(o).all(), f"{name} has unwritten (NaN) elements"
    _poison_allocator(64 * B * S * D)
    y, mean, rstd = torch.ops.ds_adaptive.ln_modulate(x, sh, sc, None, None, 1e-6)
    assert torch.isfinite(y).all() and torch.isfinite(mean).all() and torch.isfinite(rstd).all()


@pytest.mark.parametrize("kernels", GENS, indirect=True)
@pytest.mark.parametrize("D,per_token", [(1536, False), (5120, False), (1536, True)],
                         ids=["per_sample-D1536", "per_sample-D5120", "per_token-D1536"])
def test_deterministic(D, per_token, kernels):
    x, sh, sc, w, b, dy = make(2, 3001, D, BF16, F32, per_token, True)
    a = run(lnm.ln_modulate, x, sh, sc, w, b, dy)
    c = run(lnm.ln_modulate, x, sh, sc, w, b, dy)
    for u, v in zip(a, c):
        assert torch.equal(u, v)


def test_custom_op_registration_and_fake():
    x, sh, sc, w, b, dy = make(2, 9, 1536, BF16, F32, False, False)
    torch.library.opcheck(torch.ops.ds_adaptive.ln_modulate.default, (x, sh, sc, None, None, 1e-6))
    torch.library.opcheck(torch.ops.ds_adaptive.ln_modulate.default,
                          (x.requires_grad_(), sh.clone().requires_grad_(), sc.clone().requires_grad_(),
                           None, None, 1e-6))


@pytest.mark.parametrize("kernels", GENS, indirect=True)
def test_torch_compile_matches_eager(kernels):
    x, sh, sc, w, b, dy = make(2, 257, 1536, BF16, F32, False, False)
    table = torch.randn(2, 6, 1536, device=CUDA)

    def f(x, table):
        h = lnm.ln_modulate(x * 2, table[:, 0:1], table[:, 1:2])
        return h.float().sin()

    compiled = torch.compile(f, fullgraph=True)
    res = []
    for fn in (f, compiled):
        xl, tl = x.detach().clone().requires_grad_(), table.clone().requires_grad_()
        y = fn(xl, tl)
        gx, gt = torch.autograd.grad(y, (xl, tl), dy.float())
        res.append((y, gx, gt))
    for e, c in zip(*res):
        torch.testing.assert_close(c, e, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kernels", GENS, indirect=True)
@pytest.mark.parametrize("D", [1536, 5120])
def test_cuda_graph_capture_and_replay(D, kernels):
    x, sh, sc, w, b, dy = make(2, 129, D, BF16, F32, False, True)
    xs = x.clone().requires_grad_()
    table = torch.randn(2, 6, D, device=CUDA).requires_grad_()
    ws = w.clone().requires_grad_()

    def step():
        y = lnm.ln_modulate(xs, table[:, 0:1], table[:, 1:2], 1e-6, ws, None)
        return torch.autograd.grad(y, (xs, table, ws), dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    with torch.no_grad():
        xs.copy_(torch.randn_like(xs))
        table.copy_(torch.randn_like(table))
    graph.replay()
    eager = step()
    for s_, e in zip(static, eager):
        assert torch.equal(s_, e)


def test_errors_name_what_was_expected():
    x, sh, sc, w, b, dy = make(2, 5, 64, BF16, F32, False, False)
    with pytest.raises(ValueError, match=r"shift must be \[B, D\], \[B, 1, D\] or \[B, S, D\]"):
        lnm.ln_modulate(x, sh[..., :32], sc)
    with pytest.raises(ValueError, match="is on cpu but x is on cuda"):
        lnm.ln_modulate(x, sh.cpu(), sc)
    with pytest.raises(ValueError, match=r"x must be a \[B, S, D\] tensor"):
        lnm.ln_modulate(x[0], sh, sc)
    with pytest.raises(TypeError, match="floating-point"):
        lnm.ln_modulate(x.to(torch.int32), sh, sc)
    with pytest.raises(RuntimeError, match="must be float32 or x's dtype"):
        torch.ops.ds_adaptive.ln_modulate(x, sh.half(), sc.half(), None, None, 1e-6)


def test_oversized_d_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setenv(lnm.ENV_VAR, "auto")
    x, sh, sc, w, b, dy = make(1, 3, 20000, BF16, F32, False, False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        y1 = lnm.ln_modulate(x, sh, sc)
        y2 = lnm.ln_modulate(x, sh, sc)
    msgs = [str(r.message) for r in rec if "register-resident" in str(r.message)]
    assert len(msgs) <= 1  # exactly one per process (an earlier test may already have emitted it)
    torch.testing.assert_close(y1, lnm.ln_modulate_reference(x, sh, sc))
    assert torch.equal(y1, y2)
    monkeypatch.setenv(lnm.ENV_VAR, "fused")
    with pytest.raises(ValueError, match="register-resident"):
        lnm.ln_modulate(x, sh, sc)


@pytest.mark.parametrize("per_token", [False, True], ids=LAYOUT_IDS)
def test_no_host_synchronisation(per_token):
    """The C++ dispatch (checks, allocation, launches, autograd) never synchronises with the GPU."""
    x, sh, sc, w, b, dy = make(2, 129, 1536, BF16, F32, per_token, True)
    leaves = [t.detach().clone().requires_grad_() for t in (x, sh, sc, w, b)]
    torch.autograd.grad(lnm.ln_modulate(*leaves[:3], 1e-6, *leaves[3:]), leaves, dy)  # first call: caches filled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = lnm.ln_modulate(*leaves[:3], 1e-6, *leaves[3:])
        torch.autograd.grad(y, leaves, dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cpp_checks_raise_cleanly_on_cuda_inputs():
    """The op's own C++ checks (called directly, without the Python layer's checks) raise the
    documented errors for CUDA inputs. A failing shape check segfaulted under torch 2.11 when its
    message printed c10::SymInt sizes (issue 18); run in a subprocess so a crash fails this test only."""
    code = (
        "import torch\n"
        "from ds_adaptive.ops.ln_modulate import load_op\n"
        "load_op(strict=True)\n"
        "op = torch.ops.ds_adaptive.ln_modulate_apply.default\n"
        "x = torch.randn(2, 5, 64, device='cuda', dtype=torch.bfloat16)\n"
        "sh, sc = torch.randn(2, 64, device='cuda'), torch.randn(2, 64, device='cuda')\n"
        "for args in ((x, sh[..., :32], sc), (x[0], sh, sc), (x, sh, sc[:1, :7])):\n"
        "    try:\n"
        "        op(*args, 1e-6, None, None)\n"
        "        print('no error')\n"
        "    except ValueError as e:\n"
        "        print('ValueError', str(e).splitlines()[0])\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"rc {p.returncode}: {p.stderr[-2000:]}"
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(("ValueError", "no error"))]
    assert len(lines) == 3 and all(ln.startswith("ValueError ln_modulate: ") for ln in lines), p.stdout
    assert "got [2, 32]" in lines[0] and "got [5, 64]" in lines[1] and "got [1, 7]" in lines[2], lines


def test_fast_entry_point_matches_torch_ops():
    """ln_modulate's eager entry point (the extension's `apply`) is the op torch.ops calls: same y
    and gradients bit for bit, and it is what plain CUDA tensors take."""
    assert lnm._STATE.fast_apply is not None
    x, sh, sc, w, b, dy = make(3, 37, 1536, BF16, F32, False, True)
    fast = run(lnm.ln_modulate, x, sh, sc, w, b, dy)
    slow = run(lambda *a: torch.ops.ds_adaptive.ln_modulate_apply(*a), x, sh, sc, w, b, dy)
    for u, v in zip(fast, slow):
        assert torch.equal(u, v)
    calls = []
    real = lnm._STATE.try_apply
    try:
        lnm._STATE.try_apply = lambda *a: calls.append(1) or real(*a)
        lnm.ln_modulate(x, sh, sc)
    finally:
        lnm._STATE.try_apply = real
    assert calls == [1]


def test_try_apply_conditions():
    """The extension's try_apply (ln_modulate's eager fast path in one C++ call) runs the op exactly when
    the Python layer's old checks held: plain tensors or nn.Parameter (whose __torch_function__ is
    disabled), no torch-function mode, a CUDA [B, S, D] x of a kernel dtype with D <= 8192; None otherwise.
    Its result equals torch.ops' bit for bit; argument errors of the op still raise."""
    ext = lnm.load_op(strict=True)
    x, sh, sc, w, b, dy = make(2, 5, 1536, BF16, F32, False, True)
    ref = torch.ops.ds_adaptive.ln_modulate_apply(x, sh, sc, 1e-6, w, b)
    assert torch.equal(ext.try_apply(x, sh, sc, 1e-6, w, b), ref)
    assert torch.equal(ext.try_apply(x, sh, sc, 1e-6, torch.nn.Parameter(w), torch.nn.Parameter(b)), ref)

    class Sub(torch.Tensor):
        pass

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert ext.try_apply(x.as_subclass(Sub), sh, sc, 1e-6, None, None) is None
    assert ext.try_apply(x, sh, sc.as_subclass(Sub), 1e-6, None, None) is None
    assert ext.try_apply(x, sh, sc, 1e-6, w.as_subclass(Sub), None) is None
    assert ext.try_apply(x.cpu(), sh.cpu(), sc.cpu(), 1e-6, None, None) is None
    assert ext.try_apply(x.double(), sh, sc, 1e-6, None, None) is None
    assert ext.try_apply(x[0], sh, sc, 1e-6, None, None) is None  # 2-D x: the checked path names the error
    wide = torch.zeros(1, 2, 8200, device="cuda", dtype=BF16)
    assert ext.try_apply(wide, wide[:, :1].float(), wide[:, :1].float(), 1e-6, None, None) is None
    with Mode():
        assert ext.try_apply(x, sh, sc, 1e-6, None, None) is None
    with pytest.raises((RuntimeError, ValueError), match="shift must be"):
        ext.try_apply(x, sh[..., :7], sc, 1e-6, None, None)


def test_cpp_autograd_node_is_used():
    """ln_modulate on CUDA runs the C++ autograd node (no Python custom op / autograd layer); mean /
    rstd are no part of the autograd graph."""
    x, sh, sc, w, b, dy = make(2, 9, 1536, BF16, F32, False, False)
    y = lnm.ln_modulate(x.requires_grad_(), sh, sc)
    assert y.grad_fn.name() == "LnModulateBackward"
    y, mean, rstd = torch.ops.ds_adaptive.ln_modulate(x, sh, sc, None, None, 1e-6)
    assert y.grad_fn.name() == "LnModulateBackward" and mean.grad_fn is None and not rstd.requires_grad

