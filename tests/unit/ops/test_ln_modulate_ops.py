"""Guards the C++ registration of ln_modulate (csrc/ln_modulate/ln_modulate_ops.cpp): schemas, the C++
autograd node, CPU and Meta implementations, the composite entry point's checks and layouts, and the
Python layer's choice of the C++ op. Built here as a CPU-only library (no CUDA needed); on a GPU machine
the full extension (which contains the same file) is loaded instead."""
from __future__ import annotations

import importlib
import os
import shutil

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

lnm = importlib.import_module("ds_adaptive.ops.ln_modulate")
from ds_adaptive.ops import ln_modulate_reference  # noqa: E402
from ds_adaptive.ops.builder import build_cpu_ops  # noqa: E402
from test_ln_modulate import make, ref64  # noqa: E402  (inputs and fp64 reference of the Python-side tests)


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    """torch.ops.ds_adaptive with the op registered (built once per session, ~30 s on 2 cores)."""
    if torch.cuda.is_available():
        lnm.load_op(strict=True)  # the CUDA extension registers the same ops (two definitions would clash)
    else:
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            pytest.skip("no C++ compiler: the CPU build of the op's registration needs one")
        build_cpu_ops(os.environ.get("DS_ADAPTIVE_CPU_OPS_DIR") or str(tmp_path_factory.mktemp("lnm_ops")))
    return torch.ops.ds_adaptive


def test_schemas(ops):
    assert str(ops.ln_modulate.default._schema) == (
        "ds_adaptive::ln_modulate(Tensor x, Tensor shift, Tensor scale, Tensor? weight, Tensor? bias, float eps) "
        "-> (Tensor, Tensor, Tensor)")
    assert str(ops.ln_modulate_backward.default._schema) == (
        "ds_adaptive::ln_modulate_backward(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor scale, "
        "Tensor? weight, Tensor? bias, bool need_dshift) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
    apply = str(ops.ln_modulate_apply.default._schema)
    assert apply.startswith("ds_adaptive::ln_modulate_apply(Tensor x, Tensor shift, Tensor scale, float eps=")
    assert apply.endswith("Tensor? weight=None, Tensor? bias=None) -> Tensor")
    for name, keys in (("ln_modulate", ("CPU", "Meta", "Autograd")), ("ln_modulate_backward", ("CPU", "Meta")),
                       ("ln_modulate_apply", ("CompositeImplicitAutograd",))):
        for key in keys:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ds_adaptive::{name}", key), (name, key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_op_forward_equals_reference_bitwise(ops, dtype, per_token):
    x, sh, sc, w, b, _ = make(2, 7, 48, dtype, torch.float32, per_token, True)
    y, mean, rstd = ops.ln_modulate(x, sh, sc, w, b, 1e-6)
    assert torch.equal(y, ln_modulate_reference(x, sh, sc, 1e-6, w, b))
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == (2, 7)
    torch.testing.assert_close(mean, x.float().mean(-1))
    torch.testing.assert_close(rstd, torch.rsqrt(x.float().var(-1, unbiased=False) + 1e-6))


@pytest.mark.parametrize("case", ["per_sample", "per_token", "affine", "affine_per_token"])
def test_op_gradcheck_fp64(ops, case):
    x, sh, sc, w, b, _ = make(2, 5, 7, torch.float64, torch.float64, "per_token" in case, "affine" in case)
    args = [x.requires_grad_(), sh.detach().clone().requires_grad_(), sc.detach().clone().requires_grad_()]
    if "affine" in case:
        args += [w.double().requires_grad_(), b.double().requires_grad_()]
        f = lambda x, sh, sc, w, b: ops.ln_modulate(x, sh, sc, w, b, 1e-5)[0]  # noqa: E731
    else:
        f = lambda x, sh, sc: ops.ln_modulate(x, sh, sc, None, None, 1e-5)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, tuple(args))


