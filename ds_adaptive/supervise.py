"""Signal-safe wrapper around the ``deepspeed`` launcher: signals reach every rank, no orphans.

    python ds_adaptive/supervise.py [--stop-timeout S] -- deepspeed --num_gpus 8 launch/train_wan.py ...

``launch/train_wan.sh`` runs its ``deepspeed`` command through this file. Why: DeepSpeed's
launcher is a chain of processes (``deepspeed`` runner -> ``deepspeed.launcher.launch`` -> one
process per rank). ``kill`` of the runner (what a scheduler sends to the job's main process)
ends the runner only; the ranks keep training and writing checkpoints. And DeepSpeed's per-node
launcher, when it gets SIGTERM itself, gives the ranks 30 s before it SIGKILLs them: too short
to finish a step and save a checkpoint of a large model.

What the supervisor does:

* The command runs in its own session / process group (``start_new_session``): everything it
  starts (runner, per-node launcher, ranks, DataLoader workers) shares one process group.
* SIGTERM / SIGINT / SIGHUP / SIGUSR1 to the supervisor are forwarded **to the rank processes** (the
  children of ``deepspeed.launcher.launch``, or of the per-node launcher ``ds_adaptive.multinode``
  of a multi-node run without ssh), not to DeepSpeed's launchers, so the trainer's own
  handler decides how to stop (finish the step, save, exit with a distinct code) without a 30 s
  cap. When no local rank is found (multi-node: the ranks run under pdsh on the nodes), the signal
  goes to the runner, whose pdsh handler stops the remote launchers.
* A second signal, or ``--stop-timeout`` seconds after the first, SIGKILLs the whole group (a second
  signal is ignored with ``DS_ADAPTIVE_REPEAT_SIGNAL=ignore``, set under SLURM: SLURM delivers one
  preemption to every process, and again through srun).
* SIGKILL of the supervisor cannot be caught: a small reaper process (its own session, its stdin
  the read end of a pipe that only the supervisor holds) sees the pipe close when the supervisor
  dies in any way and SIGKILLs the group. The ranks also ask the kernel for SIGTERM when their
  parent dies (``die_with_parent``, called by ``launch/train_wan.py``).
* When the command ends, any process of its group still alive (a stray worker) is killed.

Exit status: the command's (a signal death ``-N`` becomes ``128 + N``, like a shell).

This file uses the standard library and ``psutil`` only (a DeepSpeed dependency), so it runs as a
plain script before any package import.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Optional

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)  # USR1: SLURM's --signal=USR1@N
LAUNCH_MODULE = "deepspeed.launcher.launch"
# Multi-node without ssh: the per-node launcher of ds_adaptive/multinode/ starts the ranks itself.
NODE_LAUNCH_MODULE = "ds_adaptive.multinode"
ENV_SUPERVISOR = "DS_ADAPTIVE_SUPERVISOR_PID"
# DS_ADAPTIVE_REPEAT_SIGNAL=ignore (set by launch/train_wan.sh under SLURM): SLURM signals every process of the
# step, and srun forwards its own copy, so one preemption arrives more than once; a repeat must not kill.
ENV_REPEAT_SIGNAL = "DS_ADAPTIVE_REPEAT_SIGNAL"
_PR_SET_PDEATHSIG = 1

# The reaper: waits for EOF on stdin (the supervisor closed the pipe: it exited or was killed).
# A supervisor that exits normally first writes "done"; anything else kills the group.
_REAPER = r"""
import os, signal, sys, time
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):  # a scheduler signals every process
    signal.signal(s, signal.SIG_IGN)
pgid = int(sys.argv[1])
msg = sys.stdin.buffer.read()
if msg.strip() == b"done":
    sys.exit(0)
try:
    os.killpg(pgid, signal.SIGKILL)
    sys.stderr.write(f"ds_adaptive supervisor: the launcher died; killed its process group {pgid}\n")
except ProcessLookupError:
    pass
