"""The dataset index ``DIR/index.arrow``: one row per sample, an Arrow IPC file that every rank memory-maps.

Columns (one record batch per ``BATCH_ROWS`` samples, uncompressed so that a reader maps it without a copy)::

    id          string                        the sample id; its tensors are "<id>.latents" / "<id>.context"
    file        dictionary<int32, string>     the shard file (relative to DIR); the index is the shard id
    shape       dictionary<int32, string>     pixel shape "FxHxW" (frames x height x width); the index is
                                              the shape id, the dictionary the unique shapes, sorted
    text_len    int32                         tokens of the text embedding (its rows L)
    latents_key string, nullable, optional    only when some key is not "<id>.latents" (null: the default)
    context_key string, nullable, optional    only when some key is not "<id>.context"
    <meta>      any, nullable, optional       extra keys of the writer's entries (``preprocess``: source,
                                              start_s); field metadata encoding=json: JSON text of a value

The schema's metadata ``ds_adaptive`` holds the header (JSON): format, version, latent_channels, text_dim,
vae, vae_stride, num_samples. Opening reads the footer, the header and the two dictionaries; planning
reads the 4-byte shape ids of every sample (``shape_ids()``); a sample's id, keys and metadata are read
when it is loaded, from the pages of its own row. An ``index.json`` (version 1) is read into the same
table by :mod:`ds_adaptive.data.legacy_json`.
"""
from __future__ import annotations

import bisect
import importlib.util
import json
import os
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np

from ds_adaptive.core.shapes import InputSpec, SampleShape, ShapeError, default_input_spec
from ds_adaptive.data.synthetic import DataError


class _Pyarrow:
    """pyarrow, imported at its first use rather than with this module: its import starts a thread (the jemalloc
    pool's), and every trainer process imports this module. A process that forks after its imports must have no
    thread (the test suite's rank fork server, tests/_rank_zygote.py, refused to start and every test rank paid
    its imports again)."""

    def __getattr__(self, name: str):
        import pyarrow

        return getattr(pyarrow, name)


pa = _Pyarrow()

FORMAT = "ds_adaptive.latents"
VERSION = 2
INDEX_FILE = "index.arrow"
LEGACY_INDEX_FILE = "index.json"
HEADER_KEY = b"ds_adaptive"
BATCH_ROWS = 1 << 20
"""Samples per record batch (a batch's string data must stay under 2 GiB)."""
CORE_COLUMNS = ("id", "file", "shape", "text_len")
KEY_COLUMNS = ("latents_key", "context_key")
ENTRY_KEYS = ("id", "frames", "height", "width", "text_len", "file", "latents_key", "context_key")
_DERIVED = ("frames", "height", "width", "latent_shape")
_JSON = {b"encoding": b"json"}


def require_pyarrow(what: str) -> None:
    """A :class:`DataError` saying how to install pyarrow when it is missing (``what``: the file it would read)."""
    if importlib.util.find_spec("pyarrow") is None:  # a dependency; without it only the Arrow index is unreadable
        raise DataError(f"{what}: reading or writing a dataset index needs pyarrow, which is not installed here; "
                        "run `pip install pyarrow` (a dependency of ds_adaptive)")


def find_index(root: Union[str, Path]) -> Optional[Path]:
    """``root/index.arrow``, else ``root/index.json`` (a dataset written before version 2), else None."""
    for name in (INDEX_FILE, LEGACY_INDEX_FILE):
        if (Path(root) / name).is_file():
            return Path(root) / name
    return None


def header_for(spec: Optional[InputSpec], num_samples: int) -> dict:
    """The index header of latents for ``spec`` (default: the default model's)."""
    spec = spec or default_input_spec()
    return {"format": FORMAT, "version": VERSION, "latent_channels": spec.grid.latent_channels,
            "text_dim": spec.text_dim, "vae": spec.grid.vae, "vae_stride": list(spec.grid.vae_stride),
            "num_samples": int(num_samples)}


def check_model(header: dict, spec: InputSpec, path: Path) -> None:
    """The header's latent channels / VAE stride / text width against the model's (absent keys pass)."""
    grid = spec.grid
    found = {k: header.get(k) for k in ("latent_channels", "vae_stride", "text_dim")}
    want = {"latent_channels": grid.latent_channels, "vae_stride": list(grid.vae_stride), "text_dim": spec.text_dim}
    bad = [f"{k} {found[k]} (expected {want[k]})" for k in want if found[k] is not None and found[k] != want[k]]
    if bad:
        vae = f" ({header['vae']})" if header.get("vae") else ""
        raise DataError(f"{path}: the latents were written for another model{vae}: {', '.join(bad)}; "
                        f"{spec.describe()}. Train a model of that VAE (--model) or re-encode the media for this "
                        "one (ds-adaptive preprocess --model ...)")


