"""The rank processes of this node and how each one ended (the supervisor's view of its job).

    watch = RankWatch(launcher_pid)
    for end in watch.poll(): ...          # RankEnd: rank, pid, the signal that killed it or its exit code
    watch.first_failure()                 # the rank whose failure stopped the run

Standard library and ``psutil`` only (the supervisor starts before torch).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["LAUNCH_MODULE", "NODE_LAUNCH_MODULE", "EXIT_USAGE", "EXIT_PEER_LOST", "EXIT_PREEMPTED", "RankEnd",
           "RankWatch", "rank_processes", "process_end", "launcher_status", "signame", "ENV_FATAL_DIR", "write_fatal",
           "read_fatal", "write_exit", "read_exits", "read_exit_records",
           "start_heartbeat", "stale_heartbeats", "EXIT_STUCK", "HEARTBEAT_S"]

ENV_FATAL_DIR = "DS_ADAPTIVE_FATAL_DIR"
"""A directory the supervisor makes for its run: a rank that fails writes its one-line message there
(:func:`write_fatal`) before it prints it, so the message reaches the console (the supervisor's line) even when
DeepSpeed's launcher kills that rank before its own output got out."""

LAUNCH_MODULE = "deepspeed.launcher.launch"
# Multi-node without ssh: the per-node launcher of ds_adaptive/launch/multinode/ starts the ranks itself.
NODE_LAUNCH_MODULE = "ds_adaptive.launch.multinode"

# The ranks' exit codes the supervisor tells apart (ds_adaptive.training.preempt; this file imports no package code:
# tests/integration/test_checkpoint_safety.py checks that they agree).
EXIT_USAGE = 2
EXIT_PEER_LOST = 3
EXIT_PREEMPTED = 75


def rank_processes(root_pid: int) -> list:
    """The rank processes under ``root_pid``: children of a ``deepspeed.launcher.launch`` process, or of
    the per-node launcher ``ds_adaptive.launch.multinode`` (which may be ``root_pid`` itself) (psutil.Process
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


@dataclass
class RankEnd:
    """One rank process that ended: its rank, pid, and the signal that killed it or its exit code (both None
    when it was reaped before the supervisor could read its status); ``seen``: when the supervisor saw it gone
    (wall clock, the time base of the ranks' exit records)."""

    rank: int
    pid: int
    signal: Optional[int] = None
    code: Optional[int] = None
    seen: float = field(default=0.0, compare=False)

    @property
    def failed(self) -> bool:
        """Ended by a signal, or with a status other than 0 and the preemption exit."""
        return self.signal is not None or self.code not in (0, EXIT_PREEMPTED)

    @property
    def cause(self) -> bool:
        """A failure of its own (not a rank that stopped because another was gone)."""
        return self.failed and self.code != EXIT_PEER_LOST

    def describe(self) -> str:
        who = f"rank {self.rank} (pid {self.pid})"
        if self.signal is not None:
            return f"{who} was killed by {signame(self.signal)}"
        if self.code is None:
            return f"{who} ended (its exit status was not seen)"
        return f"{who} exited with status {self.code}"

    def exit_status(self) -> Optional[int]:
        return 128 + self.signal if self.signal is not None else self.code


def signame(sig: int) -> str:
    try:
        return f"{signal.Signals(sig).name} (signal {sig})"
    except ValueError:
        return f"signal {sig}"


def process_end(pid: int) -> Optional[tuple[Optional[int], Optional[int]]]:
    """None while ``pid`` runs; (signal, None) / (None, exit code) once it is a zombie (its parent has not reaped
    it yet: /proc/PID/stat field 52, the wait status); (None, None) once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None, None
    if fields[0] not in ("Z", "X"):
        return None
    status = int(fields[49]) if len(fields) > 49 else -1
    if status < 0:
        return None, None
    return (status & 0x7F, None) if status & 0x7F else (None, (status >> 8) & 0xFF)


def _started(proc) -> bool:
    """``proc`` runs its own program: a child forked but not exec'd yet still shows its launcher's command line
    and environment (no RANK of its own); it is found on a later poll."""
    try:
        return proc.cmdline() != proc.parent().cmdline()
    except Exception:  # noqa: BLE001 - psutil NoSuchProcess / AccessDenied / ZombieProcess, no parent: gone
        return True


class RankWatch:
    """The rank processes of this node (children of ``deepspeed.launcher.launch``) and how each ended.

    Each rank gets a pidfd (Linux >= 5.3), readable the moment it exits, so :meth:`poll` runs before
    DeepSpeed's launcher (which polls once a second) reaps it and the wait status is still readable."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.ranks: dict[int, tuple[int, Optional[int]]] = {}  # pid -> (rank, pidfd)
        self.ended: list[RankEnd] = []

    def fds(self) -> list[int]:
        done = {e.pid for e in self.ended}
        return [fd for pid, (_, fd) in self.ranks.items() if fd is not None and pid not in done]

    def _discover(self) -> None:
        for proc in rank_processes(self.root_pid):
            if proc.pid in self.ranks or not _started(proc):
                continue
            try:
                rank = int(proc.environ().get("RANK", len(self.ranks)))
            except Exception:  # noqa: BLE001 - psutil AccessDenied / NoSuchProcess / a bad value
                rank = len(self.ranks)
            try:
                fd = os.pidfd_open(proc.pid)
            except (AttributeError, OSError):
                fd = None
            self.ranks[proc.pid] = (rank, fd)

    def poll(self) -> list[RankEnd]:
        """Ranks that ended since the last call (oldest first)."""
        new = []
        done = {e.pid for e in self.ended}
        for pid, (rank, _) in self.ranks.items():
            if pid in done:
                continue
            end = process_end(pid)
            if end is not None:
                new.append(RankEnd(rank, pid, *end, seen=time.time()))
        self.ended += new
        self._discover()
        return new

    def close(self) -> None:
        for _, fd in self.ranks.values():
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def first_failure(self) -> Optional[RankEnd]:
        """The rank whose failure stopped the run: the first that failed on its own; else the first that ended
        with an unseen status; else the first that lost its peers."""
        for test in (lambda e: e.cause and (e.signal is not None or e.code is not None),
                     lambda e: e.cause, lambda e: e.failed):
            found = next((e for e in self.ended if test(e)), None)
            if found is not None:
                return found
        return None


def write_fatal(message: str, *, resume: bool, rank: Optional[int] = None, printed: bool = False) -> None:
    """Record this rank's fatal one-line ``message`` for the supervisor (no-op outside one). ``resume``: resuming
    from the last checkpoint is the way on (False: a start-up problem the message says how to fix). ``printed``:
    this rank printed it (and flushed) before recording it, so the console has it already."""
    where = os.environ.get(ENV_FATAL_DIR)
    if not where:
        return
    rank = int(os.environ.get("RANK", "0") or 0) if rank is None else rank
    path = os.path.join(where, f"rank{rank}.json")
    try:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"rank": rank, "pid": os.getpid(), "message": message, "resume": bool(resume),
                       "printed": bool(printed), "time": time.time()}, f)
        os.replace(tmp, path)
    except OSError:
        pass