def test_apply_gradcheck_through_layouts(ops):
    """The composite entry point: [B, D] modulation, a B-broadcast one, bias without weight, all
    differentiated back to their own leaves (a [B, 6, D] table: gradients in the right rows only)."""
    table = torch.randn(2, 6, 9, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 5, 9, dtype=torch.float64, requires_grad=True)
    bcast = torch.randn(1, 1, 9, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(9, dtype=torch.float64, requires_grad=True)
    f = lambda x, t, s, b: ops.ln_modulate_apply(x, t[:, 0], s, 1e-5, None, b)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, table, bcast, bias))
    (gt,) = torch.autograd.grad(f(x, table, bcast, bias).sum(), table)
    assert gt[:, 1:].abs().sum() == 0 and gt[:, 0].abs().sum() > 0


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_op_backward_matches_fp64_autograd(ops, per_token, affine):
    """The backward op's math (what the CUDA kernel implements) against fp64 autograd."""
    x, sh, sc, w, b, dy = make(3, 11, 40, torch.float32, torch.float32, per_token, affine)
    y, mean, rstd = ops.ln_modulate(x, sh, sc, w, b, 1e-6)
    dx, dshift, dscale, dw, db = ops.ln_modulate_backward(dy, x, mean, rstd, sc, w, b, per_token)
    l64 = [t.double().requires_grad_() for t in (x, sh, sc)]
    a64 = [t.double().requires_grad_() for t in (w, b)] if affine else [None, None]
    want = torch.autograd.grad(ref64(*l64, 1e-6, *a64), l64 + [a for a in a64 if a is not None], dy.double())
    got = [dx, dshift, dscale] + ([dw, db] if affine else [])
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, atol=1e-4 * (1 + r.abs().max().item()), rtol=1e-4)
    if not affine:
        assert dw.numel() == 0 and db.numel() == 0


def test_per_token_dshift_is_dy_itself(ops):
    """Autograd in C++: per-token dshift of the same dtype as dy is dy (no copy); otherwise written."""
    x, sh, sc, _, _, dy = make(2, 5, 16, per_token=True)
    leaves = [t.detach().clone().requires_grad_() for t in (x, sh, sc)]
    gx, gsh, gsc = torch.autograd.grad(ops.ln_modulate_apply(*leaves, 1e-6), leaves, dy)
    assert gsh.data_ptr() == dy.data_ptr()
    xb = x.bfloat16().requires_grad_()
    (gsh32,) = torch.autograd.grad(ops.ln_modulate_apply(xb, leaves[1], leaves[2], 1e-6), leaves[1], dy.bfloat16())
    assert gsh32.dtype == torch.float32 and torch.equal(gsh32, dy.bfloat16().float())


