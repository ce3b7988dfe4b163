"""Video shape -> Wan latent grid -> transformer tokens.

Wan 2.1's VAE compresses time by 4 (keeping the first frame) and space by 8;
the DiT patchifies the latent with a 1x2x2 patch. A sample of ``frames`` x
``height`` x ``width`` pixels therefore becomes

    latent  [16, T', H', W'] with T' = (frames - 1) / 4 + 1, H' = height / 8, W' = width / 8
    tokens  S = T' * (H' / 2) * (W' / 2)

e.g. 81x480x832 -> 21 x 60 x 104 latent -> 32760 tokens; 81x720x1280 -> 75600;
an image 1x480x832 -> 1560. With Ulysses sequence parallelism of degree ``sp``
the sequence is padded to a multiple of ``sp``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

VAE_STRIDE = (4, 8, 8)
PATCH_SIZE = (1, 2, 2)
LATENT_CHANNELS = 16
TEXT_DIM = 4096
MAX_TEXT_LEN = 512

_SPATIAL_MULTIPLE = VAE_STRIDE[1] * PATCH_SIZE[1]  # 16 pixels


class ShapeError(ValueError):
    """A (frames, height, width) that Wan's VAE + patchify cannot represent."""


@dataclass(frozen=True, order=True)
class SampleShape:
    """Pixel-space shape of one sample. ``frames == 1`` is an image."""

    frames: int
    height: int
    width: int

    def __post_init__(self) -> None:
        validate_shape(self.frames, self.height, self.width)

    @property
    def is_image(self) -> bool:
        return self.frames == 1

    @property
    def latent_grid(self) -> tuple[int, int, int]:
        """(T', H', W') of the VAE latent."""
        return latent_grid(self.frames, self.height, self.width)

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """[C=16, T', H', W'] of the VAE latent."""
        return (LATENT_CHANNELS, *self.latent_grid)

    @property
    def token_grid(self) -> tuple[int, int, int]:
        """(F, Hp, Wp): the grid of transformer tokens after the 1x2x2 patch."""
        return token_grid(self.frames, self.height, self.width)

    @property
    def tokens(self) -> int:
        """Sequence length S (tokens) of the transformer input, unpadded."""
        f, h, w = self.token_grid
        return f * h * w

    def padded_tokens(self, sp: int) -> int:
        """S rounded up to a multiple of the Ulysses degree ``sp``."""
        return pad_to_multiple(self.tokens, sp)

    def as_dict(self) -> dict:
        return {"frames": self.frames, "height": self.height, "width": self.width}

    def __str__(self) -> str:  # 81x480x832
        return f"{self.frames}x{self.height}x{self.width}"

    @classmethod
    def parse(cls, text: str, *, where: str = "") -> "SampleShape":
        """``"81x480x832"`` (frames x height x width) -> SampleShape; ShapeError naming ``where`` otherwise."""
        parts = str(text).lower().split("x")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            ctx = f" ({where})" if where else ""
            raise ShapeError(f"a shape is FRAMESxHEIGHTxWIDTH such as 81x480x832{ctx}, got {text!r}")
        f, h, w = (int(p) for p in parts)
        validate_shape(f, h, w, where=where)
        return cls(f, h, w)


def validate_shape(frames: int, height: int, width: int, *, where: str = "") -> None:
    """Raise ShapeError unless frames = 4n+1 >= 1 and both sides are positive multiples of 16."""
    ctx = f" ({where})" if where else ""
    for name, v in (("frames", frames), ("height", height), ("width", width)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ShapeError(f"{name} must be an int{ctx}, got {type(v).__name__} {v!r}")
        if v < 1:
            raise ShapeError(f"{name} must be >= 1{ctx}, got {v}")
    if (frames - 1) % VAE_STRIDE[0] != 0:
        lo = (frames - 1) // 4 * 4 + 1
        raise ShapeError(
            f"frames must be 4n+1 (1, 5, 9, ..., 81) for Wan's causal VAE{ctx}, got {frames}; "
            f"use {lo} or {lo + 4}")
    for name, v in (("height", height), ("width", width)):
        if v % _SPATIAL_MULTIPLE != 0:
            lo = v // _SPATIAL_MULTIPLE * _SPATIAL_MULTIPLE
            raise ShapeError(
                f"{name} must be a multiple of {_SPATIAL_MULTIPLE} (VAE stride 8 x patch 2){ctx}, "
                f"got {v}; resize or crop to {lo or _SPATIAL_MULTIPLE} or {lo + _SPATIAL_MULTIPLE}")


def latent_grid(frames: int, height: int, width: int) -> tuple[int, int, int]:
    validate_shape(frames, height, width)
    return ((frames - 1) // VAE_STRIDE[0] + 1, height // VAE_STRIDE[1], width // VAE_STRIDE[2])


def token_grid(frames: int, height: int, width: int) -> tuple[int, int, int]:
    t, h, w = latent_grid(frames, height, width)
    return (t // PATCH_SIZE[0], h // PATCH_SIZE[1], w // PATCH_SIZE[2])


def latent_to_token_grid(latent_thw: Sequence[int]) -> tuple[int, int, int]:
    """(T', H', W') of a latent -> token grid; H', W' must be even."""
    t, h, w = (int(v) for v in latent_thw)
    if h % PATCH_SIZE[1] or w % PATCH_SIZE[2] or t % PATCH_SIZE[0]:
        raise ShapeError(f"latent grid {t}x{h}x{w} is not divisible by the patch {PATCH_SIZE}")
    return (t // PATCH_SIZE[0], h // PATCH_SIZE[1], w // PATCH_SIZE[2])


def num_tokens(frames: int, height: int, width: int) -> int:
    f, h, w = token_grid(frames, height, width)
    return f * h * w


def pad_to_multiple(n: int, k: int) -> int:
    if k < 1:
        raise ValueError(f"sequence-parallel degree must be >= 1, got {k}")
    return -(-n // k) * k


@dataclass(frozen=True)
class ShapeWeight:
    """One entry of a shape distribution: a shape and its relative frequency."""

    shape: SampleShape
    weight: float


def parse_shape_distribution(entries: Iterable[dict], *, source: str = "<dict>") -> list[ShapeWeight]:
    """Validate ``[{"frames", "height", "width", "weight"}, ...]``; errors name the entry."""
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
        validate_shape(e["frames"], e["height"], e["width"], where=where)
        out.append(ShapeWeight(SampleShape(e["frames"], e["height"], e["width"]), float(w)))
    return out


DEFAULT_SHAPES_FILE = Path(__file__).parent / "data" / "default_shapes.json"


def load_shape_distribution(path: str | Path | None = None) -> list[ShapeWeight]:
    """Read a shape-distribution JSON file (default: the shipped mixed Wan fine-tuning mix)."""
    from .jsonfile import read_json

    p = Path(path) if path is not None else DEFAULT_SHAPES_FILE
    data = read_json(p, missing=f"shape distribution file {p} does not exist; pass a JSON list of "
                                '{"frames", "height", "width", "weight"} objects', invalid_error=ShapeError)
    if isinstance(data, dict) and "shapes" in data:
        data = data["shapes"]
    return parse_shape_distribution(data, source=str(p))
