"""Datasets of Wan latents: the embedded synthetic default and precomputed on-disk shards.

Both expose ``__len__``, ``__getitem__(i) -> {"latents": [16,T',H',W'] float32,
"context": [L,4096] float32, "index": i}`` and ``sample_shapes()`` (no tensor is loaded),
which is what the batch sampler plans from. ``collate_latents`` stacks one micro-batch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

from .collate import collate_latents
from .shards import INDEX_FILE, LatentShardDataset, LatentShardWriter, write_index
from .synthetic import DEFAULT_TEXT_LEN, DataError, SyntheticLatentDataset

__all__ = ["DataError", "SyntheticLatentDataset", "LatentShardDataset", "LatentShardWriter", "collate_latents",
           "build_dataset", "DEFAULT_TEXT_LEN", "INDEX_FILE", "write_index"]


def build_dataset(data: str, *, num_samples: int = 10000, shapes: Union[str, Path, None] = None,
                  seed: int = 0) -> Union[SyntheticLatentDataset, LatentShardDataset]:
    """``data == "synthetic"``: the embedded default (``num_samples``, ``shapes``, ``seed``);
    otherwise a directory written by ``ds-adaptive synth`` / ``LatentShardWriter``."""
    if data == "synthetic":
        return SyntheticLatentDataset(num_samples, shapes, seed=seed)
    return LatentShardDataset(data)
