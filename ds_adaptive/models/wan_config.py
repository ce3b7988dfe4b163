"""The Wan DiT's architecture as data: :class:`WanConfig` and :func:`get_wan_config` (from a registered model's name,
a dict of fields or a WanConfig).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Union

from ds_adaptive.models.family import ModelError
from ds_adaptive.models.registry import get_model


class WanConfigError(ModelError):
    """A WanConfig field (or a latent / context shape given to the model) is invalid."""


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


def get_wan_config(name_or_dict: Union[str, Mapping[str, Any], WanConfig], **overrides: Any) -> WanConfig:
    """A WanConfig from a model name (``ds_adaptive.models.registry``), a dict of WanConfig fields, or a
    WanConfig; ``overrides`` replace fields. Unknown names / keys are errors that list the valid ones."""
    fields = {f.name for f in dataclasses.fields(WanConfig)}
    if isinstance(name_or_dict, WanConfig):
        base = name_or_dict.to_dict()
    elif isinstance(name_or_dict, str):
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
