"""The trainer's checkpoints: what a checkpoint carries (:class:`TrainState`), saving it, resuming from one.

    state = TrainState()                                      # a new run: step 0, a fresh run id
    ckpt = Checkpointing(run, engine, sparse=hook, log=print)
    ckpt.resume("ckpt", state)                                # the newest complete checkpoint of --save "ckpt"
    ckpt.save(state)                                          # global_step{state.global_step} in --save

The files, markers, checksums and retention are ``ds_adaptive.training.checkpoint``; this module adds the
trainer's part: the client state (sampler position, model, LoRA adapters, sparse-attention state; the EMA's
record, its slices in one file per rank: ``ds_adaptive.training.ema``), the checks
shared by the ranks before a load, and the run's continuation after a resume (its run id, a note when the loaded
checkpoint is not marked good).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ds_adaptive.training.checkpoint import (CLIENT_STATE_KEY, CheckpointError, check_checkpoint, find_resumable,
                                             last_good, read_marker, step_of, tag_for, write_checkpoint)
from ds_adaptive.training.ema import EMA_CLIENT_KEY
from ds_adaptive.training.lora import CLIENT_KEY as LORA_KEY, resume_problem
from ds_adaptive.planning.sampler import SamplerStateError
from ds_adaptive.training.run_config import UsageError

__all__ = ["TrainState", "Checkpointing", "checkpoint_location", "resume_mismatch"]


def _new_run_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class TrainState:
    """Where the run is: what a checkpoint carries (and a resume restores) besides weights and sampler."""

    global_step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """The sampler's epoch."""
    step_in_epoch: int = 0
    """Optimizer steps done in ``epoch``."""
    nonfinite_steps: list = field(default_factory=list)
    """Steps whose loss or gradient norm was not finite (their updates skipped)."""
    run_id: str = field(default_factory=_new_run_id)
    """The run id in every checkpoint marker (retention deletes only this run's checkpoints); a resume from
    ``--save`` continues the run of the checkpoint it loads. Every rank draws one; rank 0's is written."""
    last_saved_step: int = 0
    """The step of the last checkpoint saved or loaded (a checkpoint is *good* when no step after it failed)."""


