"""Datasets of VAE latents: the embedded synthetic default and precomputed on-disk shards.

Both expose ``__len__``, ``__getitem__(i) -> {"latents": [C,T',H',W'] float32,
"context": [L,text_dim] float32, "index": i}`` and, without loading a tensor, the shapes the batch
sampler plans from (they carry the model's grid rule):

* ``unique_shapes() -> list[SampleShape]``: the distinct shapes, sorted;
* ``shape_ids() -> np.ndarray[int32]``: per sample, its index into ``unique_shapes()`` (4 bytes a sample:
  what the trainer plans from, as ``ds_adaptive.core.shapes.IndexedShapes``; a dataset of your own with these two
  methods is planned the same way);
* ``sample_shapes() -> list[SampleShape]``: the same, one object per sample.

Both are built for a model's :class:`ds_adaptive.core.shapes.InputSpec`. On disk the index is
``index.arrow`` (:mod:`ds_adaptive.data.index`; an older ``index.json`` is read too). ``collate_latents``
stacks one micro-batch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from ds_adaptive.core.shapes import InputSpec

from ds_adaptive.data.collate import collate_latents
from ds_adaptive.data.index import INDEX_FILE, LEGACY_INDEX_FILE, IndexBuilder, ShardIndex, find_index, write_index
from ds_adaptive.data.legacy_json import read_legacy_index, write_legacy_index
from ds_adaptive.data.shards import (EMPTY_PROMPT_FILE, LatentShardDataset, LatentShardWriter, open_index,
                                     read_empty_prompt, write_empty_prompt)
from ds_adaptive.data.split import DatasetView, split_held_out
from ds_adaptive.data.synthetic import DEFAULT_TEXT_LEN, DataError, SyntheticLatentDataset

__all__ = ["DataError", "SyntheticLatentDataset", "LatentShardDataset", "LatentShardWriter", "collate_latents",
           "build_dataset", "DEFAULT_TEXT_LEN", "INDEX_FILE", "LEGACY_INDEX_FILE", "IndexBuilder", "ShardIndex",
           "find_index", "open_index", "read_legacy_index", "write_index", "write_legacy_index", "EMPTY_PROMPT_FILE",
           "write_empty_prompt", "read_empty_prompt", "DatasetView", "split_held_out"]


def build_dataset(data: str, *, num_samples: int = 10000, shapes: Union[str, Path, None] = None,
                  seed: int = 0, spec: Optional[InputSpec] = None) -> Union[SyntheticLatentDataset, LatentShardDataset]:
    """``data == "synthetic"``: the embedded default (``num_samples``, ``shapes``, ``seed``);
    otherwise a directory written by ``ds-adaptive synth`` / ``preprocess``. ``spec``: the model's
    inputs (default: the default model's); an on-disk dataset whose latents do not fit it is an error."""
    if data == "synthetic":
        return SyntheticLatentDataset(num_samples, shapes, seed=seed, spec=spec)
    return LatentShardDataset(data, spec=spec)
