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


class AttentionCalls:
    """Counts the fused SDPA calls that reach a kernel while entered (``with AttentionCalls() as c: ...;
    c.calls``): how many attention forwards a backward recomputes (``sampler.checkpoint_attention``)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        from ds_adaptive.recompute import kept_attention_ops

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.calls += func in kept_attention_ops()
                return func(*args, **(kwargs or {}))

        self.calls = 0
        self._mode = _Mode()

    def __enter__(self) -> "AttentionCalls":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
