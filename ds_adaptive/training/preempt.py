"""Stopping at a step boundary on SIGTERM / SIGINT / SIGHUP / SIGUSR1 (what a scheduler sends before preemption).

    stop = StopRequest.install()          # in every rank, before training
    ...
    if stop.agreed(device):               # once per optimizer step, a collective: every rank agrees
        save, then exit with EXIT_PREEMPTED

The handler only records the signal: the rank finishes the optimizer step it is in. Before the next
step every rank contributes its flag to an all_reduce (MAX), so a signal that reached one rank only
(or reached the ranks at different steps) still stops all of them after the same step, which is
what a consistent ZeRO-3 checkpoint needs. A second signal to a rank restores the default action
and re-raises it (the rank dies at once); the launcher's supervisor does the same for the whole run.
Under SLURM (``DS_ADAPTIVE_REPEAT_SIGNAL=ignore``) repeats are the same request: SLURM signals every
process of a step, srun forwards its own copy, and SLURM kills by itself at its deadline.
"""
from __future__ import annotations

import os
import re
import signal
from typing import Optional

import torch

__all__ = ["StopRequest", "EXIT_PREEMPTED", "EXIT_PEER_LOST", "STOP_SIGNALS", "ignore_stop_signals", "peer_lost"]

EXIT_PREEMPTED = 75
"""Exit status of a run stopped by a signal at a step boundary (sysexits' EX_TEMPFAIL: "try again",
i.e. resume with ``--resume``). Distinct from 0 (finished), 1 (a bug), 2 (a usage, config or data
error) and 128+N (killed by signal N without stopping cleanly)."""

EXIT_PEER_LOST = 3
"""Exit status of a rank whose collective broke because another rank died or failed (a consequence, not the
cause: ``ds_adaptive/launch/supervise.py`` reports the rank that ended first, with its own status)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)  # USR1: SLURM's --signal=USR1@N
ENV_REPEAT_SIGNAL = "DS_ADAPTIVE_REPEAT_SIGNAL"
"""``ignore`` (launch/train_wan.sh sets it under SLURM): a repeated stop signal is the same request (SLURM
signals every process of a step and srun forwards its own copy; SLURM kills on its own at its deadline)."""

_PEER_LOST = re.compile(r"gloo/transport|Connection (reset|closed) by peer|Broken pipe|NCCL (error|communicator "
                        r"was aborted)|ProcessGroupNCCL|Socket Timeout|connectFullMesh")


def peer_lost(exc: BaseException) -> bool:
    """``exc`` is a collective that failed because another rank is gone (gloo's "Connection reset by peer",
    NCCL's errors, torch.distributed's DistError family), not a bug of this rank."""
    try:
        from torch.distributed import DistError
    except ImportError:  # pragma: no cover
        DistError = ()
    if isinstance(exc, DistError):
        return True
    return isinstance(exc, RuntimeError) and bool(_PEER_LOST.search(str(exc)))


class StopRequest:
    """The signal flag of one rank; :meth:`agreed` makes it a decision of the whole job."""

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None
        self._previous: dict = {}

    @classmethod
    def install(cls, signals=STOP_SIGNALS) -> "StopRequest":
        """Handle ``signals`` in this process (main thread only; elsewhere nothing is installed)."""
        self = cls()
        import threading

        if threading.current_thread() is threading.main_thread():
            for s in signals:
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def _on_signal(self, signum, _frame) -> None:
        if self.signal_name is not None and os.environ.get(ENV_REPEAT_SIGNAL) == "ignore":
            return
        if self.signal_name is not None:  # the second one: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        """This rank got a signal."""
        return self.signal_name is not None

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank got a signal (a collective: call it on every rank at the
        same point of the loop)."""
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 and self.signal_name is None:
            self.signal_name = "a signal to another rank"
        return bool(flag.item() > 0)

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """``worker_init_fn`` of the training DataLoader: its workers ignore the stop signals.

    ``timeout``, Ctrl-C in a terminal and schedulers (SLURM's preemption, Kubernetes) signal the whole
    process group, DataLoader workers included. torch's workers die on SIGTERM, and the main process
    then raises "DataLoader worker ... is killed by signal: Terminated" from its SIGCHLD handler in the
    middle of the step, before the rank can finish the step, save and write its summary (seen on an
    H200 when a run was stopped by ``timeout``). Ignoring the signals in the workers leaves the stop to
    the ranks (:class:`StopRequest`); the workers still end with the main process (torch's watchdog
    and the loader's shutdown)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
