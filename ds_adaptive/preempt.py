"""Stopping at a step boundary on SIGTERM / SIGINT / SIGHUP (what a scheduler sends before preemption).

    stop = StopRequest.install()          # in every rank, before training
    ...
    if stop.agreed(device):               # once per optimizer step, a collective: every rank agrees
        save, then exit with EXIT_PREEMPTED

The handler only records the signal: the rank finishes the optimizer step it is in. Before the next
step every rank contributes its flag to an all_reduce (MAX), so a signal that reached one rank only
(or reached the ranks at different steps) still stops all of them after the same step, which is
what a consistent ZeRO-3 checkpoint needs. A second signal to a rank restores the default action
and re-raises it (the rank dies at once); the launcher's supervisor does the same for the whole run.
"""
from __future__ import annotations

import os
import signal
from typing import Optional

import torch

__all__ = ["StopRequest", "EXIT_PREEMPTED", "STOP_SIGNALS"]

EXIT_PREEMPTED = 75
"""Exit status of a run stopped by a signal at a step boundary (sysexits' EX_TEMPFAIL: "try again",
i.e. resume with ``--resume``). Distinct from 0 (finished), 1 (a bug), 2 (a usage, config or data
error) and 128+N (killed by signal N without stopping cleanly)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


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
