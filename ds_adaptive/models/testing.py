"""Helpers for tests that compare a WanModel with diffusers' WanTransformer3DModel.

Used by tests/unit/models/test_wan_*.py and usable by other components' tests (fused op, Ulysses, the
diffusers patch) that need a Wan model with non-trivial weights or its diffusers twin.
"""
from __future__ import annotations

from typing import Optional

import torch

from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.weights import convert_wan_to_diffusers, diffusers_config
from ds_adaptive.models.recompute import kept_attention_ops
from ds_adaptive.models import fusion, wan, wan_blocks
from ds_adaptive.models.wan_config import get_wan_config


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
    c.calls``): how many attention forwards a backward recomputes (``recompute.attention``)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode


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


def block_fusion_errors(dtype: torch.dtype, size: tuple, device="cpu", impls: Optional[dict] = None) -> list:
    """Errors of block fusion's compiled pieces (``models/fusion.py``) and of the eager functions, both against the
    same functions in fp64, forward and backward: ``size`` = (B, S, heads, head_dim), inputs seeded. Returns
    ``(name, index, compiled_err, eager_err, ref_max)`` per output and per input gradient (max abs values). The
    loss weights each output along its last dim (the gradient of a plain sum hides errors of normalisations).
    ``impls``: piece name -> the implementation to check instead of the compiled pieces (e.g. the Triton
    ``qk_norm_rope``; only those pieces are checked). Used by tests/unit/models/test_fusion.py (CPU),
    tests/gpu/test_fusion_gpu.py and the q / k norm + RoPE kernel's tests."""
    B, S, heads, head_dim = size
    D = heads * head_dim
    split = get_wan_config({"dim": D, "ffn_dim": 8, "num_heads": heads, "num_layers": 1}).rope_split
    freqs = wan.rope_table((1, S, 1), split).to(device)
    # name -> (call with the function, argument shapes, argument dtypes: None = the case's dtype)
    cases = {
        "qk_norm_rope": (lambda f, *t: f(*t, freqs, 1e-6, heads), [(B, S, D), (B, S, D), (D,), (D,)], [None] * 4),
        "gated_residual": (lambda f, *t: f(*t), [(B, S, D), (B, S, D), (B, 1, D)], [None, None, torch.float32]),
        "fp32_layer_norm": (lambda f, *t: f(*t, 1e-6), [(B, S, D), (D,), (D,)], [None, torch.float32, torch.float32]),
    }

    def outputs_and_grads(call, args):
        out = call(*args)
        out = out if isinstance(out, tuple) else (out,)
        weight = [torch.linspace(-1, 1, o.shape[-1], dtype=torch.float32, device=device) for o in out]
        grads = torch.autograd.grad(sum((o.float() * w).sum() for o, w in zip(out, weight)), args)
        return [o.detach().double() for o in out] + [g.double() for g in grads]

    impls = impls if impls is not None else {name: fusion.compiled(name) for name in cases}
    rows = []
    for name, (call, shapes, kinds) in cases.items():
        if name not in impls:
            continue
        args = []
        for i, (shape, kind) in enumerate(zip(shapes, kinds)):
            g = torch.Generator().manual_seed(i)
            x = torch.randn(*shape, generator=g) * 1.3 + 0.2
            args.append(x.to(device=device, dtype=kind or dtype).requires_grad_())
        ref = getattr(wan_blocks, name)
        got = outputs_and_grads(lambda *t: call(impls[name], *t), args)
        eager = outputs_and_grads(lambda *t: call(ref, *t), args)
        exact = outputs_and_grads(lambda *t: call(ref, *t), [a.detach().double().requires_grad_() for a in args])
        for i, (g, e, r) in enumerate(zip(got, eager, exact)):
            g_err = (g - r).abs().max() if torch.isfinite(g).all() else torch.tensor(float("inf"))
            rows.append((name, i, float(g_err), float((e - r).abs().max()), float(r.abs().max())))
    return rows
