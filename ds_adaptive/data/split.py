"""A held-out split of a dataset: the training view and the validation view of one set of samples.

    train, held_out = split_held_out(dataset, count=64, seed=0)
    sampler = build_batch_sampler(cfg, train.sample_shapes(), ...)   # plans the training view only

Both views are datasets like the one they split (``__len__``, ``__getitem__``, ``sample_shapes()``,
``describe()``, ``spec``, ``empty_context()``) with their own indices ``0..len-1``: a batch sampler built on the
training view cannot name a held-out sample, so the split is never planned into a training batch. A sample's
``index`` is its index in the view (what the objective seeds its noise with); ``source_index(i)`` is its index in
the dataset that was split. The split is a pure function of (number of samples, count, seed): the same on every
rank, after a resume and on another world size.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ds_adaptive.data.synthetic import DataError

__all__ = ["DatasetView", "split_held_out", "held_out_indices"]

SPLIT_STREAM = 0x5E1D
"""Tag of the split's stream in its seed sequence."""


def held_out_indices(num_samples: int, count: int, seed: int) -> np.ndarray:
    """The ``count`` held-out sample indices (sorted int64) of a dataset of ``num_samples``, drawn by ``seed``."""
    n, k = int(num_samples), int(count)
    if not 1 <= k < n:
        raise DataError(f"a held-out split needs 1 <= count < the dataset's {n} samples, got count {k}")
    rng = np.random.default_rng([int(seed), SPLIT_STREAM])
    return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)


class DatasetView(torch.utils.data.Dataset):
    """The samples ``indices`` of ``base``, renumbered ``0..len(indices)-1`` (see the module doc)."""

    def __init__(self, base, indices: Sequence[int], *, role: str) -> None:
        self.base = base
        self.indices = np.asarray(indices, dtype=np.int64)
        self.role = role
        if self.indices.size == 0:
            raise DataError(f"the {role} split of {base.describe()} is empty")

    @property
    def spec(self):
        """The model inputs of the split dataset (``InputSpec``)."""
        return self.base.spec

    def __len__(self) -> int:
        return int(self.indices.size)

    def source_index(self, i: int) -> int:
        """The index in the split dataset of this view's sample ``i``."""
        return int(self.indices[i])

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"sample index {i} out of range for the {self.role} split ({len(self)} samples)")
        sample = dict(self.base[int(self.indices[i])])
        sample["index"] = int(i)
        return sample

    def sample_shapes(self) -> list:
        """The view's sample shapes, in its order (no tensor is loaded)."""
        if self._indexed():
            u = self.base.unique_shapes()
            return [u[j] for j in self.shape_ids().tolist()]
        shapes = self.base.sample_shapes()
        return [shapes[j] for j in self.indices.tolist()]

    def _indexed(self) -> bool:
        return callable(getattr(self.base, "shape_ids", None)) and callable(getattr(self.base, "unique_shapes", None))

    def unique_shapes(self) -> list:
        """The base dataset's distinct shapes, sorted (a shape may be absent from this view); with
        :meth:`shape_ids`, what the planner takes. Only where the base dataset has them."""
        if not self._indexed():
            raise AttributeError(f"{self.base.describe()} has no unique_shapes(); use sample_shapes()")
        return self.base.unique_shapes()

    def shape_ids(self) -> np.ndarray:
        """[len(view)] ints: each of the view's samples' index into :meth:`unique_shapes`."""
        if not self._indexed():
            raise AttributeError(f"{self.base.describe()} has no shape_ids(); use sample_shapes()")
        return np.asarray(self.base.shape_ids())[self.indices]

    def empty_context(self) -> Optional[torch.Tensor]:
        """The empty prompt's embedding stored with the dataset (``[L, text_dim]`` fp32), or None."""
        return self.base.empty_context()

    def describe(self) -> str:
        return f"{self.base.describe()}; {self.role} split: {len(self)} samples"


def split_held_out(dataset, *, count: int, seed: int) -> tuple[DatasetView, DatasetView]:
    """``(training view, held-out view)`` of ``dataset``: ``count`` samples drawn by ``seed`` are held out."""
    held = held_out_indices(len(dataset), count, seed)
    keep = np.ones(len(dataset), dtype=bool)
    keep[held] = False
    return (DatasetView(dataset, np.flatnonzero(keep), role="training"),
            DatasetView(dataset, held, role=f"held-out (validation, seed {seed})"))
