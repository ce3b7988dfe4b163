"""On-disk precomputed latents: an index (``index.arrow``) + safetensors shard files.

Layout of a dataset directory::

    DIR/index.arrow                  # one row per sample (ds_adaptive.data.index has the schema)
    DIR/shard-00000.safetensors      # tensors "<id>.latents" [C, T', H', W'], "<id>.context" [L, text_dim]
    DIR/shard-00001.safetensors
    ...

A directory written before version 2 has ``DIR/index.json`` instead (``ds_adaptive.data.legacy_json``); it is
read the same way, and ``ds-adaptive data convert DIR`` writes its ``index.arrow``.

A dataset is read for a model (its :class:`ds_adaptive.core.shapes.InputSpec`): latent channels, VAE stride and
text width in the index must be the model's, and every shape must fit its grid rule. The index alone is
enough to plan (``shape_ids()`` / ``unique_shapes()`` / ``sample_shapes()`` read no tensor). Shards are
written first and the index last (atomically), so a directory with an index is complete. A shard is checked
when it is first read in a process (existence, keys and tensor shapes of all its samples from the
safetensors header, which costs no tensor read): opening a dataset of 10M samples reads no shard. Errors
name the file, the key and the sample id; ``verify()`` (``ds-adaptive data check DIR``) checks every shard.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ds_adaptive.core.files import save_safetensors
from ds_adaptive.core.shapes import InputSpec, SampleShape, default_input_spec
from ds_adaptive.data.index import FORMAT, INDEX_FILE, LEGACY_INDEX_FILE, ShardIndex, find_index, write_index
from ds_adaptive.data.legacy_json import read_legacy_index
from ds_adaptive.data.synthetic import DataError

EMPTY_PROMPT_FILE = "empty_prompt.safetensors"
"""The text encoder's embedding of the empty prompt, tensor ``context`` ``[L, text_dim]``, next to the index
(``ds-adaptive preprocess`` and ``synth`` write it): what caption dropout trains the unconditional branch with."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VERIFY_MODES = ("lazy", "open", "off")


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
        found = find_index(self.out_dir) if index else None
        if found is not None and not overwrite:
            raise DataError(f"{found} already exists; pick another --out directory or "
                            "pass --overwrite to replace the dataset")
        self._overwrite = bool(overwrite)
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
            if self._overwrite:   # a replaced old dataset's index.json would describe the old samples
                (self.out_dir / LEGACY_INDEX_FILE).unlink(missing_ok=True)
        return self.out_dir / INDEX_FILE

    def __enter__(self) -> "LatentShardWriter":
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        if exc_type is None:
            self.close()


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


