"""GPU: LoRA with the fused LayerNorm-modulate op (same forward as the torch reference, gradients reach only the
adapters), and the preview memory bound (ds_adaptive.training.preview.preview_memory_gib) holds for a no-grad forward of
the Wan 1.3B at 480p on this GPU's shipped profile."""
from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft", reason="LoRA needs peft (the wheelhouse's EXTRA_WHEELS, bench/gpu/lora_preview.sh)")

from ds_adaptive.core.config import LoraConfig  # noqa: E402
from ds_adaptive.training.lora import apply_lora  # noqa: E402
from ds_adaptive.models.testing import random_init_  # noqa: E402
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.wan_config import get_wan_config  # noqa: E402

DEV = torch.device("cuda")


def test_lora_with_the_fused_op_matches_the_reference_and_trains_adapters_only():
    from ds_adaptive.ops import apply_ln_modulate
    from ds_adaptive.ops.ln_modulate import call_counts

    model = random_init_(WanModel(get_wan_config("tiny")), seed=1).to(DEV).to_dtype(torch.bfloat16)
    apply_lora(model, LoraConfig(enabled=True, rank=8, alpha=16), seed=0, spec="tiny")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(2, 16, 3, 16, 24, device=DEV, generator=g, dtype=torch.bfloat16)
    t = torch.tensor([300.0, 800.0], device=DEV)
    c = torch.randn(2, 64, 4096, device=DEV, generator=g, dtype=torch.bfloat16)
    apply_ln_modulate(model, False)
    exact = copy.deepcopy(model).to_dtype(torch.float64)
    with torch.no_grad():
        want = exact(x.double(), t.double(), c.double())
    ref = model(x, t, c)
    apply_ln_modulate(model, True)
    before = call_counts()["fused"]
    out = model(x, t, c)
    assert call_counts()["fused"] > before, "the fused op did not run (is it built?)"
    # Both bf16 paths against the fp64 model: the fused op may be off by at most a few times torch's own bf16 error
    # (a fixed tolerance between two bf16 paths flags a single rounding flip).
    err_fused = float((out.detach().double() - want).abs().max())
    err_torch = float((ref.detach().double() - want).abs().max())
    assert err_fused <= 3 * err_torch + 1e-3 * float(want.abs().max()), (err_fused, err_torch)
    out.float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is None for n, g in grads.items() if ".lora_" not in n)
    assert all(g is not None and torch.isfinite(g).all() for n, g in grads.items() if ".lora_" in n)
    assert any(float(g.abs().max()) > 0 for n, g in grads.items() if ".lora_A." in n)


def test_preview_memory_bound_holds_for_the_1_3b_at_480p():
    from ds_adaptive.planning.cost import CostModel
    from ds_adaptive.planning.devices import resolve_auto_profile
    from ds_adaptive.training.preview import preview_memory_gib
    from ds_adaptive.core.shapes import SampleShape

    profile, _ = resolve_auto_profile("wan2.1-1.3b")
    profile, _ = profile.for_ln_modulate("reference")
    cost = CostModel(profile, checkpointing="auto")
    shape = SampleShape(81, 480, 832)
    with torch.device(DEV):
        model = WanModel(get_wan_config("wan2.1-1.3b"))
    model.to_dtype(torch.bfloat16).eval().requires_grad_(False)
    f, h, w = shape.latent_grid
    x = torch.randn(1, 16, f, h, w, device=DEV, dtype=torch.bfloat16)
    c = torch.zeros(1, 512, 4096, device=DEV, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model(x, torch.tensor([500.0], device=DEV), c)
    torch.cuda.synchronize()
    used = (torch.cuda.max_memory_allocated() - base) / 2**30
    bound = preview_memory_gib(cost, shape, 1)
    assert used <= bound, f"a 480p preview forward used {used:.2f} GiB above the weights, the bound is {bound:.2f}"
