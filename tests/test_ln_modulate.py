"""Guards ln_modulate on CPU: reference numerics vs fp64, the custom op (schema, fake, autograd), path selection."""
from __future__ import annotations

import importlib
import types
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

lnm = importlib.import_module("ds_adaptive.ops.ln_modulate")
from ds_adaptive.ops import LayerNormModulate, ln_modulate, ln_modulate_reference  # noqa: E402

OP = torch.ops.ds_adaptive.ln_modulate
OP_BWD = torch.ops.ds_adaptive.ln_modulate_backward
TOL = {torch.float32: 2e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


# fp64 reference written independently of the module (explicit mean and biased variance)
def ref64(x, shift, scale, eps=1e-6, weight=None, bias=None):
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


def make(B, S, D, dtype=torch.float32, mdtype=torch.float32, per_token=False, affine=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, S, D, generator=g) * 1.5 + 0.7).to(dtype)
    if per_token:  # [B, S, 6, D] table, views with strides (S*6D, 6D, 1)
        table = (torch.randn(B, S, 6, D, generator=g) * 0.5).to(mdtype)
        shift, scale = table[:, :, 1], table[:, :, 4]
    else:  # [B, 6, D] table, views [B, 1, D] with strides (6D, D, 1)
        table = (torch.randn(B, 6, D, generator=g) * 0.5).to(mdtype)
        shift, scale = table[:, 1:2], table[:, 4:5]
    w = b = None
    if affine:
        w = 1 + 0.2 * torch.randn(D, generator=g)
        b = 0.2 * torch.randn(D, generator=g)
    dy = torch.randn(B, S, D, generator=g).to(dtype)
    return x, shift, scale, w, b, dy


SIZES = [(1, 1, 1), (2, 5, 7), (3, 9, 100), (1, 17, 1000), (2, 3, 1536)]


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,S,D", SIZES)
def test_reference_forward_matches_fp64(B, S, D, dtype, per_token, affine):
    x, sh, sc, w, b, _ = make(B, S, D, dtype, torch.float32, per_token, affine)
    y = ln_modulate_reference(x, sh, sc, 1e-6, w, b)
    ref = ref64(x, sh, sc, 1e-6, w, b)
    assert y.dtype == dtype and y.shape == (B, S, D)
    # fp32 math then one rounding: within one rounding step of the exact value
    assert ((y.double() - ref).abs() <= TOL[dtype] * ref.abs() + 1e-5).all()


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("B,S,D", [(2, 5, 7), (3, 9, 100), (1, 17, 33)])
def test_reference_backward_matches_fp64(B, S, D, per_token, affine):
    x, sh, sc, w, b, dy = make(B, S, D, torch.float32, torch.float32, per_token, affine)
    leaves = [t.detach().clone().requires_grad_() for t in (x, sh, sc)]
    aff = [t.clone().requires_grad_() for t in (w, b)] if affine else [None, None]
    y = ln_modulate_reference(*leaves, 1e-6, *aff)
    got = torch.autograd.grad(y, leaves + [a for a in aff if a is not None], dy)
    l64 = [t.detach().double().requires_grad_() for t in (x, sh, sc)]
    a64 = [t.double().requires_grad_() for t in (w, b)] if affine else [None, None]
    want = torch.autograd.grad(ref64(*l64, 1e-6, *a64), l64 + [a for a in a64 if a is not None], dy.double())
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, atol=5e-5 * (1 + r.abs().max().item()), rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# the custom op (its CPU implementation is the kernel's math in torch)
# ------------------------------------------------------------------------------------------------
def test_custom_ops_are_registered():
    assert hasattr(torch.ops.ds_adaptive, "ln_modulate")
    assert hasattr(torch.ops.ds_adaptive, "ln_modulate_backward")
    schema = str(OP.default._schema)
    assert "Tensor x, Tensor shift, Tensor scale, Tensor? weight, Tensor? bias, float eps" in schema


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_op_forward_equals_reference_bitwise(dtype, per_token):
    x, sh, sc, w, b, _ = make(2, 7, 48, dtype, torch.float32, per_token, True)
    y, mean, rstd = OP(x, sh, sc, w, b, 1e-6)
    assert torch.equal(y, ln_modulate_reference(x, sh, sc, 1e-6, w, b))
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == (2, 7)
    torch.testing.assert_close(mean, x.float().mean(-1))
    torch.testing.assert_close(rstd, torch.rsqrt(x.float().var(-1, unbiased=False) + 1e-6))


