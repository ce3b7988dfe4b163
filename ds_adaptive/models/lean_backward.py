"""Layers whose backward keeps less: recompute cheap elementwise work instead of saving its output.

A whole (not checkpointed) Wan block keeps ~89 KiB of activations per token for its backward (H200, Wan 1.3B,
fused LayerNorm-modulate op, block fusion ``regions``; ``ds-adaptive calibrate`` measures it). Two of its
saved tensors are outputs of cheap elementwise work whose input is saved anyway:

* the FFN's ``Linear(GELU_tanh(h))``: autograd keeps ``h`` (GELU's backward) AND ``GELU(h)`` (the second
  Linear's weight gradient), two ``[tokens, ffn_dim]`` bf16 tensors: 2 x 17.5 KiB per token for Wan 1.3B.
  :class:`GeluTanhLinear` keeps ``h`` only and recomputes ``GELU(h)`` in the backward (one elementwise pass);
* the cross-attention LayerNorm in fp32: ``F.layer_norm(x.float())`` keeps the fp32 copy of ``x`` (6 KiB per
  token); :func:`fp32_layer_norm` keeps ``x`` in its own dtype (3 KiB) and casts it again in the backward.

A whole block then keeps ~21 KiB per token less (~24%), so the memory-bounded planner checkpoints fewer blocks
(less recomputed forward) or packs larger micro-batches. The forward runs the same kernels on the same values;
the backward runs the same kernels plus the recomputation, so outputs and gradients equal the plain modules'
(``tests/test_lean_backward.py`` checks both against fp64 references and against the plain composition).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GeluTanhLinear", "gelu_tanh_linear", "gelu_tanh_linear_reference", "fp32_layer_norm",
           "fp32_layer_norm_reference"]


def gelu_tanh_linear_reference(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``Linear(GELU_tanh(h))`` by plain torch ops (autograd keeps ``h`` and ``GELU(h)``)."""
    return F.linear(F.gelu(h, approximate="tanh"), weight, bias)


class _GeluTanhLinearFn(torch.autograd.Function):
    """``F.linear(GELU_tanh(h), weight, bias)`` keeping ``h`` (and ``weight``) for the backward, not ``GELU(h)``."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        ctx.has_bias = bias is not None
        return F.linear(F.gelu(h, approximate="tanh"), weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        h, weight = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dh = dw = db = None
        dy2 = dy.reshape(-1, dy.shape[-1])
        if need_w:   # the recomputation: GELU(h), the second Linear's input, for its weight gradient
            g = F.gelu(h, approximate="tanh")
            dw = dy2.t().mm(g.reshape(-1, g.shape[-1]))
            del g
        if need_h:
            dg = dy2.mm(weight).view(h.shape)
            dh = torch.ops.aten.gelu_backward(dg, h, approximate="tanh")
        if need_b and ctx.has_bias:
            db = dy2.sum(0)
        return dh, dw, db


def gelu_tanh_linear(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``Linear(GELU_tanh(h))``: h ``[..., in]``, weight ``[out, in]``, bias ``[out]`` or None -> ``[..., out]`` in h's
    dtype. Saves ``h`` for the backward and recomputes ``GELU(h)`` there (one elementwise pass) instead of keeping
    it: ``h.numel() * h.element_size()`` bytes less held between the forward and the backward. Without autograd
    (no input needs a gradient, or grad mode off) it is the plain composition."""
    if not torch.is_grad_enabled() or not (h.requires_grad or weight.requires_grad
                                           or (bias is not None and bias.requires_grad)):
        return gelu_tanh_linear_reference(h, weight, bias)
    return _GeluTanhLinearFn.apply(h, weight, bias)


class GeluTanhLinear(nn.Linear):
    """``nn.Linear`` that can take its input before the GELU-tanh in front of it (the FFN's second projection).

    ``forward(x)`` is ``nn.Linear``'s; ``forward(h, gelu_input=True)`` is ``Linear(GELU_tanh(h))`` by
    :func:`gelu_tanh_linear`, which keeps ``h`` instead of ``GELU(h)`` for the backward. The product runs inside
    this module's call, so ZeRO-3's gather hooks fire as for any Linear. Same parameters and names as
    ``nn.Linear`` (checkpoints load unchanged). A LoRA wrapper (peft) around it is not this class: the block then
    runs the plain ``Linear(GELU(h))`` (the adapter needs ``GELU(h)`` as its input), see ``WanBlock``."""

    def forward(self, x: torch.Tensor, gelu_input: bool = False) -> torch.Tensor:
        if gelu_input:
            return gelu_tanh_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def fp32_layer_norm_reference(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                              eps: float) -> torch.Tensor:
    """Affine LayerNorm over the last dim in fp32, rounded once to x's dtype, by plain torch ops (autograd keeps
    the fp32 copy of ``x``)."""
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


class _FP32LayerNormFn(torch.autograd.Function):
    """LayerNorm of ``x.float()`` keeping ``x`` in its own dtype (and the fp32 mean / rstd) for the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: Optional[torch.Tensor], b: Optional[torch.Tensor],
                eps: float) -> torch.Tensor:
        out, mean, rstd = torch.native_layer_norm(x.float(), (x.shape[-1],), w, b, eps)
        ctx.save_for_backward(x, w, b, mean, rstd)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, b, mean, rstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        mask = [need_x, need_w and w is not None, need_b and b is not None]
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy.float(), x.float(), (x.shape[-1],), mean, rstd,
                                                               w, b, mask)
        return (None if dx is None else dx.to(x.dtype)), dw, db, None


def fp32_layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                    eps: float) -> torch.Tensor:
    """Affine LayerNorm over the last dim in fp32, rounded once to x's dtype: x ``[..., D]``, weight / bias ``[D]``
    (any float dtype; used in fp32) or None -> ``[..., D]`` in x's dtype. Keeps ``x`` in its own dtype for the
    backward, not its fp32 copy (half the bytes for bf16); fp32 inputs take the plain path (nothing to save)."""
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    if x.dtype == torch.float32 or not torch.is_grad_enabled():
        return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)
    return _FP32LayerNormFn.apply(x, w, b, eps)
