"""The seam between ds_adaptive and a model family: what the rest of the package may ask a model.

A **family** (:class:`ModelFamily`) is code shared by its models: how a config is made and a model
built, its FLOPs and parameter counts, its weight adapter (diffusers / original layouts, parameter
names to and from diffusers'), its encoders for preprocessing and sampling, where LoRA adapters go
(:class:`LoraTargets`). A **preset** (:class:`Preset`) is data: one ``--model`` name with its
architecture fields, its VAE's stride, its text length, its objective options (e.g. the noise
range of one expert of a mixture), where its weights sit in a diffusers pipeline, its default
shape mix, media defaults and calibration shapes. ``ds_adaptive.models.registry.get_model(name)``
returns a :class:`Model` (a preset bound to its family); shapes, data, preprocessing, the
planner and sampler, calibration, export, the dry run and the trainer ask it, never a family's
module. The runtime changes a model only through the setters of :class:`DiffusionTransformer`.

Learned from torchtitan's ``TrainSpec`` (one entry per family: configs by name, builder, state-dict
adapter; looked up by name) and FastVideo's ``configs/models/dits`` (architecture constants as data).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, runtime_checkable

from ds_adaptive.core.shapes import GridRule, InputSpec

__all__ = ["ModelError", "BlockFusionUnavailable", "DiffusionTransformer", "WeightAdapter", "LoraTargets",
           "ObjectiveOptions", "MediaDefaults", "Preset", "ModelFamily", "Model", "set_plain_attr", "sigma_to_u"]


class ModelError(ValueError):
    """A model name, config, input or checkpoint that does not fit; every family's errors derive from it."""


class BlockFusionUnavailable(RuntimeError):
    """Raised by a model's optional ``warm_up_block_fusion`` when torch.compile cannot build its fused block pieces
    on this machine (no working triton on a GPU, no C++ compiler on a CPU, or a graph dynamo cannot capture),
    after it has put every block back on its eager path. The message is torch's first line; the trainer warns
    once and trains eager."""


def set_plain_attr(module: Any, name: str, value: Any) -> None:
    """Store ``value`` on ``module`` without ``nn.Module.__setattr__``: an attention fn may itself be an
    ``nn.Module`` (DeepSpeed's DistributedAttention); registering it as a child of every block would put
    it in ``named_modules()`` and under ZeRO-3's hooks. The runtime's setters all store this way."""
    object.__setattr__(module, name, value)


@runtime_checkable
class DiffusionTransformer(Protocol):
    """The setters and split forward the runtime uses (``ops.apply_ln_modulate``, ``parallel.apply_ulysses``,
    sparse attention, the trainer's checkpoint plan). Every family's model implements them; nothing else
    of a model is touched from outside ``ds_adaptive.models``.

    Setters store plain (non-module) attributes that ``forward`` reads; none replaces a method, so
    parameter names and checkpoints never change and a deepcopy runs its own weights.
    """

    config: Any
    blocks: Sequence[Any]
    gradient_checkpointing: bool

    def set_attention(self, fn: Optional[Callable[..., Any]]) -> None:
        """Every block's self-attention core ``fn(q, k, v, **kw)`` (``[B, S, H, Dh]``); a fn with
        ``for_layer(i)`` gives block i its own; None: the default."""

    def set_ln_modulate(self, fn: Optional[Callable[..., Any]]) -> None:
        """``fn(x, shift, scale, eps, weight=None, bias=None)`` at every norm + modulate site; None: the reference."""

    def set_sequence_parallel(self, runner: Optional[Callable[..., Any]]) -> None:
        """Route ``forward`` through ``runner(model, latents, timestep, context, local=...)``; None: plain."""

    def set_token_order(self, order: Any) -> None:
        """Permute tokens after the patch embedding (``order.to_cube`` / ``to_raster``); None: raster."""

    def set_checkpoint_blocks(self, n: Optional[int]) -> None:
        """Checkpoint the first ``n`` blocks while grad is on; None: ``gradient_checkpointing``'s all or nothing."""

    def checkpointed_blocks(self) -> int:
        """Blocks the next forward checkpoints."""

    def embed(self, latents: Any, timestep: Any, context: Any) -> Any:
        """Inputs of the blocks: ``.tokens`` [B, S, D], ``.grid``, ``.time_emb``, ``.local(shard_fn)``."""

    def rope(self, grid: Any, device: Any = None) -> Any:
        """Per-token rotary table, first dim S (sharded like the tokens)."""

    def run_blocks(self, x: Any, inputs: Any, freqs: Any, **attn_kwargs: Any) -> Any:
        """All blocks on this rank's tokens."""

    def head(self, x: Any, time_emb: Any) -> Any:
        """Output head on this rank's tokens -> [B, S_local, C * prod(patch)]."""

    def unpatchify(self, tokens: Any, grid: Any) -> Any:
        """Tokens of the whole sequence -> latents."""