def _is_plain(t: pa.DataType) -> bool:
    return not (pa.types.is_nested(t) or pa.types.is_dictionary(t))


def _meta_array(values: list) -> tuple[pa.Array, bool]:
    """(array, json-encoded?) of one chunk of an extra key's values (None: absent)."""
    try:
        arr = pa.array(values)
        if _is_plain(arr.type):
            return arr, False
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        pass
    return pa.array([None if v is None else json.dumps(v) for v in values], pa.string()), True


def _unify(chunks: list[tuple[pa.Array, bool]]) -> tuple[pa.ChunkedArray, bool]:
    """One column of an extra key from its chunks: one type, or JSON text of every value."""
    types = {a.type for a, js in chunks if not js and a.type != pa.null()}
    if not any(js for _, js in chunks) and len(types) <= 1:
        t = types.pop() if types else pa.null()
        return pa.chunked_array([a.cast(t) for a, _ in chunks], t), False
    text = [pa.array([v if js or v is None else json.dumps(v) for v in a.to_pylist()], pa.string())
            for a, js in chunks]
    return pa.chunked_array(text, pa.string()), True


def _rebatch(table: pa.Table) -> pa.Table:
    """``table`` in record batches of about ``BATCH_ROWS`` rows (one per work unit would be 10^5 batches)."""
    out, group, rows = [], [], 0
    for b in table.to_batches():
        if group and rows + b.num_rows > BATCH_ROWS:
            out += pa.Table.from_batches(group).combine_chunks().to_batches(max_chunksize=BATCH_ROWS)
            group, rows = [], 0
        group.append(b)
        rows += b.num_rows
    out += pa.Table.from_batches(group).combine_chunks().to_batches(max_chunksize=BATCH_ROWS)
    return pa.Table.from_batches(out, schema=table.schema)


