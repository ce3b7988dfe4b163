"""A free TCP port for a rendezvous (``MASTER_PORT``), drawn below the kernel's ephemeral port range.

The kernel hands ephemeral ports (Linux: 32768-60999, ``/proc/sys/net/ipv4/ip_local_port_range``) to every outgoing
connection: gloo's and NCCL's, a TCPStore client's. A port picked there (``bind(("", 0))``) can be taken by such a
connection of another job before this job's rank 0 binds it, and that rank then fails with ``EADDRINUSE``. A port
below the range is only taken by a program that binds it on purpose.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port", "LOWEST"]

#: the lowest port drawn (below: well-known and registered services)
LOWEST = 20000
_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_start() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "", tries: int = 50) -> int:
    """A port that binds on ``host`` now ("": every interface), drawn at random from ``LOWEST`` up to the ephemeral
    range; the kernel's pick where that range leaves too little room or every draw is taken."""
    hi = _ephemeral_start()
    if hi > LOWEST + 1000:
        for port in random.sample(range(LOWEST, hi), tries):
            if _binds(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
