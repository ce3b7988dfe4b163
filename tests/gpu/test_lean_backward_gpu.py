"""The lean-backward layers on the GPU (``ds_adaptive.models.lean_backward``): bf16 forward and backward within
2x torch's own bf16 error of an fp64 reference on awkward sizes, and the memory held between the forward and the
backward measured by the CUDA allocator: a Wan-sized FFN holds one ``[tokens, ffn_dim]`` tensor less than the plain
modules, a Wan 1.3B block at least that and three normalised Linear inputs less, with the same output."""
from __future__ import annotations

import pytest
import torch

from ds_adaptive.models import lean_backward as lb


def _case(shape_h, n_out, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(*shape_h, device="cuda", generator=g, dtype=torch.float64) * 2
    w = torch.randn(n_out, shape_h[-1], device="cuda", generator=g, dtype=torch.float64) / shape_h[-1] ** 0.5
    b = torch.randn(n_out, device="cuda", generator=g, dtype=torch.float64)
    dout = torch.randn(*shape_h[:-1], n_out, device="cuda", generator=g, dtype=torch.float64)
    return (h, w, b), dout


def _run(fn, args, dout):
    out = fn(*args)
    return [out] + list(torch.autograd.grad(out, args, dout))


@pytest.mark.parametrize("shape_h,n_out", [((1, 4097, 8960), 1536), ((3, 1559, 1000), 333), ((2, 77, 129), 65)])
def test_gelu_linear_bf16_against_fp64(shape_h, n_out):
    args64, dout = _case(shape_h, n_out, seed=n_out)
    ref = _run(lb.gelu_tanh_linear_reference, [a.requires_grad_(True) for a in args64], dout)
    low = lambda: [a.detach().bfloat16().requires_grad_(True) for a in args64]  # noqa: E731
    plain = _run(lb.gelu_tanh_linear_reference, low(), dout.bfloat16())
    ours = _run(lb.gelu_tanh_linear, low(), dout.bfloat16())
    for name, o, p, r in zip(("out", "dh", "dw", "db"), ours, plain, ref):
        assert torch.isfinite(o).all(), name
        err, plain_err = (o.double() - r).abs().max().item(), (p.double() - r).abs().max().item()
        assert err <= 2 * plain_err + 1e-6, (name, err, plain_err)


@pytest.mark.parametrize("shape", [(2, 1023, 1536), (1, 4099, 5120), (5, 3, 17)])
def test_fp32_layer_norm_bf16_against_fp64(shape):
    g = torch.Generator(device="cuda").manual_seed(shape[1])
    x64 = torch.randn(*shape, device="cuda", generator=g, dtype=torch.float64) * 3 + 0.5
    w64, b64 = (torch.randn(shape[-1], device="cuda", generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(*shape, device="cuda", generator=g, dtype=torch.float64)
    ref = _run(lambda x, w, b: lb.fp32_layer_norm_reference(x, w, b, 1e-6),
               [t.clone().requires_grad_(True) for t in (x64, w64, b64)], dout)
    args = lambda: [x64.bfloat16().requires_grad_(True), w64.float().requires_grad_(True),  # noqa: E731
                    b64.float().requires_grad_(True)]
    plain = _run(lambda *a: lb.fp32_layer_norm_reference(*a, 1e-6), args(), dout.bfloat16())
    ours = _run(lambda *a: lb.fp32_layer_norm(*a, 1e-6), args(), dout.bfloat16())
    assert torch.equal(ours[0], plain[0])
    for name, o, p, r in zip(("out", "dx", "dw", "db"), ours, plain, ref):
        err, plain_err = (o.double() - r).abs().max().item(), (p.double() - r).abs().max().item()
        assert err <= 2 * plain_err + 1e-6, (name, err, plain_err)


def _held_between_passes(fn, tokens, ffn_dim, dim):
    """Bytes allocated after ``fn``'s forward beyond its inputs, parameters and output (what backward holds)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(1, tokens, ffn_dim, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(True)
    w = (torch.randn(dim, ffn_dim, device="cuda", generator=g, dtype=torch.bfloat16) / 100).requires_grad_(True)
    b = torch.zeros(dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fn(h, w, b).sum().backward()   # warm-up: library workspaces are allocated once, not counted below
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fn(h, w, b)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    out.sum().backward()
    return held


def test_wan_sized_ffn_holds_one_activation_less():
    tokens, ffn_dim, dim = 32760, 8960, 1536
    act = tokens * ffn_dim * 2
    plain = _held_between_passes(lb.gelu_tanh_linear_reference, tokens, ffn_dim, dim)
    lean = _held_between_passes(lb.gelu_tanh_linear, tokens, ffn_dim, dim)
    assert abs(plain - lean - act) < 2 ** 20, (plain, lean, act)
    assert lean < act // 8, lean   # nothing of activation size beyond the (already allocated) input h


def test_wan_block_lean_vs_plain(monkeypatch):
    """A Wan 1.3B-sized block in bf16: the same output, gradients as close as bf16 allows, and less memory held
    between its passes by at least GELU(h) and the three normalised Linear inputs."""
    from ds_adaptive.models.wan_blocks import WanBlock
    from ds_adaptive.models.wan_config import get_wan_config

    cfg = get_wan_config("wan2.1-1.3b")
    torch.manual_seed(0)
    block = WanBlock(cfg).cuda().to(torch.bfloat16)
    block.modulation.data = block.modulation.data.float()
    block.norm3.float()
    S, L = 4099, 512
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, S, cfg.dim, device="cuda", generator=g).bfloat16().requires_grad_(True)
    tm = torch.randn(1, 6, cfg.dim, device="cuda", generator=g) * 0.1
    ctx = torch.randn(1, L, cfg.dim, device="cuda", generator=g).bfloat16()
    freqs = torch.randn(S, cfg.dim // cfg.num_heads // 2, 2, device="cuda", generator=g)
    weight = torch.linspace(-1, 1, cfg.dim, device="cuda")

    def run(lean: str):
        monkeypatch.setenv(lb.ENV, lean)
        block.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = block(x, tm, ctx, freqs)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
        (dx,) = torch.autograd.grad((out.float() * weight).sum(), [x])
        return out.detach(), dx, held

    run("1")   # warm-up: library workspaces
    lean_out, lean_dx, lean_held = run("1")
    plain_out, plain_dx, plain_held = run("0")
    assert torch.equal(lean_out, plain_out)
    scale = plain_dx.float().abs().max().item()
    assert (lean_dx.float() - plain_dx.float()).abs().max().item() <= 2e-2 * scale
    at_least = S * (2 * cfg.ffn_dim + 3 * 2 * cfg.dim)
    assert plain_held - lean_held >= at_least, (plain_held, lean_held, at_least)
