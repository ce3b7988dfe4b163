"""Datasets written before the Arrow index: ``DIR/index.json`` (version 1), read into the same table.

``index.json``::

    {"format": "ds_adaptive.latents", "version": 1, "latent_channels": 16, "text_dim": 4096,
     "vae": "Wan 2.1 VAE", "vae_stride": [4, 8, 8], "num_samples": 2,
     "samples": [
       {"id": "000000", "frames": 81, "height": 480, "width": 832, "latent_shape": [16, 21, 60, 104],
        "text_len": 97, "file": "shard-00000.safetensors",
        "latents_key": "000000.latents", "context_key": "000000.context"},
       ...]}

Every rank parses the whole file and checks every entry (what the Arrow index avoids: 43 MB for 200k
samples); ``ds-adaptive data convert DIR`` writes the ``index.arrow`` of such a dataset once.
``vae``/``vae_stride`` are absent in indexes written before they were recorded: the channels and every
entry's ``latent_shape`` are still checked against the model's rule.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional, Union

from ds_adaptive.core.jsonfile import read_json
from ds_adaptive.core.shapes import InputSpec, SampleShape, ShapeError, default_input_spec
from ds_adaptive.data.index import (ENTRY_KEYS, FORMAT, INDEX_FILE, LEGACY_INDEX_FILE, IndexBuilder, ShardIndex,
                                    check_model, header_for)
from ds_adaptive.data.synthetic import DataError

LEGACY_VERSION = 1


def write_legacy_index(out_dir: Union[str, Path], entries: Iterable[dict], *,
                       spec: Optional[InputSpec] = None) -> Path:
    """Write ``out_dir/index.json`` (version 1) atomically: what ds_adaptive wrote before ``index.arrow``
    (for readers of older versions, tests and the benchmark's comparison)."""
    out_dir, entries = Path(out_dir), list(entries)
    head = {**header_for(spec, len(entries)), "version": LEGACY_VERSION}
    tmp = out_dir / f"{LEGACY_INDEX_FILE}.tmp{os.getpid()}"
    # One sample per line: readable, diffable and still plain JSON.
    rows = ",\n  ".join(json.dumps(e) for e in entries)
    tmp.write_text(f'{json.dumps(head)[:-1]}, "samples": [\n  {rows}\n]}}\n')
    os.replace(tmp, out_dir / LEGACY_INDEX_FILE)
    return out_dir / LEGACY_INDEX_FILE


def _read(root: Path) -> dict:
    path = root / LEGACY_INDEX_FILE
    index = read_json(path, missing=f"{root / INDEX_FILE} does not exist (nor an older {LEGACY_INDEX_FILE}): {root} "
                                    "is not a ds_adaptive latent dataset (or its writer did not finish; the index "
                                    "is written last)",
                      missing_error=DataError, invalid_error=DataError, fix="; rewrite the dataset")
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(f"{path}: 'format' must be {FORMAT!r}, got "
                        f"{index.get('format') if isinstance(index, dict) else type(index).__name__!r}")
    if index.get("version") != LEGACY_VERSION:
        raise DataError(f"{path}: version {index.get('version')!r} is not supported (this ds_adaptive reads "
                        f"index.json version {LEGACY_VERSION})")
    if not isinstance(index.get("samples"), list) or not index["samples"]:
        raise DataError(f"{path}: 'samples' must be a non-empty list")
    if index.get("num_samples", len(index["samples"])) != len(index["samples"]):
        raise DataError(f"{path}: num_samples is {index['num_samples']} but 'samples' lists "
                        f"{len(index['samples'])} entries; the index is truncated or edited")
    return index


def _check_entry(i: int, e: object, spec: InputSpec, path: Path) -> dict:
    where = f"{path} sample {i}"
    if not isinstance(e, dict):
        raise DataError(f"{where}: expected an object, got {e!r}")
    where = f"{path} sample {i} (id {e.get('id')!r})"
    missing = [k for k in ENTRY_KEYS if k not in e]
    if missing:
        raise DataError(f"{where}: missing key(s) {missing}; every entry needs {list(ENTRY_KEYS)}")
    try:
        spec.grid.validate(e["frames"], e["height"], e["width"], where=where)
    except ShapeError as exc:
        raise DataError(str(exc)) from None
    n = spec.text_len
    if not isinstance(e["text_len"], int) or not 1 <= e["text_len"] <= n:
        raise DataError(f"{where}: text_len must be an int in 1..{n}, got {e['text_len']!r}")
    shape = SampleShape(e["frames"], e["height"], e["width"], spec.grid)
    if "latent_shape" in e and list(e["latent_shape"]) != list(shape.latent_shape):
        raise DataError(f"{where}: latent_shape {e['latent_shape']} for {shape}, the model expects "
                        f"{list(shape.latent_shape)} ({spec.describe()}); the latents were encoded for "
                        "another model: re-encode them (ds-adaptive preprocess --model ...)")
    return e


def read_legacy_index(root: Union[str, Path], spec: Optional[InputSpec] = None) -> ShardIndex:
    """``root/index.json`` checked entry by entry for the model ``spec`` (errors name the sample), as a
    :class:`ShardIndex` held in memory. Its header has the keys the file has."""
    root, spec = Path(root), spec or default_input_spec()
    index = _read(root)
    path = root / LEGACY_INDEX_FILE
    check_model(index, spec, path)
    builder = IndexBuilder()
    builder.add_entries(_check_entry(i, e, spec, path) for i, e in enumerate(index.pop("samples")))
    return ShardIndex(builder.table(index), index, path, spec)
