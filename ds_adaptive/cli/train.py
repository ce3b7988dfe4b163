"""``ds-adaptive train``: train a video DiT with DeepSpeed (ZeRO-3) on mixed image + video latents, batched by AdaptiveLoad.

    deepspeed launch/train_wan.py --deepspeed_config launch/configs/zero3_adaptive.json --model wan2.1-1.3b
    bash launch/train_wan.sh                      # the embedded default on this machine

The thin command line: flags -> :class:`ds_adaptive.training.run_config.RunConfig` -> ``init_distributed`` ->
:func:`ds_adaptive.training.assemble.build_run` -> :class:`ds_adaptive.training.trainer.Trainer` ``.fit()``. The objective
(rectified flow matching, the timestep shift, per-sample seeds) is ``ds_adaptive.models.objective``; loss
weighting and checkpoints are ``ds_adaptive.training.trainer``; docs/ARCHITECTURE.md shows the flow.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
import warnings
from typing import Optional

from ds_adaptive.core.config import ConfigError
from ds_adaptive.data import DataError
from ds_adaptive.models.objective import EVAL_TIMESTEPS, flow_matching_losses, sample_seed  # noqa: F401  (public names)
from ds_adaptive.training.run_config import DEFAULT_SAVE_INTERVAL, UsageError, run_config_from_args
from ds_adaptive.core.shapes import ShapeError
from ds_adaptive.launch.supervise import ENV_SUPERVISOR
from ds_adaptive.launch.rank_watch import start_heartbeat, write_exit, write_fatal
from ds_adaptive.training.checkpoint import CheckpointError, CheckpointSpaceError
from ds_adaptive.training.evaluation import evaluate  # noqa: F401  (public name)
from ds_adaptive.training.engine import backward_micro_batch, init_distributed, shutdown_distributed  # noqa: F401
from ds_adaptive.models.registry import model_names
from ds_adaptive.core.layout import Layout
from ds_adaptive.training.assemble import build_run
from ds_adaptive.launch.startup import prepare_save_dir
from ds_adaptive.training.trainer import Trainer
from ds_adaptive.planning.memory import configure_allocator
from ds_adaptive.planning.profile import ProfileError
from ds_adaptive.planning.planner import OversizeSampleError, PlanError
from ds_adaptive.planning.sampler import SamplerStateError
from ds_adaptive.core.layout import SequenceParallelError
from ds_adaptive.models.family import ModelError
from ds_adaptive.training.preempt import EXIT_PEER_LOST, peer_lost
from ds_adaptive.training.trainer import EXIT_PREEMPTED
from ds_adaptive.training.nonfinite import NonFiniteError


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line (from rank 0 only), not the usage block once per rank."""

    def error(self, message: str):
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")
        self.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ds-adaptive train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")
    p.add_argument("--deepspeed_config", "--deepspeed-config", required=True,
                   help="DeepSpeed json with the 'adaptive_load' block (see launch/configs/)")
    p.add_argument("--deepspeed", action="store_true", help="accepted for DeepSpeed launcher compatibility")

    p.add_argument("--model", default="tiny", choices=model_names(), help="the model (default: %(default)s)")
    p.add_argument("--layers", type=int, default=None, help="override the number of transformer blocks")
    p.add_argument("--steps", type=int, default=20, help="train until this global optimizer step")
    p.add_argument("--data", default="synthetic",
                   help="'synthetic' (the embedded default) or a directory written by 'ds-adaptive synth'")
    p.add_argument("--num-samples", type=int, default=None, help="size of the synthetic dataset (default 10000)")
    p.add_argument("--shapes", default=None,
                   help="shape-distribution json of the synthetic data (default: adaptive_load.sampler.shapes, "
                        "else the model's shipped mix)")
    p.add_argument("--shift", type=float, default=5.0, help="timestep shift of the flow-matching sampler (default 5)")
    p.add_argument("--objective", action="append", default=None, metavar="KEY=VALUE",
                   help="override one of the model's objective options, e.g. sigma_range=[0.875,1] (noise levels "
                        "trained on; an expert's own range by default); repeatable")
    p.add_argument("--seed", type=int, default=0, help="model init, data and noise seed")
    p.add_argument("--sp", type=int, default=None,
                   help="Ulysses sequence-parallel degree (default: the ds_config's sequence_parallel_size, else 1)")
    p.add_argument("--fused-ln-modulate", action=argparse.BooleanOptionalAction, default=None,
                   help="override adaptive_load.fused_ln_modulate")
    p.add_argument("--grad-ckpt", nargs="?", const="all", default=None, choices=["auto", "all", "none"],
                   help="override adaptive_load.recompute.blocks: 'auto' (per micro-batch the fewest blocks "
                        "that fit the memory budget, from the plan), 'all' (every block; the value of a bare "
                        "--grad-ckpt) or 'none'; default: the config's (auto)")
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader workers per rank (default: 2 on GPU, 0 on CPU)")
    p.add_argument("--log-dir", default=None, help="override adaptive_load.metrics.log_dir")
    p.add_argument("--global-batch", type=int, default=None, metavar="SAMPLES",
                   help="samples per optimizer step over all data-parallel ranks: overrides "
                        "adaptive_load.sampler.global_batch (launcher: GLOBAL_BATCH=N); scale the LR with it yourself")
    p.add_argument("--compute-timing", action=argparse.BooleanOptionalAction, default=True,
                   help="time each rank's compute without ZeRO's waits for other ranks (CV_step; default on); "
                        "--no-compute-timing: wall-clock time only")
    p.add_argument("--eval-samples", type=int, default=0,
                   help="after training, the flow-matching loss on this many held-out synthetic samples at "
                        f"{EVAL_TIMESTEPS} fixed timesteps with fixed noise (summary 'eval_loss'; default 0: off)")
    p.add_argument("--save", default=None, help="checkpoint directory")
    p.add_argument("--save-interval", type=int, default=None,
                   help=f"save every N steps when --save is given (default {DEFAULT_SAVE_INTERVAL}; 0: only at the "
                        "end and on SIGTERM/SIGINT)")
    p.add_argument("--keep-checkpoints", type=int, default=None,
                   help="keep the N newest complete checkpoints in --save, delete older ones (default 3; 0: keep all)")
    p.add_argument("--resume", default=None,
                   help="resume from the newest complete checkpoint of this --save directory (a corrupt or "
                        "incomplete 'latest' falls back to the previous one), or from DIR/global_stepN")
    p.add_argument("--restart-epoch", action="store_true", default=None,
                   help="with --resume after the dataset changed (bad samples dropped from its index): keep the "
                        "weights, optimizer and step, plan the current epoch afresh for this dataset")
    p.add_argument("--overwrite", action="store_true", default=None,
                   help="start a new run in --save although it holds checkpoints of an earlier run: they are "
                        "deleted at start-up (without it: an error naming them; --resume continues that run)")
    p.add_argument("--init-from", default=None,
                   help="fine-tune: start from these weights (diffusers or the original layout, or a diffusers "
                        "pipeline directory: the model's folder in it; --model/--layers must match them)")
    p.add_argument("--nonfinite", choices=("skip", "stop"), default=None,
                   help="a step whose loss or gradient norm is not finite: skip it (no update; default) or stop")
    p.add_argument("--nonfinite-limit", type=int, default=None,
                   help="stop (exit 2) once more than N steps were skipped as non-finite (default 20)")
    return p


