"""Start-up checks of a training run: what would fail later fails before the model is built, in one line.

    guard = prepare_save_dir(cfg, rank=rank, command=" ".join(sys.argv))   # every rank (a collective)
    ...                                                                    # build_run, Trainer(...).fit()
    guard.release()                                                        # rank 0 drops the run lock

Rank 0 checks, in this order, and the first problem ends every rank with the same message (exit 2):

1. ``--save``: not a file, creatable, writable (a probe file is written, synced and removed);
2. ``--init-from``: the weights' files exist, their headers read, and every tensor's name and shape fit
   the model of ``--model`` / ``--layers`` (``ds_adaptive.models.weights``); then every tensor is read once
   (one at a time) and one with a NaN / inf is named;
3. the run lock of ``--save`` (``ds_adaptive.training.runlock``): another live run there is an error;
4. checkpoints already in ``--save`` from an earlier run: an error naming them, unless this run resumes
   from that directory (``--resume``) or was started with ``--overwrite`` (then they are deleted, after
   every check has passed);
5. free disk space for ``--keep-checkpoints`` + 1 checkpoints (they coexist until the oldest is pruned;
   :func:`checkpoint_bytes`: parameters x optimizer-state bytes), in MB where GiB would read 0.00.

Partial checkpoints (``.global_stepN.partial``: a save that was killed) are deleted first, with one line;
``global_stepN`` directories without a completeness marker neither block a new run nor get resumed.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ds_adaptive.training.checkpoint import (checkpoint_tags, human_bytes, newest_kept, read_marker, remove_partial,
                                             step_of)
from ds_adaptive.training.run_config import RunConfig, UsageError
from ds_adaptive.training.runlock import RunLock, RunLockError
from ds_adaptive.models.family import ModelError
from ds_adaptive.models.registry import get_model

__all__ = ["SaveDir", "prepare_save_dir", "save_dir_problem", "init_from_problem", "nonfinite_weights_problem",
           "checkpoint_bytes",
           "disk_problem", "OPTIMIZER_STATE_BYTES"]

OPTIMIZER_STATE_BYTES = {"sgd": 8, "adagrad": 8}
"""Bytes per parameter in DeepSpeed's optimizer-state files by optimizer type (lower case): the fp32 master
copy plus the optimizer's own state; any other optimizer (Adam, AdamW, FusedAdam, Lamb, ...) 12 (master + two
moments)."""
DEFAULT_OPTIMIZER_STATE_BYTES = 12


@dataclass
class SaveDir:
    """What the start-up checks leave for the run: the run lock (rank 0) and notes to print once."""

    path: Optional[Path] = None
    lock: Optional[RunLock] = None
    notes: list = field(default_factory=list)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def save_dir_problem(save: str) -> Optional[str]:
    """None when ``save`` is (or can be made) a directory this process can write; else the message."""
    p = Path(save)
    if p.exists() and not p.is_dir():
        return f"--save {save} is a file, not a directory; pass a directory for the checkpoints (SAVE_DIR)"
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return (f"--save {save}: cannot create the checkpoint directory ({exc.strerror or exc}); pick a directory "
                "you can write (SAVE_DIR)")
    probe = p / f".ds_adaptive_write_probe.{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"ds_adaptive")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return (f"--save {save} is not writable ({exc.strerror or exc}); pick a directory you can write "
                "(SAVE_DIR), or fix its permissions")
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None


def init_from_problem(path: str, model: str, layers: Optional[int]) -> Optional[str]:
    """None when the pretrained weights at ``path`` fit the model (names and shapes, from the files' headers,
    by the model family's weight adapter); else one line naming the first problems and what to do."""
    import torch


    spec = get_model(model)
    cfg = spec.config(**({"num_layers": layers} if layers else {}))
    try:
        with torch.device("meta"):
            net = spec.build(cfg)
        spec.weights.check(net, path, subfolder=spec.subfolder)
    except ModelError as exc:
        text = " ".join(line.strip() for line in str(exc).splitlines())
        return f"--init-from {path} (--model {model}, {cfg.num_layers} blocks): {text}"
    except Exception as exc:  # noqa: BLE001 - an unreadable file is the same message whatever the reader raised
        return (f"--init-from {path} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "check the path and that the download is complete")
    return nonfinite_weights_problem(path, spec.subfolder)


def nonfinite_weights_problem(path: str, subfolder: Optional[str] = None) -> Optional[str]:
    """None when every floating-point tensor of the safetensors files at ``path`` (its ``subfolder`` when it has
    one) is finite; else one line naming the first tensor with NaN / inf and its file. Read tensor by tensor."""
    import torch
    from safetensors import safe_open

    root = Path(path)
    if subfolder and (root / subfolder).is_dir():
        root = root / subfolder
    files = [root] if root.is_file() else sorted(root.glob("*.safetensors"))
    for f in files:
        if f.suffix != ".safetensors":
            continue
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    bad = int((~torch.isfinite(t)).sum())
                    return (f"--init-from {path}: tensor {name!r} in {f} has {bad} non-finite value(s) (NaN / inf) of "
                            f"{t.numel()}: every step would be skipped as non-finite. Use an intact copy of the "
                            "weights (re-download or re-export them)")
    return None


def checkpoint_bytes(cfg: RunConfig) -> tuple[int, str]:
    """Estimated bytes of one checkpoint of this run and how the estimate was made: parameters x (optimizer
    state bytes + the weights' bytes when ZeRO < 3 keeps them in the model-state file)."""
    t, ds = cfg.trainer, cfg.ds_config
    spec = get_model(t.model)
    n = spec.param_counts(spec.config(**({"num_layers": t.layers} if t.layers else {})))["total"]
    opt = str((ds.get("optimizer") or {}).get("type", "AdamW")).lower()
    per = OPTIMIZER_STATE_BYTES.get(opt, DEFAULT_OPTIMIZER_STATE_BYTES)
    stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
    half = any((ds.get(k) or {}).get("enabled") in (True, "auto") for k in ("bf16", "fp16"))
    weights = 0 if stage == 3 else (2 if half else 4)
    return n * (per + weights), (f"{n / 1e9:.3g}B parameters x {per + weights} bytes ({opt} state"
                                 + (f" + weights" if weights else "") + ")")


def disk_problem(save: str, need: int, how: str, freed: int = 0, count: int = 1) -> Optional[str]:
    """None when the filesystem of ``save`` has ``count`` x ``need`` bytes free (counting ``freed`` bytes about to
    be deleted); else the message (MB where GiB would read 0.00)."""
    free = shutil.disk_usage(save).free + freed
    if free >= need * count:
        return None
    many = (f"{count} checkpoints (--keep-checkpoints + the one being written) need about "
            f"{human_bytes(need * count)}, one" if count > 1 else "one checkpoint")
    return (f"--save {save}: {human_bytes(free)} free on its filesystem, {many} needs about "
            f"{human_bytes(need)} ({how}); free some space, lower KEEP_CHECKPOINTS, or choose another --save / "
            "SAVE_DIR")


def _incomplete(save: Path, tags: list[str]) -> list[str]:
    """The ``global_stepN`` of ``tags`` without a completeness marker (saves interrupted before atomic saves)."""
    return [t for t in tags if read_marker(save / t) is None]


def _checkpoints_to_keep(cfg: RunConfig, save: Path, resuming: bool) -> int:
    """How many more checkpoints must fit on the disk: ``keep + 1`` coexist before pruning, less the ones of
    the run resumed already there (at least one)."""
    keep = cfg.trainer.keep_checkpoints or 0
    if keep <= 0:
        return 1
    there = 0
    if resuming:
        run = (read_marker(save / newest_kept(save)) or {}).get("run_id") if newest_kept(save) else None
        there = sum(1 for t in checkpoint_tags(save) if run and (read_marker(save / t) or {}).get("run_id") == run)
    return max(1, keep + 1 - there)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _resumes_from(save: Path, resume: Optional[str]) -> bool:
    """``--resume`` names ``save`` itself or one of its ``global_stepN`` directories."""
    if resume is None:
        return False
    r = Path(resume).resolve()
    return r == save.resolve() or (step_of(r.name) is not None and r.parent == save.resolve())


def _rank0_checks(cfg: RunConfig, command: str) -> SaveDir:
    """The checks of the module doc; raises UsageError with the first problem (the lock released)."""
    t = cfg.trainer
    if t.overwrite and t.resume:
        raise UsageError("--overwrite starts a new run and --resume continues one; give one of them")
    if t.save is not None:
        problem = save_dir_problem(t.save)
        if problem:
            raise UsageError(problem)
    if t.init_from:
        problem = init_from_problem(t.init_from, t.model, t.layers)
        if problem:
            raise UsageError(problem)
    out = SaveDir()
    if t.save is None:
        return out
    save = Path(t.save)
    out.path = save
    try:
        out.lock = RunLock.acquire(save, command=command)
    except RunLockError as exc:
        raise UsageError(str(exc)) from None
    try:
        if out.lock.took_over:
            out.notes.append(f"ds_adaptive: {save}: {out.lock.took_over}")
        for gone in remove_partial(save):
            out.notes.append(f"ds_adaptive: {save}: removed {gone.name}, a checkpoint whose save was interrupted "
                             "(it was never complete)")
        resuming = _resumes_from(save, t.resume)
        found = checkpoint_tags(save)
        partial = _incomplete(save, found)
        if partial and not resuming:
            out.notes.append(f"ds_adaptive: {save}: ignoring {', '.join(partial)}: no completeness marker (an "
                             "interrupted save); they are not resumed and do not block a new run")
        earlier = [] if resuming else [tag for tag in found if tag not in partial]
        if earlier and not t.overwrite:
            shown = ", ".join(earlier[-4:]) + (f" and {len(earlier) - 4} more" if len(earlier) > 4 else "")
            raise UsageError(f"--save {save} already holds checkpoints of an earlier run ({shown}): continue that "
                             f"run with RESUME=1 (--resume {save}), start a new one there with OVERWRITE=1 "
                             "(--overwrite deletes them), or choose another SAVE_DIR / --save")
        need, how = checkpoint_bytes(cfg)
        problem = disk_problem(str(save), need, how, freed=sum(_dir_bytes(save / tag) for tag in earlier),
                               count=_checkpoints_to_keep(cfg, save, resuming))
        if problem:
            raise UsageError(problem)
        for tag in earlier:  # --overwrite: every check passed
            shutil.rmtree(save / tag)
        if earlier:
            (save / "latest").unlink(missing_ok=True)
            out.notes.append(f"ds_adaptive: --overwrite: deleted the earlier run's checkpoints {', '.join(earlier)} "
                             f"in {save}")
    except BaseException:
        out.release()
        raise
    return out


def prepare_save_dir(cfg: RunConfig, *, rank: int, command: str = "") -> SaveDir:
    """Run the start-up checks on rank 0 and share the outcome (a collective when torch.distributed is
    initialised): every rank raises the same UsageError, or every rank goes on. Rank 0's result holds the
    run lock; call :meth:`SaveDir.release` at the end."""
    out, problem = SaveDir(), None
    if rank == 0:
        try:
            out = _rank0_checks(cfg, command)
        except UsageError as exc:
            problem = str(exc)
        except Exception as exc:  # a bug: the other ranks stop with its name, rank 0 raises it
            _share(f"the start-up checks failed on rank 0 ({type(exc).__name__}: {exc})")
            raise
    problem = _share(problem)
    if problem is not None:
        raise UsageError(problem)
    return out


def _share(value):
    """Rank 0's ``value`` on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
