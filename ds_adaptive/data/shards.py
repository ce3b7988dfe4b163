"""On-disk precomputed latents: ``index.json`` + safetensors shard files.

Layout of a dataset directory::

    DIR/index.json
    DIR/shard-00000.safetensors      # tensors "<id>.latents" [C, T', H', W'], "<id>.context" [L, text_dim]
    DIR/shard-00001.safetensors
    ...

``index.json``::

    {"format": "ds_adaptive.latents", "version": 1, "latent_channels": 16, "text_dim": 4096,
     "vae": "Wan 2.1 VAE", "vae_stride": [4, 8, 8], "num_samples": 2,
     "samples": [
       {"id": "000000", "frames": 81, "height": 480, "width": 832, "latent_shape": [16, 21, 60, 104],
        "text_len": 97, "file": "shard-00000.safetensors",
        "latents_key": "000000.latents", "context_key": "000000.context"},
       ...]}

A dataset is read for a model (its :class:`ds_adaptive.core.shapes.InputSpec`): latent channels, VAE stride and
text width in the index must be the model's (``vae``/``vae_stride`` absent in indexes written before they
were recorded: the channels and every entry's ``latent_shape`` are still checked against the model's rule).
The index alone is enough to plan (``sample_shapes()`` reads no tensor). Shards are written
first and the index last (atomically), so a directory with an index is complete. Files are
checked when the dataset opens (existence, keys and tensor shapes from the safetensors
headers, which costs no tensor read); errors name the file, the key and the sample id.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError, safe_open

from ds_adaptive.core.files import save_safetensors
from ds_adaptive.core.jsonfile import read_json
from ds_adaptive.core.shapes import InputSpec, SampleShape, ShapeError, default_input_spec
from ds_adaptive.data.synthetic import DataError

EMPTY_PROMPT_FILE = "empty_prompt.safetensors"
"""The text encoder's embedding of the empty prompt, tensor ``context`` ``[L, text_dim]``, next to the index
(``ds-adaptive preprocess`` and ``synth`` write it): what caption dropout trains the unconditional branch with."""
FORMAT = "ds_adaptive.latents"
VERSION = 1
INDEX_FILE = "index.json"
_ENTRY_KEYS = ("id", "frames", "height", "width", "text_len", "file", "latents_key", "context_key")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LatentShardWriter:
    """Append samples, get safetensors shards of about ``shard_bytes`` each and an index.

    Use as a context manager, or call ``close()``: the index is written only then. Each shard file
    is written under a temporary name and renamed, so a file under its final name is complete.
    ``prefix`` names the files ``<prefix>-00000.safetensors``, ...; ``index=False`` writes no index
    (a part of a dataset whose index ``write_index`` assembles later from ``entries``). ``spec``: the
    model the latents are for (default: the default model's).
    """

    def __init__(self, out_dir: Union[str, Path], *, shard_bytes: int = 1 << 30, dtype: str = "float32",
                 overwrite: bool = False, prefix: str = "shard", index: bool = True,
                 spec: Optional[InputSpec] = None) -> None:
        if dtype not in _DTYPES:
            raise DataError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.out_dir = Path(out_dir)
        self.spec = spec or default_input_spec()
        self.prefix, self.write_index = prefix, bool(index)
        if index and (self.out_dir / INDEX_FILE).exists() and not overwrite:
            raise DataError(f"{self.out_dir / INDEX_FILE} already exists; pick another --out directory or "
                            "pass --overwrite to replace the dataset")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.shard_bytes = int(shard_bytes)
        self.dtype = _DTYPES[dtype]
        self._entries: list[dict] = []
        self._ids: set[str] = set()
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shard = 0
        self._closed = False

    @property
    def num_shards(self) -> int:
        """Shard files written so far."""
        return self._shard

    @property
    def entries(self) -> list[dict]:
        """Index entries of the samples added so far (their ``file`` is final once flushed)."""
        return list(self._entries)

    def _shard_name(self) -> str:
        return f"{self.prefix}-{self._shard:05d}.safetensors"

    def add(self, sample_id: str, shape: SampleShape, latents: torch.Tensor, context: torch.Tensor,
            meta: Optional[dict] = None) -> None:
        """Queue one sample; ``latents`` must be ``shape.latent_shape``, ``context`` [L <= text_len, text_dim].
        ``meta``: extra JSON keys for its index entry (e.g. the source file); readers ignore them."""
        if self._closed:
            raise DataError("LatentShardWriter is closed")
        sample_id = str(sample_id)
        if sample_id in self._ids or "." in sample_id:
            raise DataError(f"sample id {sample_id!r} is duplicated or contains '.'; ids must be unique "
                            "and dot-free (keys are '<id>.latents')")
        if shape.grid != self.spec.grid:
            raise DataError(f"sample {sample_id}: shape {shape} is under {shape.grid.describe()}, the dataset is "
                            f"written for {self.spec.describe()}")
        if tuple(latents.shape) != shape.latent_shape:
            raise DataError(f"sample {sample_id}: latents have shape {tuple(latents.shape)}, expected "
                            f"{shape.latent_shape} for {shape} (frames x height x width)")
        dim, max_len = self.spec.text_dim, self.spec.text_len
        if context.dim() != 2 or context.shape[1] != dim or not 1 <= context.shape[0] <= max_len:
            raise DataError(f"sample {sample_id}: context must be [L, {dim}] with 1 <= L <= {max_len}, "
                            f"got {tuple(context.shape)}")
        lat_key, ctx_key = f"{sample_id}.latents", f"{sample_id}.context"
        self._pending[lat_key] = latents.detach().to("cpu", self.dtype).contiguous()
        self._pending[ctx_key] = context.detach().to("cpu", self.dtype).contiguous()
        self._pending_bytes += (latents.numel() + context.numel()) * self._pending[lat_key].element_size()
        self._ids.add(sample_id)
        self._entries.append({
            "id": sample_id, **shape.as_dict(), "latent_shape": list(shape.latent_shape),
            "text_len": int(context.shape[0]), "file": self._shard_name(),
            "latents_key": lat_key, "context_key": ctx_key, **(meta or {}),
        })
        if self._pending_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        final = self.out_dir / self._shard_name()
        tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")  # renamed when complete
        save_safetensors(self._pending, tmp, metadata={"format": FORMAT})  # mode from the umask, not 0600
        os.replace(tmp, final)
        self._pending, self._pending_bytes = {}, 0
        self._shard += 1

    def close(self) -> Path:
        """Write the last shard and then the index (atomically). Returns the index path."""
        if self._closed:
            return self.out_dir / INDEX_FILE
        self._flush()
        self._closed = True
        if self.write_index:
            write_index(self.out_dir, self._entries, spec=self.spec)
        return self.out_dir / INDEX_FILE

    def __enter__(self) -> "LatentShardWriter":
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        if exc_type is None:
            self.close()


def write_index(out_dir: Union[str, Path], entries: list[dict], *, spec: Optional[InputSpec] = None) -> Path:
    """Write ``out_dir/index.json`` for ``entries`` of latents for ``spec`` (default: the default model's)
    atomically: temporary file, then rename."""
    out_dir = Path(out_dir)
    spec = spec or default_input_spec()
    index = {"format": FORMAT, "version": VERSION, "latent_channels": spec.grid.latent_channels,
             "text_dim": spec.text_dim, "vae": spec.grid.vae, "vae_stride": list(spec.grid.vae_stride),
             "num_samples": len(entries), "samples": entries}
    tmp = out_dir / (INDEX_FILE + ".tmp")
    # One sample per line: readable, diffable and still plain JSON.
    head = json.dumps({k: v for k, v in index.items() if k != "samples"})[:-1]
    rows = ",\n  ".join(json.dumps(e) for e in entries)
    tmp.write_text(f'{head}, "samples": [\n  {rows}\n]}}\n')
    os.replace(tmp, out_dir / INDEX_FILE)
    return out_dir / INDEX_FILE


def write_empty_prompt(out_dir: Union[str, Path], context: torch.Tensor) -> Path:
    """Store the empty prompt's embedding ``[L, text_dim]`` as ``out_dir/``:data:`EMPTY_PROMPT_FILE` (atomically)."""
    path = Path(out_dir) / EMPTY_PROMPT_FILE
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    save_safetensors({"context": context.detach().cpu().contiguous()}, tmp, metadata={"format": FORMAT})
    os.replace(tmp, path)
    return path


def read_empty_prompt(path: Union[str, Path], spec: InputSpec, *, what: str) -> torch.Tensor:
    """The empty-prompt embedding in the safetensors file ``path`` (one tensor, ``[L <= text_len, text_dim]`` of
    ``spec``) as fp32; errors name ``what`` and the file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            t = f.get_tensor(keys[0]).float() if len(keys) == 1 else None
    except (SafetensorError, OSError) as exc:
        raise DataError(f"{what}: {path} is not a readable safetensors file ({exc})") from None
    if t is None:
        raise DataError(f"{what}: {path} must hold one tensor (the empty prompt's embedding), it holds {len(keys)}")
    if t.dim() != 2 or t.shape[1] != spec.text_dim or not 1 <= t.shape[0] <= spec.text_len:
        raise DataError(f"{what}: {path} holds a {list(t.shape)} tensor; the empty prompt's embedding must be "
                        f"[L <= {spec.text_len}, {spec.text_dim}] ({spec.describe()})")
    return t


def _read_index(root: Path) -> dict:
    if not root.is_dir():
        raise DataError(f"dataset directory {root} does not exist (from --data); write one with "
                        f"'ds-adaptive synth --out {root} --num-samples N' or pass --data synthetic")
    path = root / INDEX_FILE
    index = read_json(path, missing=f"{path} does not exist: {root} is not a ds_adaptive latent dataset (or its "
                                    "writer did not finish; the index is written last)",
                      missing_error=DataError, invalid_error=DataError, fix="; rewrite the dataset")
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(f"{path}: 'format' must be {FORMAT!r}, got "
                        f"{index.get('format') if isinstance(index, dict) else type(index).__name__!r}")
    if index.get("version") != VERSION:
        raise DataError(f"{path}: version {index.get('version')!r} is not supported (this ds_adaptive reads "
                        f"version {VERSION})")
    if not isinstance(index.get("samples"), list) or not index["samples"]:
        raise DataError(f"{path}: 'samples' must be a non-empty list")
    if index.get("num_samples", len(index["samples"])) != len(index["samples"]):
        raise DataError(f"{path}: num_samples is {index['num_samples']} but 'samples' lists "
                        f"{len(index['samples'])} entries; the index is truncated or edited")
    return index


class LatentShardDataset(torch.utils.data.Dataset):
    """Reader of a directory written by ``LatentShardWriter`` / ``ds-adaptive synth``.

    ``__getitem__(i)`` -> ``{"latents": [C, T', H', W'] float32, "context": [L, text_dim] float32,
    "index": i}``. ``verify=True`` checks every file, key and tensor shape on open (headers only).
    ``spec``: the model the latents are read for (default: the default model's).
    """

    def __init__(self, root: Union[str, Path], *, verify: bool = True, spec: Optional[InputSpec] = None) -> None:
        self.root = Path(root)
        self.index_path = self.root / INDEX_FILE
        self.spec = spec or default_input_spec()
        index = _read_index(self.root)
        self._check_model(index)
        self.entries: list[dict] = []
        self._shapes: list[SampleShape] = []
        for i, e in enumerate(index["samples"]):
            self.entries.append(self._check_entry(i, e))
            self._shapes.append(SampleShape(e["frames"], e["height"], e["width"], self.spec.grid))
        self._handles: dict[str, object] = {}
        self._pid: Optional[int] = None
        if verify:
            self.verify()

    def _check_model(self, index: dict) -> None:
        """The index's latent channels / VAE stride / text width against the model's."""
        grid = self.spec.grid
        found = {"latent_channels": index.get("latent_channels"), "vae_stride": index.get("vae_stride"),
                 "text_dim": index.get("text_dim")}
        want = {"latent_channels": grid.latent_channels, "vae_stride": list(grid.vae_stride),
                "text_dim": self.spec.text_dim}
        bad = [f"{k} {found[k]} (expected {want[k]})" for k in want if found[k] is not None and found[k] != want[k]]
        if bad:
            vae = f" ({index['vae']})" if index.get("vae") else ""
            raise DataError(f"{self.index_path}: the latents were written for another model{vae}: "
                            f"{', '.join(bad)}; {self.spec.describe()}. Train a model of that VAE (--model) or "
                            "re-encode the media for this one (ds-adaptive preprocess --model ...)")

    def _check_entry(self, i: int, e: object) -> dict:
        where = f"{self.index_path} sample {i}"
        if not isinstance(e, dict):
            raise DataError(f"{where}: expected an object, got {e!r}")
        where = f"{self.index_path} sample {i} (id {e.get('id')!r})"
        missing = [k for k in _ENTRY_KEYS if k not in e]
        if missing:
            raise DataError(f"{where}: missing key(s) {missing}; every entry needs {list(_ENTRY_KEYS)}")
        try:
            self.spec.grid.validate(e["frames"], e["height"], e["width"], where=where)
        except ShapeError as exc:
            raise DataError(str(exc)) from None
        n = self.spec.text_len
        if not isinstance(e["text_len"], int) or not 1 <= e["text_len"] <= n:
            raise DataError(f"{where}: text_len must be an int in 1..{n}, got {e['text_len']!r}")
        shape = SampleShape(e["frames"], e["height"], e["width"], self.spec.grid)
        if "latent_shape" in e and list(e["latent_shape"]) != list(shape.latent_shape):
            raise DataError(f"{where}: latent_shape {e['latent_shape']} for {shape}, the model expects "
                            f"{list(shape.latent_shape)} ({self.spec.describe()}); the latents were encoded for "
                            "another model: re-encode them (ds-adaptive preprocess --model ...)")
        return e

    def verify(self) -> None:
        """Check that every shard exists, is readable, and holds every key with the right shape."""
        by_file: dict[str, list[dict]] = {}
        for e in self.entries:
            by_file.setdefault(e["file"], []).append(e)
        for fname, entries in by_file.items():
            path = self.root / fname
            if not path.is_file():
                raise DataError(f"shard {path} does not exist (needed by sample {entries[0]['id']!r} and "
                                f"{len(entries) - 1} more, listed in {self.index_path})")
            try:
                with safe_open(str(path), framework="pt") as f:
                    keys = set(f.keys())
                    for e in entries:
                        shape = SampleShape(e["frames"], e["height"], e["width"], self.spec.grid)
                        expected = {e["latents_key"]: list(shape.latent_shape),
                                    e["context_key"]: [e["text_len"], self.spec.text_dim]}
                        for key, want in expected.items():
                            if key not in keys:
                                raise DataError(f"shard {path} has no tensor {key!r} for sample {e['id']!r} "
                                                f"(index {self.index_path})")
                            got = list(f.get_slice(key).get_shape())
                            if got != want:
                                raise DataError(f"shard {path} tensor {key!r} of sample {e['id']!r} has shape "
                                                f"{got}, the index says {want}")
            except SafetensorError as exc:
                raise DataError(f"shard {path} is corrupt or not a safetensors file ({exc}); first sample in "
                                f"it: {entries[0]['id']!r}. Rewrite the dataset.") from None

    def __len__(self) -> int:
        return len(self.entries)

    def sample_shapes(self) -> list[SampleShape]:
        """Every sample's pixel shape, read from the index (no tensor is loaded)."""
        return list(self._shapes)

    def _handle(self, fname: str, sample_id: str):
        if self._pid != os.getpid():  # DataLoader workers: do not share mmaps across fork
            self._handles, self._pid = {}, os.getpid()
        h = self._handles.get(fname)
        if h is None:
            path = self.root / fname
            if not path.is_file():
                raise DataError(f"shard {path} does not exist (sample {sample_id!r}, index {self.index_path})")
            try:
                h = safe_open(str(path), framework="pt")
            except SafetensorError as exc:
                raise DataError(f"shard {path} is corrupt ({exc}); sample {sample_id!r}") from None
            self._handles[fname] = h
        return h

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self.entries):
            raise IndexError(f"sample index {i} out of range for {self.root} ({len(self.entries)} samples)")
        e = self.entries[i]
        h = self._handle(e["file"], e["id"])
        path = self.root / e["file"]
        out = {}
        shape = self._shapes[i]
        for name, key, want in (("latents", e["latents_key"], shape.latent_shape),
                                ("context", e["context_key"], (e["text_len"], self.spec.text_dim))):
            try:
                t = h.get_tensor(key)
            except SafetensorError as exc:
                raise DataError(f"shard {path}: cannot read {key!r} of sample {e['id']!r} ({exc})") from None
            if tuple(t.shape) != tuple(want):
                raise DataError(f"shard {path} tensor {key!r} of sample {e['id']!r} has shape "
                                f"{tuple(t.shape)}, expected {tuple(want)}")
            t = t.float()
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                bad = int((~finite).sum())
                raise DataError(f"sample {i} (id {e['id']!r}) in shard {path}: tensor {key!r} holds {bad} "
                                f"non-finite value(s) (NaN/inf) of {t.numel()}; the shard is corrupt or was "
                                "written from a diverged encoder: re-encode this sample or drop it from "
                                f"{self.index_path}")
            out[name] = t
        out["index"] = i
        return out

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handles"], state["_pid"] = {}, None
        return state

    def empty_context(self) -> Optional[torch.Tensor]:
        """The empty prompt's embedding stored with the dataset (:data:`EMPTY_PROMPT_FILE`), or None."""
        path = self.root / EMPTY_PROMPT_FILE
        return read_empty_prompt(path, self.spec, what=f"dataset {self.root}") if path.is_file() else None

    def describe(self) -> str:
        n_img = sum(1 for s in self._shapes if s.is_image)
        return f"latent dataset {self.root}: {len(self)} samples ({n_img} images, {len(self) - n_img} videos)"