class Checkpointing:
    """Saves and resumes the trainer's checkpoints (every rank calls both: they are collectives)."""

    def __init__(self, run, engine, *, sparse=None, log: Callable[[str], None] = print, ema=None) -> None:
        self.run, self.engine, self.sparse, self.log, self.ema = run, engine, sparse, log, ema
        self.opts = run.cfg.trainer

    def client_state(self, state: TrainState) -> dict:
        """DeepSpeed's client_state of a checkpoint of ``state``."""
        o = self.opts
        mine = {"global_step": state.global_step, "epoch": state.epoch, "step_in_epoch": state.step_in_epoch,
                "sampler": self.run.sampler.state_dict(state.step_in_epoch), "seed": o.seed, "model": o.model,
                "layers": o.layers, "data": o.data, "world_size": self.run.layout.world,
                "nonfinite_steps": list(state.nonfinite_steps)}
        out = {CLIENT_STATE_KEY: mine}
        if self.sparse is not None:
            out.update(self.sparse.client_state())
        if self.run.lora is not None:  # adapters only: the frozen base is rebuilt (seed / --init-from) on resume
            mine[LORA_KEY] = self.run.lora.client_state()
        if self.ema is not None:
            mine[EMA_CLIENT_KEY] = self.ema.record()
        return out

    def save(self, state: TrainState) -> None:
        """A complete checkpoint ``global_step{N}`` in ``--save`` (sampler state in DeepSpeed's client_state);
        ``latest`` moves after every rank's files are on disk (``ds_adaptive.training.checkpoint``), then the oldest
        beyond ``--keep-checkpoints`` are deleted."""
        t0 = time.perf_counter()
        # "good": every step since the previous checkpoint was finite; retention never deletes the newest good one
        window = [s for s in state.nonfinite_steps if s > state.last_saved_step]
        write_checkpoint(self.engine, self.opts.save, tag_for(state.global_step), self.client_state(state),
                         step=state.global_step, keep=self.opts.keep_checkpoints, run_id=state.run_id,
                         good=not window, nonfinite_steps=window, log=self.log,
                         exclude_frozen=self.run.lora is not None,
                         extra_files=self.ema.save if self.ema is not None else None,
                         info={"model": self.opts.model, "num_layers": self.run.model_config.num_layers,
                               "world_size": self.run.layout.world})
        state.last_saved_step = state.global_step
        self.log(f"saved checkpoint step {state.global_step} to {self.opts.save} ({time.perf_counter() - t0:.1f} s)"
                 + (f"; not marked good: non-finite step(s) {window[-5:]} since the previous checkpoint" if window
                    else ""))

    def resume(self, path: str, state: TrainState) -> None:
        """Load ``path`` (the --save directory: its newest complete checkpoint, falling back from a corrupt or
        incomplete ``latest``; or DIR/global_stepN: that one) into the engine (weights, optimizer, scheduler),
        the sampler and ``state``."""
        load_dir, tag = self._choose(path)
        problem = resume_mismatch(read_marker(Path(load_dir) / tag) or {}, world=self.run.layout.world,
                                  model=self.opts.model, layers=self.run.model_config.num_layers,
                                  zero_sharded=any((Path(load_dir) / tag).glob("zero_pp_rank_*optim_states.pt")))
        if problem is not None:
            raise UsageError(f"--resume {path}: {problem}")
        client, load_path = self._load(path, load_dir, tag)
        mine = (client or {}).get(CLIENT_STATE_KEY)
        if mine is None:
            raise UsageError(f"--resume {path}: the checkpoint {load_path} was not written by ds_adaptive "
                             f"(client_state has no '{CLIENT_STATE_KEY}')")
        lora = resume_problem(self.run.lora, Path(load_dir) / tag, mine)
        if lora is not None:
            raise UsageError(f"--resume {path}: {lora}")
        restarted = self._load_sampler(mine)
        if self.ema is not None:
            self.log(f"ds_adaptive: {self.ema.load(Path(load_dir) / tag)}")
        if self.sparse is not None:
            self.sparse.load(client, model=self.run.model, layout=self.run.layout)
        state.global_step, state.epoch, state.step_in_epoch = mine["global_step"], mine["epoch"], mine["step_in_epoch"]
        if restarted:
            state.step_in_epoch = 0
        state.nonfinite_steps = list(mine.get("nonfinite_steps", []))
        state.last_saved_step = state.global_step
        self.log(f"resumed from {load_path}: step {state.global_step} (epoch {state.epoch}, step "
                 f"{state.step_in_epoch} of the epoch)")
        self.continue_run(Path(load_dir), tag, state)

    def _load_sampler(self, mine: dict) -> bool:
        """The sampler's position; True when ``--restart-epoch`` replaced a state of another dataset by the
        saved epoch planned afresh (said in one line)."""
        try:
            self.run.sampler.load_state_dict(mine["sampler"])
            return False
        except SamplerStateError as exc:
            if not self.opts.restart_epoch:
                raise
            self.run.sampler.set_epoch(int(mine["epoch"]))
            self.log(f"ds_adaptive: --restart-epoch: {str(exc).split(': the consumed', 1)[0]}; epoch {mine['epoch']} "
                     f"is planned afresh for this dataset from step {mine['global_step']} on (weights and optimizer "
                     "resumed; samples already seen in this epoch are seen again)")
            return True

    def _choose(self, path: str) -> tuple[str, str]:
        """(load directory, tag) of ``--resume path``, the files checked (the ranks share the reading)."""
        load_dir, tag = checkpoint_location(path)
        if tag is None:
            try:
                tag, skipped = find_resumable(load_dir, check=self.check_shared)
            except CheckpointError as exc:
                raise UsageError(f"--resume {path}: {exc}. Nothing was loaded: fix or remove them and resume "
                                 f"(RESUME=1), or start a new run there with OVERWRITE=1 (--overwrite deletes "
                                 "them)") from None
            for note in skipped:
                self.log(f"ds_adaptive: --resume {path}: {note}; falling back to an older checkpoint")
        else:
            problem = self.check_shared(Path(load_dir) / tag, need_marker=False)
            if problem is not None:
                raise UsageError(f"--resume {path}: {problem}; pass the --save directory to fall back to the "
                                 "newest complete checkpoint")
        return load_dir, tag

    def _load(self, path: str, load_dir: str, tag: str) -> tuple[Optional[dict], str]:
        """DeepSpeed's load of ``load_dir/tag``: (client state, load path); a failure is one UsageError."""
        try:  # a LoRA checkpoint has no frozen base weights: the module state is not loaded strictly
            load_path, client = self.engine.load_checkpoint(load_dir, tag=tag, load_module_strict=self.run.lora is None)
        except (RuntimeError, OSError, EOFError, KeyError, ValueError) as exc:
            lora = resume_problem(self.run.lora, Path(load_dir) / tag)  # LoRA vs full fine-tuning, named
            raise UsageError(f"--resume {path}: " + (lora or f"DeepSpeed could not load checkpoint {tag} "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")) from None
        if load_path is None:
            raise UsageError(f"--resume {path}: DeepSpeed could not load a checkpoint from it")
        return client, load_path

    def check_shared(self, tag_dir: Path, need_marker: bool = True) -> Optional[str]:
        """:func:`check_checkpoint` with the reading shared by the ranks (rank r reads files r, r + world, ...;
        a collective): the first problem any rank found, on every rank."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return check_checkpoint(tag_dir, need_marker=need_marker)
        mine = check_checkpoint(tag_dir, need_marker=need_marker, part=(dist.get_rank(), dist.get_world_size()))
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
        return next((p for p in found if p is not None), None)

    def continue_run(self, load_dir: Path, tag: str, state: TrainState) -> None:
        """After a resume: keep the run id of a checkpoint loaded from --save (its retention goes on), and say
        when the loaded checkpoint is not marked good (non-finite steps before it), naming the last good one."""
        marker = read_marker(load_dir / tag) or {}
        save = self.opts.save
        if save and Path(save).resolve() == load_dir.resolve() and marker.get("run_id"):
            state.run_id = marker["run_id"]
        if not marker.get("good", True):
            good = last_good(load_dir, marker.get("run_id"))
            self.log(f"ds_adaptive: note: {tag} was saved after non-finite step(s) {marker.get('nonfinite_steps')} "
                     "(their updates were skipped); the last checkpoint whose steps were all finite is "
                     + (f"{good}: --resume {load_dir / good} goes back to it" if good else "none"))


def resume_mismatch(saved: dict, *, world: int, model: str, layers: Optional[int],
                    zero_sharded: bool = True) -> Optional[str]:
    """None when a run of ``model`` (``layers`` blocks) on ``world`` ranks can load a checkpoint whose marker is
    ``saved``; else one line saying why not and how to go on (before anything is loaded). Markers without these
    keys (older checkpoints) are not checked. A checkpoint without ZeRO optimizer shards loads on any world size."""
    s_model, s_layers, s_world = saved.get("model"), saved.get("num_layers"), saved.get("world_size")
    if s_model is not None and (s_model != model or (s_layers is not None and layers is not None
                                                      and s_layers != layers)):
        return (f"the checkpoint is of --model {s_model} ({s_layers} blocks), this run is --model {model} "
                f"({layers} blocks): resume with MODEL={s_model} (--model {s_model}"
                + (f" --layers {s_layers}" if s_layers is not None else "") + "), or start a new run in another "
                "SAVE_DIR (--init-from an export of it: ds-adaptive export)")
    if zero_sharded and s_world is not None and s_world != world:
        return (f"the checkpoint was saved by {s_world} rank(s), this run has {world}: its ZeRO optimizer shards "
                f"are per rank and nothing was loaded. Resume with the same world size (NUM_PROCS={s_world} on the "
                f"CPU, or {s_world} GPUs in all: NUM_GPUS / nodes), or export it (ds-adaptive export) and start a "
                "new run on this world size with --init-from (the optimizer state starts afresh)")
    return None


def checkpoint_location(path: str) -> tuple[str, Optional[str]]:
    """``--resume DIR`` (the --save directory: its 'latest' checkpoint) or ``DIR/global_stepN`` (that one)."""
    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"--resume {path}: no such directory; pass the directory given to --save, or one of its "
                         "global_stepN subdirectories")
    if (p / "latest").is_file() or any(step_of(c.name) is not None for c in p.iterdir() if c.is_dir()):
        return str(p), None
    if any(p.glob("*model_states.pt")):
        return str(p.parent), p.name
    raise UsageError(f"--resume {path}: no DeepSpeed checkpoint there (neither a 'latest' file, a global_stepN "
                     "directory nor *model_states.pt); pass the directory given to --save, or one of its "
                     "global_stepN subdirectories")