class IndexBuilder:
    """Entries (the dicts of :attr:`LatentShardWriter.entries`) -> the table of ``index.arrow``.

    ``add_entries`` may be called once per work unit: each call becomes compact columns at once, so
    building the index of 10M samples holds ~30 bytes per sample, not the entries' dicts.
    """

    def __init__(self) -> None:
        require_pyarrow("a dataset index")
        self._files: dict[str, int] = {}
        self._shapes: dict[tuple[int, int, int], int] = {}
        self._chunks: list[dict] = []
        self._meta_names: list[str] = []
        self.num_rows = 0

    def add_entries(self, entries: Iterable[dict]) -> None:
        ids, files, shapes, text, lat, ctx, meta = [], [], [], [], [], [], {}
        for n, e in enumerate(entries):
            try:
                sid = str(e["id"])
                ids.append(sid)
                files.append(self._files.setdefault(e["file"], len(self._files)))
                shape = (int(e["frames"]), int(e["height"]), int(e["width"]))
                shapes.append(self._shapes.setdefault(shape, len(self._shapes)))
                text.append(int(e["text_len"]))
                lat.append(None if e["latents_key"] == f"{sid}.latents" else e["latents_key"])
                ctx.append(None if e["context_key"] == f"{sid}.context" else e["context_key"])
            except (KeyError, TypeError, ValueError) as exc:
                raise DataError(f"index entry {self.num_rows + n} ({e.get('id')!r}): {exc!r}; every entry needs "
                                f"{list(ENTRY_KEYS)} (ints for the shape and text_len)") from None
            for k, v in e.items():
                if k not in ENTRY_KEYS and k not in _DERIVED:
                    if k in CORE_COLUMNS or k == "shape":
                        raise DataError(f"index entry {self.num_rows + n} ({sid!r}): extra key {k!r} is a column "
                                        "of the index; rename it")
                    if k not in meta:
                        meta[k] = [None] * n   # absent in the entries before
                    meta[k].append(v)
            for vals in meta.values():
                if len(vals) == n:        # absent in this entry
                    vals.append(None)
        if not ids:
            return
        self._chunks.append({
            "id": pa.array(ids, pa.string()), "file": np.asarray(files, np.int32),
            "shape": np.asarray(shapes, np.int32), "text_len": np.asarray(text, np.int32),
            "latents_key": pa.array(lat, pa.string()), "context_key": pa.array(ctx, pa.string()),
            "rows": len(ids), "meta": {k: _meta_array(v) for k, v in meta.items()}})
        self._meta_names += [k for k in meta if k not in self._meta_names]
        self.num_rows += len(ids)

    def table(self, header: dict) -> pa.Table:
        """The index table; ``header`` goes into the schema's metadata (num_samples is set here)."""
        if not self.num_rows:
            raise DataError("an index needs at least one sample; nothing was added")
        order = sorted(self._shapes)     # (frames, height, width): the order of SampleShape
        remap = np.empty(len(order), np.int32)
        for new, s in enumerate(order):
            remap[self._shapes[s]] = new
        cols = {"id": pa.chunked_array([c["id"] for c in self._chunks], pa.string())}
        files = pa.array(list(self._files), pa.string())
        cols["file"] = pa.DictionaryArray.from_arrays(np.concatenate([c["file"] for c in self._chunks]), files)
        names = pa.array(["x".join(map(str, s)) for s in order], pa.string())
        sid = remap[np.concatenate([c["shape"] for c in self._chunks])]
        cols["shape"] = pa.DictionaryArray.from_arrays(sid, names)
        cols["text_len"] = pa.array(np.concatenate([c["text_len"] for c in self._chunks]))
        fields = [pa.field("id", pa.string(), nullable=False), pa.field("file", cols["file"].type, nullable=False),
                  pa.field("shape", cols["shape"].type, nullable=False),
                  pa.field("text_len", pa.int32(), nullable=False)]
        for k in KEY_COLUMNS:
            arr = pa.chunked_array([c[k] for c in self._chunks], pa.string())
            if arr.null_count < len(arr):
                cols[k] = arr
                fields.append(pa.field(k, pa.string()))
        for k in self._meta_names:
            parts = [c["meta"].get(k, (pa.nulls(c["rows"]), False)) for c in self._chunks]
            cols[k], js = _unify(parts)
            fields.append(pa.field(k, cols[k].type, metadata=_JSON if js else None))
        header = {**header, "num_samples": self.num_rows}
        schema = pa.schema(fields, metadata={HEADER_KEY: json.dumps(header, sort_keys=True).encode()})
        return _rebatch(pa.table([cols[f.name] for f in fields], schema=schema))

    def write(self, out_dir: Union[str, Path], *, spec: Optional[InputSpec] = None,
              header: Optional[dict] = None) -> Path:
        """Write ``out_dir/index.arrow`` atomically (temporary file, then rename). ``header``: its keys
        (default: those of ``spec``, the model the latents are for)."""
        path = Path(out_dir) / INDEX_FILE
        write_table(path, self.table(header or header_for(spec, self.num_rows)))
        return path


def write_table(path: Path, table: pa.Table) -> None:
    """``table`` as an uncompressed Arrow IPC file at ``path``, atomically; the file mode follows the umask."""
    require_pyarrow(str(path))
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=BATCH_ROWS)
    os.replace(tmp, path)


def write_index(out_dir: Union[str, Path], entries: Iterable[dict], *, spec: Optional[InputSpec] = None) -> Path:
    """Write ``out_dir/index.arrow`` for ``entries`` of latents for ``spec`` (default: the default model's)."""
    builder = IndexBuilder()
    builder.add_entries(entries)
    return builder.write(out_dir, spec=spec)


def _read_arrow(path: Path) -> tuple[pa.Table, dict]:
    """The table of ``path`` memory-mapped (no copy) and its header; errors name the file."""
    try:
        table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path} is not a readable Arrow IPC file ({exc}); the index is corrupt or was cut short: "
                        "rewrite the dataset (or rerun `ds-adaptive data convert` on its index.json)") from None
    raw = (table.schema.metadata or {}).get(HEADER_KEY)
    try:
        header = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DataError(f"{path}: the schema metadata 'ds_adaptive' must be a JSON header with format {FORMAT!r}; "
                        f"got {raw[:200] if raw else None!r}. This Arrow file is not a ds_adaptive index")
    if header.get("version") != VERSION:
        raise DataError(f"{path}: version {header.get('version')!r} is not supported (this ds_adaptive reads "
                        f"version {VERSION} indexes and version 1 index.json)")
    if header.get("num_samples") != table.num_rows or not table.num_rows:
        raise DataError(f"{path}: the header says num_samples {header.get('num_samples')!r}, the table has "
                        f"{table.num_rows} rows (an index needs >= 1); the index is truncated or edited")
    return table, header


def _schema() -> dict:
    """The core columns' types (built at the first check: pyarrow is imported at its first use)."""
    strings = pa.dictionary(pa.int32(), pa.string())
    return {"id": pa.string(), "file": strings, "shape": strings, "text_len": pa.int32()}


