"""Layers whose backward keeps less: recompute cheap work in the backward instead of keeping its output.

A whole (not checkpointed) Wan block keeps its activations for its backward (``ds-adaptive calibrate`` measures how
much per token). Several of those tensors are outputs of cheap elementwise or normalisation work whose inputs are kept anyway:

* the FFN's ``Linear(GELU_tanh(h))``: autograd keeps ``h`` (GELU's backward) AND ``GELU(h)`` (the second Linear's
  weight gradient), two ``[tokens, ffn_dim]`` bf16 tensors: 2 x 17.5 KiB per token for Wan 1.3B;
* the input of each Linear layer after a norm: q / k / v after the first LayerNorm-modulate, the cross-attention's
  q after its LayerNorm, the FFN's first projection after the second LayerNorm-modulate (3 KiB per token each in
  bf16), while the norm keeps its own input for its backward;
* the cross-attention LayerNorm in fp32: ``F.layer_norm(x.float())`` keeps the fp32 copy of ``x`` (6 KiB per token)
  where ``x`` itself (3 KiB) will do.

A :class:`RecomputingLinear` takes its input as a :class:`RecomputedInput` ``fn(*tensors)`` (the block builds them),
keeps ``tensors`` and runs ``fn`` again in its backward (:func:`recomputed_input_linear`); :func:`fp32_layer_norm`
keeps its bf16 input. The forward runs the same kernels on the same values; the backward adds the recomputation
(one elementwise pass per site; each of q / k / v recomputes its norm), so outputs are the plain modules' and
gradients match an fp64 reference as closely (``tests/unit/models/test_lean_backward.py``,
``tests/gpu/test_lean_backward_gpu.py``).
A whole block then keeps less per token (the H200 profile's ``block_fusion_variants.regions`` memory terms are
calibrated with it), so the memory-bounded planner checkpoints fewer blocks. ``DS_ADAPTIVE_LEAN_BACKWARD`` picks what runs, for same-sample A/Bs of each part's compute:
``1`` everything (the default), ``gelu`` the GELU and LayerNorm sites only (the norms' outputs kept), ``0`` nothing
(the plain modules).
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ENV", "LEVELS", "enabled", "norm_inputs", "RecomputedInput", "RecomputingLinear", "linear_on",
           "recomputed_input_linear", "flat_linear", "gelu_tanh", "gelu_tanh_linear", "gelu_tanh_linear_reference", "fp32_layer_norm",
           "fp32_layer_norm_reference"]


#: what recomputes in the backward: "1" every site (the default), "gelu" the FFN's GELU and the fp32 LayerNorm's cast
#: only (the norms' outputs are kept, as at 273bf38), "0" nothing (the plain modules, as before it existed); for A/Bs
ENV = "DS_ADAPTIVE_LEAN_BACKWARD"
LEVELS = ("1", "gelu", "0")


def _level() -> str:
    value = os.environ.get(ENV, "1")
    if value not in LEVELS:
        raise ValueError(f"{ENV}={value!r}: expected 1 (recompute cheap inputs in the backward, the default), gelu "
                         f"(the GELU and LayerNorm sites only) or 0 (keep them all, for an A/B); unset it for the "
                         f"default")
    return value


def enabled() -> bool:
    """Whether the GELU and LayerNorm sites recompute (``DS_ADAPTIVE_LEAN_BACKWARD`` 1 or gelu; default 1)."""
    return _level() != "0"


def norm_inputs() -> bool:
    """Whether the Linear layers after a norm keep the norm's input and recompute its output
    (``DS_ADAPTIVE_LEAN_BACKWARD`` 1, the default)."""
    return _level() == "1"


def gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Wan's FFN activation)."""
    return F.gelu(h, approximate="tanh")


