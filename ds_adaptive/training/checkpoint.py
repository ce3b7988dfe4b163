"""Checkpoints you can resume from: complete before ``latest`` moves, checked (bytes and content) before they load.

    write_checkpoint(engine, save_dir, tag, client_state, step=N, keep=3, run_id=ID, good=True)   # every rank
    tag, notes = find_resumable(save_dir)                          # newest complete checkpoint
    problem = check_checkpoint(save_dir / tag)                     # None, or what is wrong (one line)

How a checkpoint is written (every rank calls :func:`write_checkpoint`):

1. Room: the newest complete checkpoint's size must be free on the disk, else every rank stops with one line
   (:class:`CheckpointSpaceError`: the directory, free and needed bytes, the checkpoint kept, the resume command).
2. DeepSpeed's ``save_checkpoint(save_dir, ".TAG.partial", save_latest=False)``: every rank writes its own files
   into the temporary ``save_dir/.TAG.partial``, each file hashed while it is written
   (``ds_adaptive.training.checksum``); ``latest`` is not touched yet. A partial checkpoint never has a final name
   (the start-up checks delete one left by a killed run, with one line); ENOSPC here is the same one line.
3. The ranks gather their files' sizes and checksums (an all-gather: after it every rank's files are on
   disk); a file no rank hashed while writing it is hashed now, the ranks sharing that work.
4. Rank 0 writes the completeness marker ``ds_adaptive_complete.json``: the tag, the step, the run id,
   whether every step since the previous checkpoint was finite (``good``), and the name, byte size and
   checksum of every file; renames the directory to ``TAG`` (a ``TAG`` from before a resume is replaced only
   now); then ``latest`` (write to a temporary file, then ``os.replace``: a reader sees
   the old or the new tag, never half a name); then retention (:func:`prune_checkpoints`): only this run's
   checkpoints are deleted, the ``keep`` newest and the newest good one are kept.
5. A barrier, so that no rank leaves (or exits) before ``latest`` names the new checkpoint.

A preemption at any point leaves ``latest`` naming a complete checkpoint (the previous one until step 4).
``latest`` can only name a ``global_stepN`` directory of ``save_dir`` written by the directory's run
(``ds_adaptive.core.ckpt_pointer``): a path, garbage or an unreadable file is ignored with one line.
On resume, :func:`check_checkpoint` compares the files with the marker (missing directory, missing marker,
missing file, wrong size = truncated, wrong checksum = changed after it was written) and opens every
``.pt`` file's zip directory; :func:`find_resumable` falls back from a bad ``latest`` to the newest good
``global_stepN`` and says what was wrong with each one it skipped. A marker written before checksums
existed (no ``checksums`` key) is checked by size only.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from ds_adaptive.core.ckpt_pointer import (MARKER, PARTIAL_SUFFIX, TAG_PREFIX, directory_run_id, marker_of,  # noqa: F401
                                          newest_complete, partial_dirs, partial_name, read_pointer, tag_step)
from ds_adaptive.training.checksum import ALGORITHM, HashingSaves, file_digest

__all__ = ["MARKER", "TAG_PREFIX", "write_checkpoint", "check_checkpoint", "find_resumable", "tag_for",
           "step_of", "write_latest", "prune_checkpoints", "read_marker", "checkpoint_tags", "last_good",
           "CheckpointError", "CheckpointSpaceError", "remove_partial", "human_bytes", "newest_kept", "PARTIAL_SUFFIX"]


PathLike = Union[str, os.PathLike]


CLIENT_STATE_KEY = "ds_adaptive"
"""The key of ds_adaptive's client state (model preset, layers, step, sampler, LoRA, ...) in a DeepSpeed checkpoint."""


class CheckpointError(ValueError):
    """No checkpoint to resume from (each candidate's problem is named in the message)."""


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step}"


def step_of(tag: str) -> Optional[int]:
    """The step of a ``global_stepN`` tag; None for any other name."""
    return tag_step(tag)


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def _all_gather(obj) -> list:
    """``obj`` of every rank, in rank order (``[obj]`` in a single process). A collective."""
    dist = _dist()
    if dist is None:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


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


def checkpoint_tags(save_dir: PathLike) -> list[str]:
    """The ``global_stepN`` directories of ``save_dir`` (complete or not), oldest first."""
    d = Path(save_dir)
    if not d.is_dir():
        return []
    return sorted((p.name for p in d.iterdir() if p.is_dir() and step_of(p.name) is not None), key=step_of)


def read_marker(tag_dir: PathLike) -> Optional[dict]:
    """The completeness marker of a checkpoint, or None when it has none (or an unreadable one)."""
    return marker_of(tag_dir)


