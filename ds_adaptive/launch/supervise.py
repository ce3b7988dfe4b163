"""Signal-safe wrapper around the ``deepspeed`` launcher: signals reach every rank, no orphans.

    python -m ds_adaptive.launch.supervise [--stop-timeout S] -- deepspeed --num_gpus 8 launch/train_wan.py ...

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
  children of ``deepspeed.launcher.launch``, or of the per-node launcher ``ds_adaptive.launch.multinode``
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
* **A rank that dies** (a signal: SIGKILL, the OOM killer, a segfault) or exits with an error while the
  others run: the supervisor sees it at once (a pidfd per rank), gives the other ranks
  ``--rank-exit-grace`` seconds (default 10) to end on their own (gloo tells them at once; an NCCL
  collective can wait for its timeout), then kills the run's process group. One line names the rank that
  ended first and how, the exit status, the last complete checkpoint and the command that resumes from it.
  Ranks that stopped only because that rank was gone exit ``EXIT_PEER_LOST`` (3) quietly.
* **The rendezvous port** (single node): ``--master_port`` of the ``deepspeed`` command, default 29500, must
  be free on this host: no listening socket, and no other supervised run holding it (a ``flock`` on
  ``<tmp>/ds_adaptive.port-<port>.lock`` for the run's lifetime). A port given explicitly (``MASTER_PORT``)
  that is busy ends the launch with one line and exit 2; the default port, when busy, is replaced by a free
  one, and the line says which. A second job on a busy port would otherwise fail with EADDRINUSE, or let
  its ranks join the first job's store.
* At the end, DeepSpeed's CPU shared-memory buffers of this run
  (``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``, ~69 MB per rank, never unlinked by
  DeepSpeed 0.19.8) are removed.

* **The ranks' own words**: the supervisor makes a directory for the run (``$DS_ADAPTIVE_FATAL_DIR``); a rank
  that fails writes its one-line message there, and every rank its exit status, so the supervisor's line carries
  the first failing rank's message when DeepSpeed's launcher killed the ranks before it got out, and says
  "resume with" only when resuming is the way on (not after a start-up error the message explains).
* **The watchdog**: every rank beats ``rankR.beat`` there once a second (a thread); a rank without a beat for
  ``--watchdog`` / ``$DS_ADAPTIVE_WATCHDOG_S`` seconds (default 120; stopped, hung, its node not answering) ends
  the job at once with one line naming the rank, its pid and host, and the resume command (exit 124).
* DeepSpeed's runner exits 0 when its per-node launcher is killed by a signal; the ranks then stop on their
  parent's death and save: the supervisor reports 75 (what they recorded), never 0.

Exit status: 0 finished; 75 stopped by a forwarded signal with a checkpoint (the ranks' ``EXIT_PREEMPTED``);
124 stopped by the watchdog;
2 a usage, config, data or checkpoint error (one message); 128+N a rank killed by signal N (the ``deepspeed``
launcher's own report of it, 256-N, is mapped to 128+N) or the launcher itself killed by N; otherwise the
status of the rank that failed first.

The port claim is :mod:`ds_adaptive.launch.port_claim`, the view of the ranks :mod:`ds_adaptive.launch.rank_watch`.
It imports the standard library, ``psutil`` (a DeepSpeed dependency) and :mod:`ds_adaptive.core.ports` (standard
library only): ``python -m ds_adaptive.launch.supervise`` starts in well under a second, before torch.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from ds_adaptive.core.ckpt_pointer import directory_run_id, marker_of, newest_complete, read_pointer, sizes_problem
from ds_adaptive.launch.port_claim import (DEFAULT_MASTER_PORT, SHM_PREFIX, PortInUse, choose_master_port,  # noqa: F401
                                           claim_port, port_lock_path, release_port, remove_shm_buffers, single_node)
from ds_adaptive.launch.rank_watch import (ENV_FATAL_DIR, EXIT_PEER_LOST, EXIT_PREEMPTED,  # noqa: F401
                                           EXIT_USAGE, LAUNCH_MODULE, NODE_LAUNCH_MODULE, RankEnd, RankWatch,
                                           EXIT_STUCK, launcher_status, process_end, rank_processes,
                                           read_exit_records, read_exits, read_fatal, stale_heartbeats)

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)  # USR1: SLURM's --signal=USR1@N
ENV_SUPERVISOR = "DS_ADAPTIVE_SUPERVISOR_PID"
# DS_ADAPTIVE_REPEAT_SIGNAL=ignore (set by launch/train_wan.sh under SLURM): SLURM signals every process of the
# step, and srun forwards its own copy, so one preemption arrives more than once; a repeat must not kill.
ENV_REPEAT_SIGNAL = "DS_ADAPTIVE_REPEAT_SIGNAL"
ENV_RESUME_HINT = "DS_ADAPTIVE_RESUME_HINT"
"""The command that resumes this run (``launch/train_wan.sh`` sets it), for the rank-death message."""
_PR_SET_PDEATHSIG = 1
ENV_WATCHDOG = "DS_ADAPTIVE_WATCHDOG_S"
WATCHDOG_S = 120.0
"""Default seconds without a heartbeat from a rank before the watchdog stops the job (well under the collective
timeouts: DeepSpeed's 30 min, NCCL's 10 min); ``$DS_ADAPTIVE_WATCHDOG_S`` or ``--watchdog`` set it, 0 turns it off."""
RANK_EXIT_GRACE = 10.0
"""Seconds the other ranks get to end on their own after one rank died or failed."""

# The reaper: waits for EOF on stdin (the supervisor closed the pipe: it exited or was killed).
# A supervisor that exits normally first writes "done"; anything else kills the group, then cleans up what the dead
# supervisor would have: its port lock file (lock=PATH), DeepSpeed's /dev/shm buffers of the job (shm=GLOB: the
# ranks are dead by then) and the ranks' fatal-message directory (rm=DIR).
_REAPER = r"""
import fcntl, glob, os, shutil, signal, sys, time
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):  # a scheduler signals every process
    signal.signal(s, signal.SIG_IGN)
