"""The trainer's arguments in the dry run: what `ds-adaptive train` would get, parsed by its own parser and
checked as the run checks them before it builds the model (flags, the data directory and its shapes,
``--init-from`` weights against ``--model``/``--layers``, ``--save`` and its earlier checkpoints)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn, Optional

import numpy as np

from ds_adaptive.cli.train import build_parser as trainer_parser
from ds_adaptive.core.shapes import ShapeWeight
from ds_adaptive.planning.shape_table import dataset_shapes
from ds_adaptive.launch.startup import _resumes_from, init_from_problem
from ds_adaptive.training.checkpoint import checkpoint_tags
from ds_adaptive.training.run_config import RunConfig, UsageError, run_config_from_args


class TrainerArgumentError(ValueError):
    """A trainer argument the trainer's parser refuses (unknown flag, bad value)."""


def _refuse(message: str) -> NoReturn:
    raise TrainerArgumentError(message)


def trainer_namespace(args: argparse.Namespace, extra: list[str]) -> argparse.Namespace:
    """The namespace ``ds-adaptive train`` gets for the dry run's own flags followed by ``extra`` (the trainer
    arguments after ``--``; a later flag wins, as on the trainer's command line). An unknown flag or a bad value
    raises :class:`TrainerArgumentError` with one line."""
    base = ["--deepspeed_config", args.deepspeed_config, "--model", args.model]
    for flag, value in (("--layers", args.layers), ("--sp", args.sp), ("--shapes", args.shapes)):
        if value:
            base += [flag, str(value)]
    parser = trainer_parser()
    parser.error = _refuse  # one line, not argparse's usage block
    ns, unknown = parser.parse_known_args(base + list(extra))
    if unknown:
        raise TrainerArgumentError(f"unknown trainer argument(s) {' '.join(unknown)} (`ds-adaptive train --help` "
                                   "lists them)")
    return ns


def trainer_run_config(ns: argparse.Namespace, *, world: int, device: str) -> RunConfig:
    """:func:`ds_adaptive.training.run_config.run_config_from_args`: the trainer's own flag checks, for the planned
    launch's world and device."""
    return run_config_from_args(ns, world=world, device=device)


def start_up_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """(check, message) for the start-up checks of the run that need no process group and write nothing:
    ``--init-from`` weights fit the model, ``--save`` is not a file and holds no earlier run's checkpoints unless
    resumed or overwritten (``ds_adaptive.launch.startup``)."""
    t, out = cfg.trainer, []
    if t.overwrite and t.resume:
        out.append(("save", "--overwrite starts a new run and --resume continues one; give one of them"))
    if t.init_from:
        problem = init_from_problem(t.init_from, t.model, t.layers)
        if problem:
            out.append(("init-from", problem))
    if t.save is not None:
        save = Path(t.save)
        if save.exists() and not save.is_dir():
            out.append(("save", f"--save {save} is a file, not a directory; pass a directory for the checkpoints "
                                "(SAVE_DIR)"))
        elif save.is_dir() and not t.overwrite and not _resumes_from(save, t.resume) and checkpoint_tags(save):
            out.append(("save", f"--save {save} already holds checkpoints of an earlier run: continue it with "
                                f"RESUME=1 (--resume {save}), start a new one there with OVERWRITE=1, or choose "
                                "another SAVE_DIR / --save"))
    return out


def data_shapes(run) -> Optional[list[ShapeWeight]]:
    """The shapes of a data directory's samples with their counts (None for the synthetic data, whose shape mix
    the dry run reads from its shapes file)."""
    if run.cfg.trainer.data == "synthetic":
        return None
    shapes = dataset_shapes(run.dataset)
    counts = np.bincount(shapes.ids, minlength=len(shapes.unique))
    return [ShapeWeight(shape, float(n)) for shape, n in sorted(zip(shapes.unique, counts.tolist()),
                                                                 key=lambda kv: kv[0].tokens)]


__all__ = ["TrainerArgumentError", "UsageError", "data_shapes", "start_up_problems", "trainer_namespace",
           "trainer_run_config"]
