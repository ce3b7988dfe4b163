"""Layers that keep less for their backward (``ds_adaptive.models.lean_backward``): the FFN's ``Linear(GELU(h))``
keeping ``h`` only and the fp32 LayerNorm keeping its bf16 input give the outputs and gradients of the plain
compositions (fp64 references, awkward sizes, bf16 within 2x torch's own rounding error), keep the bytes they
claim, and the Wan block uses them (and falls back to the plain modules under a wrapper such as LoRA)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ds_adaptive.models import lean_backward as lb
from ds_adaptive.models.family import set_plain_attr
from ds_adaptive.models.wan_blocks import WanBlock
from ds_adaptive.models.wan_config import get_wan_config
from ds_adaptive.ops.ln_modulate import ln_modulate_reference


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


def test_recomputed_input_linear_matches_fp64_with_several_inputs():
    x = _rand(2, 7, 12, seed=20, dtype=torch.float64)
    shift, scale = _rand(2, 1, 12, seed=21, dtype=torch.float64), _rand(2, 1, 12, seed=22, dtype=torch.float64)
    w, b = _rand(5, 12, seed=23, dtype=torch.float64), _rand(5, seed=24, dtype=torch.float64)
    frozen = torch.randn(12, dtype=torch.float64, generator=torch.Generator().manual_seed(25))   # needs no grad

    def fn(x, shift, scale, frozen):
        return torch.nn.functional.layer_norm(x, (12,)) * (1 + scale) + shift + frozen

    dout = torch.randn(2, 7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(26))
    args = (x, shift, scale, w, b)
    ref = _grads(lambda x, sh, sc, w, b: torch.nn.functional.linear(fn(x, sh, sc, frozen), w, b), args, dout)
    got = _grads(lambda x, sh, sc, w, b: lb.recomputed_input_linear(fn, (x, sh, sc, frozen), w, b), args, dout)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_the_switch_reads_one_of_three_levels(monkeypatch):
    monkeypatch.setenv(lb.ENV, "0")
    assert not lb.enabled() and not lb.norm_inputs()
    monkeypatch.setenv(lb.ENV, "gelu")
    assert lb.enabled() and not lb.norm_inputs()
    monkeypatch.delenv(lb.ENV)
    assert lb.enabled() and lb.norm_inputs()
    monkeypatch.setenv(lb.ENV, "yes")
    with pytest.raises(ValueError, match="DS_ADAPTIVE_LEAN_BACKWARD='yes': expected 1"):
        lb.enabled()


def _block(dim=24, heads=2, ffn=40, dtype=torch.float64):
    cfg = get_wan_config({"dim": dim, "ffn_dim": ffn, "num_heads": heads, "num_layers": 1, "text_dim": 16,
                          "freq_dim": 8})
    torch.manual_seed(0)
    block = WanBlock(cfg).to(dtype)
    block.modulation.data = block.modulation.data.double()
    block.norm3.double()
    return block, cfg


def _inputs(cfg, dtype=torch.float64, seed=0, S=10, L=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, S, cfg.dim, dtype=torch.float64, generator=g).to(dtype).requires_grad_(True)
    tm = torch.randn(2, 6, cfg.dim, dtype=torch.float64, generator=g)
    ctx = torch.randn(2, L, cfg.dim, dtype=torch.float64, generator=g).to(dtype)
    freqs = torch.randn(S, cfg.dim // cfg.num_heads // 2, 2, dtype=torch.float64, generator=g).float()
    return x, tm, ctx, freqs


def _run(block, cfg):
    x, tm, ctx, freqs = _inputs(cfg)
    out = block(x, tm, ctx, freqs)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, cfg.dim, dtype=torch.float64)).sum(),
                                [x] + list(block.parameters()))
    return out.detach(), grads


class _Wrapper(nn.Module):
    """Stands in for a LoRA wrapper: the base module inside, called on the evaluated input."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base

    def forward(self, x):
        return self.base_layer(x)


def _counted(monkeypatch):
    calls, original = [], lb._RecomputedInputLinearFn
    monkeypatch.setattr(lb, "_RecomputedInputLinearFn", type("Counted", (original,), {
        "forward": staticmethod(lambda ctx, *a: calls.append(1) or original.forward(ctx, *a))}))
    return calls