def missing_members(model: Any) -> list[str]:
    """The :class:`DiffusionTransformer` members ``model`` lacks (empty: it fits the seam).

    ``isinstance(model, DiffusionTransformer)`` is not used: from Python 3.12 a runtime-checkable protocol
    looks members up with ``inspect.getattr_static``, which does not see an ``nn.Module``'s submodules
    (``blocks`` lives in ``_modules``), so every model would fail the check there."""
    names = [n for n in DiffusionTransformer.__annotations__] + [
        n for n, v in vars(DiffusionTransformer).items() if callable(v) and not n.startswith("_")]
    return [n for n in dict.fromkeys(names) if not hasattr(model, n)]


class WeightAdapter(Protocol):
    """Weights to and from a family's checkpoint layouts (diffusers and the family's original one)."""

    def init_from(self, model: Any, path: str, *, subfolder: str) -> dict:
        """Load pretrained weights into ``model`` (possibly ZeRO-3-partitioned) on every rank ->
        ``{"path", "layout", "tensors", "zero3"}``. ``subfolder``: the model's folder in a pipeline dir."""

    def load_state_dict(self, model: Any, state_dict: Mapping[str, Any], *, source: str) -> Any:
        """Names and shapes checked (one error listing every problem), then assigned into a meta-built model."""

    def check(self, model: Any, path: str, *, subfolder: str) -> None:
        """The weights at ``path`` fit ``model`` (names and shapes, from the files' headers: nothing loaded), else
        a ModelError listing the problems. The start-up check of ``--init-from``."""

    def save(self, model: Any, directory: str, *, layout: str = "diffusers") -> Path:
        """``config.json`` + weights in ``layout``; returns the weights file."""

    def read_config(self, path: str, *, subfolder: str) -> Any:
        """The config of a checkpoint directory (None when it has none)."""

    def load(self, path: str, *, config: Any = None, subfolder: str = "transformer", dtype: Any = None) -> Any:
        """A model built from the checkpoint ``path`` without a random init (plain, CPU; ``dtype`` default fp32);
        ``config`` replaces the checkpoint's own (needed when it has none)."""

    def to_diffusers_key(self, name: str) -> Optional[str]:
        """diffusers' name of the model's parameter ``name`` (``blocks.0.x.weight``); None: no counterpart. Export
        and LoRA files use it."""

    def from_diffusers_key(self, key: str) -> Optional[str]:
        """The model's name of diffusers' parameter ``key``; None: no counterpart."""


@dataclass(frozen=True)
class LoraTargets:
    """Where LoRA adapters can go in a family's model (``ds_adaptive.training.lora``): linears inside every block, by
    module path, grouped under names a config may use."""

    block_prefix: str
    """Regex of a block's module path prefix (e.g. ``blocks\\.\\d+\\.``)."""
    groups: Mapping[str, tuple[str, ...]]
    """Group name -> module paths inside a block (e.g. ``self_attn`` -> ``self_attn.q``, ...)."""

    @property
    def modules(self) -> tuple[str, ...]:
        """Every module path a target may name, in table order."""
        return tuple(dict.fromkeys(m for paths in self.groups.values() for m in paths))

    def resolve(self, targets: Sequence[str]) -> tuple[str, ...]:
        """Targets (group names or module paths) -> module paths inside a block, in table order; an unknown
        one is a :class:`ModelError` listing the valid ones."""
        chosen = set()
        for t in targets:
            if t in self.groups:
                chosen.update(self.groups[t])
            elif t in self.modules:
                chosen.add(t)
            else:
                raise ModelError(f"unknown target {t!r}; valid: groups {sorted(self.groups)} or module paths "
                                 f"{list(self.modules)}")
        return tuple(m for m in self.modules if m in chosen)

    def pattern(self, paths: Sequence[str]) -> str:
        """peft ``target_modules`` regex (full match on module names) of ``paths`` in every block."""
        return self.block_prefix + "(" + "|".join(re.escape(p) for p in paths) + ")"


