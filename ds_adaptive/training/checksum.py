"""Content checksums of checkpoint files: computed while the files are written, checked before they load.

    with HashingSaves(engine) as saved:          # every rank, around engine.save_checkpoint(...)
        engine.save_checkpoint(save_dir, tag=tag, ...)
    saved.digests                                 # {path: (bytes written, hex digest)} of this rank's files
    file_digest(path, ALGORITHM)                  # the same digest of a file on disk (streamed, 64 MiB reads)

The hash is xxHash's XXH3-128 (``xxhash`` package) when it is installed, else BLAKE2b from the standard
library; the completeness marker names the algorithm it used, so either can be checked later. XXH3-128 hashes several times
faster than BLAKE2b, SHA or zlib's CRC32 on one core (``bench/training/checkpoint_save.py --hashes`` times them).
Both release the GIL on large buffers.

"While writing": DeepSpeed's ``TorchCheckpointEngine.save`` is ``torch.save(state, path)``. Inside
:class:`HashingSaves` it is ``torch.save(state, <a file object>)`` instead: torch's zip writer hands every record
(each tensor's bytes: one call for a whole flat ZeRO partition) to the file object's ``write``, which writes the
bytes and updates the hash of the same memory on a second thread, in pieces of ``PIECE`` bytes, so hashing runs
beside the write instead of after it, and no byte is read twice. Other checkpoint engines (DeepSpeed's
fast / decoupled / datastates writers) are left as they are; the files they wrote are hashed afterwards by
reading them back (``write_checkpoint`` spreads that over the ranks).

torch's zip writer also computes a CRC32 of every record by default, which ``torch.load`` never checks and which
costs more than the hash (``bench/training/checkpoint_save.py`` times a save with and without it). Inside :class:`HashingSaves` it is off (``torch_crc32=False``): the
file's checksum, which resume and export do check, replaces it.
"""
from __future__ import annotations

import hashlib
import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Union

try:  # XXH3-128: faster than BLAKE2b; the fallback keeps checkpoints hashed when the package is missing
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - xxhash is in install_requires
    _xxhash = None

__all__ = ["ALGORITHM", "ALGORITHMS", "new_hasher", "file_digest", "HashingFile", "HashingSaves", "CHUNK", "PIECE"]

ALGORITHMS: dict[str, Callable] = {"blake2b": lambda: hashlib.blake2b(digest_size=16)}
if _xxhash is not None:
    ALGORITHMS["xxh3_128"] = _xxhash.xxh3_128
ALGORITHM = "xxh3_128" if _xxhash is not None else "blake2b"
"""The algorithm new checkpoints are hashed with (recorded in each completeness marker)."""

CHUNK = 64 << 20
"""Bytes per read when a file is hashed from disk (large sequential reads; one reused buffer)."""
PIECE = 64 << 20
"""A write larger than this is written and hashed piece by piece, the hash of a piece beside its write."""
_OVERLAP_MIN = 1 << 20
"""Writes below this size are hashed inline (a thread hand-off costs more than hashing them)."""

PathLike = Union[str, os.PathLike]


def new_hasher(algorithm: str = ALGORITHM):
    """A fresh hash object (``update`` / ``hexdigest``) of ``algorithm``; ValueError naming the known ones."""
    try:
        return ALGORITHMS[algorithm]()
    except KeyError:
        hint = " (pip install xxhash)" if algorithm.startswith("xxh") else ""
        raise ValueError(f"checksum algorithm {algorithm!r} is not available here{hint}; known: "
                         f"{sorted(ALGORITHMS)}") from None


def file_digest(path: PathLike, algorithm: str = ALGORITHM) -> str:
    """Hex digest of the file at ``path``, read in ``CHUNK``-byte pieces into one reused buffer."""
    h = new_hasher(algorithm)
    buf = bytearray(max(1, min(CHUNK, os.path.getsize(path))))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        try:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        while True:
            n = f.readinto(view)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


