"""Shape policy: which (frames, height, width) a source image or video becomes.

Pure functions (no decoding, no torch): ``ds-adaptive preprocess`` applies them to decoded
media and ``ds-adaptive stats`` to probed metadata, so both agree on the output shape mix.

A policy belongs to a model (``--model``): its defaults are the model's media defaults
(``Preset.media``: Wan 2.1 samples 16 fps at 480p / 720p, Wan 2.2 TI2V-5B 24 fps at 704p) and its
sizes and frame counts must fit the model's grid rule (VAE stride x patch).

* **Frames.** A video is sampled at ``fps`` and cut into clips whose frame counts come from
  ``frame_counts`` (each t*n+1, t the VAE's time stride: a causal VAE keeps the first frame): with
  ``long_clips: cut`` a long video gives consecutive clips of the largest count plus a tail clip
  of the largest count that fits the rest (if any fits); ``truncate`` keeps only the first clip.
  A video with fewer sampled frames than the smallest count is rejected as too short.
* **Size.** Every clip of a source gets one bucket from ``video_sizes`` (images: ``image_sizes``):
  among the buckets reachable without upscaling by more than ``max_upscale``, those whose
  aspect ratio is within ``aspect_tolerance`` (in |log(h/w)|) of the closest one, the largest;
  if none is reachable, the one that needs the least upscaling. The source is resized
  (aspect kept) to cover the bucket and centre-cropped to it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from ds_adaptive.core.shapes import GridRule, InputSpec, SampleShape, ShapeError, default_input_spec
from ds_adaptive.models.registry import default_model, get_model

if TYPE_CHECKING:
    from argparse import Namespace


class PolicyError(ValueError):
    """A shape policy (from --policy or the command line) is invalid."""


def parse_size(text: str, *, where: str = "size", grid: Optional[GridRule] = None) -> tuple[int, int]:
    """``"480x832"`` -> (480, 832) (height x width, multiples of the model's pixels per token: ``grid``,
    default the default model's)."""
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise PolicyError(f"{where}: expected HEIGHTxWIDTH like '480x832', got {text!r}")
    h, w = int(parts[0]), int(parts[1])
    try:
        (grid or default_input_spec().grid).validate(1, h, w, where=where)
    except ShapeError as exc:
        raise PolicyError(str(exc)) from None
    return h, w


def _context_spec(info: ValidationInfo) -> InputSpec:
    return (info.context or {}).get("spec") or default_input_spec()


def _context_grid(info: ValidationInfo) -> GridRule:
    return _context_spec(info).grid


def _default(field_name: str):
    """A field's default: the default model's media defaults (``Preset.media``)."""
    def factory():
        return list(v) if isinstance(v := getattr(get_model(default_model()).preset.media, field_name), tuple) else v
    return factory


class ShapePolicy(BaseModel):
    """How sources become clips of a model's shapes (frames at a target fps, bucketed sizes).

    Defaults are the model's (``load_policy(model=...)``; the default model's here): for Wan 2.1 they
    produce the shapes of ``ds_adaptive/data/default_shapes.json`` (the mix ``simulate`` and the synthetic
    data plan for by default), plus portrait 17- and 49-frame clips. The model's inputs come in the
    validation context (``{"spec": InputSpec}``); ``spec`` and ``grid`` give them back."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    fps: float = Field(default_factory=_default("fps"), gt=0.0, le=240.0)
    """Frame rate videos are sampled at, frames per second (the model's; Wan 2.1: 16). A manifest row's
    `fps` overrides it for that row."""

    frame_counts: list[int] = Field(default_factory=_default("frame_counts"))
    """Frame counts of video clips, each t*n+1 and > 1 (t: the VAE's time stride, 4 for Wan: the causal VAE
    keeps the first frame and compresses the rest by t). The largest is the longest clip."""

    video_sizes: list[str] = Field(default_factory=_default("video_sizes"))
    """Buckets of video clips, "HEIGHTxWIDTH", sides multiples of the model's pixels per token (16 for Wan
    2.1: 480p and 720p; 32 for Wan 2.2 TI2V-5B: 704p)."""

    image_sizes: list[str] = Field(default_factory=_default("image_sizes"))
    """Buckets of images, "HEIGHTxWIDTH", sides multiples of the model's pixels per token."""

    long_clips: Literal["cut", "truncate"] = "cut"
    """A video longer than the longest clip: `cut` into consecutive clips (plus a shorter tail clip
    when one fits), or `truncate` to its first clip."""

    max_clips_per_video: Optional[int] = Field(None, ge=1)
    """With `cut`: at most this many clips from one video (None: no limit)."""

    max_upscale: float = Field(1.0, ge=1.0)
    """Largest upscaling factor a bucket may need to count as reachable (1.0: never upscale when a
    smaller bucket exists)."""

    aspect_tolerance: float = Field(0.05, ge=0.0)
    """Buckets whose |log(h/w)| is within this of the closest reachable bucket's count as the same
    aspect, and the largest of them wins (0.05: 480x832 and 720x1280 are one aspect class)."""

    _spec: InputSpec = PrivateAttr(default_factory=default_input_spec)

    @field_validator("frame_counts")
    @classmethod
    def _frames(cls, v: list[int], info: ValidationInfo) -> list[int]:
        if not v:
            raise ValueError("needs at least one frame count")
        grid = _context_grid(info)
        k = grid.vae_stride[0]
        for f in v:
            if not isinstance(f, int) or f <= 1:
                raise ValueError(f"every frame count must be an int {k}n+1 > 1, got {f!r}")
            try:
                grid.validate(f, *grid.spatial_multiple)
            except ShapeError as exc:
                raise ValueError(str(exc)) from None
        return sorted(set(v))

    @field_validator("video_sizes", "image_sizes")
    @classmethod
    def _sizes(cls, v: list[str], info: ValidationInfo) -> list[str]:
        if not v:
            raise ValueError("needs at least one HEIGHTxWIDTH bucket")
        out = []
        for s in v:
            h, w = parse_size(s, where=info.field_name, grid=_context_grid(info))
            if f"{h}x{w}" not in out:
                out.append(f"{h}x{w}")
        return out

    @model_validator(mode="after")
    def _cut_only(self, info: ValidationInfo) -> "ShapePolicy":
        if self.max_clips_per_video is not None and self.long_clips != "cut":
            raise ValueError("max_clips_per_video applies to long_clips 'cut' only")
        self._spec = _context_spec(info)
        return self

    @property
    def spec(self) -> InputSpec:
        """The inputs of the model the policy was validated for."""
        return self._spec

    @property
    def grid(self) -> GridRule:
        """The model's grid rule."""
        return self._spec.grid

    @property
    def video_buckets(self) -> list[tuple[int, int]]:
        return [parse_size(s, grid=self.grid) for s in self.video_sizes]

    @property
    def image_buckets(self) -> list[tuple[int, int]]:
        return [parse_size(s, grid=self.grid) for s in self.image_sizes]

    def shape(self, frames: int, height: int, width: int) -> SampleShape:
        """A shape under the policy's grid rule."""
        return SampleShape(frames, height, width, self.grid)

    def output_shapes(self) -> list[SampleShape]:
        """Every shape this policy can produce (images first)."""
        out = [self.shape(1, h, w) for h, w in self.image_buckets]
        out += [self.shape(f, h, w) for f in self.frame_counts for h, w in self.video_buckets]
        return out


def load_policy(path: Union[str, Path, None] = None, *, model=None, **overrides) -> ShapePolicy:
    """A policy for ``model`` (a :class:`ds_adaptive.models.family.Model`; default: the default model):
    its media defaults, then a JSON file (``--policy``; keys = ``ShapePolicy`` fields), then ``overrides``
    (command-line flags; None values are ignored); validated under the model's grid rule. Errors name the
    key and the file."""
    if model is None:

        model = get_model(default_model())
    media = model.preset.media
    data: dict = {"fps": media.fps, "frame_counts": list(media.frame_counts), "video_sizes": list(media.video_sizes),
                  "image_sizes": list(media.image_sizes)}
    source = "the command line"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise PolicyError(f"shape policy file {p} (from --policy) does not exist")
        try:
            loaded = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise PolicyError(f"shape policy file {p} is not valid JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise PolicyError(f"shape policy file {p} must hold a JSON object of {sorted(ShapePolicy.model_fields)}")
        data.update(loaded)
        source = f"{p} and the command line"
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ShapePolicy.model_validate(data, context={"spec": model.input_spec})
    except ValidationError as exc:
        lines = [f"invalid shape policy for model {model.name} (from {source}):"]
        for err in exc.errors():
            key = ".".join(str(x) for x in err["loc"]) or "policy"
            if err["type"] == "extra_forbidden":
                lines.append(f"  - unknown key '{key}'; valid keys: {', '.join(sorted(ShapePolicy.model_fields))}")
            else:
                lines.append(f"  - {key}: {err['msg']} (got {err.get('input')!r})")
        raise PolicyError("\n".join(lines)) from None


def model_from_args(args: Namespace):
    """The model of ``--model`` (default: the default model)."""
    return get_model(getattr(args, "model", None) or default_model())


def policy_from_args(args: Namespace) -> ShapePolicy:
    """``load_policy`` from the shape-policy flags (``ds_adaptive.cli.preprocess.add_policy_args``; ``--model`` gives
    the defaults and the grid)."""
    return load_policy(args.policy, model=model_from_args(args), fps=args.fps, frame_counts=args.frames,
                       video_sizes=args.video_sizes,
                       image_sizes=args.image_sizes, long_clips=args.long_clips,
                       max_clips_per_video=args.max_clips_per_video)


@dataclass(frozen=True)
class Resize:
    """Resize a ``src_h`` x ``src_w`` source to ``resized_h`` x ``resized_w`` (aspect kept, covering
    the bucket), then crop ``height`` x ``width`` at (``top``, ``left``)."""

    src_h: int
    src_w: int
    resized_h: int
    resized_w: int
    top: int
    left: int
    height: int
    width: int

    @property
    def scale(self) -> float:
        return self.resized_h / self.src_h


def choose_bucket(src_h: int, src_w: int, buckets: list[tuple[int, int]], policy: ShapePolicy) -> tuple[int, int]:
    """The bucket (height, width) a ``src_h`` x ``src_w`` source goes to (see the module docstring)."""
    if src_h < 1 or src_w < 1:
        raise ValueError(f"source size must be positive, got {src_h}x{src_w}")
    ar = math.log(src_h / src_w)
    need = [max(h / src_h, w / src_w) for h, w in buckets]
    dist = [abs(math.log(h / w) - ar) for h, w in buckets]
    reach = [i for i in range(len(buckets)) if need[i] <= policy.max_upscale * (1 + 1e-9)]
    if not reach:
        return buckets[min(range(len(buckets)), key=lambda i: (need[i], dist[i], i))]
    best = min(dist[i] for i in reach)
    same = [i for i in reach if dist[i] <= best + policy.aspect_tolerance + 1e-12]
    return buckets[max(same, key=lambda i: (buckets[i][0] * buckets[i][1], -dist[i], -i))]


def plan_resize(src_h: int, src_w: int, bucket: tuple[int, int]) -> Resize:
    """Scale so that the source covers ``bucket`` (aspect kept), then centre-crop to it."""
    h, w = bucket
    scale = max(h / src_h, w / src_w)
    rh, rw = max(h, round(src_h * scale)), max(w, round(src_w * scale))
    return Resize(src_h, src_w, rh, rw, (rh - h) // 2, (rw - w) // 2, h, w)


def clip_frame_counts(available: int, policy: ShapePolicy) -> list[int]:
    """Frame counts of the consecutive clips taken from ``available`` sampled frames (empty: too short)."""
    counts = policy.frame_counts
    fits = [f for f in counts if f <= available]
    if not fits:
        return []
    longest = counts[-1]
    if policy.long_clips == "truncate" or available < longest:
        return [fits[-1]]
    out = [longest] * (available // longest)
    rest = available - len(out) * longest
    tail = [f for f in counts if f <= rest]
    if tail:
        out.append(tail[-1])
    if policy.max_clips_per_video is not None:
        out = out[: policy.max_clips_per_video]
    return out


def sampled_frame_count(duration_s: float, fps: float) -> int:
    """Frames sampled at ``fps`` from a span of ``duration_s`` seconds: times 0, 1/fps, ... < duration."""
    if duration_s <= 0:
        return 0
    # a 1e-6 s guard so that 81 frames of a 16 fps file (5.0625 s) give 81, not 82 by rounding
    return int(math.floor(duration_s * fps - 1e-6)) + 1
