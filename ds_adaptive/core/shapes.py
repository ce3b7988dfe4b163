"""Video shape -> latent grid -> transformer tokens, by a model's :class:`GridRule`.

A model family's VAE compresses time by ``t`` (keeping the first frame: a causal VAE) and space by
``s``; its DiT patchifies the latent with a ``pt x ph x pw`` patch. A sample of ``frames`` x
``height`` x ``width`` pixels therefore becomes

    latent  [C, T', H', W'] with T' = (frames - 1) / t + 1, H' = height / s, W' = width / s
    tokens  S = T'/pt * (H' / ph) * (W' / pw)

The numbers are the family's (``ds_adaptive.models``: ``get_model(name).grid``); e.g. a VAE of
stride 4x8x8 and a 1x2x2 patch give 81x480x832 -> 21 x 60 x 104 latent -> 32760 tokens, a VAE of
stride 4x16x16 gives 81x480x832 -> 21 x 30 x 52 -> 8190. A :class:`SampleShape` carries its rule;
without one it takes the default model's (``ds_adaptive.models.registry.default_model``). With
Ulysses sequence parallelism of degree ``sp`` the sequence is padded to a multiple of ``sp``.
"""
from __future__ import annotations

import collections.abc
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from ds_adaptive.core.jsonfile import read_json


class ShapeError(ValueError):
    """A (frames, height, width) that a model's VAE + patchify cannot represent."""


def _triple(name: str, v) -> tuple[int, int, int]:
    t = tuple(v)
    if len(t) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in t):
        raise ValueError(f"GridRule.{name} must be 3 ints >= 1 (t, h, w), got {v!r}")
    return t