def sigma_to_u(sigma: float, shift: float) -> float:
    """Inverse of the timestep shift ``sigma = shift*u / (1 + (shift-1)*u)``: the uniform draw ``u`` that
    gives noise level ``sigma`` (both in [0, 1])."""
    return sigma / (shift - (shift - 1.0) * sigma)


@dataclass(frozen=True)
class ObjectiveOptions:
    """How a preset is trained (``ds_adaptive.models.objective``); the trainer's ``--objective KEY=VALUE`` overrides fields."""

    sigma_range: tuple[float, float] = (0.0, 1.0)
    """Noise levels [lo, hi) the model is trained on (sigma = timestep / 1000 after the shift). An expert of a
    mixture trains on its range: the draw ``u ~ U(0, 1)`` is restricted to the ``u`` whose shifted sigma lies
    in it, i.e. the training distribution conditioned on the range."""

    first_frame_ratio: float = 0.0
    """Share of video samples trained image-to-video: the first latent frame is the clean conditioning image,
    its tokens get timestep 0 (one timestep per token, diffusers' ``expand_timesteps``) and stay out of the
    loss. Needs a family with per-token timesteps (``ModelFamily.per_token_timesteps``)."""

    def __post_init__(self) -> None:
        lo, hi = (float(v) for v in self.sigma_range)
        if not 0.0 <= lo < hi <= 1.0:
            raise ModelError(f"objective sigma_range must satisfy 0 <= lo < hi <= 1, got {self.sigma_range!r}")
        object.__setattr__(self, "sigma_range", (lo, hi))
        r = self.first_frame_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise ModelError(f"objective first_frame_ratio must be a number in [0, 1], got {r!r}")
        object.__setattr__(self, "first_frame_ratio", float(r))

    def u_range(self, shift: float) -> tuple[float, float]:
        """The uniform draw's interval for ``sigma_range`` under ``shift``."""
        lo, hi = self.sigma_range
        return (sigma_to_u(lo, shift), sigma_to_u(hi, shift))

    def with_overrides(self, items: Mapping[str, Any]) -> "ObjectiveOptions":
        """A copy with ``{field: value}`` replaced; unknown fields are an error naming the valid ones."""
        known = {f.name for f in fields(self)}
        bad = sorted(set(items) - known)
        if bad:
            raise ModelError(f"--objective: unknown key(s) {bad}; valid keys: {sorted(known)}")
        return replace(self, **dict(items))

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class MediaDefaults:
    """A preset's preprocessing defaults (``ds-adaptive preprocess`` / ``stats`` shape policy)."""

    fps: float
    """Frame rate videos are sampled at."""
    frame_counts: tuple[int, ...]
    """Frame counts of video clips."""
    video_sizes: tuple[str, ...]
    """Video buckets, ``HEIGHTxWIDTH``."""
    image_sizes: tuple[str, ...]
    """Image buckets, ``HEIGHTxWIDTH``."""


@dataclass(frozen=True)
class Preset:
    """One ``--model`` name: architecture fields and everything else that is data."""

    name: str
    """The ``--model`` value."""
    arch: Mapping[str, Any]
    """The family's config fields (``ModelFamily.make_config(arch, **overrides)``)."""
    vae_stride: tuple[int, int, int]
    """(t, h, w) compression of the VAE the model's latents come from."""
    vae: str
    """Name of that VAE (messages, dataset indexes)."""
    shapes: Path
    """Default shape-distribution json (synthetic data, ``simulate``, the dry run)."""
    media: MediaDefaults
    """Preprocessing defaults."""
    calibration_shapes: tuple[tuple[int, int, int], ...]
    """``ds-adaptive calibrate``'s default FxHxW grids, short to long."""
    text_len: int = 512
    """Text tokens per sample after zero padding."""
    objective: ObjectiveOptions = field(default_factory=ObjectiveOptions)
    """How the preset is trained."""
    subfolder: str = "transformer"
    """The model's folder in a diffusers pipeline directory (``transformer_2``: the second expert)."""
    profile_model: Optional[str] = None
    """Another preset of identical architecture and token grid whose shipped calibrations describe this
    one exactly (e.g. an expert of a mixture); None: the preset's own name."""
    description: str = ""


