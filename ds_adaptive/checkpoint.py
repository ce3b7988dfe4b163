"""Checkpoints you can resume from: complete before ``latest`` moves, checked before they load.

    write_checkpoint(engine, save_dir, tag, client_state, keep=3)   # every rank
    tag, notes = find_resumable(save_dir)                          # newest complete checkpoint
    problem = check_checkpoint(save_dir / tag)                     # None, or what is wrong

How a checkpoint is written (every rank calls :func:`write_checkpoint`):

1. DeepSpeed's ``save_checkpoint(save_dir, tag, save_latest=False)``: every rank writes its own
   files into ``save_dir/tag``; ``latest`` is not touched yet.
2. A barrier: after it, every rank's files are on disk (``torch.save`` returned on every rank).
3. Rank 0 writes the completeness marker ``tag/ds_adaptive_complete.json`` (the tag, the step, and
   the name and byte size of every file of the checkpoint), then ``latest`` (write to a temporary
   file, then ``os.replace``: a reader sees the old or the new tag, never half a name), then deletes
   the oldest complete checkpoints beyond ``keep``.
4. A second barrier, so that no rank leaves (or exits) before ``latest`` names the new checkpoint.

A preemption at any point leaves ``latest`` naming a complete checkpoint (the previous one until
step 3). On resume, :func:`check_checkpoint` compares the files with the marker (missing directory,
missing marker, missing file, wrong size = truncated) and opens every ``.pt`` file's zip directory;
:func:`find_resumable` falls back from a bad ``latest`` to the newest good ``global_stepN`` and says
what was wrong with each one it skipped.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Optional, Union

__all__ = ["MARKER", "TAG_PREFIX", "write_checkpoint", "check_checkpoint", "find_resumable", "tag_for",
           "step_of", "write_latest", "prune_checkpoints", "CheckpointError"]

MARKER = "ds_adaptive_complete.json"
"""Name of the completeness marker inside a checkpoint's tag directory (written last, by rank 0)."""
TAG_PREFIX = "global_step"
_TAG_RE = re.compile(rf"^{TAG_PREFIX}(\d+)$")

PathLike = Union[str, os.PathLike]


class CheckpointError(ValueError):
    """No checkpoint to resume from (each candidate's problem is named in the message)."""


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step}"


def step_of(tag: str) -> Optional[int]:
    """The step of a ``global_stepN`` tag; None for any other name."""
    m = _TAG_RE.match(tag)
    return int(m.group(1)) if m else None


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_latest(save_dir: PathLike, tag: str) -> None:
    """Point ``save_dir/latest`` at ``tag`` atomically (temporary file + rename)."""
    _atomic_write(Path(save_dir) / "latest", tag)


def _files(tag_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(tag_dir)): p.stat().st_size for p in sorted(tag_dir.rglob("*"))
            if p.is_file() and p.name != MARKER}


def write_checkpoint(engine, save_dir: PathLike, tag: str, client_state: dict, *, step: int, keep: int = 0,
                     log=print, exclude_frozen: bool = False) -> Path:
    """Save a complete checkpoint (see the module doc); every rank calls it. ``keep`` > 0: keep
    only the ``keep`` newest complete ``global_stepN`` checkpoints (rank 0 deletes the rest after the
    new one is complete). ``exclude_frozen``: leave out parameters without gradients (LoRA: the frozen
    base). Returns the tag directory."""
    save_dir = Path(save_dir)
    engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state, save_latest=False,
                           exclude_frozen_parameters=exclude_frozen)
    _barrier()
    tag_dir = save_dir / tag
    if _rank() == 0:
        files = _files(tag_dir)
        _atomic_write(tag_dir / MARKER, json.dumps({"tag": tag, "step": step, "files": files}, indent=1) + "\n")
        write_latest(save_dir, tag)
        for old in prune_checkpoints(save_dir, keep, protect=tag):
            log(f"ds_adaptive: deleted old checkpoint {old} (--keep-checkpoints {keep})")
    _barrier()
    return tag_dir


def prune_checkpoints(save_dir: PathLike, keep: int, *, protect: str) -> list[Path]:
    """Delete the oldest good ``global_stepN`` checkpoints so that ``keep`` good ones remain
    (``protect`` is never deleted; incomplete or corrupt ones neither count nor are deleted: they are
    left for a person to look at). ``keep`` <= 0: keep all."""
    if keep <= 0:
        return []
    save_dir = Path(save_dir)
    complete = sorted((step_of(p.name), p) for p in save_dir.iterdir()
                      if p.is_dir() and step_of(p.name) is not None and check_checkpoint(p) is None)
    gone = []
    for _, p in complete[:max(0, len(complete) - keep)]:
        if p.name != protect:
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def check_checkpoint(tag_dir: PathLike, *, need_marker: bool = True) -> Optional[str]:
    """None when ``tag_dir`` holds a complete checkpoint; else what is wrong, for a person."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        return f"{tag_dir} does not exist"
    marker = tag_dir / MARKER
    if not marker.is_file():
        if need_marker:
            return (f"{tag_dir} has no completeness marker {MARKER} (the save was interrupted, or it was "
                    "written by another program)")
        expected = None
    else:
        try:
            expected = json.loads(marker.read_text())["files"]
        except (ValueError, KeyError, TypeError) as exc:
            return f"{marker} is unreadable ({exc})"
    if expected is not None:
        for name, size in expected.items():
            p = tag_dir / name
            if not p.is_file():
                return f"{p} is missing (listed in {MARKER})"
            actual = p.stat().st_size
            if actual != size:
                return f"{p} has {actual} bytes, {MARKER} says {size} (truncated or overwritten)"
    pts = sorted(tag_dir.glob("*.pt"))
    if not pts:
        return f"{tag_dir} holds no DeepSpeed checkpoint file (*.pt)"
    if not any(p.name.endswith("model_states.pt") for p in pts):
        return f"{tag_dir} has no *model_states.pt file"
    for p in pts:  # torch.save files are zip archives: a cut-off file has no central directory
        try:
            with zipfile.ZipFile(p) as z:
                z.namelist()
        except (zipfile.BadZipFile, OSError) as exc:
            return f"{p} is not a readable torch checkpoint file ({exc})"
    return None


def _candidates(save_dir: Path) -> list[str]:
    """Tags to try, best first: the one named by ``latest``, then every ``global_stepN`` newest first."""
    tags = sorted((p.name for p in save_dir.iterdir() if p.is_dir() and step_of(p.name) is not None),
                  key=step_of, reverse=True)
    latest = save_dir / "latest"
    if latest.is_file():
        named = latest.read_text().strip()
        tags = [named] + [t for t in tags if t != named]
    return tags


def find_resumable(save_dir: PathLike) -> tuple[str, list[str]]:
    """The newest complete checkpoint of ``save_dir`` (``latest`` first) and one note per skipped
    candidate naming what was wrong. Raises :class:`CheckpointError` when none is usable."""
    save_dir = Path(save_dir)
    notes = []
    for tag in _candidates(save_dir):
        problem = check_checkpoint(save_dir / tag)
        if problem is None:
            return tag, notes
        notes.append(f"skipping checkpoint {tag}: {problem}")
    detail = "; ".join(notes) if notes else "it holds no 'latest' file and no global_stepN directory"
    raise CheckpointError(f"no complete checkpoint in {save_dir}: {detail}")