@dataclass(frozen=True, order=True)
class GridRule:
    """How a model turns pixels into latents and tokens: its VAE's stride and channels, its DiT's patch."""

    vae_stride: tuple[int, int, int]
    """(t, h, w) compression of the VAE; time keeps the first frame (T' = (frames - 1) / t + 1)."""
    patch_size: tuple[int, int, int]
    """(pt, ph, pw) patch of the DiT's patch embedding."""
    latent_channels: int
    """Channels of the VAE latent (= the DiT's input channels)."""
    vae: str = field(default="", compare=False)
    """Name of the VAE, for messages."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "vae_stride", _triple("vae_stride", self.vae_stride))
        object.__setattr__(self, "patch_size", _triple("patch_size", self.patch_size))
        if not isinstance(self.latent_channels, int) or self.latent_channels < 1:
            raise ValueError(f"GridRule.latent_channels must be an int >= 1, got {self.latent_channels!r}")

    @property
    def spatial_multiple(self) -> tuple[int, int]:
        """Pixels per token along height and width (VAE stride x patch)."""
        return (self.vae_stride[1] * self.patch_size[1], self.vae_stride[2] * self.patch_size[2])

    def describe(self) -> str:
        """``VAE 4x8x8 (16 channels), patch 1x2x2``."""
        name = f"{self.vae} " if self.vae else "VAE "
        return (f"{name}{'x'.join(map(str, self.vae_stride))} ({self.latent_channels} channels), "
                f"patch {'x'.join(map(str, self.patch_size))}")

    def validate(self, frames: int, height: int, width: int, *, where: str = "") -> None:
        """Raise ShapeError unless frames = t*n+1 >= 1 (t: the VAE's time stride) with a latent frame count
        divisible by the time patch, and both sides are positive multiples of the pixels per token."""
        ctx = f" ({where})" if where else ""
        for name, v in (("frames", frames), ("height", height), ("width", width)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ShapeError(f"{name} must be an int{ctx}, got {type(v).__name__} {v!r}")
            if v < 1:
                raise ShapeError(f"{name} must be >= 1{ctx}, got {v}")
        k, pt = self.vae_stride[0], self.patch_size[0]
        if (frames - 1) % k != 0:
            lo = (frames - 1) // k * k + 1
            raise ShapeError(
                f"frames must be {k}n+1 (1, {k + 1}, {2 * k + 1}, ...) for {self.describe()}{ctx}, got {frames}; "
                f"use {lo} or {lo + k}")
        if ((frames - 1) // k + 1) % pt != 0:
            raise ShapeError(f"frames {frames} give {(frames - 1) // k + 1} latent frames, not a multiple of the time "
                             f"patch {pt} ({self.describe()}){ctx}; use {k}n+1 frames with n+1 a multiple of {pt}")
        for name, v, m in (("height", height, self.spatial_multiple[0]), ("width", width, self.spatial_multiple[1])):
            if v % m != 0:
                lo = v // m * m
                raise ShapeError(
                    f"{name} must be a multiple of {m} ({self.describe()}){ctx}, "
                    f"got {v}; resize or crop to {lo or m} or {lo + m}")

    def latent_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(T', H', W') of the VAE latent."""
        self.validate(frames, height, width)
        t, h, w = self.vae_stride
        return ((frames - 1) // t + 1, height // h, width // w)

    def latent_to_token_grid(self, latent_thw: Sequence[int]) -> tuple[int, int, int]:
        """(T', H', W') of a latent -> token grid (F, Hp, Wp); each side divisible by the patch."""
        t, h, w = (int(v) for v in latent_thw)
        pt, ph, pw = self.patch_size
        if t % pt or h % ph or w % pw:
            raise ShapeError(f"latent grid {t}x{h}x{w} is not divisible by the patch {self.patch_size}")
        return (t // pt, h // ph, w // pw)

    def token_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        return self.latent_to_token_grid(self.latent_grid(frames, height, width))

    def tokens(self, frames: int, height: int, width: int) -> int:
        return math.prod(self.token_grid(frames, height, width))


@dataclass(frozen=True)
class InputSpec:
    """What a model's data looks like: latents by its :class:`GridRule`, text features of ``text_dim``
    channels and at most ``text_len`` tokens (zero-padded to it before the DiT)."""

    grid: GridRule
    """Pixels -> latent -> tokens."""
    text_dim: int
    """Width of the text-encoder features."""
    text_len: int
    """Text tokens per sample after zero padding (the longest caption the encoder keeps)."""
    model: str = field(default="", compare=False)
    """Name of the model, for messages."""

    def describe(self) -> str:
        who = f"model {self.model}: " if self.model else ""
        return f"{who}{self.grid.describe()}, text [<= {self.text_len}, {self.text_dim}]"


DEFAULT_GRID = GridRule(vae_stride=(4, 8, 8), patch_size=(1, 2, 2), latent_channels=16)
"""The grid rule of the default model (``ds_adaptive.models.registry.DEFAULT_MODEL``), for shapes that name no
model. Its family builds on these numbers and a test keeps the two equal; names stay with the models."""

DEFAULT_INPUT_SPEC = InputSpec(DEFAULT_GRID, text_dim=4096, text_len=512)
"""The default model's inputs: :data:`DEFAULT_GRID` latents and its text encoder's features (a test keeps it equal
to the registry's default model's)."""

DEFAULT_SHAPES = Path(__file__).resolve().parent.parent / "data" / "default_shapes.json"
"""The default model's shipped shape mix (a test keeps it the registry's default model's)."""


def default_grid() -> GridRule:
    """:data:`DEFAULT_GRID`."""
    return DEFAULT_GRID


def default_input_spec() -> InputSpec:
    """:data:`DEFAULT_INPUT_SPEC`."""
    return DEFAULT_INPUT_SPEC


@dataclass(frozen=True, order=True)
class SampleShape:
    """Pixel-space shape of one sample (``frames == 1`` is an image) under a model's :class:`GridRule`
    (default: the default model's), which gives its latent shape and tokens."""

    frames: int
    height: int
    width: int
    grid: Optional[GridRule] = field(default=None, repr=False)
    """The model's pixels -> latent -> tokens rule (None: the default model's)."""

    def __post_init__(self) -> None:
        if self.grid is None:
            object.__setattr__(self, "grid", default_grid())
        self.grid.validate(self.frames, self.height, self.width)

    @property
    def is_image(self) -> bool:
        return self.frames == 1

    @property
    def latent_grid(self) -> tuple[int, int, int]:
        """(T', H', W') of the VAE latent."""
        try:
            return self.__dict__["_latent_grid"]   # a pure function of the frozen fields: computed once
        except KeyError:
            grid = self.grid.latent_grid(self.frames, self.height, self.width)
            object.__setattr__(self, "_latent_grid", grid)
            return grid

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """[C, T', H', W'] of the VAE latent."""
        return (self.grid.latent_channels, *self.latent_grid)

    @property
    def token_grid(self) -> tuple[int, int, int]:
        """(F, Hp, Wp): the grid of transformer tokens after the patch."""
        try:
            return self.__dict__["_token_grid"]   # computed once, as latent_grid (the planner asks per batch)
        except KeyError:
            grid = self.grid.latent_to_token_grid(self.latent_grid)
            object.__setattr__(self, "_token_grid", grid)
            return grid

    @property
    def tokens(self) -> int:
        """Sequence length S (tokens) of the transformer input, unpadded."""
        f, h, w = self.token_grid
        return f * h * w

    def padded_tokens(self, sp: int) -> int:
        """S rounded up to a multiple of the Ulysses degree ``sp``."""
        return pad_to_multiple(self.tokens, sp)

    def with_grid(self, grid: GridRule) -> "SampleShape":
        """The same pixel shape under another model's rule (ShapeError when it cannot represent it)."""
        return SampleShape(self.frames, self.height, self.width, grid)

    def as_dict(self) -> dict:
        return {"frames": self.frames, "height": self.height, "width": self.width}

    def __str__(self) -> str:  # 81x480x832
        return f"{self.frames}x{self.height}x{self.width}"

    @staticmethod
    def parse_text(text: str, *, where: str = "") -> tuple[int, int, int]:
        """``"81x480x832"`` -> (frames, height, width), the syntax only (no model's rule); ShapeError naming
        ``where`` otherwise."""
        parts = str(text).lower().split("x")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            ctx = f" ({where})" if where else ""
            raise ShapeError(f"a shape is FRAMESxHEIGHTxWIDTH such as 81x480x832{ctx}, got {text!r}")
        f, h, w = (int(p) for p in parts)
        return f, h, w

    @classmethod
    def parse(cls, text: str, *, where: str = "", grid: Optional[GridRule] = None) -> "SampleShape":
        """``"81x480x832"`` (frames x height x width) -> SampleShape under ``grid`` (default: the default
        model's); ShapeError naming ``where`` otherwise."""
        f, h, w = cls.parse_text(text, where=where)
        validate_shape(f, h, w, where=where, grid=grid)
        return cls(f, h, w, grid)


def validate_shape(frames: int, height: int, width: int, *, where: str = "", grid: Optional[GridRule] = None) -> None:
    """Raise ShapeError unless ``grid`` (default: the default model's) can represent the shape."""
    (grid or default_grid()).validate(frames, height, width, where=where)


def latent_grid(frames: int, height: int, width: int, grid: Optional[GridRule] = None) -> tuple[int, int, int]:
    return (grid or default_grid()).latent_grid(frames, height, width)


def token_grid(frames: int, height: int, width: int, grid: Optional[GridRule] = None) -> tuple[int, int, int]:
    return (grid or default_grid()).token_grid(frames, height, width)


def latent_to_token_grid(latent_thw: Sequence[int], grid: Optional[GridRule] = None) -> tuple[int, int, int]:
    """(T', H', W') of a latent -> token grid; each side divisible by the patch."""
    return (grid or default_grid()).latent_to_token_grid(latent_thw)


def num_tokens(frames: int, height: int, width: int, grid: Optional[GridRule] = None) -> int:
    return (grid or default_grid()).tokens(frames, height, width)


def pad_to_multiple(n: int, k: int) -> int:
    if k < 1:
        raise ValueError(f"sequence-parallel degree must be >= 1, got {k}")
    return -(-n // k) * k


@dataclass(frozen=True)
class ShapeWeight:
    """One entry of a shape distribution: a shape and its relative frequency."""

    shape: SampleShape
    weight: float


def parse_shape_distribution(entries: Iterable[dict], *, source: str = "<dict>",
                             grid: Optional[GridRule] = None) -> list[ShapeWeight]:
    """Validate ``[{"frames", "height", "width", "weight"}, ...]`` under ``grid`` (default: the default
    model's); errors name the entry."""
    grid = grid or default_grid()
    out: list[ShapeWeight] = []
    allowed = {"frames", "height", "width", "weight"}
    entries = list(entries)
    if not entries:
        raise ShapeError(f"shape distribution {source} is empty; give at least one "
                         '{"frames", "height", "width", "weight"} entry')
    for i, e in enumerate(entries):
        where = f"{source} entry {i}"
        if not isinstance(e, dict):
            raise ShapeError(f"{where}: expected an object with frames/height/width/weight, got {e!r}")
        unknown = set(e) - allowed
        missing = {"frames", "height", "width"} - set(e)
        if unknown:
            raise ShapeError(f"{where}: unknown key(s) {sorted(unknown)}; valid keys are {sorted(allowed)}")
        if missing:
            raise ShapeError(f"{where}: missing key(s) {sorted(missing)}")
        w = e.get("weight", 1.0)
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not w > 0:
            raise ShapeError(f"{where}: weight must be a number > 0, got {w!r}")
        grid.validate(e["frames"], e["height"], e["width"], where=where)
        out.append(ShapeWeight(SampleShape(e["frames"], e["height"], e["width"], grid), float(w)))
    return out


def load_shape_distribution(path: str | Path | None = None, *, grid: Optional[GridRule] = None) -> list[ShapeWeight]:
    """Read a shape-distribution JSON file under ``grid``; without a path, the default model's shipped mix
    (``ds_adaptive.models``: each model names its default mix)."""
    if path is None:
        path = DEFAULT_SHAPES
    p = Path(path)
    data = read_json(p, missing=f"shape distribution file {p} does not exist; pass a JSON list of "
                                '{"frames", "height", "width", "weight"} objects', invalid_error=ShapeError)
    if isinstance(data, dict) and "shapes" in data:
        data = data["shapes"]
    return parse_shape_distribution(data, source=str(p), grid=grid)


class IndexedShapes(collections.abc.Sequence):
    """Every sample's shape as an index into a few distinct shapes: ``unique`` (sorted, as
    ``planning.shape_table.unique_shapes`` sorts them) and ``ids`` (one int per sample). A sequence of the
    samples' shapes like a list of them, at 4 bytes a sample instead of an object reference (and without the
    10M-element list a dataset's ``sample_shapes()`` builds): what a dataset's ``shape_ids()`` and
    ``unique_shapes()`` give, and what the planner takes as is."""

    def __init__(self, unique: Sequence, ids) -> None:
        self.unique = list(unique)
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"IndexedShapes: ids must be a 1-d int array, got {ids.dtype} of shape {ids.shape}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= len(self.unique)):
            raise ValueError(f"IndexedShapes: ids must lie in [0, {len(self.unique)}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        if any(a >= b for a, b in zip(self.unique, self.unique[1:])):
            raise ValueError("IndexedShapes: unique shapes must be sorted and distinct")
        self.ids = ids

    @classmethod
    def of_dataset(cls, dataset) -> "IndexedShapes | None":
        """The dataset's ``unique_shapes()`` / ``shape_ids()`` when it has both (only the shapes its samples
        have), else None."""
        try:
            unique, ids = dataset.unique_shapes(), dataset.shape_ids()
        except AttributeError:
            return None
        return cls(unique, ids).compact()

    def compact(self) -> "IndexedShapes":
        """The same samples without the distinct shapes that no sample has (a split view of a dataset)."""
        used = np.bincount(self.ids, minlength=len(self.unique)) > 0
        if used.all():
            return self
        new_id = np.cumsum(used) - 1
        return IndexedShapes([u for u, k in zip(self.unique, used) if k], new_id[self.ids].astype(self.ids.dtype))

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return IndexedShapes(self.unique, self.ids[i]).compact()
        return self.unique[int(self.ids[i])]

    def __iter__(self):
        u = self.unique
        for lo in range(0, len(self), 1 << 16):
            yield from (u[j] for j in self.ids[lo:lo + (1 << 16)].tolist())

    def __eq__(self, other) -> bool:
        if isinstance(other, IndexedShapes):
            return self.unique == other.unique and np.array_equal(self.ids, other.ids)
        if isinstance(other, collections.abc.Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None   # a mutable-looking sequence, like a list

    def __repr__(self) -> str:
        return f"IndexedShapes({len(self):,} samples of {len(self.unique)} shapes)"