class CheckpointSpaceError(CheckpointError):
    """A save that did not fit on the disk (the message names the directory, free and needed bytes, the checkpoint
    kept and how to resume). ``shared``: every rank raises it (a check before the save), so rank 0 says it."""

    def __init__(self, msg: str, shared: bool = False) -> None:
        super().__init__(msg)
        self.shared = shared


def human_bytes(n: float) -> str:
    """``n`` bytes for a person: GiB from 1 GiB on, MB below (where GiB would read 0.00 or 0.01)."""
    gib = float(1 << 30)
    return f"{n / gib:.2f} GiB" if n >= gib else f"{n / 1e6:.1f} MB"


def _no_space(exc: BaseException) -> bool:
    """``exc`` (or an exception it chains) is ENOSPC / EDQUOT, or torch's zip writer failing on a full disk."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or "unexpected pos" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _space_message(save_dir: Path, tag: str, need: int, run_id: Optional[str], during: bool) -> str:
    free = shutil.disk_usage(save_dir).free
    kept = newest_kept(save_dir, run_id)
    hint = os.environ.get("DS_ADAPTIVE_RESUME_HINT") or f"--resume {save_dir}"
    what = "ran out of space while it was written" if during else "does not fit"
    return (f"checkpoint {tag} {what}: {save_dir} has {human_bytes(free)} free, it needs about "
            f"{human_bytes(need)}; nothing partial was left. "
            + (f"The last complete checkpoint {save_dir / kept} is kept: free some space, then resume with: {hint}"
               if kept else "No complete checkpoint of this run is there yet: free some space and start again"))


def newest_kept(save_dir: PathLike, run_id: Optional[str] = None) -> Optional[str]:
    """The newest complete checkpoint of ``save_dir`` (of ``run_id`` when given; sizes checked)."""
    return newest_complete(save_dir, run_id=run_id)


def _checkpoint_size(tag_dir: Path) -> int:
    marker = read_marker(tag_dir) or {}
    return sum(int(v) for v in (marker.get("files") or {}).values() if isinstance(v, int))


def _check_room(save_dir: Path, tag: str, run_id: Optional[str]) -> None:
    """Before a save (a collective): the newest complete checkpoint's size must be free on ``save_dir``'s disk;
    else every rank raises the same :class:`CheckpointSpaceError`."""
    problem = None
    if _rank() == 0:
        last = newest_kept(save_dir, run_id)
        need = _checkpoint_size(save_dir / last) if last else 0
        if need and shutil.disk_usage(save_dir).free < need:
            problem = _space_message(save_dir, tag, need, run_id, during=False)
    problem = _all_gather(problem)[0]
    if problem is not None:
        raise CheckpointSpaceError(problem, shared=True)


def _replace_dir(tmp: Path, final: Path, log) -> None:
    """``tmp`` takes the name ``final``; a directory already there (a save of this step from before a resume)
    goes away only once the new one is complete."""
    if final.exists():
        old = final.with_name(f".{final.name}.replaced{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        log(f"ds_adaptive: replacing the checkpoint {final} written before this run resumed")
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def write_checkpoint(engine, save_dir: PathLike, tag: str, client_state: dict, *, step: int, keep: int = 0,
                     run_id: Optional[str] = None, good: bool = True, nonfinite_steps=(), log=print,
                     exclude_frozen: bool = False, extra_files: Optional[Callable[[Path], object]] = None,
                     info: Optional[dict] = None) -> Path:
    """Save a complete checkpoint (see the module doc); every rank calls it. ``keep`` > 0: keep only the
    ``keep`` newest complete checkpoints of ``run_id`` and its newest ``good`` one (rank 0 deletes the rest
    after the new one is complete; checkpoints of other runs are never deleted). ``good``: every step since
    the previous checkpoint was finite (``nonfinite_steps`` lists the ones that were not). ``exclude_frozen``:
    leave out parameters without gradients (LoRA: the frozen base). ``extra_files(tag_dir)``: every rank writes
    its own files into the checkpoint after DeepSpeed's (the EMA's slices); they are in the marker, checked like
    DeepSpeed's. ``info``: more keys for the marker (the model, its depth, the world size: checked before a
    resume loads anything). The files are written under ``.TAG.partial`` and renamed to ``TAG`` once complete. A full disk is
    a :class:`CheckpointSpaceError` (the partial files removed). Returns the tag directory."""
    save_dir = Path(save_dir)
    tag_dir, work = save_dir / tag, partial_name(tag)
    tmp_dir = save_dir / work
    _check_room(save_dir, tag, run_id)
    if _rank() == 0 and tmp_dir.exists():  # an interrupted save of this step
        shutil.rmtree(tmp_dir)
    _barrier()
    try:
        with HashingSaves(engine) as saved:
            engine.save_checkpoint(str(save_dir), tag=work, client_state=client_state, save_latest=False,
                                   exclude_frozen_parameters=exclude_frozen)
        if extra_files is not None:
            extra_files(tmp_dir)
    except Exception as exc:
        if not _no_space(exc):
            raise
        need = _checkpoint_size(save_dir / (newest_kept(save_dir, run_id) or tag)) or _dir_bytes(tmp_dir)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise CheckpointSpaceError(_space_message(save_dir, tag, need, run_id, during=True)) from None
    checksums = _gather_checksums(tmp_dir, saved.digests)
    if _rank() == 0:
        marker = {**(info or {}), "tag": tag, "step": step, "run_id": run_id, "good": bool(good),
                  "nonfinite_steps": list(nonfinite_steps),
                  "files": {name: size for name, (size, _) in sorted(checksums.items())},
                  "checksums": {"algorithm": ALGORITHM,
                                "files": {name: digest for name, (_, digest) in sorted(checksums.items())}}}
        _atomic_write(tmp_dir / MARKER, json.dumps(marker, indent=1) + "\n")
        _replace_dir(tmp_dir, tag_dir, log)
        write_latest(save_dir, tag)
        for old in prune_checkpoints(save_dir, keep, protect=tag, run_id=run_id):
            log(f"ds_adaptive: deleted old checkpoint {old} (--keep-checkpoints {keep})")
    _barrier()
    return tag_dir


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def remove_partial(save_dir: PathLike) -> list[Path]:
    """Delete the interrupted saves (``.global_stepN.partial``) of ``save_dir``; returns them."""
    gone = partial_dirs(save_dir)
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def _gather_checksums(tag_dir: Path, written: dict) -> dict[str, tuple[int, str]]:
    """(size, checksum) of every file of ``tag_dir`` on every rank (a collective). ``written`` holds the
    files this rank hashed while writing them; the files no rank hashed (another checkpoint engine, a
    file written outside ``checkpoint_engine.save``) are hashed now, file ``i`` of them by rank
    ``i % world``."""
    mine = {}
    for path, value in written.items():
        try:
            mine[str(Path(path).resolve().relative_to(tag_dir.resolve()))] = value
        except ValueError:  # written outside the tag directory (not part of the checkpoint)
            continue
    merged: dict = {}
    for part in _all_gather(mine):
        merged.update(part)
    rest = [name for name in _files(tag_dir) if name not in merged]
    dist = _dist()
    ranks = dist.get_world_size() if dist is not None else 1
    mine = {name: (os.path.getsize(tag_dir / name), file_digest(tag_dir / name))
            for name in rest[_rank()::ranks]}
    for part in _all_gather(mine):
        merged.update(part)
    return merged


def prune_checkpoints(save_dir: PathLike, keep: int, *, protect: str, run_id: Optional[str] = None) -> list[Path]:
    """Delete the oldest complete ``global_stepN`` checkpoints of ``run_id`` so that ``keep`` remain, and
    never the newest one whose marker says ``good`` (every step since the checkpoint before it finite):
    the last good checkpoint is never rotated out. Checkpoints of other runs (another ``run_id`` in the
    marker), incomplete or corrupt ones neither count nor are deleted (they are left for a person to look
    at); ``protect`` is never deleted. ``run_id`` None: every complete checkpoint counts (markers written
    before run ids existed). ``keep`` <= 0: keep all. Checks sizes only (a full checksum pass per save would
    read every checkpoint again)."""
    if keep <= 0:
        return []
    save_dir = Path(save_dir)
    ours = []
    for tag in checkpoint_tags(save_dir):
        marker = read_marker(save_dir / tag)
        if marker is None or check_checkpoint(save_dir / tag, verify=False) is not None:
            continue
        if run_id is None or marker.get("run_id") == run_id:
            ours.append((tag, bool(marker.get("good", True))))
    kept = {tag for tag, _ in ours[-keep:]} | {protect}
    good = [tag for tag, ok in ours if ok]
    if good:
        kept.add(good[-1])
    gone = []
    for tag, _ in ours:
        if tag not in kept:
            shutil.rmtree(save_dir / tag, ignore_errors=True)
            gone.append(save_dir / tag)
    return gone


def last_good(save_dir: PathLike, run_id: Optional[str] = None, exclude=()) -> Optional[str]:
    """The newest complete checkpoint of ``save_dir`` (of ``run_id``, when given; not in ``exclude``) whose marker
    says ``good`` (sizes checked, not contents)."""
    for tag in reversed(checkpoint_tags(save_dir)):
        if tag in exclude:
            continue
        marker = read_marker(Path(save_dir) / tag)
        if (marker is not None and marker.get("good", True) and (run_id is None or marker.get("run_id") == run_id)
                and check_checkpoint(Path(save_dir) / tag, verify=False) is None):
            return tag
    return None


def check_checkpoint(tag_dir: PathLike, *, need_marker: bool = True, verify: bool = True,
                     part: tuple[int, int] = (0, 1)) -> Optional[str]:
    """None when ``tag_dir`` holds a complete checkpoint; else what is wrong, for a person (one line).

    Every file's presence and size are checked against the marker; ``verify``: the contents too (the
    checksums in the marker; every byte is read). ``part=(i, n)`` opens and reads only the files
    ``i, i + n, ...`` (sorted by name), so that ``n`` ranks can share the reading (:func:`find_resumable`
    with a collective ``check``)."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        return f"{tag_dir} does not exist"
    marker = read_marker(tag_dir)
    if marker is None:
        if (tag_dir / MARKER).exists():
            return f"{tag_dir / MARKER} is unreadable (not a JSON object)"
        if need_marker:
            return (f"{tag_dir} has no completeness marker {MARKER} (the save was interrupted, or it was "
                    "written by another program)")
        expected, digests, algorithm = None, {}, None
    else:
        expected = marker.get("files")
        if not isinstance(expected, dict):
            return f"{tag_dir / MARKER} is unreadable (no 'files' table)"
        sums = marker.get("checksums") or {}
        digests, algorithm = sums.get("files") or {}, sums.get("algorithm")
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
    i, n = part
    for p in pts[i::n]:  # torch.save files are zip archives: a cut-off file has no central directory
        try:
            with zipfile.ZipFile(p) as z:
                z.namelist()
        except (zipfile.BadZipFile, OSError) as exc:
            return f"{p} is not a readable torch checkpoint file ({exc})"
    if verify and digests:
        for name in sorted(digests)[i::n]:
            try:
                actual = file_digest(tag_dir / name, algorithm)
            except ValueError as exc:  # an algorithm this installation lacks
                return f"cannot check {tag_dir / name}: {exc}"
            if actual != digests[name]:
                return (f"{tag_dir / name} does not match its {algorithm} checksum in {MARKER} (its contents "
                        "changed after it was written: corrupt or overwritten)")
    return None


