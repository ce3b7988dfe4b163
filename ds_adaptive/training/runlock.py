"""One run at a time per checkpoint directory: a lock file in ``--save``, and the rule for a stale one.

    lock = RunLock.acquire(save_dir, command="...")   # rank 0 at start-up; RunLockError (one line) if another run holds it
    ...
    lock.release()                                    # at the end; a killed run leaves it, the next run finds it stale

The lock is ``SAVE_DIR/ds_adaptive.lock``, a JSON object: the holder's pid, host name, boot id and process
start time, when the run started, a heartbeat (refreshed every ``HEARTBEAT_S`` by a thread of the holder) and
its command line. A lock is **stale** (taken over, with a note) when:

* its host is this host (same host name and boot id) and its process is gone, or its pid now belongs to a
  process that started later (a reused pid);
* its host is this host after a reboot (same name, another boot id);
* its host is another host and its heartbeat is older than ``STALE_AFTER_S`` (10 minutes, ten missed
  heartbeats; this assumes the hosts' clocks agree to within minutes).

Otherwise it is **live** and a second run into the directory fails at start-up naming the holder. The lock
file is created complete (written to a temporary file, then hard-linked to its name, which fails if the
name exists); starters that race are serialised by ``flock`` on ``.ds_adaptive.lock.guard`` while they look
at, take over or remove a lock; the release deletes the guard file too (a starter that locked the deleted file
notices the new inode and locks the new one).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

__all__ = ["LOCK_NAME", "HEARTBEAT_S", "STALE_AFTER_S", "LockInfo", "RunLock", "RunLockError", "read_lock"]

LOCK_NAME = "ds_adaptive.lock"
HEARTBEAT_S = 60.0
"""Seconds between the holder's refreshes of the lock's heartbeat."""
STALE_AFTER_S = 600.0
"""A lock from another host whose heartbeat is older than this is stale."""


class RunLockError(ValueError):
    """Another live run holds the checkpoint directory (the message names it), or the lock cannot be made."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> Optional[float]:
    """Start time (epoch seconds) of process ``pid``; None when there is no such (running) process."""
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


@dataclass
class LockInfo:
    """The contents of a lock file."""

    pid: int
    host: str
    boot_id: str
    pid_start: float
    """Start time of the holding process (tells a reused pid from the holder)."""
    started: float
    heartbeat: float
    command: str = ""

    @classmethod
    def mine(cls, command: str = "") -> "LockInfo":
        now = time.time()
        return cls(pid=os.getpid(), host=socket.gethostname(), boot_id=_boot_id(),
                   pid_start=_process_start(os.getpid()) or now, started=now, heartbeat=now, command=command)

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {_stamp(self.started)}"

    def same_holder(self, other: "LockInfo") -> bool:
        return (self.pid, self.host, self.boot_id, self.started) == (other.pid, other.host, other.boot_id,
                                                                       other.started)

    def stale_reason(self, now: Optional[float] = None) -> Optional[str]:
        """Why this lock is stale (see the module doc), or None when it is live."""
        now = time.time() if now is None else now
        if self.host == socket.gethostname():
            if self.boot_id and self.boot_id != _boot_id():
                return "this host was rebooted since"
            start = _process_start(self.pid)
            if start is None:
                return f"process {self.pid} is gone"
            if abs(start - self.pid_start) > 1.0:
                return f"pid {self.pid} now belongs to another process"
            return None
        if now - self.heartbeat > STALE_AFTER_S:
            return (f"its heartbeat is {now - self.heartbeat:.0f} s old (a live run on another host refreshes it "
                    f"every {HEARTBEAT_S:.0f} s)")
        return None


def read_lock(save_dir) -> Optional[LockInfo]:
    """The lock of ``save_dir``; None when there is none. RunLockError when the file is unreadable."""
    path = Path(save_dir) / LOCK_NAME
    try:
        data = json.loads(path.read_text())
        return LockInfo(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise RunLockError(f"the run lock {path} is unreadable ({exc}); if no run is using {save_dir}, delete "
                           "the file") from None


@contextlib.contextmanager
def _guard(save_dir: Path, remove: bool = False):
    """flock on the guard file while a lock is looked at and changed (a no-op where flock is unsupported).
    ``remove``: the guard file is deleted before the flock is let go (the run's release: nothing is left in
    ``--save``). A starter that locked a guard file deleted meanwhile opens the new one (inode compared)."""
    path = save_dir / f".{LOCK_NAME}.guard"
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # e.g. a filesystem without locks: the O_EXCL / link creation still decides
            break
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # removed by a releasing run after we opened it: take the new one
    try:
        yield
        if remove:
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _write_new(path: Path, info: LockInfo) -> bool:
    """Create ``path`` holding ``info``, complete or not at all; False when it exists."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(info), indent=1) + "\n")
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links on this filesystem: exclusive create (a reader may see it half-written)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(tmp.read_text())
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _replace(path: Path, info: LockInfo) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(info), indent=1) + "\n")
    os.replace(tmp, path)


class RunLock:
    """The lock this process holds on a checkpoint directory (see the module doc)."""

    def __init__(self, save_dir: Path, info: LockInfo, took_over: Optional[str] = None) -> None:
        self.save_dir = save_dir
        self.path = save_dir / LOCK_NAME
        self.info = info
        self.took_over = took_over
        """A note naming the stale lock this one replaced (None: there was none)."""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def acquire(cls, save_dir, *, command: str = "", heartbeat: bool = True) -> "RunLock":
        """Take the lock of ``save_dir`` (which must exist). Raises :class:`RunLockError` naming the live
        run that holds it."""
        save_dir = Path(save_dir)
        path = save_dir / LOCK_NAME
        info = LockInfo.mine(command)
        took_over = None
        with _guard(save_dir):
            if not _write_new(path, info):
                held = read_lock(save_dir)
                reason = held.stale_reason() if held is not None else "it vanished"
                if reason is None:
                    raise RunLockError(
                        f"{save_dir} is in use by another run ({held.describe()}; lock {path}): two runs writing "
                        "checkpoints into one directory overwrite each other. Wait for it to end, stop it, or "
                        "choose another --save / SAVE_DIR")
                _replace(path, info)
                if held is not None:
                    took_over = f"took over the stale run lock of {held.describe()} ({reason})"
        lock = cls(save_dir, info, took_over)
        if heartbeat:
            lock._thread = threading.Thread(target=lock._beat, name="ds_adaptive-lock-heartbeat", daemon=True)
            lock._thread.start()
        return lock

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.refresh()

    def refresh(self) -> bool:
        """Renew the heartbeat; False (and no more heartbeats) when the file is no longer ours."""
        try:
            with _guard(self.save_dir):
                held = read_lock(self.save_dir)
                if held is None or not held.same_holder(self.info):
                    self._stop.set()
                    return False
                self.info.heartbeat = time.time()
                _replace(self.path, self.info)
            return True
        except (OSError, RunLockError):
            return False

    def release(self) -> None:
        """Remove the lock if it is still this process's."""
        self._stop.set()
        try:
            with _guard(self.save_dir, remove=True):
                held = read_lock(self.save_dir)
                if held is not None and held.same_holder(self.info):
                    self.path.unlink(missing_ok=True)
        except (OSError, RunLockError):
            pass