pgid = int(sys.argv[1])
opts = [a.split("=", 1) for a in sys.argv[2:]]
msg = sys.stdin.buffer.read()
if msg.strip() == b"done":
    sys.exit(0)
try:
    os.killpg(pgid, signal.SIGKILL)
    sys.stderr.write(f"ds_adaptive supervisor: the launcher died; killed its process group {pgid}\n")
except ProcessLookupError:
    pass
for _ in range(50):  # the killed ranks' memory maps go before their buffers can be removed for good
    try:
        os.killpg(pgid, 0)
        time.sleep(0.1)
    except (ProcessLookupError, PermissionError):
        break
for key, value in opts:
    try:
        if key == "lock":
            fd = os.open(value, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free now: nobody else holds it
            os.unlink(value)
            os.close(fd)
        elif key == "shm":
            for f in glob.glob(value):
                os.unlink(f)
        elif key == "rm":
            shutil.rmtree(value, ignore_errors=True)
    except OSError:
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


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _save_dir(cmd: list[str]) -> Optional[str]:
    for i, arg in enumerate(cmd):
        if arg == "--save" and i + 1 < len(cmd):
            return cmd[i + 1]
        if arg.startswith("--save="):
            return arg.split("=", 1)[1]
    return None


def resume_advice(cmd: list[str]) -> str:
    """Where the run can go on from: the newest complete checkpoint of ``--save`` (the one ``latest`` names when it
    is a ``global_stepN`` of the directory, by the directory's run, with every file of its marker at its size;
    garbage, an unreadable ``latest`` or a path elsewhere are passed over) and the command."""
    save = _save_dir(cmd)
    if save is None:
        return "Nothing was saved (no --save directory)."
    tag, _ = read_pointer(save)
    owner = directory_run_id(save)
    if tag is not None and (sizes_problem(Path(save) / tag) is not None
                            or (marker_of(Path(save) / tag) or {}).get("run_id") not in (None, owner)):
        tag = None
    tag = tag or newest_complete(save, run_id=owner)
    if tag is None:
        return f"No complete checkpoint in {save} yet."
    hint = os.environ.get(ENV_RESUME_HINT) or shlex.join(
        [c for c in cmd if c != "--overwrite"] + ([] if "--resume" in cmd else ["--resume", save]))
    return f"The last complete checkpoint is {Path(save) / tag}; resume with: {hint}"


class Supervisor:
    """Runs one command in its own process group and owns its signals (see the module doc)."""

    def __init__(self, cmd: list[str], *, stop_timeout: float = 0.0, rank_exit_grace: float = RANK_EXIT_GRACE,
                 log=None, watchdog: float = WATCHDOG_S) -> None:
        self.cmd = cmd
        # the per-node launcher watches its ranks and the other nodes itself and reports the failure once, with
        # its own exit status: the supervisor then only forwards signals and keeps the process group
        self.node_launcher = NODE_LAUNCH_MODULE in " ".join(cmd)
        self.stop_timeout = stop_timeout
        self.rank_exit_grace = rank_exit_grace
        self.log = log or (lambda msg: print(f"ds_adaptive supervisor: {msg}", file=sys.stderr, flush=True))
        self.proc: Optional[subprocess.Popen] = None
        self.reaper: Optional[subprocess.Popen] = None
        self.signals: list[int] = []
        self.stop_deadline: Optional[float] = None
        self.port: Optional[int] = None
        self.watch: Optional[RankWatch] = None
        self.rank_deadline: Optional[float] = None
        """Set when a rank failed: the others are killed if still running then."""
        self.killed_others = False
        self.fatal_dir: Optional[str] = None
        self.watchdog = watchdog
        self.stuck: Optional[dict] = None
        """The rank the watchdog stopped the job for."""

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
        """Start the command and supervise it to the end; returns the exit status (module doc). Raises
        :class:`PortInUse` before starting anything when the explicit rendezvous port is taken."""
        self.cmd, self.port, port_fd = choose_master_port(self.cmd, log=self.log)
        for s in FORWARDED:
            signal.signal(s, self._on_signal)
        self.fatal_dir = tempfile.mkdtemp(prefix="ds_adaptive_fatal.")
        env = {**os.environ, ENV_SUPERVISOR: str(os.getpid()), ENV_FATAL_DIR: self.fatal_dir}
        try:
            self.proc = subprocess.Popen(self.cmd, start_new_session=True, env=env)
        except OSError:  # the command cannot start (main: exit 127): leave no directory behind
            shutil.rmtree(self.fatal_dir, ignore_errors=True)
            if port_fd is not None:
                release_port(self.port, port_fd)
            raise
        clean = ([f"lock={port_lock_path(self.port)}", f"shm={SHM_PREFIX}_{os.getuid()}_*_{self.port}_*"]
                 if self.port is not None else []) + [f"rm={self.fatal_dir}"]
        self.reaper = subprocess.Popen([sys.executable, "-c", _REAPER, str(self.proc.pid), *clean],
                                       stdin=subprocess.PIPE, start_new_session=True)
        self.watch = RankWatch(self.proc.pid)
        rc = None
        try:
            rc = self._supervise()
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
            self.watch.close()
            status = self._exit_status(rc) if rc is not None else None
            shutil.rmtree(self.fatal_dir, ignore_errors=True)
            if self.port is not None:
                remove_shm_buffers(self.port)
            if port_fd is not None:
                release_port(self.port, port_fd)
        return status

    def _supervise(self) -> int:
        """The loop: wait for the launcher, a rank's end (its pidfd) or a signal; returns the launcher's code."""
        handled = 0
        while True:
            fds = self.watch.fds()
            if fds:
                try:
                    select.select(fds, [], [], 0.2)
                except (OSError, ValueError):  # a pidfd closed under us: poll again
                    pass
            else:
                time.sleep(0.2)
            for end in self.watch.poll():
                self._on_rank_end(end)
            rc = self.proc.poll()
            if rc is not None:
                for end in self.watch.poll():
                    self._on_rank_end(end)
                return rc
            while handled < len(self.signals):
                handled += 1
                self._forward(self.signals[handled - 1])
            now = time.monotonic()
            if self.stop_deadline is not None and now > self.stop_deadline:
                self.log(f"the run did not stop within --stop-timeout {self.stop_timeout:g} s of the signal: "
                         "killing it (SIGKILL)")
                self._kill_group()
                self.stop_deadline = None
            if self.stuck is None:  # per-node launches too: this node's ranks (the others see the node go)
                self._check_heartbeats()
            if self.rank_deadline is not None and now > self.rank_deadline:
                self.killed_others = True
                self._kill_group()
                self.rank_deadline = None

    def _check_heartbeats(self) -> None:
        """The watchdog: a rank without a heartbeat for ``watchdog`` s (stopped, hung, its node not answering)
        stops the job at once (SIGKILL of the group: a stopped process cannot act on anything else)."""
        stale = stale_heartbeats(self.fatal_dir, self.watchdog, ended={e.rank for e in self.watch.ended})
        if not stale:
            return
        self.stuck = stale[0]
        self.log(f"watchdog: rank {self.stuck['rank']} (pid {self.stuck['pid']}) on host {self.stuck['host']} made no "
                 f"progress for {self.stuck['age']:.0f} s (no heartbeat: stopped, hung, or its node stopped "
                 f"answering; {ENV_WATCHDOG}={self.watchdog:g}); stopping the job (SIGKILL); exit {EXIT_STUCK}. "
                 f"{resume_advice(self.cmd)}")
        self._kill_group()

    def _on_rank_end(self, end: RankEnd) -> None:
        """A rank ended: after a failure (not during a stop we forwarded) the others get rank_exit_grace s."""
        if (end.failed and not self.signals and self.rank_deadline is None and not self.killed_others
                and not self.node_launcher):
            self.rank_deadline = time.monotonic() + self.rank_exit_grace

    def _exit_status(self, rc: int) -> int:
        """The run's exit status (module doc), and the one line after a rank failure."""
        if self.stuck is not None:
            return EXIT_STUCK
        failure = self.watch.first_failure() if not (self.signals or self.node_launcher) else None
        records = read_exit_records(self.fatal_dir)
        exits = {rank: code for rank, (code, _) in records.items()}
        if failure is not None:
            recorded = self._recorded_cause(failure, records)
            if recorded is not None:
                return self._say_recorded(*recorded, "the other rank(s) stopped")
        if failure is None or (failure.exit_status() is None and exits.get(failure.rank) == EXIT_PREEMPTED):
            return self._launcher_truth(launcher_status(rc), exits)
        status = failure.exit_status()
        if status is None:  # reaped before it was seen: what it recorded, else what the launcher reported
            status = exits.get(failure.rank, launcher_status(rc))
        # the others ended after the failure however they did: on the lost peer (EXIT_PEER_LOST), or terminated by
        # DeepSpeed's launcher first (it kills the rest when one rank exits non-zero: a race with the peer check)
        others = [e for e in self.watch.ended if e is not failure]
        if failure.signal is not None or self.killed_others or others:
            stopped = ("the other rank(s) were killed after " f"{self.rank_exit_grace:g} s" if self.killed_others
                       else "the other rank(s) stopped")
            fatal = read_fatal(self.fatal_dir)
            said = f" ({fatal['message']})" if fatal and not fatal.get("printed") else ""  # its own line was lost
            self.log(f"{failure.describe()}{said}; {stopped}; exit {status}. {self._advice(fatal)}")
        return status

    def _recorded_cause(self, failure: RankEnd, records: dict) -> Optional[tuple[int, int]]:
        """(rank, status) of a rank whose own exit record names the failure where the ends the watch saw do not:
        the failing rank ended unseen (before the watch found it, or reaped at once by its launcher) and the watch
        saw only the ranks its launcher killed afterwards, or only a rank that stopped on the lost peer. A record
        written after the seen failure's end is its consequence, not its cause. None: the seen ends tell it."""
        if failure.code is not None and failure.cause:
            return None  # it exited on its own with a status the watch read
        failing = sorted((t, rank, code) for rank, (code, t) in records.items()
                         if code not in (0, EXIT_PREEMPTED, EXIT_PEER_LOST) and t <= failure.seen)
        if not failing or failing[0][1] == failure.rank:
            return None
        return failing[0][1], failing[0][2]

    def _say_recorded(self, rank: int, code: int, how: str) -> int:
        """Say a failure known from rank ``rank``'s records (exit ``code``; its fatal message, when it left one)."""
        fatal = read_fatal(self.fatal_dir)
        mine = fatal if fatal and fatal.get("rank") == rank else None
        who = f"rank {rank}" + (f" (pid {mine['pid']})" if mine and mine.get("pid") else "")
        said = f" ({mine['message']})" if mine and not mine.get("printed") else ""
        self.log(f"{who} exited with status {code}{said}; {how}; exit {code}. {self._advice(mine)}")
        return code

    def _launcher_truth(self, status: int, exits: dict) -> int:
        """``status`` of the launcher, unless it says 0 while the ranks did not finish: DeepSpeed's runner exits 0
        when its per-node launcher is killed by a signal (the ranks then stop on their parent's death, save and
        exit 75: the job's status is 75), or a rank recorded a failure."""
        if status != 0 or not exits or all(code == 0 for code in exits.values()):
            return status
        if all(code in (0, EXIT_PREEMPTED) for code in exits.values()):
            self.log(f"DeepSpeed's launcher ended early (killed?); the ranks stopped at a step boundary and exited "
                     f"{EXIT_PREEMPTED}; exit {EXIT_PREEMPTED}. {resume_advice(self.cmd)}")
            return EXIT_PREEMPTED
        rank, code = min(((r, c) for r, c in exits.items() if c not in (0, EXIT_PREEMPTED)),
                         key=lambda rc: (rc[1] == EXIT_PEER_LOST, rc[0]))
        # its end was not seen (it failed before the watch found it): what it recorded says who and why
        return self._say_recorded(rank, code, "the launcher reported success")

    def _advice(self, fatal: Optional[dict]) -> str:
        """What to do after a rank's failure: resume, unless its fatal record says there is nothing to resume."""
        if fatal is None or fatal.get("resume"):
            return resume_advice(self.cmd)
        return "Nothing to resume from this launch: do what the message says, then start it again."

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
    ap.add_argument("--rank-exit-grace", type=float, default=RANK_EXIT_GRACE,
                    help="after one rank died or failed, SIGKILL the others if they have not ended within this many "
                         f"seconds (default {RANK_EXIT_GRACE:g})")
    ap.add_argument("--watchdog", type=float, default=float(os.environ.get(ENV_WATCHDOG, WATCHDOG_S) or 0),
                    help="stop the job when a rank has not sent a heartbeat for this many seconds (default: "
                         f"${ENV_WATCHDOG}, else {WATCHDOG_S:g}; 0 = off)")
    if "--" not in argv:
        ap.error("give the command after '--'")
    i = argv.index("--")
    args = ap.parse_args(argv[:i])
    cmd = argv[i + 1:]
    if not cmd:
        ap.error("no command after '--'")
    if args.stop_timeout < 0:
        ap.error(f"--stop-timeout must be >= 0, got {args.stop_timeout}")
    if args.rank_exit_grace < 0:
        ap.error(f"--rank-exit-grace must be >= 0, got {args.rank_exit_grace}")
    try:
        return Supervisor(cmd, stop_timeout=args.stop_timeout, rank_exit_grace=args.rank_exit_grace,
                          watchdog=args.watchdog).run()
    except PortInUse as exc:
        print(f"ds_adaptive supervisor: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FileNotFoundError as exc:
        print(f"supervise.py: cannot start {cmd[0]!r}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
