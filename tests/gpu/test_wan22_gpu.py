"""Guards Wan 2.2 TI2V on CUDA: with per-token timesteps (first-frame conditioning) every adaLN site runs the fused
op's per-token path on [B, S, D] views of the [B, S, 6, D] table, and the model's outputs and gradients stay within
bf16's own error of the torch reference path (TI2V-5B width, one block; and the tiny twin through the trainer's
objective)."""
from __future__ import annotations

import pytest
import torch

from ds_adaptive.models.registry import get_model
from ds_adaptive.models.testing import random_init_
from ds_adaptive.ops.apply import apply_ln_modulate
from ds_adaptive.ops.ln_modulate import call_counts, load_op


@pytest.fixture(scope="module", autouse=True)
def _op():
    if load_op(strict=False) is None:
        pytest.skip("the fused LayerNorm-modulate op did not load on this GPU (see `ds-adaptive report`)")


def _run(model, lat, t, ctx):
    model.zero_grad(set_to_none=True)
    x = lat.clone().requires_grad_()
    out = model(x, t, ctx)
    out.float().square().mean().backward()
    return out.float(), x.grad.float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name,layers", [("wan2.2-ti2v-5b", 1), ("tiny-ti2v", 2)])
def test_per_token_fused_path_matches_the_reference(name, layers):
    m = get_model(name)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = random_init_(m.build(m.config(num_layers=layers)), seed=1)
    model.to_dtype(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(2)
    T, H, W = 5, 16, 24                                   # latent 5x16x24 -> 5 x 8 x 12 = 480 tokens
    lat = torch.randn(2, 48, T, H, W, device="cuda", generator=g, dtype=torch.bfloat16)
    t = torch.rand(2, T * (H // 2) * (W // 2), device="cuda", generator=g) * 1000
    t[0, : (H // 2) * (W // 2)] = 0.0                     # sample 0: image-to-video (frame 0 clean)
    ctx = torch.randn(2, 32, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    apply_ln_modulate(model, False)
    ref = _run(model, lat, t, ctx)
    apply_ln_modulate(model, True)
    before = call_counts()["fused"]
    got = _run(model, lat, t, ctx)
    assert call_counts()["fused"] - before == 2 * layers + 1     # every site took the fused op
    with torch.device("cuda"):                                # fp32 twin: bf16's own error bounds the comparison
        exact = random_init_(m.build(m.config(num_layers=layers)), seed=1)
    apply_ln_modulate(exact, False)
    ex = _run(exact, lat.float(), t, ctx.float())
    for a, b, e in zip(got[:2], ref[:2], ex[:2]):
        assert (a - b).abs().max() <= 2 * (b - e).abs().max() + 1e-3