def _candidates(save_dir: Path, notes: list) -> list[str]:
    """Tags to try, best first: the one named by ``latest`` (when it names a ``global_stepN`` directory of
    ``save_dir``: ``ds_adaptive.core.ckpt_pointer``), then every ``global_stepN`` newest first. A pointer that is
    ignored, and checkpoints another run wrote (another run id than the directory's), add a line to ``notes``."""
    tags = list(reversed(checkpoint_tags(save_dir)))
    named, note = read_pointer(save_dir)
    if note is not None:
        notes.append(note)
    if named is not None:
        tags = [named] + [t for t in tags if t != named]
    owner = directory_run_id(save_dir)
    out = []
    for tag in tags:
        run = (read_marker(save_dir / tag) or {}).get("run_id")
        if owner is not None and run and run != owner:
            notes.append(f"skipping checkpoint {tag}: written by another run (run id {run}, the directory's run is "
                         f"{owner})")
            continue
        out.append(tag)
    return out


def find_resumable(save_dir: PathLike, check: Optional[Callable[[Path], Optional[str]]] = None
                   ) -> tuple[str, list[str]]:
    """The newest complete checkpoint of ``save_dir`` (``latest`` first) and one note per skipped
    candidate naming what was wrong. ``check`` (default :func:`check_checkpoint`, contents included) may
    be a collective that shares the reading between ranks. Raises :class:`CheckpointError` when none is
    usable."""
    save_dir = Path(save_dir)
    check = check or check_checkpoint
    notes: list = []
    for tag in _candidates(save_dir, notes):
        problem = check(save_dir / tag)
        if problem is None:
            return tag, notes
        notes.append(f"skipping checkpoint {tag}: {problem}")
    detail = "; ".join(notes) if notes else "it holds no complete global_stepN checkpoint"
    raise CheckpointError(f"no complete checkpoint in {save_dir}: {detail}")


def read_client_state(ckpt_dir: Path) -> dict:
    """The ds_adaptive client state (:data:`CLIENT_STATE_KEY`) of the checkpoint directory ``ckpt_dir``, read from
    its model-states file; {} if absent. A file that cannot be read is a :class:`CheckpointError` naming it."""
    files = sorted(Path(ckpt_dir).glob("*model_states.pt"))
    if not files:
        raise CheckpointError(f"{ckpt_dir} holds no *model_states.pt: not a complete DeepSpeed checkpoint")
    try:
        state = torch.load(files[0], map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same message for the user
        raise CheckpointError(f"{files[0]} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is "
                              "truncated or corrupt") from None
    return dict(state.get(CLIENT_STATE_KEY) or {})
