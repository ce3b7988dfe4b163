"""Guards ln_modulate on CPU: reference numerics vs fp64, the public function, path selection, kernel policy
(the C++ op itself: tests/unit/ops/test_ln_modulate_ops.py)."""
from __future__ import annotations

import importlib
import subprocess
import sys
import types
import warnings

import pytest
import torch

lnm = importlib.import_module("ds_adaptive.ops.ln_modulate")
from ds_adaptive.ops import LayerNormModulate, ln_modulate, ln_modulate_reference  # noqa: E402

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


def test_the_side_effect_helpers_import_dynamo_lazily_and_stay_out_of_compiled_graphs(monkeypatch):
    """Importing the op (every dry run and CLI command imports the model) leaves torch._dynamo unimported (~2 s of
    CPU); the warn-once helper still runs eagerly, once, when its first call is inside a compiled function."""
    code = "import sys, ds_adaptive.ops, ds_adaptive.models.wan; print('torch._dynamo' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    # the last line: DeepSpeed's op registry (imported by ops.builder) may print its accelerator line first
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == ["False"], r.stdout + r.stderr

    monkeypatch.setattr(lnm, "_STATE", lnm._OpState())

    def f(x):
        lnm._warn_once("compiled-first", "ln_modulate: a warning from inside a compiled function")
        return x * 2 + 1

    torch._dynamo.reset()
    cf = torch.compile(f, backend="eager")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        outs = [cf(torch.ones(3)) for _ in range(3)]
    assert all(torch.equal(o, torch.full((3,), 3.0)) for o in outs)
    assert [str(w.message) for w in rec if "compiled function" in str(w.message)] == [
        "ln_modulate: a warning from inside a compiled function"]
    assert lnm._STATE.warned == {"compiled-first"}
    disabled = getattr(lnm._warn_once.__wrapped__, "_ds_adaptive_disabled", None)
    assert disabled is not None and getattr(disabled, "_torchdynamo_disable", False)


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
