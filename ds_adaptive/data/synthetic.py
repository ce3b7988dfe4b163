"""The embedded default dataset: synthetic latents on a mixed image + video shape mix.

Every sample is a VAE latent ``[C, T', H', W']`` by the model's grid rule (``InputSpec.grid``; e.g. C = 16,
T' = (frames-1)/4+1, H' = height/8, W' = width/8) with a text embedding ``[L, text_dim]`` (L <= the
model's text length, like the text encoder's output). The
latents carry learnable structure, so that a flow-matching loss really falls:

* a sample belongs to one of ``num_classes`` "prompts";
* its text embedding is the class's fixed 4096-d prototype plus per-token noise, so the
  class can be read from the context;
* its latent is a fixed smooth function of (class, normalised position, latent frame):
  a class-specific channel bias plus a few moving plane waves with class-specific
  frequencies, phases and velocities, mixed into the C channels, plus small iid noise.
  The function uses normalised coordinates, so one "prompt" looks alike at every
  resolution, and videos move (phase drift per latent frame).

The "world" (prototypes and latent functions) is fixed by ``world_seed``; the dataset
``seed`` picks each sample's shape, class, text length and noise. Sample ``i`` is a pure
function of (seed, i): any worker, rank or resume regenerates it bit for bit.
``sample_shapes()`` returns every sample's shape without generating a tensor (``unique_shapes()`` +
``shape_ids()``: the same as distinct shapes and an int32 per sample), so the sampler can plan an epoch of
millions of samples in milliseconds.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence, Union

import numpy as np
import torch

from ds_adaptive.core.shapes import InputSpec, SampleShape, ShapeWeight, default_input_spec, load_shape_distribution

DEFAULT_WORLD_SEED = 20250225  # fixes the learnable "world"
DEFAULT_TEXT_LEN = (16, 256)


class DataError(ValueError):
    """A dataset file, index entry or sample is missing, corrupt or inconsistent."""


ShapesArg = Union[None, str, Path, Sequence[ShapeWeight]]


def _resolve_shapes(shapes: ShapesArg, grid) -> list[ShapeWeight]:
    """The distribution under the model's grid rule (pixel shapes of a list are re-read under it)."""
    if shapes is None or isinstance(shapes, (str, Path)):
        return load_shape_distribution(shapes, grid=grid)
    out = list(shapes)
    if not out or not all(isinstance(s, ShapeWeight) for s in out):
        raise DataError("shapes must be a path to a shape-distribution json or a non-empty list of ShapeWeight")
    return [w if w.shape.grid == grid else ShapeWeight(w.shape.with_grid(grid), w.weight) for w in out]


class _World:
    """The fixed learnable structure: per-class text prototypes and latent functions."""

    def __init__(self, num_classes: int, world_seed: int, channels: int, text_dim: int, waves: int = 4,
                 noise_std: float = 0.1) -> None:
        rng = np.random.default_rng([world_seed, 0x7E47])
        self.num_classes = num_classes
        self.noise_std = noise_std
        self.text_proto = rng.standard_normal((num_classes, text_dim), dtype=np.float32)
        # Plane waves: integer spatial frequencies (cycles per frame side), phase, velocity
        # (radians per latent frame). Low frequencies keep the function smooth.
        self.freq_h = rng.integers(-2, 3, size=(num_classes, waves)).astype(np.float32)
        self.freq_w = rng.integers(-2, 3, size=(num_classes, waves)).astype(np.float32)
        self.phase = rng.uniform(0, 2 * math.pi, size=(num_classes, waves)).astype(np.float32)
        self.velocity = rng.uniform(-0.6, 0.6, size=(num_classes, waves)).astype(np.float32)
        # Per-element variance: bias 0.25 + waves sum(A^2)/2 ~ 0.74 + noise 0.01 ~ 1 (VAE latents are
        # normalised to about unit variance).
        self.bias = (0.5 * rng.standard_normal((num_classes, channels))).astype(np.float32)
        self.mix = (rng.standard_normal((num_classes, channels, waves))
                    * math.sqrt(2 * 0.74 / waves)).astype(np.float32)
        # the "empty prompt": one token, like a text encoder's EOS-only output, from its own stream
        self.empty = np.random.default_rng([world_seed, 0xE4]).standard_normal((1, text_dim), dtype=np.float32)

    def clean_latent(self, cls: int, latent_thw: tuple[int, int, int]) -> np.ndarray:
        """The noiseless latent [C, T', H', W'] of class ``cls`` (float32)."""
        t_n, h_n, w_n = latent_thw
        t = np.arange(t_n, dtype=np.float32)[:, None, None, None]
        h = (np.arange(h_n, dtype=np.float32) / h_n)[None, :, None, None]
        w = (np.arange(w_n, dtype=np.float32) / w_n)[None, None, :, None]
        angle = (2 * math.pi * (self.freq_h[cls] * h + self.freq_w[cls] * w)
                 + self.velocity[cls] * t + self.phase[cls])            # [T', H', W', waves]
        waves = np.cos(angle, dtype=np.float32)
        latent = np.einsum("thwk,ck->cthw", waves, self.mix[cls], optimize=True)
        latent += self.bias[cls][:, None, None, None]
        return latent