@dataclass(frozen=True)
class ModelFamily:
    """Code shared by a family's presets; ``presets`` are its configs by name."""

    name: str
    description: str
    presets: tuple[Preset, ...]
    make_config: Callable[..., Any]
    """``(arch: dict | config, **overrides) -> config`` (has ``num_heads``, ``num_layers``, ``dim``,
    ``in_channels``, ``patch_size``, ``text_dim``)."""
    build_model: Callable[[Any], DiffusionTransformer]
    """``config -> model`` (under ``torch.device("meta")`` / ``deepspeed.zero.Init`` as the caller chooses)."""
    train_flops: Callable[..., tuple[float, float]]
    """``(config, tokens, batch_size, ckpt_blocks, kept_attention=False) -> (model FLOPs, hardware FLOPs)`` of one
    micro-batch; ``kept_attention``: the checkpointed blocks' recompute skips the self-attention core (a family
    whose models cannot keep it need not take the keyword: it is only passed when True)."""
    param_counts: Callable[[Any], dict]
    """``config -> {"block": n, "total": n}`` (static memory of a profile)."""
    weights: Callable[[], WeightAdapter]
    """Factory of the weight adapter (imported on first use)."""
    vae_class: str
    """diffusers class of the VAE (``ds-adaptive preprocess``, previews and ``ds-adaptive sample`` decoding; its
    config's ``latents_mean`` / ``latents_std`` normalise the latents)."""
    text_encoder_class: str
    """transformers class of the text encoder."""
    per_token_timesteps: bool = False
    """The model accepts ``timestep [B, S]`` (one per token) besides ``[B]``."""
    transformer_class: str = ""
    """diffusers class of the DiT: what an export (``weights.save(layout="diffusers")``) and an exported LoRA
    file load into (messages)."""
    lora_targets: Optional[LoraTargets] = None
    """Where LoRA adapters may go (``adaptive_load.lora.targets``); None: the family has no LoRA support."""
    keeps_attention: bool = False
    """Its models offer ``set_checkpoint_attention``: a checkpointed block can keep its self-attention output
    (``recompute.attention: keep``; ``auto`` plans it only for such a family)."""
    per_token_modulation_bytes: Optional[Callable[[Any], tuple[float, float]]] = None
    """``config -> (outside, block)``: activation bytes per token that one timestep per token adds over one per
    sample (``per_token_timesteps``): ``outside`` once per sample (embeddings, head, the modulation's gradient),
    ``block`` in every block that is not checkpointed. The planner's estimate for a profile that did not measure
    it (``Profile.with_per_token_timesteps``); None: no estimate (the family has no per-token path)."""
    kept_input_bytes: Optional[Callable[..., float]] = None
    """``config, *, hooked, wrapped, adapter_rank, adapter_dropout -> bytes``: activation bytes per token that a whole
    block keeps beyond its calibrated (lean-backward) count when ZeRO-3 hooks its submodules or LoRA wraps its
    Linear layers (``Profile.with_kept_inputs``); None: the family keeps nothing more."""