def open_index(root: Union[str, Path], spec: Optional[InputSpec] = None) -> ShardIndex:
    """The index of the dataset at ``root`` for the model ``spec``: ``index.arrow`` (memory-mapped), else an
    ``index.json`` read into memory; errors say what is missing and how to write a dataset."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"dataset directory {root} does not exist (from --data); write one with "
                        f"'ds-adaptive synth --out {root} --num-samples N' or pass --data synthetic")
    path = find_index(root)
    if path is not None and path.name == INDEX_FILE:
        return ShardIndex.open(path, spec)
    return read_legacy_index(root, spec)   # or its error: neither index exists


class LatentShardDataset(torch.utils.data.Dataset):
    """Reader of a directory written by ``LatentShardWriter`` / ``ds-adaptive synth`` / ``preprocess``.

    ``__getitem__(i)`` -> ``{"latents": [C, T', H', W'] float32, "context": [L, text_dim] float32,
    "index": i}``. ``verify``: ``"lazy"`` (default) checks a shard's header (every key and tensor shape of
    its samples) when the shard is first read in this process; ``"open"`` (or True) checks every shard now;
    ``"off"`` (or False) only checks the tensors that are read. ``spec``: the model the latents are read for
    (default: the default model's).

    For planning: ``shape_ids()`` (int32 per sample) and ``unique_shapes()`` (sorted); ``sample_shapes()``
    is the same as a list of one :class:`SampleShape` per sample.
    """

    def __init__(self, root: Union[str, Path], *, verify: Union[bool, str] = "lazy",
                 spec: Optional[InputSpec] = None) -> None:
        mode = ("open" if verify else "off") if isinstance(verify, bool) else verify
        if mode not in VERIFY_MODES:
            raise DataError(f"verify must be one of {list(VERIFY_MODES)} (or a bool), got {verify!r}")
        self.root = Path(root)
        self.spec = spec or default_input_spec()
        self.index = open_index(self.root, self.spec)
        self.index_path = self.index.path
        self._lazy = mode == "lazy"
        self._handles: dict[int, object] = {}
        self._pid: Optional[int] = None
        if mode == "open":
            self.verify()

    # ------------------------------------------------------------------ the index
    def __len__(self) -> int:
        return len(self.index)

    @property
    def header(self) -> dict:
        """The index's dataset keys (format, version, latent_channels, text_dim, vae, vae_stride, num_samples)."""
        return dict(self.index.header)

    @property
    def entries(self) -> "IndexEntries":
        """Every sample's index entry (a dict like an index.json entry), read when indexed."""
        return IndexEntries(self.index)

    def shape_ids(self) -> np.ndarray:
        """[num_samples] int32 (read-only): every sample's index into :meth:`unique_shapes`."""
        return self.index.shape_ids()

    def unique_shapes(self) -> list[SampleShape]:
        """The distinct pixel shapes of the dataset, sorted (as ``planning.planner.unique_shapes`` sorts)."""
        return self.index.unique_shapes()

    def sample_shapes(self) -> list[SampleShape]:
        """Every sample's pixel shape, read from the index (no tensor is loaded; one shared object per shape)."""
        table = np.empty(len(self.index.unique_shapes()), dtype=object)
        for k, s in enumerate(self.index.unique_shapes()):
            table[k] = s
        return table[self.shape_ids()].tolist()

    def shape_of(self, i: int) -> SampleShape:
        return self.index.unique_shapes()[self.index.keys(i)[2]]

    def text_lens(self) -> np.ndarray:
        """[num_samples] int32: every sample's text length (tokens)."""
        return self.index.text_lens()

    # ------------------------------------------------------------------ shards
    def _check_shard(self, f, path: Path, rows: np.ndarray) -> None:
        """Every key and tensor shape of the samples ``rows`` of the shard at ``path`` against its (open) header."""
        keys = set(f.keys())
        for row in rows:
            sid, _, shape_id, text_len, lat_key, ctx_key = self.index.keys(int(row))
            shape = self.index.unique_shapes()[shape_id]
            for key, want in ((lat_key, list(shape.latent_shape)), (ctx_key, [text_len, self.spec.text_dim])):
                if key not in keys:
                    raise DataError(f"shard {path} has no tensor {key!r} for sample {sid!r} "
                                    f"(index {self.index_path})")
                got = list(f.get_slice(key).get_shape())
                if got != want:
                    raise DataError(f"shard {path} tensor {key!r} of sample {sid!r} has shape "
                                    f"{got}, the index says {want}")

    def _open_shard(self, shard: int, row: int, check: bool):
        """safe_open of shard ``shard`` (read for sample ``row``), its header checked when ``check``."""
        path = self.root / self.index.shard_files[shard]
        rows = self.index.rows_of_shard(shard)
        sid = self.index.sample_id(row)
        if not path.is_file():
            raise DataError(f"shard {path} does not exist (needed by sample {sid!r} and {len(rows) - 1} more, "
                            f"listed in {self.index_path})")
        try:
            with open(path, "rb"):  # safetensors reports EACCES as "No such file": say what it is
                pass
        except OSError as exc:
            raise DataError(f"shard {path} exists but cannot be read ({exc.strerror or exc}; needed by sample "
                            f"{sid!r} and {len(rows) - 1} more): fix its permissions (chmod a+r) or run as its "
                            "owner") from None
        try:
            f = safe_open(str(path), framework="pt")
            if check:
                self._check_shard(f, path, rows)
        except SafetensorError as exc:
            raise DataError(f"shard {path} is corrupt or not a safetensors file ({exc}); sample {sid!r} is in it. "
                            "Rewrite the dataset.") from None
        return f

    def verify(self) -> None:
        """Check that every shard exists, is readable, and holds every key with the right shape."""
        for shard in range(len(self.index.shard_files)):
            rows = self.index.rows_of_shard(shard)
            if len(rows):
                self._open_shard(shard, int(rows[0]), check=True)

    def _handle(self, shard: int, row: int):
        if self._pid != os.getpid():  # DataLoader workers: do not share mmaps across fork
            self._handles, self._pid = {}, os.getpid()
        h = self._handles.get(shard)
        if h is None:
            h = self._handles[shard] = self._open_shard(shard, row, check=self._lazy)
        return h

    def __getitem__(self, i: int) -> dict:
        sid, shard, shape_id, text_len, lat_key, ctx_key = self.index.keys(i)
        h = self._handle(shard, i)
        path = self.root / self.index.shard_files[shard]
        out = {}
        shape = self.index.unique_shapes()[shape_id]
        for name, key, want in (("latents", lat_key, shape.latent_shape),
                                ("context", ctx_key, (text_len, self.spec.text_dim))):
            try:
                t = h.get_tensor(key)
            except SafetensorError as exc:
                raise DataError(f"shard {path}: cannot read {key!r} of sample {sid!r} ({exc})") from None
            if tuple(t.shape) != tuple(want):
                raise DataError(f"shard {path} tensor {key!r} of sample {sid!r} has shape "
                                f"{tuple(t.shape)}, expected {tuple(want)}")
            t = t.float()
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                bad = int((~finite).sum())
                raise DataError(f"sample {i} (id {sid!r}) in shard {path}: tensor {key!r} holds {bad} "
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
        counts = np.bincount(self.shape_ids(), minlength=len(self.unique_shapes()))
        n_img = int(sum(n for s, n in zip(self.unique_shapes(), counts) if s.is_image))
        return f"latent dataset {self.root}: {len(self)} samples ({n_img} images, {len(self) - n_img} videos)"


class IndexEntries(Sequence):
    """The index entries of a dataset as a sequence of dicts, each read from the index when indexed."""

    def __init__(self, index: ShardIndex) -> None:
        self._index = index

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._index.entry(k) for k in range(*i.indices(len(self)))]
        return self._index.entry(int(i) + len(self) if int(i) < 0 else int(i))