def _check_schema(schema: pa.Schema, path: Path) -> None:
    for name, want in _schema().items():
        got = schema.field(name).type if name in schema.names else None
        if got is None or not got.equals(want):   # equals: a dictionary's ordered flag aside
            raise DataError(f"{path}: column {name!r} must be {want}, got {got or 'no such column'}; the file was "
                            "not written by ds_adaptive's IndexBuilder: rewrite it")


class ShardIndex:
    """The sample table of a dataset, read for a model (``spec``): ``index.arrow`` memory-mapped, or an
    ``index.json`` read into the same table (:func:`ds_adaptive.data.legacy_json.read_legacy_index`).

    Open checks the header against the model, every unique shape against its grid rule and every
    sample's text length and shard / shape id (vectorised over the int32 columns); a row's strings are
    read when it is asked for.
    """

    def __init__(self, table: pa.Table, header: dict, path: Path, spec: Optional[InputSpec] = None) -> None:
        self.path, self.header, self.spec = Path(path), dict(header), spec or default_input_spec()
        _check_schema(table.schema, self.path)
        check_model(self.header, self.spec, self.path)
        self.table = table
        batches = table.to_batches()
        self._starts = [0]
        for b in batches:
            self._starts.append(self._starts[-1] + b.num_rows)
        self._cols = {name: [b.column(name) for b in batches] for name in table.schema.names}
        self._ints = {name: [a.indices.to_numpy(zero_copy_only=False) if pa.types.is_dictionary(a.type)
                             else a.to_numpy(zero_copy_only=False) for a in self._cols[name]]
                      for name in ("file", "shape", "text_len")}
        self.shard_files: list[str] = self._dictionary("file")
        self._json = {f.name for f in table.schema if (f.metadata or {}).get(b"encoding") == b"json"}
        self._meta = [n for n in table.schema.names if n not in CORE_COLUMNS and n not in KEY_COLUMNS]
        self._shapes = self._parse_shapes(self._dictionary("shape"))
        self._shape_ids: Optional[np.ndarray] = None
        self._runs: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None
        self._check_ints()

    @classmethod
    def open(cls, path: Union[str, Path], spec: Optional[InputSpec] = None) -> "ShardIndex":
        """``index.arrow`` at ``path``, memory-mapped."""
        require_pyarrow(str(path))
        table, header = _read_arrow(Path(path))
        return cls(table, header, Path(path), spec)

    def __len__(self) -> int:
        return self.table.num_rows

    def _dictionary(self, name: str) -> list[str]:
        chunks = self._cols[name]
        return chunks[-1].dictionary.to_pylist() if chunks else []   # the last batch's: deltas only grow it

    def _parse_shapes(self, names: list[str]) -> list[SampleShape]:
        out = []
        for k, text in enumerate(names):
            try:
                out.append(SampleShape(*SampleShape.parse_text(text, where=f"{self.path} shape {k}"), self.spec.grid))
            except ShapeError as exc:
                first = self._first_row(self._ints["shape"], lambda a: a == k)
                count = sum(int(np.count_nonzero(a == k)) for a in self._ints["shape"])
                raise DataError(f"{exc} ({self.path}: shape {text!r} of {count} sample(s), the first sample {first} "
                                f"(id {self.sample_id(first)!r}); re-encode them for this model or drop them from "
                                "the index)") from None
        if out != sorted(out) or len(set(out)) != len(out):
            raise DataError(f"{self.path}: the shape dictionary must hold distinct shapes sorted by (frames, height, "
                            f"width), got {names[:20]}; rewrite the index")
        return out

    def _first_row(self, chunks: list[np.ndarray], bad) -> int:
        """The first row where ``bad(column)`` holds, or -1."""
        for start, a in zip(self._starts, chunks):
            hit = np.flatnonzero(bad(a))
            if hit.size:
                return start + int(hit[0])
        return -1

    def _check_ints(self) -> None:
        for name, n in (("file", len(self.shard_files)), ("shape", len(self._shapes))):
            if any(a.null_count for a in self._cols[name]):
                raise DataError(f"{self.path}: column {name!r} holds nulls; every sample needs a {name}")
            i = self._first_row(self._ints[name], lambda a: (a < 0) | (a >= n))
            if i >= 0:
                raise DataError(f"{self.path} sample {i} (id {self.sample_id(i)!r}): {name} id "
                                f"{self._int(name, i)} is not in 0..{n - 1}; the index is corrupt: rewrite it")
        top = self.spec.text_len
        i = self._first_row(self._ints["text_len"], lambda a: (a < 1) | (a > top))
        if i >= 0:
            raise DataError(f"{self.path} sample {i} (id {self.sample_id(i)!r}): text_len must be an int in 1..{top}, "
                            f"got {self._int('text_len', i)}")

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {self.path} ({len(self)} samples)")
        b = bisect.bisect_right(self._starts, i) - 1
        return b, i - self._starts[b]

    def _int(self, name: str, i: int) -> int:
        b, j = self._locate(i)
        return int(self._ints[name][b][j])

    def sample_id(self, i: int) -> Optional[str]:
        """The id of sample ``i`` (None for ``i == -1``, for messages)."""
        if i < 0:
            return None
        b, j = self._locate(i)
        return self._cols["id"][b][j].as_py()

    # ------------------------------------------------------------------ what the planner reads
    def unique_shapes(self) -> list[SampleShape]:
        """The distinct pixel shapes, sorted (the order of ``ds_adaptive.planning.planner.unique_shapes``)."""
        return list(self._shapes)

    def shape_ids(self) -> np.ndarray:
        """[num_samples] int32, read-only: every sample's index into :meth:`unique_shapes`."""
        if self._shape_ids is None:
            chunks = self._ints["shape"]
            ids = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
            ids = ids if ids.dtype == np.int32 else ids.astype(np.int32)
            ids.setflags(write=False)
            self._shape_ids = ids
        return self._shape_ids

    def text_lens(self) -> np.ndarray:
        """[num_samples] int32: every sample's text length (tokens)."""
        return np.concatenate(self._ints["text_len"]).astype(np.int32, copy=False)

    def shard_ids(self) -> np.ndarray:
        """[num_samples] int32: every sample's index into :attr:`shard_files`."""
        return np.concatenate(self._ints["file"]).astype(np.int32, copy=False)

    # ------------------------------------------------------------------ one sample
    def keys(self, i: int) -> tuple[str, int, int, int, str, str]:
        """(id, shard id, shape id, text_len, latents key, context key) of sample ``i``: what loading it needs."""
        b, j = self._locate(i)
        sid = self._cols["id"][b][j].as_py()
        keys = []
        for name, suffix in zip(KEY_COLUMNS, (".latents", ".context")):
            v = self._cols[name][b][j].as_py() if name in self._cols else None
            keys.append(f"{sid}{suffix}" if v is None else v)
        return (sid, int(self._ints["file"][b][j]), int(self._ints["shape"][b][j]),
                int(self._ints["text_len"][b][j]), keys[0], keys[1])

    def entry(self, i: int) -> dict:
        """Sample ``i`` as an index.json entry: id, frames, height, width, latent_shape, text_len, file, keys, meta."""
        sid, shard, shape, text_len, lat, ctx = self.keys(i)
        s = self._shapes[shape]
        out = {"id": sid, **s.as_dict(), "latent_shape": list(s.latent_shape), "text_len": text_len,
               "file": self.shard_files[shard], "latents_key": lat, "context_key": ctx}
        b, j = self._locate(i)
        for name in self._meta:
            v = self._cols[name][b][j].as_py()
            if v is not None:
                out[name] = json.loads(v) if name in self._json else v
        return out

    def rows_of_shard(self, shard: int) -> np.ndarray:
        """The rows (ascending) whose tensors are in shard ``shard``; one pass over the shard ids, once."""
        if self._runs is None:
            ids = self.shard_ids()
            cut = np.flatnonzero(np.diff(ids)) + 1
            starts = np.concatenate([[0], cut]).astype(np.int64)
            stops = np.concatenate([cut, [len(ids)]]).astype(np.int64)
            order = np.argsort(ids[starts], kind="stable")
            counts = np.bincount(ids[starts], minlength=len(self.shard_files))
            self._runs = (starts[order], stops[order], np.concatenate([[0], np.cumsum(counts)]))
        starts, stops, first = self._runs
        runs = range(int(first[shard]), int(first[shard + 1]))
        return np.concatenate([np.arange(starts[r], stops[r]) for r in runs]) if runs else np.zeros(0, np.int64)

    def __getstate__(self) -> dict:
        """Pickled for a DataLoader worker: an index.arrow is re-mapped there, not copied through the pipe."""
        if self.path.name == INDEX_FILE:
            return {"path": self.path, "spec": self.spec}
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        if set(state) == {"path", "spec"}:
            state = ShardIndex.open(state["path"], state["spec"]).__dict__
        self.__dict__.update(state)