def test_wan_block_recomputes_six_linear_inputs_and_trains_the_same(monkeypatch):
    block, cfg = _block()
    assert all(isinstance(m, lb.RecomputingLinear) for m in (block.ffn[0], block.ffn[2], block.self_attn.q,
                                                            block.self_attn.k, block.self_attn.v, block.cross_attn.q))
    assert [k for k in block.state_dict() if k.startswith("ffn.")] == ["ffn.0.weight", "ffn.0.bias", "ffn.2.weight",
                                                                       "ffn.2.bias"]
    calls = _counted(monkeypatch)
    lean_out, lean_grads = _run(block, cfg)
    assert len(calls) == 6, "q, k, v, the cross-attention's q and both FFN projections"
    calls.clear()
    monkeypatch.setenv(lb.ENV, "gelu")   # the FFN's second projection only: the norms' outputs are kept
    gelu_out, gelu_grads = _run(block, cfg)
    assert len(calls) == 1
    calls.clear()
    monkeypatch.setenv(lb.ENV, "0")
    plain_out, plain_grads = _run(block, cfg)
    assert not calls
    torch.testing.assert_close(gelu_out, plain_out, rtol=0, atol=0)
    for a, b in zip(gelu_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lean_out, plain_out, rtol=0, atol=0)
    # the adaLN sites compute in fp32 even for fp64 inputs, and q / k / v's norm gradients are summed in another order
    for a, b in zip(lean_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_wrapped_linears_get_the_evaluated_input(monkeypatch):
    block, cfg = _block()
    want_out, want_grads = _run(block, cfg)
    block.ffn[2] = _Wrapper(block.ffn[2])
    block.self_attn.q = _Wrapper(block.self_attn.q)
    block.cross_attn.q = _Wrapper(block.cross_attn.q)
    calls = _counted(monkeypatch)
    out, grads = _run(block, cfg)
    assert len(calls) == 3   # k, v and the FFN's first projection
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _KeepsInput(torch.autograd.Function):
    """A LayerNorm-modulate that keeps only its inputs, as the fused op does (x and the [B, 1, D] tables)."""

    @staticmethod
    def forward(ctx, x, shift, scale):
        ctx.save_for_backward(x, shift, scale)
        return ln_modulate_reference(x, shift, scale, 1e-6)

    @staticmethod
    def backward(ctx, dy):
        with torch.enable_grad():
            ins = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
            return torch.autograd.grad(ln_modulate_reference(*ins, 1e-6), ins, dy)


def test_a_whole_bf16_block_keeps_what_the_design_says_less(monkeypatch):
    block, cfg = _block(dim=32, heads=2, ffn=48, dtype=torch.bfloat16)
    set_plain_attr(block, "ln_modulate", lambda x, sh, sc, eps: _KeepsInput.apply(x, sh, sc))
    x, tm, ctx, freqs = _inputs(cfg, dtype=torch.bfloat16, S=64)

    def kept():
        return sum(n for n, _, _ in _saved_bytes(block, x, tm, ctx, freqs).values())

    lean = kept()
    monkeypatch.setenv(lb.ENV, "0")
    plain = kept()
    tokens, D, F = 2 * 64, cfg.dim, cfg.ffn_dim
    # plain keeps GELU(h) (2F bytes a token), the normalised inputs of q/k/v, the cross q and the first FFN projection
    # (3 x 2D), the fp32 copy of the cross-attention LayerNorm's input (4D) and its fp32 mean / rstd (8); lean keeps
    # that input in bf16 (2D), and the LayerNorm's fp32 weight and bias (2 x 4D bytes, once) as the cross q's inputs
    assert plain - lean == tokens * (2 * F + 3 * 2 * D + 4 * D + 8 - 2 * D) - 2 * 4 * D, (plain, lean)


def test_per_token_modulation_keeps_the_adaln_outputs_and_recomputes_the_rest(monkeypatch):
    """Per-token shift / scale ([B, S, D]) would cost a recomputing Linear more than the output it saves: q / k / v and
    the FFN's first projection get tensors; the GELU and the cross-attention LayerNorm are still recomputed."""
    block, cfg = _block()
    x, _, ctx, freqs = _inputs(cfg)
    tm = torch.randn(2, x.shape[1], 6, cfg.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    def run():
        out = block(x, tm, ctx, freqs)
        return [out.detach()] + list(torch.autograd.grad(out.sum(), [x] + list(block.parameters())))

    calls = _counted(monkeypatch)
    lean = run()
    assert len(calls) == 2, "the cross-attention's q and the FFN's second projection"
    monkeypatch.setenv(lb.ENV, "0")
    plain = run()
    torch.testing.assert_close(lean[0], plain[0], rtol=0, atol=0)
    for a, b in zip(lean[1:], plain[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