class SyntheticLatentDataset(torch.utils.data.Dataset):
    """Deterministic synthetic latents drawn from a mixed image + video shape distribution.

    Args:
        num_samples: dataset length.
        shapes: shape-distribution json path or ``ShapeWeight`` list (default: the default model's
            shipped mix, ``ds_adaptive/data/default_shapes.json``).
        seed: picks each sample's shape, class, text length and noise.
        text_len: inclusive (min, max) text length L of the context, max <= ``spec.text_len`` (default:
            ``DEFAULT_TEXT_LEN`` clipped to the model's text length).
        num_classes: number of distinct "prompts" (latent functions).
        world_seed: fixes the prototypes and latent functions (keep the default to share
            the learnable structure across datasets).
        spec: the model's inputs (grid rule, text width and length; default: the default model's).

    ``__getitem__(i)`` -> ``{"latents": [C, T', H', W'] float32, "context": [L, text_dim] float32,
    "index": i}``.
    """

    def __init__(self, num_samples: int, shapes: ShapesArg = None, *, seed: int = 0,
                 text_len: tuple[int, int] | None = None, num_classes: int = 16,
                 world_seed: int = DEFAULT_WORLD_SEED, spec: InputSpec | None = None) -> None:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise DataError(f"num_samples must be a positive int, got {num_samples!r}")
        self.spec = spec or default_input_spec()
        if text_len is None:
            text_len = tuple(min(v, self.spec.text_len) for v in DEFAULT_TEXT_LEN)
        lo, hi = (int(v) for v in text_len)
        if not 1 <= lo <= hi <= self.spec.text_len:
            raise DataError(f"text_len must satisfy 1 <= min <= max <= {self.spec.text_len} (the model's text "
                            f"length), got {text_len!r}")
        if num_classes < 1:
            raise DataError(f"num_classes must be >= 1, got {num_classes}")
        self.num_samples = num_samples
        self.seed = int(seed)
        self.text_len = (lo, hi)
        self.distribution = _resolve_shapes(shapes, self.spec.grid)
        self.world = _World(num_classes, world_seed, self.spec.grid.latent_channels, self.spec.text_dim)
        weights = np.array([s.weight for s in self.distribution], dtype=np.float64)
        draw = np.random.default_rng([self.seed, 0x5A4E]).choice(
            len(self.distribution), size=num_samples, p=weights / weights.sum())
        self._shape_ids = draw.astype(np.int32)
        # the planner's view: distinct shapes sorted, per sample an int32 index into them
        self._unique = sorted({s.shape for s in self.distribution})
        pos = {s: k for k, s in enumerate(self._unique)}
        remap = np.array([pos[s.shape] for s in self.distribution], np.int32)
        self._unique_ids = remap[self._shape_ids]
        self._unique_ids.setflags(write=False)

    def __len__(self) -> int:
        return self.num_samples

    def sample_shapes(self) -> list[SampleShape]:
        """Every sample's pixel shape, without generating tensors."""
        table = [s.shape for s in self.distribution]
        return [table[k] for k in self._shape_ids]

    def unique_shapes(self) -> list[SampleShape]:
        """The distinct shapes of the distribution, sorted (as ``planning.planner.unique_shapes`` sorts)."""
        return list(self._unique)

    def shape_ids(self) -> np.ndarray:
        """[num_samples] int32 (read-only): every sample's index into :meth:`unique_shapes`."""
        return self._unique_ids

    def shape_of(self, index: int) -> SampleShape:
        return self.distribution[self._shape_ids[self._check_index(index)]].shape

    def _check_index(self, index: int) -> int:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range for a synthetic dataset of {self.num_samples}")
        return int(index)

    def _draws(self, index: int) -> tuple[np.random.Generator, int, int]:
        rng = np.random.default_rng([self.seed, index])
        cls = int(rng.integers(self.world.num_classes))
        length = int(rng.integers(self.text_len[0], self.text_len[1] + 1))
        return rng, cls, length

    def class_of(self, index: int) -> int:
        """The class ("prompt") of sample ``index``: what the latent is a function of."""
        return self._draws(self._check_index(index))[1]

    def __getitem__(self, index: int) -> dict:
        index = self._check_index(index)
        rng, cls, length = self._draws(index)
        shape = self.shape_of(index)
        latent = self.world.clean_latent(cls, shape.latent_grid)
        latent += self.world.noise_std * rng.standard_normal(latent.shape, dtype=np.float32)
        context = self.world.text_proto[cls] + 0.5 * rng.standard_normal((length, self.spec.text_dim),
                                                                         dtype=np.float32)
        return {"latents": torch.from_numpy(latent), "context": torch.from_numpy(context), "index": index}

    def empty_context(self) -> torch.Tensor:
        """The synthetic world's embedding of the empty prompt, ``[1, text_dim]`` fp32 (fixed by its world seed)."""
        return torch.from_numpy(self.world.empty.copy())

    def describe(self) -> str:
        n_img = sum(1 for k in self._shape_ids if self.distribution[k].shape.is_image)
        return (f"synthetic latents: {self.num_samples} samples ({n_img} images, "
                f"{self.num_samples - n_img} videos), {len(self.distribution)} shapes, seed {self.seed}")

