"""The pieces of a Wan DiT block (:class:`WanBlock`: adaLN self-attention with 3D RoPE, cross-attention to the text,
FFN), its output head, and the elementwise functions block fusion compiles (``ds_adaptive.models.fusion``).
Numerics and shapes: :mod:`ds_adaptive.models.wan`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ds_adaptive.models import lean_backward
from ds_adaptive.models.cross_attention import cross_attention
from ds_adaptive.models.family import set_plain_attr
from ds_adaptive.models.lean_backward import (RecomputedInput, RecomputingLinear, flat_linear, fp32_layer_norm,
                                              gelu_tanh, linear_on)
from ds_adaptive.models.recompute import self_attention_core
from ds_adaptive.models.rope import apply_rope
from ds_adaptive.models.wan_config import WanConfig
from ds_adaptive.ops.ln_modulate import ln_modulate_reference as _default_ln_modulate


Input = Union[torch.Tensor, RecomputedInput]
"""A Linear layer's input: a tensor, or one its layer may recompute in the backward (``models.lean_backward``)."""


AttentionFn = Callable[..., torch.Tensor]
"""``fn(q, k, v, **kwargs) -> out``, all ``[B, S, H, Dh]``."""


TokenOrder = Any
"""An object with ``to_cube(x, grid, dim)`` / ``to_raster(x, grid, dim)`` (``ds_adaptive.attention.CubeOrder``)."""


LnModulateFn = Callable[..., torch.Tensor]
"""``fn(x, shift, scale, eps, weight=None, bias=None) -> y`` like ``ds_adaptive.ops.ln_modulate``."""


Grid = tuple[int, int, int]


def timestep_embedding(timestep: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """[B] timesteps (0..1000) -> [B, dim] fp32 ``[cos(t*f), sin(t*f)]``, f_i = max_period^(-i/(dim/2)).

    Computed in fp32 exactly as diffusers' ``Timesteps(flip_sin_to_cos=True, shift=0)``
    (the original Wan computes it in fp64).
    """
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half
    args = timestep.float()[:, None] * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, freqs: torch.Tensor,
                 eps: float, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (over all heads, D) and RoPE of the projected q, k ``[B, S, D]`` -> ``[B, S, H, Dh]`` each: the
    eager block's ``norm_q`` / ``norm_k`` then ``apply_rope``, as one function (``ds_adaptive.models.fusion``
    compiles it into one kernel per tensor, forward and backward)."""
    d = q.shape[-1]
    q = F.rms_norm(q, (d,), wq, eps).unflatten(-1, (heads, -1))
    k = F.rms_norm(k, (d,), wk, eps).unflatten(-1, (heads, -1))
    return apply_rope(q, freqs), apply_rope(k, freqs)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x + y * gate`` in fp32, rounded once to x's dtype (the block's two gated residuals)."""
    return (x.float() + y.float() * gate).to(x.dtype)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   valid_len: Optional[int] = None) -> torch.Tensor:
    """Default self-attention core: torch SDPA. q, k, v ``[B, S, H, Dh]`` -> ``[B, S, H, Dh]``.

    ``valid_len``: keys at positions >= valid_len are masked out (tokens appended to pad S to a
    multiple of the sequence-parallel degree). A mask keeps SDPA off the flash backend, so it is
    only built when padding exists.
    """
    mask = None
    if valid_len is not None and valid_len < k.shape[1]:
        if valid_len < 1:
            raise ValueError(f"valid_len must be >= 1, got {valid_len}")
        mask = (torch.arange(k.shape[1], device=k.device) < valid_len).view(1, 1, 1, -1)  # over B, H, Sq
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


_set_plain_attr = set_plain_attr  # non-module attributes (ds_adaptive.models.family)