def train(args: argparse.Namespace) -> dict:
    """Run the training job; returns the summary (identical on every rank)."""


    start_heartbeat()   # the supervisor's watchdog: this rank is alive (a thread; none outside a supervisor)
    cfg = run_config_from_args(args)
    alloc_msg = configure_allocator()  # before the first CUDA allocation
    if os.environ.get("RANK", "0") == "0" and _cuda_available():  # the CUDA allocator means nothing on a CPU run
        print(alloc_msg, flush=True)
    rank, _, device = init_distributed(args.local_rank)
    # --save writable, --init-from fits, the run lock, earlier checkpoints, disk space: before the model is built
    save_dir = prepare_save_dir(cfg, rank=rank, command=" ".join(sys.argv))
    try:
        for note in save_dir.notes:
            print(note, flush=True)
        # DeepSpeed 0.19 still calls torch.distributed's renamed collectives (one FutureWarning per call
        # site and rank); and one copy of our own warnings is enough.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        # DeepSpeed reads the LR scheduler once before its first step (a warning per rank, about its own call)
        logging.getLogger("DeepSpeed").addFilter(_drop_deepspeed_noise)
        if rank != 0:
            warnings.filterwarnings("ignore", category=UserWarning, module=r"ds_adaptive")
        layout = Layout.detect(cfg.trainer.sp, ds_config=cfg.ds_config)
        run = build_run(cfg, layout=layout, device=device)
        trainer = Trainer(run)
        _STAGE["training"] = True   # a failure from now on is resumed from the last checkpoint
        return trainer.fit()
    finally:
        save_dir.release()


