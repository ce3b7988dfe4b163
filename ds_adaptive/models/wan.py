"""Wan 2.1 text-to-video diffusion transformer (DiT), built for ZeRO-3 + Ulysses training.

Shapes (B batch, S = F*H*W tokens, D = dim, Dh = head_dim, L text tokens)::

    latents [B, 16, T', H', W']  --patch 1x2x2 Conv3d-->  tokens [B, S, D], grid (F, H, W) = (T', H'/2, W'/2)
    timestep [B] float in [0, 1000] --sinusoid(256)--> MLP --> time_emb [B, D] --SiLU, Linear--> time_mod [B, 6, D]
      (or one per token, timestep [B, S] -> time_emb [B, S, D], time_mod [B, S, 6, D]: diffusers' expand_timesteps)
    context [B, L, 4096] --Linear, GELU-tanh, Linear--> [B, L, D]
    30 / 40 blocks:  x += gate1 * SelfAttn(LN(x)*(1+scale1)+shift1, 3D RoPE)
                     x += CrossAttn(LN_affine(x), context)
                     x += gate2 * FFN(LN(x)*(1+scale2)+shift2)
    head: Linear(LN(x)*(1+scale)+shift) --> [B, S, 16*1*2*2] --unpatchify--> [B, 16, T', H', W']

The forward is split so that a sequence-parallel wrapper can shard the tokens between
``embed`` and ``head``: ``embed -> rope -> run_blocks -> head -> unpatchify``. Every parameter
is used only inside the forward of the module that owns it, so ZeRO-3's per-module gather
hooks fire on this split path too.

Numerics follow diffusers' ``WanTransformer3DModel`` (the reference we test against):

* activations (the residual stream ``x``) are in the parameter dtype (bf16 in training);
* the adaLN sites compute LayerNorm, ``* (1 + scale) + shift`` in fp32 and round once to x's
  dtype (``ln_modulate``); the modulation tables ``[1, 6, D]`` / ``[1, 2, D]`` are added to the
  time modulation in fp32;
* gated residuals are ``(x.float() + y.float() * gate).to(x.dtype)``; the cross-attention
  residual is a plain add in x's dtype;
* RoPE is applied in fp32 (tables computed in fp64, stored fp32) and rounded once;
* the time embedding MLP runs in its parameter dtype and its output ``time_emb`` is rounded to the
  activation dtype before ``time_projection`` (diffusers' ``temb.type_as(...)``).

The original Wan 2.1 code (Wan-Video/Wan2.1 ``wan/modules/model.py``) differs: it runs under
``torch.autocast(bf16)`` with fp32 parameters, so the residual stream, the gates and the whole
time embedding / projection stay fp32; RoPE is applied in fp64 and the sinusoid is computed in
fp64; its RMSNorm rounds the normalised q/k to bf16 before the weight multiply; and it zero-pads
the text context to 512 tokens (callers of this model should pass T5 context zero-padded to 512
tokens to match Wan's training). In fp32 all of these agree to rounding error.

Module / parameter names follow the original Wan checkpoint layout (``blocks.N.self_attn.q``,
``blocks.N.modulation``, ``head.head``, ...); ``ds_adaptive.models.weights`` converts diffusers'
names. Wan 2.1 I2V / FLF2V (CLIP image branch) are not implemented.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.utils.checkpoint import checkpoint

from ds_adaptive.models.cross_attention import cross_attention
from ds_adaptive.models.family import ModelError, set_plain_attr
from ds_adaptive.models import lean_backward
# fp32_layer_norm: the cross-attention LayerNorm (``FP32LayerNorm``), keeping its bf16 input, not the fp32 copy
from ds_adaptive.models.lean_backward import (RecomputedInput, RecomputingLinear, flat_linear, fp32_layer_norm,
                                              gelu_tanh, linear_on)
from ds_adaptive.models.recompute import CHECKPOINT_ATTENTION_MODES, keep_attention_context, self_attention_core
from ds_adaptive.models.rope import apply_rope, rope_table  # noqa: F401  (rope_table: part of this module's API)
from ds_adaptive.models.wan21 import FAMILY as _WAN21
# Plain torch by default: the fused op is opt-in (adaptive_load.fused_ln_modulate -> set_ln_modulate),
# so a baseline run never picks it up implicitly.
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


class WanConfigError(ModelError):
    """A WanConfig field (or a latent / context shape given to the model) is invalid."""


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WanConfig:
    """Architecture of a Wan 2.1 T2V DiT."""

    dim: int
    """Hidden size D of the residual stream (tokens are [B, S, D])."""
    ffn_dim: int
    """Inner size of each block's GELU-tanh feed-forward."""
    num_heads: int
    """Attention heads; head_dim = dim / num_heads (128 in the released models)."""
    num_layers: int
    """Number of transformer blocks."""
    in_channels: int = 16
    """Latent channels in (Wan VAE: 16)."""
    out_channels: int = 16
    """Latent channels out (the flow-matching velocity)."""
    text_dim: int = 4096
    """Width of the text-encoder features (umT5-XXL: 4096)."""
    freq_dim: int = 256
    """Width of the sinusoidal timestep embedding."""
    patch_size: tuple[int, int, int] = (1, 2, 2)
    """(t, h, w) patch of the Conv3d patch embedding."""
    eps: float = 1e-6
    """Epsilon of every LayerNorm and RMSNorm."""
    cross_attn_norm: bool = True
    """Affine LayerNorm before the cross-attention (True in every released Wan 2.1)."""
    rope_theta: float = 10000.0
    """RoPE base."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(self.patch_size))
        for name in ("dim", "ffn_dim", "num_heads", "num_layers", "in_channels", "out_channels",
                     "text_dim", "freq_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise WanConfigError(f"WanConfig.{name} must be an int >= 1, got {v!r}")
        if len(self.patch_size) != 3 or not all(isinstance(p, int) and p >= 1 for p in self.patch_size):
            raise WanConfigError(f"WanConfig.patch_size must be 3 ints >= 1 (t, h, w), got {self.patch_size!r}")
        if self.dim % self.num_heads:
            raise WanConfigError(
                f"WanConfig.dim ({self.dim}) must be divisible by num_heads ({self.num_heads}); "
                f"head_dim = dim / num_heads (e.g. dim={self.num_heads * 128} for head_dim 128)")
        hd = self.dim // self.num_heads
        if hd % 2:
            raise WanConfigError(
                f"head_dim = dim / num_heads = {self.dim}/{self.num_heads} = {hd} must be even "
                "(RoPE rotates pairs of channels); change dim or num_heads")
        if hd < 6:
            raise WanConfigError(
                f"head_dim = {hd} is too small for Wan's 3D RoPE: the h and w axes get "
                f"2*(head_dim//6) = {2 * (hd // 6)} rotary channels each; use head_dim >= 6")
        if self.freq_dim % 2:
            raise WanConfigError(f"WanConfig.freq_dim must be even (cos and sin halves), got {self.freq_dim}")
        if not self.eps > 0:
            raise WanConfigError(f"WanConfig.eps must be > 0, got {self.eps!r}")
        if not self.rope_theta > 0:
            raise WanConfigError(f"WanConfig.rope_theta must be > 0, got {self.rope_theta!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def rope_split(self) -> tuple[int, int, int]:
        """Rotary pairs (complex channels) per axis (t, h, w); they sum to head_dim / 2.

        Wan: h and w get ``head_dim // 6`` pairs each (2*(d//6) channels), t gets the rest
        (d - 4*(d//6) channels). head_dim 128 -> (22, 21, 21); 64 -> (12, 10, 10); 32 -> (6, 5, 5).
        """
        hw = self.head_dim // 6
        return (self.head_dim // 2 - 2 * hw, hw, hw)

    @property
    def patch_channels(self) -> int:
        """Output features per token of the head: out_channels * prod(patch_size)."""
        return self.out_channels * math.prod(self.patch_size)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["patch_size"] = list(self.patch_size)
        return d


WAN_CONFIGS: dict[str, WanConfig] = {p.name: WanConfig(**p.arch) for p in _WAN21.presets}
"""The Wan 2.1 presets (``ds_adaptive.models.wan21``); ``get_wan_config`` also knows every registered
Wan-architecture model (``ds_adaptive.models.registry``)."""


def get_wan_config(name_or_dict: Union[str, Mapping[str, Any], WanConfig], **overrides: Any) -> WanConfig:
    """A WanConfig from a model name (``ds_adaptive.models.registry``), a dict of WanConfig fields, or a
    WanConfig; ``overrides`` replace fields. Unknown names / keys are errors that list the valid ones."""
    fields = {f.name for f in dataclasses.fields(WanConfig)}
    if isinstance(name_or_dict, WanConfig):
        base = name_or_dict.to_dict()
    elif isinstance(name_or_dict, str):
        from ds_adaptive.models.registry import get_model

        try:
            base = dict(get_model(name_or_dict).preset.arch)
        except ModelError as exc:
            raise WanConfigError(f"{exc} (or pass a dict of WanConfig fields)") from None
    elif isinstance(name_or_dict, Mapping):
        base = dict(name_or_dict)
    else:
        raise WanConfigError(f"get_wan_config expects a name, a dict or a WanConfig, got {type(name_or_dict).__name__}")
    base.update(overrides)
    unknown = sorted(set(base) - fields)
    if unknown:
        raise WanConfigError(f"unknown WanConfig key(s) {unknown}; valid keys: {sorted(fields)}")
    missing = sorted(f.name for f in dataclasses.fields(WanConfig)
                     if f.default is dataclasses.MISSING and f.name not in base)
    if missing:
        raise WanConfigError(f"WanConfig needs {missing}; got keys {sorted(base)}")
    return WanConfig(**base)


# --------------------------------------------------------------------------------------------
# Functional pieces
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------

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
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d ** 0.5)
        _set_plain_attr(self, "attn_fn", sdpa_attention)
        _set_plain_attr(self, "ln_modulate", _default_ln_modulate)
        _set_plain_attr(self, "residual", gated_residual)   # block fusion: its compiled form

    def forward(self, x: torch.Tensor, time_mod: torch.Tensor, context: torch.Tensor, freqs: torch.Tensor, *,
                checkpointed: Optional[Mapping[str, Any]] = None, **attn_kwargs: Any) -> torch.Tensor:
        """x [B, S, D] (activation dtype), time_mod [B, 6, D] or [B, S, 6, D] fp32, context [B, L, D],
        freqs [S, Dh/2, 2].

        ``checkpointed``: None runs the block; a dict of ``torch.utils.checkpoint`` keyword arguments (``{}``,
        or ``context_fn`` for ``checkpoint_attention: keep``) runs it under non-reentrant activation
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
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim ** 0.5)
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


class WanModel(nn.Module):
    """Wan 2.1 T2V DiT. See the module docstring for shapes and numerics.

    ``forward(latents, timestep, context)`` = ``embed -> rope -> run_blocks -> head -> unpatchify``.
    """

    def __init__(self, cfg: Union[WanConfig, str, Mapping[str, Any]]):
        super().__init__()
        cfg = cfg if isinstance(cfg, WanConfig) else get_wan_config(cfg)
        self.config = cfg
        d = cfg.dim
        self.patch_embedding = nn.Conv3d(cfg.in_channels, d, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(WanBlock(cfg) for _ in range(cfg.num_layers))
        self.head = WanHead(cfg)
        # Checkpoint each block (torch.utils.checkpoint, use_reentrant=False) while grad is enabled;
        # checkpoint_blocks (set_checkpoint_blocks) limits it to the first n blocks.
        self.gradient_checkpointing = False
        self.checkpoint_blocks: Optional[int] = None
        # what a checkpointed block's backward recomputes: "recompute" all of it, "keep" all but the
        # self-attention core (ds_adaptive.models.recompute; set_checkpoint_attention)
        self.checkpoint_attention = "recompute"
        self.set_attention(None)
        self.set_token_order(None)
        self.set_ln_modulate(None)
        self.set_sequence_parallel(None)
        self.init_weights()

    # ---- hooks for the fused op and sequence parallelism ----
    # The one patching mechanism of ds_adaptive: these setters store plain (non-module) attributes that
    # forward reads. ds_adaptive.ops.apply_ln_modulate and ds_adaptive.parallel.apply_ulysses call them;
    # nothing replaces a method.

    def set_attention(self, fn: Optional[AttentionFn]) -> None:
        """Use ``fn(q, k, v, **kwargs) -> out`` (all ``[B, S, H, Dh]``) as every block's
        self-attention core; None restores ``sdpa_attention``. kwargs given to ``run_blocks``
        are forwarded to fn. fn is not registered as a submodule."""
        fn = sdpa_attention if fn is None else fn
        _set_plain_attr(self, "attention_fn", fn)
        per_layer = getattr(fn, "for_layer", None)  # a per-layer attention (sparse runtime): block i gets fn.for_layer(i)
        for i, block in enumerate(self.blocks):
            _set_plain_attr(block, "attn_fn", per_layer(i) if per_layer is not None else fn)

    def set_token_order(self, order: Optional[TokenOrder]) -> None:
        """Permute the tokens once after the patch embedding (and the RoPE table rows the same way)
        and restore raster order in ``unpatchify``; ``order`` has ``to_cube(x, grid, dim)`` /
        ``to_raster(x, grid, dim)`` (e.g. ``ds_adaptive.attention.CubeOrder``). None: raster order."""
        _set_plain_attr(self, "token_order", order)

    def order_tokens(self, tokens: torch.Tensor, grid: Grid) -> torch.Tensor:
        """Raster-order tokens ``[B, S, ...]`` (e.g. a patchified target) in the model's token order."""
        return tokens if self.token_order is None else self.token_order.to_cube(tokens, grid, dim=1)

    def set_ln_modulate(self, fn: Optional[LnModulateFn]) -> None:
        """Use ``fn(x, shift, scale, eps, weight=None, bias=None)`` at every norm+modulate site
        (2 per block + head); None restores the torch reference ``ln_modulate_reference``."""
        fn = _default_ln_modulate if fn is None else fn
        _set_plain_attr(self, "ln_modulate_fn", fn)
        for m in (*self.blocks, self.head):
            _set_plain_attr(m, "ln_modulate", fn)

    def set_block_fusion(self, qk_rope: Optional[Callable[..., Any]] = None, residual: Optional[Callable[..., Any]] = None,
                         layer_norm: Optional[Callable[..., Any]] = None) -> None:
        """Every block's elementwise pieces outside attention: ``qk_rope`` like ``qk_norm_rope`` (None: the
        RMSNorm modules and ``apply_rope``), ``residual`` like ``gated_residual``, ``layer_norm`` like
        ``fp32_layer_norm`` for the cross-attention norm (None: the references). ``ds_adaptive.models.fusion``
        passes compiled forms (``adaptive_load.block_fusion``)."""
        for block in self.blocks:
            _set_plain_attr(block.self_attn, "qk_rope", qk_rope)
            _set_plain_attr(block, "residual", residual or gated_residual)
            if isinstance(block.norm3, FP32LayerNorm):
                _set_plain_attr(block.norm3, "layer_norm_fn", layer_norm or fp32_layer_norm)

    def apply_block_fusion(self, mode: str) -> Optional[str]:
        """``adaptive_load.block_fusion`` (``off`` | ``rope`` | ``regions``): the compiled elementwise pieces of
        :mod:`ds_adaptive.models.fusion` in every block; returns the launcher's one-line note (None for off)."""
        from ds_adaptive.models.fusion import apply_block_fusion

        return apply_block_fusion(self, mode)

    def warm_up_block_fusion(self, micro_batches, *, dtype: torch.dtype, device: Optional[torch.device],
                             per_token: bool = False) -> float:
        """Compile the installed block-fusion pieces for a plan's ``micro_batches`` ((B, tokens per rank) pairs)
        before its steps run them (:func:`ds_adaptive.models.fusion.warm_up`; the trainer's
        :class:`~ds_adaptive.training.fusion_warmup.FusionWarmup` calls it); seconds spent, 0.0 with block fusion off.
        Raises ``BlockFusionUnavailable`` with the blocks back on eager when torch.compile cannot work."""
        from ds_adaptive.models.fusion import warm_up

        return warm_up(self, micro_batches, dtype=dtype, device=device, per_token=per_token)

    def set_sequence_parallel(self, runner: Optional[Callable[..., Any]]) -> None:
        """Route ``forward`` through ``runner(model, latents, timestep, context, local=...)`` (the Ulysses
        runner of ``ds_adaptive.parallel.apply_ulysses``); None restores the plain forward."""
        _set_plain_attr(self, "sequence_parallel", runner)

    def set_checkpoint_blocks(self, n: Optional[int]) -> None:
        """Checkpoint only the first ``n`` blocks (0..num_layers; more is clamped to all) while grad is
        enabled; ``None`` restores ``gradient_checkpointing``'s all-or-nothing. Set before each forward
        (the trainer does, per micro-batch, from the checkpoint plan of ``ds_adaptive.planning.memory``):
        the first blocks are the ones backward reaches last, when the whole blocks after them are freed."""
        if n is not None and (isinstance(n, bool) or int(n) != n or n < 0):
            raise WanConfigError(f"set_checkpoint_blocks: n must be an int >= 0 or None, got {n!r}")
        self.checkpoint_blocks = None if n is None else min(int(n), len(self.blocks))

    def set_checkpoint_attention(self, mode: str) -> None:
        """``sampler.checkpoint_attention``: ``recompute`` (a checkpointed block runs its whole forward again in
        backward) or ``keep`` (it keeps its self-attention core's output and log-sum-exp and recomputes the
        rest: :mod:`ds_adaptive.models.recompute`). Gradients are the same either way."""
        if mode not in CHECKPOINT_ATTENTION_MODES:
            raise WanConfigError(f"set_checkpoint_attention: mode must be one of {list(CHECKPOINT_ATTENTION_MODES)}, "
                                 f"got {mode!r}")
        self.checkpoint_attention = mode

    def checkpointed_blocks(self) -> int:
        """Blocks the next forward checkpoints (0 when grad is off)."""
        if not torch.is_grad_enabled():
            return 0
        if self.checkpoint_blocks is not None:
            return self.checkpoint_blocks
        return len(self.blocks) if self.gradient_checkpointing else 0

    # ---- the split forward ----

    def embed(self, latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor) -> WanInputs:
        """latents [B, C_in, T', H', W'], timestep [B] or [B, S] (float, 0..1000; [B, S]: one per token in
        (f, h, w) raster order, diffusers' ``expand_timesteps``), context [B, L, text_dim]."""
        self._check_inputs(latents, timestep, context)
        dtype = self.patch_embedding.weight.dtype  # the activation dtype
        x = self.patch_embedding(latents.to(dtype))  # [B, D, F, H, W]
        grid = tuple(int(n) for n in x.shape[2:])
        tokens = self.order_tokens(x.flatten(2).transpose(1, 2), grid).contiguous()
        per_token = timestep.dim() == 2
        steps = self.order_tokens(timestep, grid).flatten() if per_token else timestep  # [B*S] or [B]
        t = timestep_embedding(steps, self.config.freq_dim)
        time_emb = self.time_embedding(t.to(self.time_embedding[0].weight.dtype)).to(dtype)
        time_mod = self.time_projection(time_emb.to(self.time_projection[1].weight.dtype))
        time_mod = time_mod.float().unflatten(1, (6, self.config.dim))  # [B(*S), 6, D]
        if per_token:  # rows are (sample, token): [B, S, D] and [B, S, 6, D]
            b = timestep.shape[0]
            time_emb, time_mod = time_emb.unflatten(0, (b, -1)), time_mod.unflatten(0, (b, -1))
        ctx = self.text_embedding(context.to(self.text_embedding[0].weight.dtype))
        return WanInputs(tokens=tokens, time_mod=time_mod, time_emb=time_emb, context=ctx, grid=grid)

    def rope(self, grid: Grid, device: Optional[torch.device] = None) -> torch.Tensor:
        """Rotary table ``[S, head_dim/2, 2]`` fp32 (cos, sin) for the token grid (F, H, W) in the model's
        token order (rows follow the tokens); see ``rope_table``."""
        grid = tuple(int(n) for n in grid)
        table = rope_table(grid, self.config.rope_split, self.config.rope_theta, device)
        return table if self.token_order is None else self.token_order.to_cube(table, grid, dim=0)

    def run_blocks(self, x: torch.Tensor, inputs: WanInputs, freqs: torch.Tensor, **attn_kwargs: Any) -> torch.Tensor:
        """All blocks on x [B, S_local, D] with freqs [S_local, Dh/2, 2] (rows aligned with x's tokens).

        Under sequence parallelism x and freqs are the local shards; ``attn_kwargs`` (e.g.
        ``valid_len``) go to the attention fn of every block.
        """
        if freqs.dim() != 3 or freqs.shape[0] != x.shape[1] or freqs.shape[1:] != (self.config.head_dim // 2, 2):
            raise WanConfigError(
                f"rope table has shape {list(freqs.shape)} but x has {x.shape[1]} tokens; expected "
                f"[{x.shape[1]}, {self.config.head_dim // 2}, 2]: shard model.rope(grid) along dim 0 "
                "exactly like the tokens (same padding)")
        if freqs._base is not None and self.blocks and self.blocks[0].self_attn.qk_rope is not None:
            # block fusion: the compiled qk_norm_rope guards on a view's base (its sizes; a one-frame grid's size
            # of 1), which differs between the plain, the Ulysses-sharded and the warm-up tables: one small copy per
            # forward gives every call the same kind of table
            freqs = freqs.clone()
        n_ckpt = self.checkpointed_blocks()
        ctx = {"context_fn": keep_attention_context()} if self.checkpoint_attention == "keep" else {}
        for i, block in enumerate(self.blocks):   # a checkpointed block checkpoints inside its call (WanBlock.forward)
            x = block(x, inputs.time_mod, inputs.context, freqs, checkpointed=ctx if i < n_ckpt else None,
                      **attn_kwargs)
        return x

    # ``self.head`` (a WanHead submodule) is the split-path head: model.head(x, time_emb) -> [B, S, C*pt*ph*pw].

    def unpatchify(self, tokens: torch.Tensor, grid: Grid) -> torch.Tensor:
        """[B, S, out_channels*pt*ph*pw] (channels fastest) -> [B, out_channels, F*pt, H*ph, W*pw]."""
        f, h, w = grid
        if tokens.shape[1] != f * h * w:
            raise WanConfigError(f"unpatchify got {tokens.shape[1]} tokens for grid {tuple(grid)} "
                                 f"(= {f * h * w}); drop sequence-parallel padding before unpatchify")
        if self.token_order is not None:
            tokens = self.token_order.to_raster(tokens, grid, dim=1)
        pt, ph, pw = self.config.patch_size
        return rearrange(tokens, "b (f h w) (pt ph pw c) -> b c (f pt) (h ph) (w pw)",
                         f=f, h=h, w=w, pt=pt, ph=ph, pw=pw)

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, *, local: bool = False):
        """latents [B, 16, T', H', W'], timestep [B] float in [0, 1000], context [B, L, 4096]
        -> the prediction [B, 16, T', H', W'] in the activation (parameter) dtype.

        ``local=True``: the caller takes this rank's share of the prediction. Under sequence
        parallelism that is a ``ds_adaptive.parallel.LocalOutput`` (this rank's token shard, no
        all-gather); without it the shard is the whole prediction, returned as above.
        """
        if self.sequence_parallel is not None:
            return self.sequence_parallel(self, latents, timestep, context, local=local)
        inputs = self.embed(latents, timestep, context)
        freqs = self.rope(inputs.grid, inputs.tokens.device)
        x = self.run_blocks(inputs.tokens, inputs, freqs)
        return self.unpatchify(self.head(x, inputs.time_emb), inputs.grid)

    # ---- utilities ----

    def _check_inputs(self, latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor) -> None:
        cfg = self.config
        pt, ph, pw = cfg.patch_size
        if latents.dim() != 5 or latents.shape[1] != cfg.in_channels:
            raise WanConfigError(f"latents must be [B, {cfg.in_channels}, T', H', W'], got {list(latents.shape)}")
        b, _, t, h, w = latents.shape
        if t % pt or h % ph or w % pw:
            raise WanConfigError(f"latent grid {t}x{h}x{w} (T'xH'xW') is not divisible by the patch "
                                 f"{cfg.patch_size}; crop or resize the sample (H', W' must be even)")
        s = (t // pt) * (h // ph) * (w // pw)
        if timestep.shape not in ((b,), (b, s)):
            raise WanConfigError(f"timestep must be [B] = [{b}] (one float in [0, 1000] per sample) or [B, S] = "
                                 f"[{b}, {s}] (one per token), got {list(timestep.shape)}")
        if context.dim() != 3 or context.shape[0] != b or context.shape[2] != cfg.text_dim:
            raise WanConfigError(f"context must be [B, L, text_dim] = [{b}, L, {cfg.text_dim}], "
                                 f"got {list(context.shape)}")

    @torch.no_grad()
    def init_weights(self) -> None:
        """The original Wan init: xavier-uniform Linear/patch weights, zero biases, N(0, 0.02) for
        the text and time embeddings, zero output head; RMSNorm / LayerNorm weights 1, modulation
        tables N(0, 1/D). Works on the meta device and under deepspeed.zero.Init."""
        params = list(self.parameters())
        if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3 partitioned: gather, init on rank 0
            import deepspeed
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                self._init_weights()
        else:
            self._init_weights()

    def _init_weights(self) -> None:
        d = self.config.dim
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and m.weight is not None:
                nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        nn.init.xavier_uniform_(self.patch_embedding.weight.view(d, -1))
        nn.init.zeros_(self.patch_embedding.bias)
        for seq in (self.text_embedding, self.time_embedding):
            for m in seq:
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
        for p in (*(b.modulation for b in self.blocks), self.head.modulation):
            nn.init.normal_(p, std=d ** -0.5)
        nn.init.zeros_(self.head.head.weight)

    def to_dtype(self, dtype: torch.dtype, keep_fp32: bool = True) -> "WanModel":
        """Cast floating parameters to dtype; with keep_fp32, those of ``is_fp32_param`` stay fp32."""
        for name, p in self.named_parameters():
            target = torch.float32 if keep_fp32 and is_fp32_param(name) else dtype
            if p.dtype != target:
                p.data = p.data.to(target)
        return self

    @classmethod
    def from_pretrained(cls, path, dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cpu",
                        config: Optional[Union[WanConfig, str, Mapping[str, Any]]] = None,
                        keep_fp32: bool = True) -> "WanModel":
        """Load a diffusers-format or original-Wan checkpoint (dir or file); see
        ``ds_adaptive.models.weights.load_pretrained``."""
        from ds_adaptive.models.weights import load_pretrained
        return load_pretrained(path, dtype=dtype, device=device, config=config, keep_fp32=keep_fp32)


def count_parameters(cfg: Union[WanConfig, str, Mapping[str, Any]]) -> int:
    """Parameter count of a config, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = WanModel(cfg)
    return sum(p.numel() for p in model.parameters())