class HashingFile:
    """A binary file opened for writing whose ``write`` also hashes the bytes (for ``torch.save``).

    Large writes are cut into ``PIECE``-byte pieces; the hash of each piece runs on ``pool`` while the
    calling thread writes it, and ``write`` returns only when both are done (the caller may reuse its
    buffer then). ``size`` counts the bytes written."""

    def __init__(self, path: PathLike, algorithm: str = ALGORITHM, pool: Optional[ThreadPoolExecutor] = None):
        self.path = Path(path)
        self.hasher = new_hasher(algorithm)
        self.size = 0
        self._pool = pool
        self._f = open(path, "wb", buffering=0)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        for start in range(0, n, PIECE):
            piece = view[start:start + PIECE]
            if self._pool is not None and len(piece) >= _OVERLAP_MIN:
                pending = self._pool.submit(self.hasher.update, piece)
                self._write_all(piece)
                pending.result()
            else:
                self.hasher.update(piece)
                self._write_all(piece)
        self.size += n
        return n

    def _write_all(self, view: memoryview) -> None:
        while len(view):  # one write(2) moves at most ~2 GiB
            view = view[self._f.write(view):]

    def flush(self) -> None:
        pass  # unbuffered: every write went to the kernel

    def seek(self, *_args) -> int:
        raise io.UnsupportedOperation("a hashing writer only appends")

    def close(self) -> None:
        self._f.close()

    def hexdigest(self) -> str:
        return self.hasher.hexdigest()

    def __enter__(self) -> "HashingFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HashingSaves:
    """Within the context, ``engine.checkpoint_engine.save(state, path)`` (DeepSpeed's torch writer) writes
    through a :class:`HashingFile`; ``digests`` maps each path written to ``(bytes, hex digest)``.

    Other checkpoint engines are not touched (``hashed_while_writing`` is False); a save that fails inside the
    hashing writer is repeated as the engine's own save, and its file is hashed by reading it back."""

    def __init__(self, engine, algorithm: str = ALGORITHM, *, torch_crc32: bool = False) -> None:
        self.ckpt_engine = getattr(engine, "checkpoint_engine", None)
        self.algorithm = algorithm
        self.torch_crc32 = torch_crc32
        self._crc32_before: Optional[bool] = None
        self.digests: dict[str, tuple[int, str]] = {}
        self.hashed_while_writing = type(self.ckpt_engine).__name__ == "TorchCheckpointEngine"
        self._pool: Optional[ThreadPoolExecutor] = None
        self._original = None
        self._shadowed = False

    def __enter__(self) -> "HashingSaves":
        if self.hashed_while_writing:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_adaptive-hash")
            self._shadowed = "save" in vars(self.ckpt_engine)
            self._original = self.ckpt_engine.save
            self.ckpt_engine.save = self._save
            self._crc32_before = _set_torch_crc32(self.torch_crc32)
        return self

    def __exit__(self, *exc) -> None:
        if self._original is not None:
            if self._shadowed:
                self.ckpt_engine.save = self._original
            else:
                del self.ckpt_engine.save
            self._original = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._crc32_before is not None:
            _set_torch_crc32(self._crc32_before)
            self._crc32_before = None

    def _save(self, state_dict, path: str) -> None:
        import torch

        zip_format = getattr(self.ckpt_engine, "zipfile_serialization", True)
        try:
            with HashingFile(path, self.algorithm, self._pool) as f:
                torch.save(state_dict, f, _use_new_zipfile_serialization=zip_format)
            self.digests[str(path)] = (f.size, f.hexdigest())
        except (AttributeError, io.UnsupportedOperation):  # a writer that needs seek(): save, then hash the file
            self._original(state_dict, path)
            self.digests[str(path)] = (os.path.getsize(path), file_digest(path, self.algorithm))


def _set_torch_crc32(on: bool) -> Optional[bool]:
    """Turn torch.save's per-record CRC32 on or off; returns the previous setting (None: torch has no switch)."""
    import torch.serialization as ser

    get, put = getattr(ser, "get_crc32_options", None), getattr(ser, "set_crc32_options", None)
    if get is None or put is None:
        return None
    before = bool(get())
    put(on)
    return before