HEARTBEAT_S = 1.0
"""Seconds between a rank's heartbeats (a thread: a rank waiting in a collective still beats; a stopped
process, a hung node or a rank holding the interpreter does not)."""
EXIT_STUCK = 124
"""The supervisor's exit status when its watchdog stopped the job: a rank made no progress (no heartbeat) for
the watchdog's time (``timeout``'s convention: 124 = timed out)."""


def start_heartbeat(interval: float = HEARTBEAT_S) -> Optional[threading.Thread]:
    """Beat ``rank{R}.beat`` in the supervisor's directory every ``interval`` s from a daemon thread (its
    content: host and pid; its mtime: the beat). None outside a supervisor."""
    where = os.environ.get(ENV_FATAL_DIR)
    if not where:
        return None
    path = os.path.join(where, f"rank{int(os.environ.get('RANK', '0') or 0)}.beat")
    try:
        with open(path, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
    except OSError:
        return None

    def beat() -> None:
        while True:
            try:
                os.utime(path)
            except OSError:
                return
            time.sleep(interval)

    t = threading.Thread(target=beat, name="ds_adaptive-heartbeat", daemon=True)
    t.start()
    return t


def stale_heartbeats(where: Optional[str], timeout: float, now: Optional[float] = None, ended=()) -> list[dict]:
    """The ranks whose heartbeat in ``where`` is older than ``timeout`` s: {rank, host, pid, age}, oldest first.
    A rank that recorded its exit (``rankR.exit``) or is in ``ended`` (seen ending) is not counted."""
    if not where or not os.path.isdir(where) or timeout <= 0:
        return []
    now = time.time() if now is None else now
    out = []
    for name in os.listdir(where):
        if not (name.startswith("rank") and name.endswith(".beat")):
            continue
        path = os.path.join(where, name)
        if os.path.exists(path[:-5] + ".exit"):
            continue
        try:
            age = now - os.stat(path).st_mtime
            if age <= timeout:
                continue
            with open(path) as f:
                info = json.load(f)
            if int(name[4:-5]) in ended:
                continue
            out.append({"rank": int(name[4:-5]), "host": info.get("host", "?"), "pid": info.get("pid"), "age": age})
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda r: -r["age"])