def modulation(table: torch.Tensor, time: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``table [1, n, D]`` plus the time modulation in fp32, as n views (diffusers' ``scale_shift_table + temb``):
    per sample ``time [B, n, D]`` (or ``[B, 1, D]``) -> ``[B, 1, D]`` each; per token ``time [B, S, n, D]`` (or
    ``[B, S, 1, D]``) -> ``[B, S, D]`` each."""
    n = table.shape[1]
    if time.dim() == 4:
        mod = table.float().unsqueeze(0) + time.float()
        return tuple(m.squeeze(2) for m in mod.chunk(n, dim=2))
    return (table.float() + time.float()).chunk(n, dim=1)


class FlatLinear(RecomputingLinear):
    """``nn.Linear`` that multiplies a ``[..., in]`` input as one ``[N, in]`` matrix, so its bias rides in the
    GEMM's epilogue (``addmm``) under ZeRO-3 too: DeepSpeed's ``F.linear`` replacement
    (``LinearFunctionForZeroStage3``, ``zero_optimization.memory_efficient_linear``) adds a 3-D input's bias
    as a separate broadcast kernel. Same parameters, names and numerics class as ``nn.Linear`` (torch's own
    ``F.linear`` flattens a contiguous 3-D input the same way). Used where it measured faster under ZeRO-3's
    function (``bench/kernels/block_fusion_kernels.py``, fwd+bwd): the FFN's D -> FFN projection; not the D -> D ones
    (their 2-D backward was slower)."""

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return flat_linear(x, self.weight, self.bias)


class FP32LayerNorm(nn.LayerNorm):
    """Affine LayerNorm computed in fp32, rounded once to the input dtype (``fp32_layer_norm``, or its
    compiled form under block fusion: the plain attribute ``layer_norm_fn``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _set_plain_attr(self, "layer_norm_fn", fp32_layer_norm)

    def forward(self, x: torch.Tensor, recomputable: bool = False) -> Union[torch.Tensor, RecomputedInput]:
        """The norm of x ``[..., D]``; with ``recomputable``, unevaluated (``lean_backward.RecomputedInput``, for the
        next Linear to recompute in its backward) where autograd is on and the norm is affine. The caller makes sure
        the weights stay gathered until that backward (``WanBlock._hooked_children``)."""
        if recomputable and torch.is_grad_enabled() and self.weight is not None and self.bias is not None:
            return RecomputedInput(self._norm, x, self.weight, self.bias)
        return self.layer_norm_fn(x, self.weight, self.bias, self.eps)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.layer_norm_fn(x, weight, bias, self.eps)


class FeedForward(nn.Sequential):
    """Wan's FFN: ``Linear(D -> F)``, GELU-tanh, ``Linear(F -> D)`` (parameter names ``ffn.0`` / ``ffn.2``)."""

    def forward(self, z: Input, lean: bool = False) -> torch.Tensor:
        """z ``[B, S, D]`` (or a ``RecomputedInput`` of that shape) -> ``[B, S, D]``. ``lean``: the second projection
        keeps the GELU's input and recomputes the GELU in its backward (17.5 KiB per token less held for Wan 1.3B);
        a wrapped projection (a LoRA adapter) gets the GELU's output either way."""
        fc1, act, fc2 = self
        h = linear_on(fc1, z)
        if lean and isinstance(act, nn.GELU) and act.approximate == "tanh":
            return linear_on(fc2, RecomputedInput(gelu_tanh, h))
        return fc2(act(h))


class _Attention(nn.Module):
    """q, k, v, o projections (D -> D) and RMSNorm of q and k over all heads (D), as Wan."""

    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.q = RecomputingLinear(dim, dim)   # q / k / v may get recomputable inputs (lean_backward)
        self.k = RecomputingLinear(dim, dim)
        self.v = RecomputingLinear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)

    def _qkv(self, x: Input, ctx: Input) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.num_heads
        q = self.norm_q(linear_on(self.q, x)).unflatten(-1, (h, -1))
        k = self.norm_k(linear_on(self.k, ctx)).unflatten(-1, (h, -1))
        v = linear_on(self.v, ctx).unflatten(-1, (h, -1))
        return q, k, v  # [B, S, H, Dh]


class WanSelfAttention(_Attention):
    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__(dim, num_heads, eps)
        _set_plain_attr(self, "qk_rope", None)   # block fusion: a compiled ``qk_norm_rope`` (None: the modules)

    def forward(self, x: Input, freqs: torch.Tensor, attn_fn: AttentionFn, **attn_kwargs: Any) -> torch.Tensor:
        """x [B, S, D] (or a ``RecomputedInput`` of that shape), freqs [S, Dh/2, 2] -> [B, S, D]; the core is
        ``attn_fn(q, k, v, **attn_kwargs)``."""
        wq, wk = self.norm_q.weight, self.norm_k.weight
        if self.qk_rope is not None and _params_available(wq, wk):
            q, k = self.qk_rope(linear_on(self.q, x), linear_on(self.k, x), wq, wk, freqs, self.norm_q.eps,
                                self.num_heads)
            v = linear_on(self.v, x).unflatten(-1, (self.num_heads, -1))
        else:
            q, k, v = self._qkv(x, x)
            q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        with self_attention_core():  # a ``keep`` checkpoint keeps this core's SDPA outputs (ds_adaptive.models.recompute)
            out = attn_fn(q, k, v, **attn_kwargs)
        return self.o(out.reshape(x.shape[0], x.shape[1], -1).to(x.dtype))


def _params_available(*params: torch.Tensor) -> bool:
    """False when ZeRO-3 holds one of ``params`` partitioned (a small parameter under
    ``stage3_param_persistence_threshold`` is always available): read outside its module's forward, it
    would not be gathered, so the fused path is skipped for the module path."""
    return all(getattr(getattr(p, "ds_status", None), "name", "AVAILABLE") != "NOT_AVAILABLE" for p in params)


class WanCrossAttention(_Attention):
    def forward(self, x: Input, context: torch.Tensor) -> torch.Tensor:
        """x [B, S, D] (or a ``RecomputedInput`` of that shape) attends to context [B, L, D] (all L tokens, no mask,
        as Wan)."""
        q, k, v = self._qkv(x, context)
        out = cross_attention(q, k, v)   # the queries in chunks where that fills the GPU (models.cross_attention)
        return self.o(out.reshape(x.shape[0], x.shape[1], -1).to(x.dtype))


class WanBlock(nn.Module):
    """One DiT block: adaLN self-attention (3D RoPE), cross-attention, adaLN GELU-tanh FFN."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        d = cfg.dim
        self.eps = cfg.eps
        self.self_attn = WanSelfAttention(d, cfg.num_heads, cfg.eps)
        self.norm3 = FP32LayerNorm(d, cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else nn.Identity()
        self.cross_attn = WanCrossAttention(d, cfg.num_heads, cfg.eps)
        self.ffn = FeedForward(FlatLinear(d, cfg.ffn_dim), nn.GELU(approximate="tanh"),
                               RecomputingLinear(cfg.ffn_dim, d))
        # in place: on the meta device (a dry run) an out-of-place div imports torch's compiler stack
        self.modulation = nn.Parameter(torch.randn(1, 6, d).div_(d ** 0.5))
        _set_plain_attr(self, "attn_fn", sdpa_attention)
        _set_plain_attr(self, "ln_modulate", _default_ln_modulate)
        _set_plain_attr(self, "residual", gated_residual)   # block fusion: its compiled form

    def forward(self, x: torch.Tensor, time_mod: torch.Tensor, context: torch.Tensor, freqs: torch.Tensor, *,
                checkpointed: Optional[Mapping[str, Any]] = None, **attn_kwargs: Any) -> torch.Tensor:
        """x [B, S, D] (activation dtype), time_mod [B, 6, D] or [B, S, 6, D] fp32, context [B, L, D],
        freqs [S, Dh/2, 2].

        ``checkpointed``: None runs the block; a dict of ``torch.utils.checkpoint`` keyword arguments (``{}``,
        or ``context_fn`` for ``recompute.attention: keep``) runs it under non-reentrant activation
        checkpointing *inside* this module's call. Module hooks then see one call per pass whether or not the
        block is checkpointed (the recompute runs the body, not the module): ZeRO-3's leaf-block gather is done
        by its backward hook before the recompute, and its trace of the module order, which it prefetches by,
        stays valid when the count of checkpointed blocks changes between micro-batches (a recompute through the
        module's call was an extra module step that invalidated the trace: no prefetch and a device sync each time).

        ``mod = modulation + time_mod`` is one fp32 ``[B, 6, D]`` table; shift / scale / gate are
        its ``[B, 1, D]`` chunk views (strides (6D, D, 1), no copies), in the order
        shift1, scale1, gate1, shift2, scale2, gate2. Per token: ``[B, S, 6, D]``, views ``[B, S, D]``
        (strides (6SD, 6D, 1)).
        """
        if checkpointed is not None:
            return checkpoint(self._body, x, time_mod, context, freqs, use_reentrant=False, **checkpointed,
                              **attn_kwargs)
        return self._body(x, time_mod, context, freqs, **attn_kwargs)

    def _body(self, x: torch.Tensor, time_mod: torch.Tensor, context: torch.Tensor, freqs: torch.Tensor,
              **attn_kwargs: Any) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = modulation(self.modulation, time_mod)
        # lean: the Linear layers after GELU or a norm keep its input and recompute its output in their backward
        # (models.lean_backward). The norms' outputs are handed over unevaluated only where the submodules' calls
        # may take them (no ZeRO-3 hooks on them), the adaLN ones only with per-sample modulation (per token, the
        # Linear would keep the [B, S, D] shift and scale instead: more than the output it saves)
        lean = torch.is_grad_enabled() and lean_backward.enabled()
        lazy_norm = lean and lean_backward.norm_inputs() and not self._hooked_children()
        lazy_ln = lazy_norm and time_mod.dim() == 3
        y = self.self_attn(self._ln_modulate(x, shift1, scale1, lazy_ln), freqs, self.attn_fn, **attn_kwargs)
        x = self.residual(x, y, gate1)
        lazy_norm3 = lazy_norm and isinstance(self.norm3, FP32LayerNorm)
        x = x + self.cross_attn(self.norm3(x, recomputable=True) if lazy_norm3 else self.norm3(x), context)
        y = self.ffn(self._ln_modulate(x, shift2, scale2, lazy_ln), lean=lean)
        return self.residual(x, y, gate2)

    def _hooked_children(self) -> bool:
        """Whether ZeRO-3 runs hooks on this block's submodules: its parameters are ZeRO-3's and the block is not a
        leaf module (``adaptive_load.zero3_leaf_blocks`` off, or LoRA). Their calls then need tensors, not
        ``RecomputedInput``s (the hooks find a call's tensors in its arguments and outputs), and a norm's weights
        are released after its own call (persistent ones too, until ZeRO-3's trace is complete)."""
        return not getattr(self, "_z3_leaf", False) and hasattr(self.modulation, "ds_id")

    def _ln_modulate(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, lazy: bool) -> Input:
        if lazy:
            return RecomputedInput(self._ln_modulate_eps, x, shift, scale)
        return self.ln_modulate(x, shift, scale, self.eps)

    def _ln_modulate_eps(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.ln_modulate(x, shift, scale, self.eps)


class WanHead(nn.Module):
    """Output head: adaLN (2-way modulation) + Linear(D -> out_channels * prod(patch))."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.eps = cfg.eps
        self.head = nn.Linear(cfg.dim, cfg.patch_channels)
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim).div_(cfg.dim ** 0.5))
        _set_plain_attr(self, "ln_modulate", _default_ln_modulate)

    def forward(self, x: torch.Tensor, time_emb: torch.Tensor) -> torch.Tensor:
        """x [B, S, D], time_emb [B, D] or [B, S, D] -> [B, S, out_channels * prod(patch)] (x's dtype)."""
        shift, scale = modulation(self.modulation, time_emb.unsqueeze(-2))  # [B, 2, D] / [B, S, 2, D] fp32
        return self.head(self.ln_modulate(x, shift, scale, self.eps))


@dataclass
class WanInputs:
    """What ``WanModel.embed`` hands to the blocks and the head."""

    tokens: torch.Tensor
    """[B, S, D] patch tokens in the activation dtype, (f, h, w) row-major order."""
    time_mod: torch.Tensor
    """[B, 6, D] fp32 time modulation (each block adds its own ``modulation`` table); per-token timesteps:
    [B, S, 6, D], rows in the model's token order."""
    time_emb: torch.Tensor
    """[B, D] time embedding (activation dtype) for the head's modulation; per-token: [B, S, D]."""
    context: torch.Tensor
    """[B, L, D] embedded text context."""
    grid: Grid
    """(F, H, W) token grid; S = F * H * W."""

    def local(self, shard: Callable[[torch.Tensor, int], torch.Tensor]) -> "WanInputs":
        """These inputs for one rank of a sequence-parallel group: ``shard(t, dim)`` cuts this rank's
        (padded) slice of a per-token tensor along ``dim`` (``ds_adaptive.parallel.shard_sequence``).
        The tokens and per-token modulation are sharded; per-sample modulation and the text context are kept
        whole."""
        if not self.per_token:
            return dataclasses.replace(self, tokens=shard(self.tokens, 1))
        return dataclasses.replace(self, tokens=shard(self.tokens, 1), time_mod=shard(self.time_mod, 1),
                                   time_emb=shard(self.time_emb, 1))

    @property
    def per_token(self) -> bool:
        """The modulation is per token (``timestep [B, S]``)."""
        return self.time_mod.dim() == 4


def is_fp32_param(name: str) -> bool:
    """Parameters kept in fp32 when the model is cast to bf16/fp16 (``WanModel.to_dtype``).

    Mirrors diffusers' ``_keep_in_fp32_modules`` (scale_shift_table, time_embedder, norm2):
    modulation tables, the time embedding MLP and the cross-attention LayerNorm.
    """
    return name.endswith("modulation") or name.startswith("time_embedding.") or ".norm3." in name
