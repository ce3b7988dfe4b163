"""Layers that keep less for their backward (``ds_adaptive.models.lean_backward``): the FFN's ``Linear(GELU(h))``
keeping ``h`` only and the fp32 LayerNorm keeping its bf16 input give the outputs and gradients of the plain
compositions (fp64 references, awkward sizes, bf16 within 2x torch's own rounding error), keep the bytes they
claim, and the Wan block uses them (and falls back to the plain modules under a wrapper such as LoRA)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ds_adaptive.models import lean_backward as lb
from ds_adaptive.models.wan import WanBlock, get_wan_config


def _rand(*shape, seed, dtype, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + 0.1).to(dtype).requires_grad_(True)


def _grads(fn, args, dout):
    out = fn(*args)
    return [out.detach()] + list(torch.autograd.grad(out, [a for a in args if a is not None], dout))


def _saved_bytes(fn, *args) -> dict:
    """Bytes of the distinct storages autograd keeps for ``fn(*args)``'s backward, by dtype."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype, tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return seen


@pytest.mark.parametrize("lead,n_in,n_out,bias",
                         [((7,), 13, 5, True), ((2, 9), 37, 11, False), ((3, 1, 5), 8, 3, True)])
def test_gelu_linear_matches_fp64_forward_and_backward(lead, n_in, n_out, bias):
    h = _rand(*lead, n_in, seed=0, dtype=torch.float64, scale=2.0)
    w = _rand(n_out, n_in, seed=1, dtype=torch.float64, scale=0.3)
    b = _rand(n_out, seed=2, dtype=torch.float64) if bias else None
    dout = torch.randn(*lead, n_out, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    args = (h, w, b)
    ref = _grads(lb.gelu_tanh_linear_reference, args, dout)
    got = _grads(lb.gelu_tanh_linear, args, dout)
    assert len(got) == len(ref) == (4 if bias else 3)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lead,n_in,n_out", [((5, 33), 61, 19), ((1, 97), 24, 40)])
def test_gelu_linear_bf16_within_twice_torchs_own_error(lead, n_in, n_out):
    h64 = _rand(*lead, n_in, seed=4, dtype=torch.float64, scale=2.0)
    w64 = _rand(n_out, n_in, seed=5, dtype=torch.float64, scale=0.2)
    b64 = _rand(n_out, seed=6, dtype=torch.float64)
    dout = torch.randn(*lead, n_out, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ref = _grads(lb.gelu_tanh_linear_reference, (h64, w64, b64), dout)
    low = [t.detach().bfloat16().requires_grad_(True) for t in (h64, w64, b64)]
    torch_bf16 = _grads(lb.gelu_tanh_linear_reference, low, dout.bfloat16())
    ours = _grads(lb.gelu_tanh_linear, low, dout.bfloat16())
    for name, o, t, r in zip(("out", "dh", "dw", "db"), ours, torch_bf16, ref):
        err, torch_err = (o.double() - r).abs().max(), (t.double() - r).abs().max()
        assert torch.isfinite(o).all() and err <= 2 * torch_err + 1e-6, (name, float(err), float(torch_err))


def test_gelu_linear_keeps_the_gelu_input_only():
    h = _rand(4, 50, 64, seed=8, dtype=torch.bfloat16)
    w = _rand(16, 64, seed=9, dtype=torch.bfloat16)
    b = _rand(16, seed=10, dtype=torch.bfloat16)
    act = 4 * 50 * 64 * 2   # bytes of one [tokens, 64] bf16 activation
    plain = sorted(n for n, _, _ in _saved_bytes(lb.gelu_tanh_linear_reference, h, w, b).values())
    lean = sorted(n for n, _, _ in _saved_bytes(lb.gelu_tanh_linear, h, w, b).values())
    assert plain == [16 * 64 * 2, act, act]   # the weight, h and GELU(h)
    assert lean == [16 * 64 * 2, act]         # the weight and h


def test_gelu_linear_frozen_weight_and_no_grad():
    h = _rand(3, 7, 10, seed=11, dtype=torch.float64)
    w = torch.randn(6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(12))  # frozen (LoRA base)
    dout = torch.randn(3, 7, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(13))
    (dh,) = torch.autograd.grad(lb.gelu_tanh_linear(h, w, None), h, dout)
    (ref,) = torch.autograd.grad(lb.gelu_tanh_linear_reference(h, w, None), h, dout)
    torch.testing.assert_close(dh, ref, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        out = lb.gelu_tanh_linear(h, w, None)
    assert out.grad_fn is None and torch.equal(out, lb.gelu_tanh_linear_reference(h, w, None).detach())


@pytest.mark.parametrize("shape,affine", [((3, 17, 29), True), ((1, 5, 1, 64), True), ((2, 3, 12), False)])
def test_fp32_layer_norm_matches_fp64_and_keeps_the_input_dtype(shape, affine):
    d = shape[-1]
    x64 = _rand(*shape, seed=14, dtype=torch.float64, scale=3.0)
    w64 = _rand(d, seed=15, dtype=torch.float64) if affine else None
    b64 = _rand(d, seed=16, dtype=torch.float64) if affine else None
    dout = torch.randn(*shape, generator=torch.Generator().manual_seed(17), dtype=torch.float64)
    ref = _grads(lambda x, w, b: lb.fp32_layer_norm_reference(x, w, b, 1e-6), (x64, w64, b64), dout)
    x = x64.detach().bfloat16().requires_grad_(True)
    w = None if w64 is None else w64.detach().float().requires_grad_(True)
    b = None if b64 is None else b64.detach().float().requires_grad_(True)
    plain = _grads(lambda *a: lb.fp32_layer_norm_reference(*a, 1e-6), (x, w, b), dout.bfloat16())
    ours = _grads(lambda *a: lb.fp32_layer_norm(*a, 1e-6), (x, w, b), dout.bfloat16())
    assert ours[0].dtype == torch.bfloat16 and torch.equal(ours[0], plain[0])
    for o, p, r in zip(ours, plain, ref):
        assert o.dtype == p.dtype
        err, plain_err = (o.double() - r).abs().max(), (p.double() - r).abs().max()
        assert err <= 2 * plain_err + 1e-6, (float(err), float(plain_err))
    kept = _saved_bytes(lambda *a: lb.fp32_layer_norm(*a, 1e-6), x, w, b)
    big = [dt for n, dt, s in kept.values() if s == tuple(shape)]
    assert big == [torch.bfloat16]   # not the fp32 copy of x


def _block(dim=24, heads=2, ffn=40):
    cfg = get_wan_config({"dim": dim, "ffn_dim": ffn, "num_heads": heads, "num_layers": 1, "text_dim": 16,
                          "freq_dim": 8})
    torch.manual_seed(0)
    return WanBlock(cfg).double(), cfg


def _run(block, cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    S, L = 10, 4
    x = torch.randn(2, S, cfg.dim, dtype=torch.float64, generator=g, requires_grad=True)
    tm = torch.randn(2, 6, cfg.dim, dtype=torch.float64, generator=g)
    ctx = torch.randn(2, L, cfg.dim, dtype=torch.float64, generator=g)
    freqs = torch.randn(S, cfg.dim // cfg.num_heads // 2, 2, dtype=torch.float64, generator=g)
    out = block(x, tm, ctx, freqs)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, cfg.dim, dtype=torch.float64)).sum(),
                                [x] + list(block.parameters()))
    return out.detach(), grads


class _Wrapper(nn.Module):
    """Stands in for a LoRA wrapper: the base module inside, called on the GELU's output."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base

    def forward(self, x):
        return self.base_layer(x)


def test_wan_block_ffn_uses_the_lean_path_and_falls_back_under_a_wrapper(monkeypatch):
    block, cfg = _block()
    assert isinstance(block.ffn[2], lb.GeluTanhLinear) and isinstance(block.ffn[2], nn.Linear)
    assert [k for k in block.state_dict() if k.startswith("ffn.")] == ["ffn.0.weight", "ffn.0.bias", "ffn.2.weight",
                                                                       "ffn.2.bias"]
    calls, original = [], lb._GeluTanhLinearFn
    monkeypatch.setattr(lb, "_GeluTanhLinearFn", type("Counted", (original,), {
        "forward": staticmethod(lambda ctx, *a: calls.append(1) or original.forward(ctx, *a))}))
    lean_out, lean_grads = _run(block, cfg)
    assert calls, "the block's FFN did not take the lean path"
    plain = nn.Sequential(block.ffn[0], block.ffn[1], _Wrapper(block.ffn[2]))
    block.ffn = plain
    calls.clear()
    plain_out, plain_grads = _run(block, cfg)
    assert not calls
    torch.testing.assert_close(lean_out, plain_out, rtol=1e-12, atol=1e-12)
    for a, b in zip(lean_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
