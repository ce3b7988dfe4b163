"""Datasets of VAE latents: the embedded synthetic default and precomputed on-disk shards.

Both expose ``__len__``, ``__getitem__(i) -> {"latents": [C,T',H',W'] float32,
"context": [L,text_dim] float32, "index": i}`` and ``sample_shapes()`` (no tensor is loaded; the
shapes carry the model's grid rule), which is what the batch sampler plans from. Both are built for
a model's :class:`ds_adaptive.core.shapes.InputSpec`. ``collate_latents`` stacks one micro-batch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from ds_adaptive.core.shapes import InputSpec

from ds_adaptive.data.collate import collate_latents
from ds_adaptive.data.shards import (EMPTY_PROMPT_FILE, INDEX_FILE, LatentShardDataset, LatentShardWriter,
                                     read_empty_prompt, write_empty_prompt, write_index)
from ds_adaptive.data.split import DatasetView, split_held_out
from ds_adaptive.data.synthetic import DEFAULT_TEXT_LEN, DataError, SyntheticLatentDataset

__all__ = ["DataError", "SyntheticLatentDataset", "LatentShardDataset", "LatentShardWriter", "collate_latents",
           "build_dataset", "DEFAULT_TEXT_LEN", "INDEX_FILE", "write_index", "EMPTY_PROMPT_FILE", "write_empty_prompt",
           "read_empty_prompt", "DatasetView", "split_held_out"]


def build_dataset(data: str, *, num_samples: int = 10000, shapes: Union[str, Path, None] = None,
                  seed: int = 0, spec: Optional[InputSpec] = None) -> Union[SyntheticLatentDataset, LatentShardDataset]:
    """``data == "synthetic"``: the embedded default (``num_samples``, ``shapes``, ``seed``);
    otherwise a directory written by ``ds-adaptive synth`` / ``preprocess``. ``spec``: the model's
    inputs (default: the default model's); an on-disk dataset whose latents do not fit it is an error."""
    if data == "synthetic":
        return SyntheticLatentDataset(num_samples, shapes, seed=seed, spec=spec)
    return LatentShardDataset(data, spec=spec)
