"""One job per rendezvous port on this host: the supervisor's claim on ``--master_port`` and the clean-up of what
DeepSpeed's CPU backend leaves for that port.

    cmd, port, fd = choose_master_port(cmd)    # the deepspeed command with a port held for this run
    ...
    remove_shm_buffers(port); release_port(port, fd)

``--master_port`` of the ``deepspeed`` command, default 29500, must be free on this host: no listening socket,
and no other supervised run holding it (a ``flock`` on ``<tmp>/ds_adaptive.port-<port>.lock`` for the run's
lifetime). A port given explicitly (``MASTER_PORT``) that is busy is :class:`PortInUse`; the default port, when
busy, is replaced by a free one, and the log line says which. Standard library and :mod:`ds_adaptive.core.ports`
only (the supervisor starts before torch).
"""
from __future__ import annotations

import errno
import fcntl
import glob
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Optional

from ds_adaptive.core.ports import free_port

__all__ = ["DEFAULT_MASTER_PORT", "SHM_PREFIX", "PortInUse", "claim_port", "release_port", "choose_master_port",
           "single_node", "remove_shm_buffers", "port_lock_path"]

DEFAULT_MASTER_PORT = 29500
"""DeepSpeed's default rendezvous port (``deepspeed --master_port``)."""
SHM_PREFIX = "/dev/shm/deepspeed_allreduce_buffer"


class PortInUse(RuntimeError):
    """An explicitly chosen rendezvous port is taken on this host (one line, for the user)."""


def port_lock_path(port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"ds_adaptive.port-{port}.lock"


def _listening(port: int) -> bool:
    """Something on this host listens on TCP ``port`` (a bind with SO_REUSEADDR fails: TIME_WAIT does not count)."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
        finally:
            s.close()
    return False


def claim_port(port: int) -> tuple[Optional[int], str]:
    """Hold ``port`` for this run: (file descriptor of the held flock, "") or (None, who has it). The lock file
    is removed by :func:`release_port`; a holder checks that the file it locked is still the one at the path."""
    path = port_lock_path(port)
    for _ in range(10):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:  # another user's lock file: read-only is enough for flock
            fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = ""
            try:
                holder = Path(path).read_text().strip()
            except OSError:
                pass
            os.close(fd)
            return None, f"held by another ds_adaptive run ({holder or 'see ' + str(path)})"
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # its holder removed the file while we opened it: lock the new one
    else:
        return None, f"its lock file {path} keeps changing"
    if _listening(port):
        release_port(port, fd)
        return None, "another program listens on it"
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"supervisor pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    except OSError:
        pass
    return fd, ""


def release_port(port: int, fd: int) -> None:
    """Give up a port claimed by :func:`claim_port` (its lock file removed while still locked)."""
    try:
        os.unlink(port_lock_path(port))
    except OSError:
        pass
    os.close(fd)


def _runner_args(cmd: list[str]) -> Optional[tuple[int, dict]]:
    """For a ``deepspeed`` runner command: (index of the user script, {runner option: value}); else None."""
    if not cmd or (os.path.basename(cmd[0]) != "deepspeed" and "deepspeed.launcher.runner" not in cmd):
        return None
    opts: dict = {}
    i = 1 if os.path.basename(cmd[0]) == "deepspeed" else cmd.index("deepspeed.launcher.runner") + 1
    while i < len(cmd) and cmd[i].startswith("-"):
        key, eq, value = cmd[i].partition("=")
        if eq:
            opts[key] = value
            i += 1
        elif i + 1 < len(cmd) and not cmd[i + 1].startswith("-") and not cmd[i + 1].endswith(".py"):
            opts[key] = cmd[i + 1]
            i += 2
        else:
            opts[key] = True
            i += 1
    return i, opts


def single_node(opts: dict) -> bool:
    """The runner options launch on this host only (no hostfile, DeepSpeed's default /job/hostfile absent)."""
    if opts.get("--hostfile") or opts.get("-H") or os.path.isfile("/job/hostfile"):
        return False
    try:
        return int(opts.get("--num_nodes", 1) or 1) <= 1
    except ValueError:
        return False


def choose_master_port(cmd: list[str], *, default: int = DEFAULT_MASTER_PORT, log=print
                       ) -> tuple[list[str], Optional[int], Optional[int]]:
    """The ``deepspeed`` command with a rendezvous port held for this run: (command, port, lock fd).

    Single node only (multi-node rendezvous is on the first host of the hostfile: port None, command as is).
    ``--master_port P`` given and busy: :class:`PortInUse`. Not given: ``default`` if free, else a free port,
    added to the command as ``--master_port`` and announced through ``log``."""
    parsed = _runner_args(cmd)
    if parsed is None:
        return cmd, None, None
    script_at, opts = parsed
    if not single_node(opts):
        return cmd, None, None
    given = opts.get("--master_port")
    port = int(given) if given not in (None, True) else default
    fd, why = claim_port(port)
    if fd is not None:
        return cmd, port, fd
    if given not in (None, True):
        raise PortInUse(f"MASTER_PORT {port} is in use on this host: {why}; a second job on it fails or joins the "
                        "first one's rendezvous. Choose a free port (MASTER_PORT=...), or leave MASTER_PORT unset to "
                        "have one picked")
    for _ in range(20):
        new = free_port()
        fd, _ = claim_port(new)
        if fd is not None:
            log(f"the default rendezvous port {port} is in use on this host: {why}; this run uses port {new} "
                "(set MASTER_PORT to choose one)")
            return cmd[:script_at] + ["--master_port", str(new)] + cmd[script_at:], new, fd
    raise PortInUse(f"no free rendezvous port found on this host (the default {port} is {why}); set MASTER_PORT")


def remove_shm_buffers(port: int) -> list[str]:
    """Remove DeepSpeed's CPU shared-memory buffers of this user's job on ``port`` (after its ranks ended)."""
    gone = []
    for f in glob.glob(f"{SHM_PREFIX}_{os.getuid()}_*_{port}_*"):
        try:
            os.unlink(f)
            gone.append(f)
        except OSError:
            pass
    return gone
