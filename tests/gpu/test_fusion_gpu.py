"""Block fusion on a GPU (``adaptive_load.block_fusion``, on in the shipped Wan 1.3B config): Inductor's triton
kernels for the fused pieces match an fp64 reference within twice torch's own low-precision error (plus a few
fp32 ulps for another summation order), forward and backward, on awkward sizes and at Wan 1.3B's width; after ``warm_up`` for a plan's (B, tokens) pairs, training
steps of those sizes compile no new graph with the real Inductor (its element-count guards are what the CPU
test's aot_eager counter cannot see)."""
from __future__ import annotations

import pytest
import torch

from ds_adaptive.models import fusion, wan
from ds_adaptive.models.wan import WanModel, get_wan_config

DEVICE = "cuda"


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 1.3 + 0.2).to(device=DEVICE, dtype=dtype).requires_grad_()


def _cases(B: int, S: int, heads: int, head_dim: int) -> dict:
    """name -> (call with the function, argument shapes, argument dtypes: None = the case's dtype)."""
    D = heads * head_dim
    split = get_wan_config({"dim": D, "ffn_dim": 8, "num_heads": heads, "num_layers": 1}).rope_split
    freqs = wan.rope_table((1, S, 1), split).to(DEVICE)
    return {
        "qk_norm_rope": (lambda f, *t: f(*t, freqs, 1e-6, heads), [(B, S, D), (B, S, D), (D,), (D,)], [None] * 4),
        "gated_residual": (lambda f, *t: f(*t), [(B, S, D), (B, S, D), (B, 1, D)], [None, None, torch.float32]),
        "fp32_layer_norm": (lambda f, *t: f(*t, 1e-6), [(B, S, D), (D,), (D,)], [None, torch.float32, torch.float32]),
    }


def _outputs_and_grads(call, args):
    out = call(*args)
    out = out if isinstance(out, tuple) else (out,)
    # a weighting that varies along the last dim: the gradient of a plain sum hides errors of normalisations
    loss = sum((o.float() * torch.linspace(-1, 1, o.shape[-1], dtype=torch.float32, device=DEVICE)).sum()
               for o in out)
    grads = torch.autograd.grad(loss, args)
    return [o.detach().double() for o in out] + [g.double() for g in grads]


@pytest.mark.parametrize("size", [(2, 37, 3, 12), (1, 1561, 12, 128), (3, 255, 5, 24)],
                         ids=["odd-tiny", "wan1.3b-width", "odd-heads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_matches_fp64_within_torchs_own_error(dtype, size):
    for name, (call, shapes, kinds) in _cases(*size).items():
        args = [_rand(*sh, dtype=k or dtype, seed=i) for i, (sh, k) in enumerate(zip(shapes, kinds))]
        ref = getattr(wan, name)
        got = _outputs_and_grads(lambda *t: call(fusion.compiled(name), *t), args)
        eager = _outputs_and_grads(lambda *t: call(ref, *t), args)
        exact = _outputs_and_grads(lambda *t: call(ref, *t), [a.detach().double().requires_grad_() for a in args])
        for i, (g, e, r) in enumerate(zip(got, eager, exact)):
            assert torch.isfinite(g).all(), (name, dtype, size, i)
            # every piece accumulates in fp32: a different summation order (Inductor's reductions over B x S tokens
            # for the weight and gate gradients) may cost up to 64 fp32 ulps of the largest value beyond that
            bound = 2 * (e - r).abs().max() + 64 * torch.finfo(torch.float32).eps * r.abs().max() + 1e-12
            assert (g - r).abs().max() <= bound, (name, dtype, size, i, float((g - r).abs().max()), float(bound))


def _model(dtype):
    torch.manual_seed(0)
    m = WanModel(get_wan_config("tiny", num_layers=2))
    with torch.no_grad():   # the zero-initialised head would hide every difference upstream
        m.head.head.weight.normal_(std=0.05)
    return m.to_dtype(dtype).to(DEVICE)


STEPS = [(1, 3, 6, 10), (3, 1, 4, 6), (2, 5, 8, 4), (1, 1, 6, 6), (3, 5, 8, 4)]   # B, frames, h, w (h, w: pixels / 8)


def _train_steps(m, dtype, steps=STEPS):
    for B, frames, h, w in steps:
        g = torch.Generator().manual_seed(B * 100 + frames)
        lat = torch.randn(B, 16, frames, h, w, generator=g).to(device=DEVICE, dtype=dtype)
        t = (torch.rand(B, generator=g) * 1000).to(DEVICE)
        ctx = torch.randn(B, 7, 4096, generator=g).to(device=DEVICE, dtype=dtype)
        m.zero_grad(set_to_none=True)
        loss = m(lat, t, ctx).float().square().mean()
        loss.backward()
        assert torch.isfinite(loss)


def test_warm_up_then_training_compiles_no_graph_with_inductor():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    try:
        m = _model(torch.bfloat16)
        fusion.apply_block_fusion(m, "regions")
        pairs = [(B, f * (h // 2) * (w // 2)) for B, f, h, w in STEPS]
        spent = m.warm_up_block_fusion(pairs, dtype=torch.bfloat16, device=torch.device(DEVICE))
        assert spent > 0
        warmed = counters["stats"]["unique_graphs"]
        assert warmed >= 6   # 3 functions x (B = 1, B >= 2)
        _train_steps(m, torch.bfloat16)
        assert counters["stats"]["unique_graphs"] == warmed, \
            f"a training step compiled {counters['stats']['unique_graphs'] - warmed} more graph(s)"
    finally:
        torch._dynamo.reset()