@pytest.mark.parametrize("case", ["per_sample", "per_token", "affine", "affine_per_token", "bias_only_weight"])
def test_op_gradcheck_fp64(case):
    B, S, D = 2, 5, 7
    per_token = "per_token" in case
    x, sh, sc, w, b, _ = make(B, S, D, torch.float64, torch.float64, per_token, "affine" in case or "bias" in case)
    args = [x.requires_grad_(), sh.detach().clone().requires_grad_(), sc.detach().clone().requires_grad_()]
    if "affine" in case or "bias" in case:
        args += [w.double().requires_grad_(), b.double().requires_grad_()]
        f = lambda x, sh, sc, w, b: OP(x, sh, sc, w, b, 1e-5)[0]  # noqa: E731
    else:
        f = lambda x, sh, sc: OP(x, sh, sc, None, None, 1e-5)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, tuple(args))


def test_op_gradcheck_strided_views_of_a_table():
    """shift/scale as chunks of one [B, 6, D] table: gradients land in the right table rows."""
    table = torch.randn(2, 6, 9, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 5, 9, dtype=torch.float64, requires_grad=True)
    f = lambda x, t: OP(x, t[:, 0:1], t[:, 1:2], None, None, 1e-5)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, table))
    y = f(x, table)
    (gt,) = torch.autograd.grad(y.sum(), table)
    assert gt[:, 2:].abs().sum() == 0 and gt[:, :2].abs().sum() > 0


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_op_backward_matches_fp64_autograd(per_token, affine):
    """The backward op's math (what the CUDA kernel implements) against fp64 autograd."""
    x, sh, sc, w, b, dy = make(3, 11, 40, torch.float32, torch.float32, per_token, affine)
    y, mean, rstd = OP(x, sh, sc, w, b, 1e-6)
    dx, dshift, dscale, dw, db = OP_BWD(dy, x, mean, rstd, sc, w, b, per_token)
    l64 = [t.double().requires_grad_() for t in (x, sh, sc)]
    a64 = [t.double().requires_grad_() for t in (w, b)] if affine else [None, None]
    want = torch.autograd.grad(ref64(*l64, 1e-6, *a64), l64 + [a for a in a64 if a is not None], dy.double())
    got = [dx, dshift, dscale] + ([dw, db] if affine else [])
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, atol=1e-4 * (1 + r.abs().max().item()), rtol=1e-4)
    if not affine:
        assert dw.numel() == 0 and db.numel() == 0


def _fake_shapes(x, sh, sc, w, b, need):
    dy = torch.zeros_like(x)
    with FakeTensorMode() as mode:
        fx, fsh, fsc, fdy = (mode.from_tensor(t) for t in (x, sh, sc, dy))
        fw = mode.from_tensor(w) if w is not None else None
        fb = mode.from_tensor(b) if b is not None else None
        y, mean, rstd = OP(fx, fsh, fsc, fw, fb, 1e-6)
        outs = OP_BWD(fdy, fx, mean, rstd, fsc, fw, fb, need)
    return (y, mean, rstd), outs