_STAGE = {"training": False}
"""Whether the run got past its start-up (resume included): a later failure's way on is to resume."""


def _drop_deepspeed_noise(record: logging.LogRecord) -> bool:
    return "get learning rate from scheduler before it has started" not in record.getMessage()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)


    ok = False
    try:
        summary = train(args)
        ok = True
        if summary.get("stopped"):
            return EXIT_PREEMPTED  # stopped by a signal at a step boundary (checkpoint saved with --save)
    except (ConfigError, DataError, ShapeError, UsageError, FileNotFoundError, ModelError, PlanError,
            ProfileError, SequenceParallelError, SamplerStateError, OversizeSampleError, NonFiniteError,
            CheckpointError) as exc:
        # These come from the config, the plan or the files, which every rank sees alike: one message
        # (rank 0's), not one per rank; a DataError (or a full disk met by one rank) may be one rank's own, so
        # every rank says it. The supervisor gets it too (its line names it, however this rank ends).
        rank = int(os.environ.get("RANK", "0") or 0)
        line = f"ds-adaptive train: error: {exc}"
        printed = rank == 0 or isinstance(exc, DataError) or (isinstance(exc, CheckpointSpaceError) and not exc.shared)
        if printed:
            print(line, file=sys.stderr, flush=True)
        write_fatal(line, resume=_STAGE["training"], rank=rank, printed=printed)  # after: the console has it
        return 2
    except Exception as exc:
        if not peer_lost(exc):
            raise
        # Another rank died or failed: this one's collective broke. The launcher's supervisor names the rank
        # that failed first (one message); without it, each surviving rank says so in one line.
        if not os.environ.get(ENV_SUPERVISOR):
            print(f"ds-adaptive train: rank {os.environ.get('RANK', '0')}: lost contact with another rank "
                  f"({str(exc).splitlines()[0][:200]}); stopping (exit {EXIT_PEER_LOST})", file=sys.stderr,
                  flush=True)
        return EXIT_PEER_LOST
    finally:
        shutdown_distributed(barrier=ok)
    return 0


def exit_process(code: int, *, immediate: bool = False) -> None:
    """End a training process with ``code`` once :func:`main` has returned.

    A multi-rank run (or any with ``immediate``) ends with ``os._exit`` after flushing: by then the logs,
    checkpoints and the summary are closed and the process group is destroyed, but C++ threads of gloo / DeepSpeed
    ops can still abort the interpreter's teardown ("terminate called without an active exception",
    signal 6), which would replace the run's exit code (0, or 75 after a preemption) with a crash.
    A single process exits normally. The status is recorded for the supervisor first (``write_exit``)."""
    write_exit(code)
    if not immediate and int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def run(argv: Optional[list[str]] = None) -> None:
    """:func:`main`, then :func:`exit_process`. An error that :func:`main` does not turn into an exit status (a CUDA
    out-of-memory, a bug) is printed with its traceback, and the process ends with 1 at once at any world size
    (``immediate``): an interpreter teardown after a failed step can wait forever on what the run left behind (a
    non-daemon thread, a compile-worker pool, a broken NCCL communicator), and a rank that hangs after its error is a
    stalled job, not a failed one."""
    try:
        code = main(argv)
    except Exception:
        traceback.print_exc()
        exit_process(1, immediate=True)
    exit_process(code)


if __name__ == "__main__":
    run()
