"""Helpers for tests that compare a WanModel with diffusers' WanTransformer3DModel.

Used by tests/test_wan_*.py and usable by other components' tests (fused op, Ulysses, the
diffusers patch) that need a Wan model with non-trivial weights or its diffusers twin.
"""
from __future__ import annotations

import torch

from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.weights import convert_wan_to_diffusers, diffusers_config


@torch.no_grad()
def random_init_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite every parameter with random values of a sensible scale (never zeros).

    Matrices ~ N(0, 1/fan_in); norm weights ~ 1 + N(0, 0.2^2); modulation tables ~ N(0, 0.3^2);
    other vectors (biases) ~ N(0, 0.1^2). Deterministic in ``seed``, independent of dtype/device.
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(("modulation", "scale_shift_table")):
            v = 0.3 * torch.randn(p.shape, generator=g, device="cpu")
        elif p.dim() >= 2:
            v = torch.randn(p.shape, generator=g, device="cpu") / (p[0].numel() ** 0.5)
        elif "norm" in name and name.endswith("weight"):
            v = 1 + 0.2 * torch.randn(p.shape, generator=g, device="cpu")
        else:
            v = 0.1 * torch.randn(p.shape, generator=g, device="cpu")
        p.copy_(v)
    return model


def diffusers_twin(model: WanModel, dtype: torch.dtype = torch.float32):
    """diffusers' ``WanTransformer3DModel`` with the same config and weights as ``model``.

    For a low-precision ``dtype`` it casts like ``from_pretrained(torch_dtype=dtype)`` does
    (modules in ``_keep_in_fp32_modules`` stay fp32; buffers untouched), without needing accelerate.
    """
    from diffusers import WanTransformer3DModel

    twin = WanTransformer3DModel(**diffusers_config(model.config))
    sd = {k: v.float() for k, v in convert_wan_to_diffusers(model.state_dict()).items()}
    twin.load_state_dict(sd, strict=True)
    keep = WanTransformer3DModel._keep_in_fp32_modules or []
    for name, p in twin.named_parameters():
        if not any(k in name.split(".") for k in keep):
            p.data = p.data.to(dtype)
    return twin
