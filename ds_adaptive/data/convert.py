"""A dataset's ``index.json`` (version 1) -> its ``index.arrow`` (``ds-adaptive data convert DIR``).

The samples keep their order, ids, shards, keys, shapes, text lengths and extra keys (``source``,
``start_s``, ...); the shards are not touched. The JSON is read and checked as training would read it (for
a model); the Arrow file is written atomically, read back and compared column by column with the table
built from the JSON, and only then is ``index.json`` renamed to ``index.json.bak`` (or kept, for readers
of ds_adaptive versions before the Arrow index).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional, Union

from ds_adaptive.core.shapes import InputSpec, default_input_spec
from ds_adaptive.data.index import HEADER_KEY, INDEX_FILE, LEGACY_INDEX_FILE, ShardIndex, header_for, write_table
from ds_adaptive.data.legacy_json import read_legacy_index
from ds_adaptive.data.synthetic import DataError

BACKUP_SUFFIX = ".bak"
_MODEL_KEYS = ("latent_channels", "text_dim", "vae", "vae_stride")


def convert_dataset(root: Union[str, Path], *, spec: Optional[InputSpec] = None, keep_json: bool = False,
                    overwrite: bool = False) -> dict:
    """Write ``root/index.arrow`` from ``root/index.json`` (checked for the model ``spec``; default: the default
    model's). Returns what was done: samples, shards, shapes, bytes of both indexes, seconds, where the JSON went.
    ``overwrite``: rewrite an ``index.arrow`` that is already there (from a kept ``index.json``)."""
    root, spec = Path(root), spec or default_input_spec()
    legacy, target = root / LEGACY_INDEX_FILE, root / INDEX_FILE
    if target.is_file() and not overwrite:
        more = (f"; pass --overwrite to rewrite it from {legacy.name}" if legacy.is_file()
                else f" and there is no {legacy.name}: nothing to convert")
        raise DataError(f"{target} already exists{more}")
    t0 = time.perf_counter()
    old = read_legacy_index(root, spec)
    t_read = time.perf_counter() - t0
    header = header_for(spec, len(old))
    header.update({k: old.header[k] for k in _MODEL_KEYS if old.header.get(k) is not None})
    filled = [k for k in _MODEL_KEYS if old.header.get(k) is None]
    table = old.table.replace_schema_metadata({HEADER_KEY: json.dumps(header, sort_keys=True).encode()})
    write_table(target, table)
    new = ShardIndex.open(target, spec)
    if not new.table.equals(table):
        target.unlink()
        raise DataError(f"{target} read back differs from {legacy} (a pyarrow bug or a full disk?); it was removed, "
                        f"{legacy} is unchanged. Report this with the pyarrow version")
    moved = None
    if not keep_json:
        moved = legacy.with_name(legacy.name + BACKUP_SUFFIX)
        legacy.replace(moved)
    return {"root": str(root), "samples": len(new), "shards": len(new.shard_files),
            "shapes": len(new.unique_shapes()), "json_bytes": (moved or legacy).stat().st_size,
            "arrow_bytes": target.stat().st_size, "read_json_s": round(t_read, 3),
            "seconds": round(time.perf_counter() - t0, 3), "json_now": str(moved or legacy),
            "filled_from_model": filled}