@dataclass(frozen=True)
class Model:
    """A preset bound to its family: what ``get_model(name)`` returns and the package asks."""

    family: ModelFamily
    preset: Preset

    @property
    def name(self) -> str:
        return self.preset.name

    def config(self, **overrides: Any) -> Any:
        """The architecture config with ``overrides`` (e.g. ``num_layers`` for ``--layers``)."""
        return self.family.make_config(dict(self.preset.arch), **overrides)

    def build(self, config: Any = None) -> DiffusionTransformer:
        """The model of ``config`` (default: the preset's); device / ZeRO context is the caller's."""
        return self.family.build_model(self.config() if config is None else config)

    @cached_property
    def grid(self) -> GridRule:
        a = self.preset.arch
        return GridRule(self.preset.vae_stride, tuple(a.get("patch_size", (1, 2, 2))), int(a.get("in_channels", 16)),
                        vae=self.preset.vae)

    @cached_property
    def input_spec(self) -> InputSpec:
        return InputSpec(self.grid, int(self.preset.arch.get("text_dim", 4096)), self.preset.text_len, model=self.name)

    @property
    def text_len(self) -> int:
        return self.preset.text_len

    @property
    def objective(self) -> ObjectiveOptions:
        return self.preset.objective

    @property
    def shapes(self) -> Path:
        return self.preset.shapes

    @property
    def subfolder(self) -> str:
        return self.preset.subfolder

    @property
    def profile_model(self) -> str:
        """The preset name its shipped profiles are filed under."""
        return self.preset.profile_model or self.preset.name

    @property
    def weights(self) -> WeightAdapter:
        return self.family.weights()

    @property
    def lora_targets(self) -> Optional[LoraTargets]:
        return self.family.lora_targets

    @property
    def media(self) -> MediaDefaults:
        return self.preset.media

    def takes_inputs_of(self, config: Any) -> bool:
        """Whether a model of ``config`` (this family's) reads this model's inputs: the same latent channels,
        patch and text width (e.g. weights of another depth or width trained on this model's data)."""
        ref = self.config()
        return all(getattr(config, k, None) == getattr(ref, k) for k in ("in_channels", "patch_size", "text_dim"))

    def flops(self, config: Any, tokens: int, batch_size: int, ckpt_blocks: int = 0,
              kept_attention: bool = False) -> tuple[float, float]:
        if kept_attention:
            return self.family.train_flops(config, tokens, batch_size, ckpt_blocks, kept_attention=True)
        return self.family.train_flops(config, tokens, batch_size, ckpt_blocks)

    def param_counts(self, config: Any = None) -> dict:
        return self.family.param_counts(self.config() if config is None else config)

    def per_token_modulation_bytes(self, config: Any = None) -> Optional[tuple[float, float]]:
        """``(outside, block)`` bytes per token that per-token timesteps add (:attr:`ModelFamily.per_token_modulation_bytes`);
        None when the family gives no estimate."""
        fn = self.family.per_token_modulation_bytes
        return None if fn is None else fn(self.config() if config is None else config)

    def kept_input_bytes(self, config: Any = None, **kw: Any) -> float:
        """Bytes per token a whole block keeps beyond its calibrated count (:attr:`ModelFamily.kept_input_bytes`;
        ``kw``: ``hooked``, ``wrapped``, ``adapter_rank``, ``adapter_dropout``); 0 when the family gives none."""
        fn = self.family.kept_input_bytes
        return 0.0 if fn is None else float(fn(self.config() if config is None else config, **kw))

    def trains_per_token_timesteps(self, objective: Optional[ObjectiveOptions] = None) -> bool:
        """Whether video micro-batches of a run with ``objective`` (default: the preset's) may take one timestep
        per token (first-frame conditioning on a family with per-token timesteps): the planner then counts the
        per-token modulation's memory for every video micro-batch (any of them may hold a conditioned sample)."""
        opts = self.objective if objective is None else objective
        return bool(self.family.per_token_timesteps and opts.first_frame_ratio > 0)

    def objective_with(self, overrides: Mapping[str, Any]) -> ObjectiveOptions:
        """The preset's objective options with ``overrides`` (``--objective``), checked against the family."""
        opts = self.objective.with_overrides(overrides)
        if opts.first_frame_ratio and not self.family.per_token_timesteps:
            raise ModelError(f"--objective first_frame_ratio={opts.first_frame_ratio}: model {self.name} "
                             f"({self.family.name}) takes one timestep per sample, not one per token")
        return opts

    def describe(self) -> str:
        cfg = self.config()
        return (f"{self.name} ({self.family.name}): {cfg.num_layers} blocks, dim {cfg.dim}, {cfg.num_heads} heads, "
                f"{self.grid.describe()}")


def check_presets(presets: Sequence[Preset]) -> None:
    """Cheap sanity checks of preset data (run when the registry loads)."""
    for p in presets:
        if len(p.vae_stride) != 3 or math.prod(p.vae_stride) < 1:
            raise ModelError(f"preset {p.name}: vae_stride must be 3 ints >= 1, got {p.vae_stride!r}")
        if not p.shapes.is_file():
            raise ModelError(f"preset {p.name}: default shape mix {p.shapes} does not exist")