@pytest.mark.parametrize("dtype,mdtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                                          (torch.float32, torch.float32)])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_meta_impl_shapes_and_dtypes(ops, dtype, mdtype, per_token, affine):
    B, S, D = 3, 7, 24
    x, sh, sc, w, b, _ = make(B, S, D, dtype, mdtype, per_token, affine)
    zeros = torch.zeros_like(x)
    with FakeTensorMode() as mode:
        fx, fsh, fsc, fdy = (mode.from_tensor(t) for t in (x, sh, sc, zeros))
        fw, fb = (mode.from_tensor(t) if t is not None else None for t in (w, b))
        y, mean, rstd = ops.ln_modulate(fx, fsh, fsc, fw, fb, 1e-6)
        fake = ops.ln_modulate_backward(fdy, fx, mean, rstd, fsc, fw, fb, per_token)
    assert (y.shape, y.dtype, mean.shape, mean.dtype) == ((B, S, D), dtype, (B, S), torch.float32)
    rows = S if per_token else 1
    assert (fake[1].shape, fake[1].dtype, fake[2].shape) == ((B, rows, D), mdtype, (B, rows, D))
    real = ops.ln_modulate_backward(torch.zeros_like(x), x, *ops.ln_modulate(x, sh, sc, w, b, 1e-6)[1:], sc, w, b,
                                    per_token)
    for f, r in zip(fake, real):
        assert f.shape == r.shape and f.dtype == r.dtype and f.stride() == r.stride()


@pytest.mark.parametrize("args", ["plain", "affine", "per_token_bf16"])
def test_opcheck(ops, args):
    if args == "plain":
        x, sh, sc, w, b, _ = make(2, 5, 16)
    elif args == "affine":
        x, sh, sc, w, b, _ = make(2, 5, 16, affine=True)
    else:
        x, sh, sc, w, b, _ = make(2, 5, 16, torch.bfloat16, torch.float32, per_token=True)
    torch.library.opcheck(ops.ln_modulate.default, (x, sh, sc, w, b, 1e-6))
    torch.library.opcheck(ops.ln_modulate.default, (x.requires_grad_(), sh.detach().requires_grad_(),
                                                    sc.detach().requires_grad_(), w, b, 1e-6))


def test_torch_compile_of_the_apply_op_matches_eager(ops):
    x, _, _, w, _, dy = make(2, 9, 32, affine=True)

    def f(x, table, w):
        return ops.ln_modulate_apply(x * 2, table[:, 0], table[:, 1:2], 1e-6, w, None).sin()

    table = torch.randn(2, 6, 32)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    outs = []
    for fn in (f, compiled):
        leaves = [x.clone().requires_grad_(), table.clone().requires_grad_(), w.clone().requires_grad_()]
        y = fn(*leaves)
        outs.append([y] + list(torch.autograd.grad(y, leaves, dy)))
    for e, c in zip(*outs):
        torch.testing.assert_close(c, e)


BAD = [
    (lambda x, sh, sc: (x[0], sh, sc), ValueError, r"x must be a \[B, S, D\] tensor"),
    (lambda x, sh, sc: (x.long(), sh, sc), TypeError, "x must be a floating-point tensor"),
    (lambda x, sh, sc: (x, sh[..., :3], sc), ValueError, r"shift must be \[B, D\], \[B, 1, D\] or \[B, S, D\]"),
    (lambda x, sh, sc: (x, sh, sc[:, :, :, None]), ValueError, r"scale must be"),
    (lambda x, sh, sc: (x, sh, sc.expand(2, 3, 8)), ValueError, r"scale must be .* S = 5"),
    (lambda x, sh, sc: (x, sh.long(), sc), TypeError, "shift must be floating point"),
    (lambda x, sh, sc: (x, sh.to("meta"), sc), ValueError, "shift is on meta but x is on cpu"),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_apply_checks_match_the_python_messages(ops, i):
    bad, exc, match = BAD[i]
    x, sh, sc, *_ = make(2, 5, 8)
    args = bad(x, sh, sc)
    with pytest.raises(exc, match=match):
        ops.ln_modulate_apply(*args, 1e-6)
    with pytest.raises(exc, match=match):  # the reference path's own checks say the same
        lnm._check_args(*args, None, None)
    with pytest.raises(ValueError, match=r"weight must be a \[D\] = \[8\] tensor or None"):
        ops.ln_modulate_apply(x, sh, sc, 1e-6, torch.ones(7))
    with pytest.raises(RuntimeError, match="must be float32 or x's dtype"):
        ops.ln_modulate(x, sh.half(), sc.half(), None, None, 1e-6)


class _CudaLooking(torch.Tensor):
    """A CPU tensor that reports is_cuda (the Python layer's choice is what is tested)."""

    @property
    def is_cuda(self):
        return True


def _graph_nodes(t, depth=4):
    names, frontier = set(), [t.grad_fn]
    for _ in range(depth):
        frontier = [n for n in frontier if n is not None]
        names |= {n.name() for n in frontier}
        frontier = [nxt for n in frontier for nxt, _ in n.next_functions]
    return names


def test_python_layer_calls_the_cpp_op_when_loaded(ops, monkeypatch):
    state = lnm._OpState()
    state.tried, state.ext, state.apply = True, object(), ops.ln_modulate_apply.default
    monkeypatch.setattr(lnm, "_STATE", state)
    monkeypatch.setenv(lnm.ENV_VAR, "auto")
    x, sh, sc, w, b, dy = make(2, 5, 24, affine=True)
    xc = torch.Tensor._make_subclass(_CudaLooking, x.clone(), True)
    y = lnm.ln_modulate(xc, sh, sc, 1e-6, w, b)
    assert "LnModulateBackward" in _graph_nodes(y)  # the C++ autograd node, not the reference's graph
    torch.testing.assert_close(y.as_subclass(torch.Tensor), ln_modulate_reference(x, sh, sc, 1e-6, w, b))
    monkeypatch.setenv(lnm.ENV_VAR, "reference")
    assert "LnModulateBackward" not in _graph_nodes(lnm.ln_modulate(xc, sh, sc))


def test_eager_fast_entry_point_only_for_plain_tensors(ops, monkeypatch):
    """The extension's `apply` (the op without torch.ops' Python layer) takes eager calls on plain
    tensors; tensor subclasses (nn.Parameter too) and torch-function modes go through torch.ops,
    whose __torch_function__ handling they may rely on. Same results either way."""
    calls = []
    state = lnm._OpState()
    state.tried, state.ext, state.apply = True, object(), ops.ln_modulate_apply.default
    state.fast_apply = lambda *a: calls.append("fast") or ops.ln_modulate_apply.default(*a)
    monkeypatch.setattr(lnm, "_STATE", state)
    monkeypatch.setattr(lnm, "_is_cuda_float", lambda x: True)
    monkeypatch.setattr(lnm, "_use_fused", lambda x: True)
    x, sh, sc, w, b, dy = make(2, 5, 24, affine=True)
    ref = ln_modulate_reference(x, sh, sc, 1e-6, w, b)
    torch.testing.assert_close(lnm.ln_modulate(x, sh, sc, 1e-6, w, b), ref)
    assert calls == ["fast"]
    y = lnm.ln_modulate(x, sh, sc, 1e-6, torch.nn.Parameter(w), b)  # a subclass: torch.ops
    torch.testing.assert_close(y, ref)
    seen = []

    class Recording(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Recording():
        torch.testing.assert_close(lnm.ln_modulate(x, sh, sc, 1e-6, w, b), ref)
    assert calls == ["fast"]
    assert ops.ln_modulate_apply.default in seen  # the mode saw the op
    assert lnm.call_counts()["fused"] == 3


def test_autograd_node(ops):
    """The hand-written C++ autograd node (issue 18: host time): y is its only differentiable output,
    mean / rstd are plain tensors; saved tensors are version-checked and released after a backward
    without retain_graph; gradients only for the inputs that need them; a double backward raises."""
    x, sh, sc, w, b, dy = make(2, 5, 24, torch.float64, torch.float64, affine=True)
    leaves = [t.detach().clone().requires_grad_() for t in (x, sh, sc, w, b)]
    y, mean, rstd = ops.ln_modulate(*leaves, 1e-6)
    assert y.grad_fn.name() == "LnModulateBackward" and len(y.grad_fn.next_functions) == 5
    assert mean.grad_fn is None and rstd.grad_fn is None and not mean.requires_grad and not rstd.requires_grad
    grads = torch.autograd.grad(y, leaves, dy, retain_graph=True)
    again = torch.autograd.grad(y, leaves, dy)
    ref = torch.autograd.grad(ln_modulate_reference(*leaves[:3], 1e-6, *leaves[3:]), leaves, dy)
    for g, a, r in zip(grads, again, ref):
        assert torch.equal(g, a)
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)  # the reference computes in fp32
    with pytest.raises(RuntimeError, match="backward through the graph a second time|freed"):
        torch.autograd.grad(y, leaves, dy)
    # only the gradients asked for; inputs that do not require grad get none
    xs = leaves[0].detach().requires_grad_()
    y2, _, _ = ops.ln_modulate(xs, leaves[1].detach(), leaves[2], None, None, 1e-6)
    (gx,) = torch.autograd.grad(y2, [xs], dy)
    torch.testing.assert_close(gx, torch.autograd.grad(ln_modulate_reference(xs, leaves[1].detach(), leaves[2]),
                                                       [xs], dy)[0], rtol=1e-5, atol=1e-5)
    # an in-place change of a saved input is detected
    xi = leaves[0].detach().clone().requires_grad_()
    xv = xi * 1
    y3, _, _ = ops.ln_modulate(xv, leaves[1], leaves[2], None, None, 1e-6)
    xv.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y3.backward(dy)
    # double backward: not implemented (raises instead of returning wrong second derivatives)
    for per_token in (False, True):  # per-token: dshift is dy itself without create_graph
        xd, shd, scd, _, _, dyd = make(2, 5, 24, torch.float64, torch.float64, per_token)
        lv = [t.detach().clone().requires_grad_() for t in (xd, shd, scd)]
        y4, _, _ = ops.ln_modulate(*lv, None, None, 1e-6)
        g1 = torch.autograd.grad(y4, lv, dyd, create_graph=True)
        torch.testing.assert_close(g1[1], torch.autograd.grad(ln_modulate_reference(*lv), lv, dyd)[1])
        for g in g1:
            with pytest.raises(RuntimeError, match="double backward .* is not implemented"):
                torch.autograd.grad(g.sum(), lv)
    with torch.no_grad():
        assert ops.ln_modulate(*leaves, 1e-6)[0].grad_fn is None


def test_fast_path_errors_are_the_python_errors(ops, monkeypatch):
    """The eager fast path leaves the argument checks to the C++ op; when it raises, the Python layer's
    check runs and raises its ValueError / TypeError (the extension's pybind entry point turns C++
    errors into RuntimeError); an error that is no argument error propagates unchanged."""
    def pybind_like(*a):
        try:
            return ops.ln_modulate_apply.default(*a)
        except Exception as e:  # what pybind11 makes of a c10::ValueError
            raise RuntimeError(str(e)) from None

    state = lnm._OpState()
    state.tried, state.ext, state.apply, state.fast_apply = True, object(), ops.ln_modulate_apply.default, pybind_like
    state.try_apply = pybind_like  # the C++ fast path when its conditions hold (they always do here)
    monkeypatch.setattr(lnm, "_STATE", state)
    x, sh, sc, w, b, dy = make(2, 5, 24)
    torch.testing.assert_close(lnm.ln_modulate(x, sh, sc), ln_modulate_reference(x, sh, sc))
    assert lnm.call_counts()["fused"] == 1
    with pytest.raises(ValueError, match=r"shift must be \[B, D\], \[B, 1, D\] or \[B, S, D\]"):
        lnm.ln_modulate(x, sh[..., :7], sc)
    with pytest.raises(ValueError, match=r"weight must be a \[D\] = \[24\] tensor or None"):
        lnm.ln_modulate(x, sh, sc, 1e-6, torch.ones(7))
    with pytest.raises(RuntimeError, match="must be float32 or x's dtype"):
        state.try_apply = lambda *a: ops.ln_modulate.default(x, sh.half(), sc.half(), None, None, 1e-6)
        lnm.ln_modulate(x, sh, sc)
    assert lnm.call_counts()["fused"] == 1


def test_fast_path_layering_and_mode(monkeypatch):
    """ln_modulate's eager fast path (the extension's try_apply, which checks its own conditions: GPU test
    test_try_apply_conditions) runs only with the extension loaded, outside torch.compile, in a mode other
    than `reference` (the environment re-read on every call); when try_apply returns None the checked
    path runs (here: the reference, CPU tensors)."""
    state = lnm._OpState()
    monkeypatch.setattr(lnm, "_STATE", state)
    x, sh, sc, w, b, dy = make(1, 2, 8)
    ref = ln_modulate_reference(x, sh, sc)
    seen = []
    state.try_apply = lambda *a: seen.append(a) or None
    torch.testing.assert_close(lnm.ln_modulate(x, sh, sc), ref)
    assert len(seen) == 1 and lnm.call_counts() == {"fused": 0, "reference": 1}
    monkeypatch.setenv(lnm.ENV_VAR, "reference")
    torch.testing.assert_close(lnm.ln_modulate(x, sh, sc), ref)
    assert len(seen) == 1  # mode reference: not even tried
    monkeypatch.setenv(lnm.ENV_VAR, "auto")
    state.try_apply = lambda *a: seen.append(a) or ref * 2  # what the op returned is what the caller gets
    torch.testing.assert_close(lnm.ln_modulate(x, sh, sc), ref * 2)
    assert len(seen) == 2 and lnm.call_counts() == {"fused": 1, "reference": 2}
    for mode in ("reference", "auto", "fused", "reference"):
        monkeypatch.setenv(lnm.ENV_VAR, mode)
        assert lnm._mode() == mode
    monkeypatch.delenv(lnm.ENV_VAR)
    assert lnm._mode() == "auto"
    monkeypatch.setenv(lnm.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="expected one of auto, fused, reference"):
        lnm._mode()