def gelu_tanh_linear_reference(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``Linear(GELU_tanh(h))`` by plain torch ops (autograd keeps ``h`` and ``GELU(h)``)."""
    return F.linear(gelu_tanh(h), weight, bias)


def flat_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear`` of x ``[..., in]`` multiplied as one ``[N, in]`` matrix (the bias in the GEMM's epilogue)."""
    if x.dim() <= 2:
        return F.linear(x, weight, bias)
    return F.linear(x.reshape(-1, x.shape[-1]), weight, bias).unflatten(0, x.shape[:-1])


class _RecomputedInputLinearFn(torch.autograd.Function):
    """``F.linear(fn(*inputs), weight, bias)`` keeping ``inputs`` (and ``weight``) for the backward, not ``fn``'s
    output: the backward runs ``fn`` again (with autograd, for the inputs' gradients through it)."""

    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor],
                *inputs: torch.Tensor) -> torch.Tensor:
        z = fn(*inputs)
        ctx.fn = fn
        ctx.has_bias = bias is not None
        ctx.save_for_backward(weight, *inputs)
        return flat_linear(z, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        weight, *inputs = ctx.saved_tensors
        need_w, need_b = ctx.needs_input_grad[1:3]
        need_in = ctx.needs_input_grad[3:]
        with torch.enable_grad():   # the recomputation, with a graph where the inputs need gradients
            ins = [t.detach().requires_grad_(n and t.is_floating_point()) for t, n in zip(inputs, need_in)]
            z = ctx.fn(*ins)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = dy2.t().mm(z.detach().reshape(-1, z.shape[-1])) if need_w else None
        db = dy2.sum(0) if need_b and ctx.has_bias else None
        wanted = [t for t in ins if t.requires_grad]
        grads = iter(torch.autograd.grad(z, wanted, dy2.mm(weight).reshape(z.shape)) if wanted else ())
        return (None, dw, db, *[next(grads) if t.requires_grad else None for t in ins])


def recomputed_input_linear(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], weight: torch.Tensor,
                            bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(fn(*inputs), weight, bias)``, keeping ``inputs`` for the backward and running ``fn`` again there
    instead of keeping its output (``fn``: cheap elementwise or normalisation work whose inputs are kept anyway, its
    output ``[..., in]``; the result ``[..., out]``). The input is multiplied as one ``[N, in]`` matrix (the bias in
    the GEMM's epilogue). Without autograd (grad mode off, or nothing needs a gradient) it is the plain composition."""
    needs = any(t.requires_grad for t in inputs) or weight.requires_grad or (bias is not None and bias.requires_grad)
    if not (torch.is_grad_enabled() and needs):
        return flat_linear(fn(*inputs), weight, bias)
    return _RecomputedInputLinearFn.apply(fn, weight, bias, *inputs)


def gelu_tanh_linear(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``Linear(GELU_tanh(h))``: h ``[..., in]``, weight ``[out, in]``, bias ``[out]`` or None -> ``[..., out]`` in h's
    dtype. Keeps ``h`` for the backward and recomputes ``GELU(h)`` there (one elementwise pass) instead of keeping
    it: ``h.numel() * h.element_size()`` bytes less held between the forward and the backward."""
    return recomputed_input_linear(gelu_tanh, (h,), weight, bias)


class RecomputedInput:
    """A Linear layer's input ``fn(*tensors)``, handed over unevaluated so that the layer can keep ``tensors`` and
    recompute ``fn`` in its backward (:class:`RecomputingLinear`) instead of keeping the result. ``fn`` keeps the
    shape and dtype of its first tensor (a norm, a modulation, an activation). :meth:`value` evaluates it once, for
    consumers that need the tensor itself. (A plain object with a ``__dict__``: ZeRO-3's post-forward hook reads a
    module's non-tensor output through ``vars()``; ``tensors`` is a tuple, so it registers none of them.)"""

    def __init__(self, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor):
        self.fn, self.tensors, self._value = fn, tensors, None

    @property
    def shape(self) -> torch.Size:
        return self.tensors[0].shape

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    def value(self) -> torch.Tensor:
        if self._value is None:
            self._value = self.fn(*self.tensors)
        return self._value


class RecomputingLinear(nn.Linear):
    """``nn.Linear`` that can take its input as :class:`RecomputedInput` (through :func:`linear_on`).

    ``forward(x)`` is ``nn.Linear``'s; ``forward(*tensors, recompute=fn)`` is ``Linear(fn(*tensors))`` by
    :func:`recomputed_input_linear`, which keeps ``tensors`` instead of ``fn``'s output for the backward. The
    product runs inside this module's call, so ZeRO-3's gather hooks fire as for any Linear, and the tensors are
    positional arguments (ZeRO-3 hooks see them). Same parameters and names as ``nn.Linear``: checkpoints load
    unchanged. A wrapper around it (a peft LoRA layer) is not this class: :func:`linear_on` then hands the wrapper
    the evaluated input, which its adapter needs."""

    def forward(self, *inputs: torch.Tensor, recompute: Optional[Callable[..., torch.Tensor]] = None) -> torch.Tensor:
        if recompute is not None:
            return recomputed_input_linear(recompute, inputs, self.weight, self.bias)
        (x,) = inputs
        return self.plain(x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on an evaluated input."""
        return F.linear(x, self.weight, self.bias)


def linear_on(module: nn.Module, x: Union[torch.Tensor, RecomputedInput]) -> torch.Tensor:
    """``module(x)``; for a :class:`RecomputedInput`, a :class:`RecomputingLinear` keeps its tensors and recomputes it
    in the backward, any other module (a LoRA wrapper) gets the evaluated input."""
    if not isinstance(x, RecomputedInput):
        return module(x)
    if isinstance(module, RecomputingLinear):
        return module(*x.tensors, recompute=x.fn)
    return module(x.value())


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
    if x.dtype == torch.float32 or not torch.is_grad_enabled() or not enabled():
        return fp32_layer_norm_reference(x, weight, bias, eps)
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return _FP32LayerNormFn.apply(x, w, b, eps)