@pytest.mark.parametrize("dtype,mdtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                                          (torch.float32, torch.float32)])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_fake_impl_shapes_and_dtypes(dtype, mdtype, per_token, affine):
    B, S, D = 3, 7, 24
    x, sh, sc, w, b, _ = make(B, S, D, dtype, mdtype, per_token, affine)
    (y, mean, rstd), (dx, dshift, dscale, dw, db) = _fake_shapes(x, sh, sc, w, b, per_token)
    assert (y.shape, y.dtype) == ((B, S, D), dtype)
    assert (mean.shape, mean.dtype, rstd.shape, rstd.dtype) == ((B, S), torch.float32, (B, S), torch.float32)
    assert (dx.shape, dx.dtype) == ((B, S, D), dtype)
    rows = S if per_token else 1
    assert (dshift.shape, dshift.dtype, dscale.shape, dscale.dtype) == ((B, rows, D), mdtype, (B, rows, D), mdtype)
    assert dw.shape == ((D,) if affine else (0,)) and db.shape == ((D,) if affine else (0,))
    # the real (CPU) implementation agrees with the fake one
    real = OP_BWD(torch.zeros_like(x), x, *OP(x, sh, sc, w, b, 1e-6)[1:], sc, w, b, per_token)
    for f, r in zip((dx, dshift, dscale, dw, db), real):
        assert f.shape == r.shape and f.dtype == r.dtype


@pytest.mark.parametrize("args", ["plain", "affine", "per_token_bf16"])
def test_opcheck(args):
    if args == "plain":
        x, sh, sc, w, b, _ = make(2, 5, 16)
    elif args == "affine":
        x, sh, sc, w, b, _ = make(2, 5, 16, affine=True)
    else:
        x, sh, sc, w, b, _ = make(2, 5, 16, torch.bfloat16, torch.float32, per_token=True)
    torch.library.opcheck(OP.default, (x, sh, sc, w, b, 1e-6))
    torch.library.opcheck(OP.default, (x.requires_grad_(), sh.detach().requires_grad_(),
                                       sc.detach().requires_grad_(), w, b, 1e-6))


def test_torch_compile_of_the_op_matches_eager():
    x, sh, sc, w, b, dy = make(2, 9, 32, affine=True)

    def f(x, table, w):
        return OP(x * 2, table[:, 0:1], table[:, 1:2], w, None, 1e-6)[0].sin()

    table = torch.randn(2, 6, 32)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    outs = []
    for fn in (f, compiled):
        leaves = [x.clone().requires_grad_(), table.clone().requires_grad_(), w.clone().requires_grad_()]
        y = fn(*leaves)
        outs.append([y] + list(torch.autograd.grad(y, leaves, dy)))
    for e, c in zip(*outs):
        torch.testing.assert_close(c, e)


# ------------------------------------------------------------------------------------------------
# public function, module, path selection
# ------------------------------------------------------------------------------------------------
def test_public_function_is_a_drop_in_for_the_reference():
    x, sh, sc, w, b, dy = make(2, 5, 24, torch.bfloat16, torch.float32, affine=True)
    assert torch.equal(ln_modulate(x, sh, sc, 1e-6, w, b), ln_modulate_reference(x, sh, sc, 1e-6, w, b))
    assert torch.equal(ln_modulate(x, sh[:, 0], sc[:, 0]), ln_modulate_reference(x, sh, sc))  # [B, D]
    assert torch.equal(ln_modulate(x, sh, sc, 1e-5), ln_modulate_reference(x, sh, sc, 1e-5))  # positional eps


def test_layer_norm_modulate_module():
    m = LayerNormModulate(24, eps=1e-5, elementwise_affine=True)
    assert m.weight.shape == (24,) and m.bias.shape == (24,)
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    x, sh, sc, *_ = make(2, 5, 24)
    torch.testing.assert_close(m(x, sh, sc), ln_modulate_reference(x, sh, sc, 1e-5, m.weight, m.bias))
    plain = LayerNormModulate(24)
    assert plain.weight is None and "elementwise_affine=False" in repr(plain)
    torch.testing.assert_close(plain(x, sh, sc), ln_modulate_reference(x, sh, sc, 1e-6))


@pytest.mark.parametrize("bad,match", [
    (lambda x, sh, sc: (x[0], sh, sc), r"x must be a \[B, S, D\] tensor"),
    (lambda x, sh, sc: (x, sh[..., :3], sc), r"shift must be \[B, D\], \[B, 1, D\] or \[B, S, D\]"),
    (lambda x, sh, sc: (x, sh, sc[:, :, :, None]), r"scale must be"),
    (lambda x, sh, sc: (x, sh, sc.expand(2, 3, 8)), r"scale must be"),
])
def test_shape_errors_say_what_was_expected(bad, match):
    x, sh, sc, *_ = make(2, 5, 8)
    with pytest.raises(ValueError, match=match):
        ln_modulate(*bad(x, sh, sc))


def test_dtype_and_affine_errors():
    x, sh, sc, *_ = make(2, 5, 8)
    with pytest.raises(TypeError, match="floating-point"):
        ln_modulate(x.long(), sh, sc)
    with pytest.raises(TypeError, match="shift must be floating point"):
        ln_modulate(x, sh.long(), sc)
    with pytest.raises(ValueError, match=r"weight must be a \[D\] = \[8\] tensor"):
        ln_modulate(x, sh, sc, 1e-6, torch.ones(7))


def test_mode_env_var(monkeypatch):
    x, sh, sc, *_ = make(2, 5, 8)
    monkeypatch.setenv(lnm.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="expected one of auto, fused, reference"):
        ln_modulate(x, sh, sc)
    monkeypatch.setenv(lnm.ENV_VAR, "fused")
    with pytest.raises(ValueError, match="CUDA tensors only"):
        ln_modulate(x, sh, sc)
    monkeypatch.setenv(lnm.ENV_VAR, "reference")
    assert torch.equal(ln_modulate(x, sh, sc), ln_modulate_reference(x, sh, sc))
    monkeypatch.setenv(lnm.ENV_VAR, "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU tensors in auto mode: the reference, no warning
        assert torch.equal(ln_modulate(x, sh, sc), ln_modulate_reference(x, sh, sc))


def _cuda_like(dtype=torch.bfloat16, d=1536):
    """Stand-in for a CUDA tensor (this CI machine has none): what _use_fused looks at."""
    t = torch.empty(1, 2, d, dtype=dtype)
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda"), dtype=dtype, shape=t.shape,
                                 element_size=t.element_size)


def test_fallback_warns_exactly_once_with_the_reason(monkeypatch):
    monkeypatch.setattr(lnm, "_STATE", lnm._OpState())
    monkeypatch.setenv(lnm.ENV_VAR, "auto")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert lnm._use_fused(_cuda_like()) is False
        assert lnm._use_fused(_cuda_like()) is False
    msgs = [str(r.message) for r in rec if "ln_modulate" in str(r.message)]
    assert len(msgs) == 1, msgs
    assert "fused CUDA op is unavailable" in msgs[0] and "CPU-only build" in msgs[0]
    status = lnm.op_status()
    assert status["tried"] and not status["loaded"] and "CPU-only build" in status["error"]
    monkeypatch.setenv(lnm.ENV_VAR, "fused")
    with pytest.raises(RuntimeError, match="fused ln_modulate op is unavailable"):
        lnm._use_fused(_cuda_like())
    monkeypatch.setenv(lnm.ENV_VAR, "reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lnm._use_fused(_cuda_like()) is False


def test_unsupported_inputs_fall_back_with_a_reason(monkeypatch):
    monkeypatch.setattr(lnm, "_STATE", lnm._OpState())
    monkeypatch.setenv(lnm.ENV_VAR, "auto")
    with pytest.warns(RuntimeWarning, match="register-resident limit"):
        assert lnm._use_fused(_cuda_like(torch.bfloat16, 40000)) is False
    with pytest.warns(RuntimeWarning, match="dtype torch.float64"):
        assert lnm._use_fused(_cuda_like(torch.float64, 64)) is False
    assert lnm._kernel_limitation(_cuda_like(torch.bfloat16, 16384)) is None
    assert lnm._kernel_limitation(_cuda_like(torch.float32, 8192)) is None
    assert lnm._kernel_limitation(_cuda_like(torch.float32, 8193)) is not None


def test_load_op_on_cpu_torch_reports_why():
    assert lnm.load_op(strict=False) is None
    with pytest.raises(RuntimeError, match="CPU-only build"):
        lnm.load_op(strict=True)


# ------------------------------------------------------------------------------------------------
# kernel-generation policy (DS_ADAPTIVE_LN_MODULATE_KERNELS)
# ------------------------------------------------------------------------------------------------
DEFAULTS = dict(zip(lnm.POLICY_KEYS, (1, 2, 2, 2, 2)))


def test_kernel_policy_spec_parsing():
    parse = lnm.parse_kernel_policy
    assert parse("", DEFAULTS) == DEFAULTS and parse(" default ", DEFAULTS) == DEFAULTS
    assert set(parse("v1", DEFAULTS).values()) == {1}
    assert set(parse("V2", DEFAULTS).values()) == {2}
    assert parse("v1,fwd=v2", DEFAULTS) == dict(fwd_sample=2, fwd_token=2, bwd_sample=1, bwd_token=1, finalize=1)
    assert parse("bwd=1", DEFAULTS) == dict(fwd_sample=1, fwd_token=2, bwd_sample=1, bwd_token=1, finalize=1)
    assert parse("sample=v2 token=v1", DEFAULTS) == dict(fwd_sample=2, fwd_token=1, bwd_sample=2, bwd_token=1,
                                                          finalize=2)
    assert parse("all=v1,finalize=v2", DEFAULTS)["finalize"] == 2
    for p in (parse("v1", DEFAULTS), parse("sample=v2", DEFAULTS), DEFAULTS):
        assert parse(lnm.format_kernel_policy(p), DEFAULTS) == p
    with pytest.raises(ValueError, match="bad generation 'v3'"):
        parse("fwd=v3", DEFAULTS)
    with pytest.raises(ValueError, match="unknown key 'forward'"):
        parse("forward=v2", DEFAULTS)
    with pytest.raises(ValueError, match="bad generation"):
        parse("v7", DEFAULTS)


class _FakeExt:
    def __init__(self):
        self.policy = [DEFAULTS[k] for k in lnm.POLICY_KEYS]

    def default_kernels(self):
        return [DEFAULTS[k] for k in lnm.POLICY_KEYS]

    def get_kernels(self):
        return list(self.policy)

    def set_kernels(self, values):
        assert len(values) == 5 and all(v in (1, 2) for v in values)
        self.policy = list(values)


def test_kernel_policy_env_is_applied_when_the_op_loads(monkeypatch):
    ext = _FakeExt()
    monkeypatch.delenv(lnm.KERNELS_ENV_VAR, raising=False)
    lnm._apply_kernel_env(ext)
    assert ext.policy == [1, 2, 2, 2, 2]
    monkeypatch.setenv(lnm.KERNELS_ENV_VAR, "bwd_token=v1")
    lnm._apply_kernel_env(ext)
    assert ext.policy == [1, 2, 2, 1, 2]
    monkeypatch.setenv(lnm.KERNELS_ENV_VAR, "v9")
    with pytest.raises(ValueError, match=lnm.KERNELS_ENV_VAR):
        lnm._apply_kernel_env(ext)
    # set_kernel_policy / kernel_policy / op_status on a loaded (fake) op
    monkeypatch.setattr(lnm, "_STATE", lnm._OpState())
    lnm._STATE.tried, lnm._STATE.ext = True, ext
    assert lnm.set_kernel_policy("v2") == dict.fromkeys(lnm.POLICY_KEYS, 2)
    assert lnm.set_kernel_policy({"fwd_sample": 1}) == DEFAULTS
    assert lnm.kernel_policy() == DEFAULTS
    assert lnm.op_status()["kernels"] == lnm.format_kernel_policy(DEFAULTS)
    with pytest.raises(ValueError, match="unknown keys"):
        lnm.set_kernel_policy({"fwd": 2})


def test_set_kernel_policy_needs_the_op(monkeypatch):
    monkeypatch.setattr(lnm, "_STATE", lnm._OpState())
    assert lnm.kernel_policy() is None
    with pytest.raises(RuntimeError, match="unavailable"):
        lnm.set_kernel_policy("v1")