def write_exit(code: int) -> None:
    """Record this rank's exit status for the supervisor (no-op outside one): DeepSpeed's runner turns a launcher
    killed by a signal into exit 0, and a rank reparented away from its launcher is reaped unseen."""
    where = os.environ.get(ENV_FATAL_DIR)
    if not where:
        return
    try:
        with open(os.path.join(where, f"rank{int(os.environ.get('RANK', '0') or 0)}.exit"), "w") as f:
            f.write(str(int(code)))
    except (OSError, ValueError):
        pass


def read_exit_records(where: Optional[str]) -> dict[int, tuple[int, float]]:
    """rank -> (the exit status it recorded with :func:`write_exit`, when: the record's mtime, wall clock)."""
    out = {}
    if where and os.path.isdir(where):
        for name in os.listdir(where):
            if name.startswith("rank") and name.endswith(".exit"):
                path = os.path.join(where, name)
                try:
                    with open(path) as f:
                        out[int(name[4:-5])] = (int(f.read().strip()), os.stat(path).st_mtime)
                except (OSError, ValueError):
                    continue
    return out


def read_exits(where: Optional[str]) -> dict[int, int]:
    """rank -> the exit status it recorded (:func:`write_exit`)."""
    return {rank: code for rank, (code, _) in read_exit_records(where).items()}


def read_fatal(where: Optional[str]) -> Optional[dict]:
    """The first (earliest) fatal record of the run's ranks in ``where``, with ``printed`` true when any rank
    printed its message; None when no rank wrote one."""
    if not where or not os.path.isdir(where):
        return None
    found = []
    for name in os.listdir(where):
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(where, name)) as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(rec, dict) and isinstance(rec.get("message"), str):
                found.append(rec)
    if not found:
        return None
    return {**min(found, key=lambda r: (r.get("time", 0), r.get("rank", 0))),
            "printed": any(r.get("printed") for r in found)}


def launcher_status(rc: int) -> int:
    """The supervisor's exit status for the launcher's return code: a signal death -N is 128+N, and so is the
    ``deepspeed`` launcher's 256-N (``sys.exit(-N)`` of a rank killed by signal N)."""
    if rc < 0:
        return 128 - rc
    if 256 - 64 <= rc <= 255:
        return 128 + (256 - rc)
    return rc