"""


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies (prctl PR_SET_PDEATHSIG).

    Called at the start of every rank (``launch/train_wan.py``): if DeepSpeed's per-node launcher
    is SIGKILLed, the ranks get ``sig`` instead of running on as orphans. Returns False where the
    call is not available (not Linux). If the parent is already gone, ``sig`` is raised at once.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)
    return True


def rank_processes(root_pid: int) -> list:
    """The rank processes under ``root_pid``: children of a ``deepspeed.launcher.launch`` process, or of
    the per-node launcher ``ds_adaptive.multinode`` (which may be ``root_pid`` itself) (psutil.Process
    objects; empty when none runs on this node)."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    ranks = []
    for proc in tree:
        try:
            cmd = " ".join(proc.cmdline())
            if LAUNCH_MODULE in cmd or f"-m {NODE_LAUNCH_MODULE} launch" in cmd:
                ranks.extend(proc.children())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return ranks


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Supervisor:
    """Runs one command in its own process group and owns its signals (see the module doc)."""

    def __init__(self, cmd: list[str], *, stop_timeout: float = 0.0, log=None) -> None:
        self.cmd = cmd
        self.stop_timeout = stop_timeout
        self.log = log or (lambda msg: print(f"ds_adaptive supervisor: {msg}", file=sys.stderr, flush=True))
        self.proc: Optional[subprocess.Popen] = None
        self.reaper: Optional[subprocess.Popen] = None
        self.signals: list[int] = []
        self.stop_deadline: Optional[float] = None

    def _on_signal(self, signum, _frame) -> None:
        self.signals.append(signum)

    def _forward(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if len(self.signals) > 1 and os.environ.get(ENV_REPEAT_SIGNAL) == "ignore":
            self.log(f"{name} again: ignored ({ENV_REPEAT_SIGNAL}=ignore: the scheduler kills the run itself)")
            return
        if len(self.signals) > 1:
            self.log(f"second signal ({name}): killing every process of the run (SIGKILL)")
            self._kill_group()
            return
        ranks = rank_processes(self.proc.pid)
        if ranks:
            for r in ranks:
                try:
                    r.send_signal(signum)
                except Exception:  # noqa: BLE001 - gone already
                    pass
            again = ("Repeats are ignored." if os.environ.get(ENV_REPEAT_SIGNAL) == "ignore" else
                     "Send it again to kill them at once.")
            self.log(f"{name}: forwarded to {len(ranks)} rank process(es) {sorted(r.pid for r in ranks)}; they "
                     f"stop at the end of the current step. {again}")
        else:
            self.proc.send_signal(signum)
            self.log(f"{name}: no local rank process yet (or multi-node): forwarded to the launcher {self.proc.pid}")
        if self.stop_timeout > 0:
            self.stop_deadline = time.monotonic() + self.stop_timeout

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def run(self) -> int:
        for s in FORWARDED:
            signal.signal(s, self._on_signal)
        env = {**os.environ, ENV_SUPERVISOR: str(os.getpid())}
        self.proc = subprocess.Popen(self.cmd, start_new_session=True, env=env)
        self.reaper = subprocess.Popen([sys.executable, "-c", _REAPER, str(self.proc.pid)], stdin=subprocess.PIPE,
                                       start_new_session=True)
        handled = 0
        try:
            while True:
                try:
                    rc = self.proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    pass
                while handled < len(self.signals):
                    handled += 1
                    self._forward(self.signals[handled - 1])
                if self.stop_deadline is not None and time.monotonic() > self.stop_deadline:
                    self.log(f"the run did not stop within --stop-timeout {self.stop_timeout:g} s of the signal: "
                             "killing it (SIGKILL)")
                    self._kill_group()
                    self.stop_deadline = None
            self._reap_stragglers()
        finally:
            if self.proc.poll() is None:  # an exception in the supervisor itself: leave nothing behind
                self._kill_group()
            try:
                self.reaper.stdin.write(b"done")
                self.reaper.stdin.close()
                self.reaper.wait(timeout=10)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
        return 128 - rc if rc < 0 else rc

    def _reap_stragglers(self, grace: float = 5.0) -> None:
        """The launcher exited; give what is left of its group ``grace`` s, then SIGKILL it."""
        deadline = time.monotonic() + grace
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(self.proc.pid):
            self.log("processes of the run outlived the launcher: killing them (SIGKILL)")
            self._kill_group()


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="supervise.py", description=__doc__.split("\n\n")[0],
                                 usage="supervise.py [--stop-timeout S] -- COMMAND [ARGS ...]")
    ap.add_argument("--stop-timeout", type=float, default=float(os.environ.get("STOP_TIMEOUT", "0") or 0),
                    help="after a forwarded SIGTERM/SIGINT, SIGKILL the run if it has not stopped within this "
                         "many seconds (default: $STOP_TIMEOUT, else 0 = wait; a second signal kills at once)")
    if "--" not in argv:
        ap.error("give the command after '--'")
    i = argv.index("--")
    args = ap.parse_args(argv[:i])
    cmd = argv[i + 1:]
    if not cmd:
        ap.error("no command after '--'")
    if args.stop_timeout < 0:
        ap.error(f"--stop-timeout must be >= 0, got {args.stop_timeout}")
    try:
        return Supervisor(cmd, stop_timeout=args.stop_timeout).run()
    except FileNotFoundError as exc:
        print(f"supervise.py: cannot start {cmd[0]!r}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
