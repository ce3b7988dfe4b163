"""The ``latest`` pointer of a checkpoint directory, and which checkpoints of it a run may continue (stdlib only).

    tag, note = read_pointer(save_dir)        # a global_stepN name of save_dir, or (None, why it is ignored)
    tag = newest_complete(save_dir)           # the newest checkpoint with a marker whose files have their sizes
    run = directory_run_id(save_dir)          # the run id the directory's checkpoints agree on

The rule: ``latest`` can only name a checkpoint directory **inside** its ``SAVE_DIR`` (a bare ``global_stepN``
name: no path, no ``..``, no absolute path), written by the run that owns the directory (the run id in its
completeness marker, compared with the other checkpoints of the directory). Anything else (a path, garbage
bytes, a file that cannot be read, another run's checkpoint) is ignored with one line, and the newest good
checkpoint of the directory's run is used instead. The supervisor (which starts before torch) and the trainer
and export (through ``ds_adaptive.training.checkpoint``) share these functions.

Partial checkpoints never carry a final name: a save writes ``.global_stepN.partial`` and renames it when it is
complete (:data:`PARTIAL_SUFFIX`, :func:`partial_dirs`).
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Optional, Union

__all__ = ["MARKER", "TAG_PREFIX", "PARTIAL_SUFFIX", "read_pointer", "tag_step", "partial_name", "partial_dirs",
           "marker_of", "sizes_problem", "newest_complete", "directory_run_id"]

MARKER = "ds_adaptive_complete.json"
TAG_PREFIX = "global_step"
PARTIAL_SUFFIX = ".partial"
_TAG_RE = re.compile(rf"^{TAG_PREFIX}(\d+)$")
_PARTIAL_RE = re.compile(rf"^\.{TAG_PREFIX}(\d+){re.escape(PARTIAL_SUFFIX)}$")
_MAX_POINTER_BYTES = 256

PathLike = Union[str, os.PathLike]


def tag_step(tag: str) -> Optional[int]:
    """The step of a ``global_stepN`` tag; None for any other name."""
    m = _TAG_RE.match(tag)
    return int(m.group(1)) if m else None


def partial_name(tag: str) -> str:
    """The temporary name a checkpoint is written under until it is complete."""
    return f".{tag}{PARTIAL_SUFFIX}"


def partial_dirs(save_dir: PathLike) -> list[Path]:
    """The partial (interrupted) saves in ``save_dir``: ``.global_stepN.partial`` directories."""
    d = Path(save_dir)
    try:
        return sorted(p for p in d.iterdir() if _PARTIAL_RE.match(p.name) and p.is_dir())
    except OSError:
        return []


def read_pointer(save_dir: PathLike) -> tuple[Optional[str], Optional[str]]:
    """(tag, None) when ``save_dir/latest`` names a ``global_stepN`` directory of ``save_dir``; (None, None) when
    there is no ``latest``; (None, one line saying why it is ignored) for anything else."""
    latest = Path(save_dir) / "latest"
    if not latest.exists() and not latest.is_symlink():
        return None, None
    try:
        raw = latest.read_bytes()[:_MAX_POINTER_BYTES + 1]
    except OSError as exc:
        return None, (f"{latest} cannot be read ({exc.strerror or type(exc).__name__}): ignored, using the newest "
                      "complete checkpoint of the directory")
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        text = None
    if text is None or len(raw) > _MAX_POINTER_BYTES or not text.isprintable():
        return None, (f"{latest} does not hold a checkpoint name ({len(raw)} bytes that are not a global_stepN "
                      "name): ignored, using the newest complete checkpoint of the directory")
    if tag_step(text) is None:
        return None, (f"{latest} names {text!r}, not a global_stepN directory inside {save_dir} (a pointer cannot "
                      "lead to another directory): ignored, using the newest complete checkpoint of the directory")
    return text, None


def marker_of(tag_dir: PathLike) -> Optional[dict]:
    """The completeness marker of a checkpoint, or None when it has none (or an unreadable one)."""
    try:
        marker = json.loads((Path(tag_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def sizes_problem(tag_dir: PathLike) -> Optional[str]:
    """None when ``tag_dir`` has a marker and every file it lists has its size; else what is wrong (one line)."""
    tag_dir = Path(tag_dir)
    marker = marker_of(tag_dir)
    if marker is None:
        return f"{tag_dir} has no readable completeness marker {MARKER}"
    files = marker.get("files")
    if not isinstance(files, dict):
        return f"{tag_dir / MARKER} is unreadable (no 'files' table)"
    for name, size in files.items():
        p = tag_dir / name
        try:
            actual = p.stat().st_size
        except OSError:
            return f"{p} is missing (listed in {MARKER})"
        if actual != size:
            return f"{p} has {actual} bytes, {MARKER} says {size} (truncated or overwritten)"
    return None


def _tags(save_dir: Path) -> list[str]:
    try:
        return sorted((p.name for p in save_dir.iterdir() if tag_step(p.name) is not None and p.is_dir()),
                      key=tag_step)
    except OSError:
        return []


def directory_run_id(save_dir: PathLike, exclude=()) -> Optional[str]:
    """The run id most complete-marker checkpoints of ``save_dir`` carry (ties: the newest one's); None if none."""
    ids = [(marker_of(Path(save_dir) / t) or {}).get("run_id") for t in _tags(Path(save_dir)) if t not in exclude]
    ids = [i for i in ids if i]
    if not ids:
        return None
    counts = Counter(ids)
    best = max(counts.values())
    return next(i for i in reversed(ids) if counts[i] == best)


def newest_complete(save_dir: PathLike, exclude=(), run_id: Optional[str] = None) -> Optional[str]:
    """The newest ``global_stepN`` of ``save_dir`` (not in ``exclude``; of ``run_id`` when given) with a marker
    whose files have their sizes (contents not read)."""
    for tag in reversed(_tags(Path(save_dir))):
        if tag in exclude:
            continue
        marker = marker_of(Path(save_dir) / tag)
        if marker is None or (run_id is not None and marker.get("run_id") != run_id):
            continue
        if sizes_problem(Path(save_dir) / tag) is None:
            return tag
    return None
