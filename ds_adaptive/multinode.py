"""Multi-node runs without ssh: the rendezvous from SLURM's or Kubernetes' variables, a per-node launcher, a node watchdog.

    python -m ds_adaptive.multinode env        # shell assignments for launch/train_wan.sh (see below)
    python -m ds_adaptive.multinode launch --nnodes 2 --node-rank 1 --nproc-per-node 8 \\
        --master-addr node-001 --master-port 29500 [--node-timeout 60] -- launch/train_wan.py [trainer args]

Three ways a multi-node job starts (README, "Multi-node"):

* ``deepspeed --hostfile`` over ssh/pdsh (DeepSpeed's runner; not this module);
* one launcher per node, started by the cluster (Kubernetes PyTorchJob / JobSet, or by hand):
  ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (or the operators' ``PET_NNODES``,
  ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``JOB_COMPLETION_INDEX``);
* SLURM: ``srun`` starts one task per node (this launcher) or one per GPU (each task is a rank);
  the rendezvous comes from ``SLURM_STEP_NODELIST`` (its first host), ``SLURM_NODEID``,
  ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS`` and ``SLURM_JOB_ID`` (a port derived from it).

:func:`rendezvous_from_env` turns the variables into a :class:`Rendezvous` (one clear error naming
the variable otherwise); ``env`` prints it for the shell launcher.

The per-node launcher (:class:`NodeLauncher`) starts this node's ranks the way DeepSpeed's per-node
launcher does (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE``, ``CROSS_RANK``, ...), but:

* it never kills the ranks on a stop signal: ``launch/train_wan.sh`` runs it under
  ``ds_adaptive/supervise.py``, which forwards SIGTERM / SIGINT / SIGHUP / SIGUSR1 to the ranks;
  the ranks agree on the step to stop after (an all_reduce over every node), save, exit 75;
* node 0's launcher hosts the job's TCP store on ``MASTER_PORT`` (the ranks use it as clients,
  torchrun's ``TORCHELASTIC_USE_AGENT_STORE``), so the store outlives any rank;
* through that store the launchers watch each other (:class:`NodeWatchdog`): a rank that dies, a
  node whose launcher stops beating (``--node-timeout`` s), or a lost node 0 ends every node's
  ranks within seconds, or ``--node-timeout`` s for a silent node, with one message naming the node
  (index and host) and the rank. NCCL / gloo would otherwise wait for their own timeouts (30 min).

Exit status of ``launch``: the ranks' (0, or 75 after a stop); a failed rank's status (128+N for
signal N) on its node, :data:`EXIT_PEER_FAILED` on the others; 2 for bad arguments.

Standard library only at import (torch's ``TCPStore`` is imported when a launcher starts).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from itertools import product
from typing import Callable, Mapping, Optional

__all__ = ["Rendezvous", "RendezvousError", "expand_hostlist", "slurm_hostnames", "tasks_on_node", "slurm_port",
           "rendezvous_from_env", "NodeLauncher", "NodeWatchdog", "EXIT_PEER_FAILED", "DEFAULT_NODE_TIMEOUT",
           "ENV_REPEAT_SIGNAL", "main"]

EXIT_PEER_FAILED = 1
"""Exit status of a node whose ranks were stopped because another node's rank failed or a node was lost."""
DEFAULT_NODE_TIMEOUT = 60.0
"""Seconds without a heartbeat after which a node counts as lost (``NODE_TIMEOUT``)."""
DEFAULT_PORT = 29500
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000
"""Under SLURM, ``MASTER_PORT`` defaults to ``SLURM_PORT_BASE + SLURM_JOB_ID % SLURM_PORT_SPAN``: the same on every
node of a job without talking, different for jobs that share a node, below the kernel's ephemeral ports."""
ENV_REPEAT_SIGNAL = "DS_ADAPTIVE_REPEAT_SIGNAL"
"""``ignore``: a repeated stop signal does not kill (the scheduler signals every process, and again at its
deadline; it kills on its own). Read by ``ds_adaptive/supervise.py`` and ``ds_adaptive/preempt.py``."""
LAUNCH_MODES = ("auto", "deepspeed", "node", "slurm")
_KEY = "ds_adaptive/watchdog"      # store keys of the launchers (the ranks' own keys have other prefixes)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


class RendezvousError(ValueError):
    """Variables that do not describe a multi-node launch (the message names the variable and the fix)."""


# --- SLURM's variables -----------------------------------------------------------------------

def _split_top(expr: str) -> list[str]:
    """Split at the commas outside brackets: 'gpu[01-03,07],cpu5' -> ['gpu[01-03,07]', 'cpu5']."""
    parts, depth, cur = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise RendezvousError(f"host list {expr!r}: a ']' without its '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise RendezvousError(f"host list {expr!r}: a '[' without its ']'")
    parts.append("".join(cur))
    return parts


def _expand_ranges(body: str, expr: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07'] (zero padding of the lower bound kept, as SLURM does)."""
    out = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise RendezvousError(f"host list {expr!r}: '[{body}]' has {item!r}, not a number or a range N-M")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise RendezvousError(f"host list {expr!r}: range {item!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist(expr: str) -> list[str]:
    """SLURM's compressed host list -> host names, in order (what ``scontrol show hostnames`` prints).

    ``gpu[01-03,07],cpu5`` -> gpu01 gpu02 gpu03 gpu07 cpu5; several bracket groups in one name expand
    as a product (``r[1-2]-n[1-2]`` -> r1-n1 r1-n2 r2-n1 r2-n2)."""
    if not expr or not expr.strip():
        raise RendezvousError("host list is empty")
    hosts: list[str] = []
    for item in _split_top(expr.strip()):
        if not item:
            raise RendezvousError(f"host list {expr!r}: an empty entry (two commas in a row?)")
        pieces = re.split(r"(\[[^\]]*\])", item)
        choices = [_expand_ranges(p[1:-1], expr) if p.startswith("[") else [p] for p in pieces]
        hosts.extend("".join(c) for c in product(*choices))
    return hosts


def slurm_hostnames(expr: str, *, scontrol: Optional[str] = "auto") -> list[str]:
    """Host names of a SLURM node list: ``scontrol show hostnames`` where SLURM is installed (it knows
    every syntax of the site's version), else :func:`expand_hostlist`."""
    exe = shutil.which("scontrol") if scontrol == "auto" else scontrol
    if exe:
        try:
            out = subprocess.run([exe, "show", "hostnames", expr], capture_output=True, text=True, timeout=30)
            hosts = out.stdout.split()
            if out.returncode == 0 and hosts:
                return hosts
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_hostlist(expr)


def tasks_on_node(spec: str, node: int) -> int:
    """Tasks on node ``node`` from SLURM's ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE``
    format: ``2(x3),1`` = 2 tasks on each of the first three nodes, 1 on the fourth."""
    counts: list[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise RendezvousError(f"tasks per node {spec!r}: {item!r} is not 'N' or 'N(xK)'")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    if not 0 <= node < len(counts):
        raise RendezvousError(f"tasks per node {spec!r} describes {len(counts)} node(s), not node {node}")
    return counts[node]


def slurm_port(job_id: int) -> int:
    """The rendezvous port of SLURM job ``job_id`` (see :data:`SLURM_PORT_BASE`)."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


# --- the rendezvous --------------------------------------------------------------------------

@dataclass(frozen=True)
class Rendezvous:
    """Where this node (or this task) sits in a multi-node job, and how its ranks meet."""

    mode: str
    """``node``: this process launches the node's ranks (per-node launch, SLURM one task per node);
    ``task``: this process is one rank (SLURM one task per GPU); ``deepspeed``: no multi-node variables
    (single node, or a DeepSpeed hostfile)."""
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    rank: Optional[int] = None
    """``task`` mode: the global rank (``SLURM_PROCID``)."""
    local_rank: Optional[int] = None
    world_size: Optional[int] = None
    local_size: Optional[int] = None
    scheduler: str = ""
    """``slurm``, ``kubernetes`` or ``env``: where the values came from."""
    origin: dict = field(default_factory=dict, compare=False)
    """Value -> the variable it came from (for the log line)."""

    def shell(self) -> str:
        """``export K=V`` lines for ``eval`` in launch/train_wan.sh."""
        values = {"LAUNCH_MODE": self.mode}
        if self.mode != "deepspeed":
            values.update(NNODES=self.nnodes, NODE_RANK=self.node_rank, MASTER_ADDR=self.master_addr,
                          MASTER_PORT=self.master_port, DS_ADAPTIVE_SCHEDULER=self.scheduler)
        if self.mode == "task":
            values.update(RANK=self.rank, LOCAL_RANK=self.local_rank, WORLD_SIZE=self.world_size,
                          LOCAL_SIZE=self.local_size, LOCAL_WORLD_SIZE=self.local_size, CROSS_RANK=self.node_rank,
                          CROSS_SIZE=self.nnodes, GROUP_RANK=self.node_rank)
        if self.scheduler == "slurm":
            values[ENV_REPEAT_SIGNAL] = "ignore"
        return "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in values.items())

    def describe(self) -> str:
        if self.mode == "deepspeed":
            return "no multi-node variables: DeepSpeed's launcher"
        src = ", ".join(f"{k} from {self.origin[k]}" for k in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
                        if k in self.origin and self.origin[k] != k)
        who = (f"rank {self.rank} of {self.world_size} (local rank {self.local_rank}) on node {self.node_rank} of "
               f"{self.nnodes}" if self.mode == "task" else f"node {self.node_rank} of {self.nnodes}")
        return f"{who}, rendezvous {self.master_addr}:{self.master_port}" + (f" ({src})" if src else "")


def _int_var(env: Mapping[str, str], names: tuple, what: str, *, lo: int = 0, origin: dict,
             default: Optional[int] = None, hint: str = "") -> int:
    for name in names:
        raw = env.get(name, "").strip()
        if raw:
            try:
                value = int(raw)
            except ValueError:
                raise RendezvousError(f"{name}={raw!r} is not a whole number ({what})") from None
            if value < lo:
                raise RendezvousError(f"{name}={value}: {what} must be >= {lo}")
            origin[what] = name
            return value
    if default is None:
        raise RendezvousError(f"{' / '.join(names)} is not set: {what} is needed{hint}")
    return default


def _str_var(env: Mapping[str, str], names: tuple, what: str, origin: dict) -> Optional[str]:
    for name in names:
        raw = env.get(name, "").strip()
        if raw:
            origin[what] = name
            return raw
    return None


def _check_port(port: int, name: str) -> int:
    if not 1 <= port <= 65535:
        raise RendezvousError(f"{name}={port} is not a TCP port (1-65535)")
    return port


def _from_node_env(env: Mapping[str, str]) -> Rendezvous:
    origin: dict = {}
    nnodes = _int_var(env, ("NNODES", "PET_NNODES"), "NNODES", lo=1, origin=origin,
                      hint=" (the number of nodes; Kubeflow's PyTorchJob sets PET_NNODES)")
    node_rank = _int_var(env, ("NODE_RANK", "PET_NODE_RANK", "JOB_COMPLETION_INDEX"), "NODE_RANK", origin=origin,
                         default=0 if nnodes == 1 else None,
                         hint=" (this node's index 0..NNODES-1; Kubernetes: PET_NODE_RANK or an Indexed Job's "
                              "JOB_COMPLETION_INDEX)")
    if node_rank >= nnodes:
        raise RendezvousError(f"{origin['NODE_RANK']}={node_rank} but there are {nnodes} node(s) "
                              f"({origin.get('NNODES', 'NNODES')}): NODE_RANK must be 0..{nnodes - 1}")
    addr = _str_var(env, ("MASTER_ADDR", "PET_MASTER_ADDR"), "MASTER_ADDR", origin)
    if addr is None:
        if nnodes > 1:
            raise RendezvousError(f"MASTER_ADDR is not set: with NNODES={nnodes} every node needs node 0's address "
                                  "(host name or IP reachable from all nodes)")
        addr = "127.0.0.1"
    port = _check_port(_int_var(env, ("MASTER_PORT", "PET_MASTER_PORT"), "MASTER_PORT", lo=1, origin=origin,
                                default=DEFAULT_PORT), origin.get("MASTER_PORT", "MASTER_PORT"))
    k8s = any(v.startswith("PET_") or v == "JOB_COMPLETION_INDEX" for v in origin.values())
    return Rendezvous("node", nnodes, node_rank, addr, port, scheduler="kubernetes" if k8s else "env", origin=origin)


def _from_slurm_env(env: Mapping[str, str], *, scontrol: Optional[str] = "auto") -> Rendezvous:
    origin: dict = {}
    hint = ": run this under srun inside a SLURM job (launch/slurm/train_wan.sbatch does)"
    job_id = _int_var(env, ("SLURM_JOB_ID", "SLURM_JOBID"), "SLURM_JOB_ID", origin=origin, hint=hint)
    nodelist = _str_var(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"), "nodes", origin)
    if nodelist is None:
        raise RendezvousError("SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is not set" + hint)
    hosts = slurm_hostnames(nodelist, scontrol=scontrol)
    nnodes = _int_var(env, ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"), "NNODES", lo=1,
                      origin=origin, default=len(hosts))
    if nnodes != len(hosts):
        raise RendezvousError(f"{origin.get('nodes')}={nodelist!r} names {len(hosts)} host(s) but "
                              f"{origin.get('NNODES')}={nnodes}")
    node_rank = _int_var(env, ("SLURM_NODEID",), "NODE_RANK", origin=origin, hint=hint)
    if node_rank >= nnodes:
        raise RendezvousError(f"SLURM_NODEID={node_rank} but the step has {nnodes} node(s)")
    addr = _str_var(env, ("MASTER_ADDR",), "MASTER_ADDR", origin) or hosts[0]
    origin.setdefault("MASTER_ADDR", f"the first host of {origin['nodes']}")
    port = _int_var(env, ("MASTER_PORT",), "MASTER_PORT", lo=1, origin=origin, default=slurm_port(job_id))
    origin.setdefault("MASTER_PORT", f"SLURM_JOB_ID {job_id}")
    _check_port(port, "MASTER_PORT")
    ntasks = _int_var(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"), "tasks", lo=1, origin=origin,
                      default=nnodes)
    per_node = _str_var(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"), "tasks per node", origin)
    local = tasks_on_node(per_node, node_rank) if per_node else -(-ntasks // nnodes)
    if ntasks == nnodes and local == 1:  # one task per node: it launches the node's ranks
        return Rendezvous("node", nnodes, node_rank, addr, port, scheduler="slurm", origin=origin)
    rank = _int_var(env, ("SLURM_PROCID",), "RANK", origin=origin, hint=hint)
    local_rank = _int_var(env, ("SLURM_LOCALID",), "LOCAL_RANK", origin=origin, hint=hint)
    if rank >= ntasks or local_rank >= local:
        raise RendezvousError(f"SLURM_PROCID={rank} / SLURM_LOCALID={local_rank} do not fit {ntasks} task(s), "
                              f"{local} on this node")
    return Rendezvous("task", nnodes, node_rank, addr, port, rank=rank, local_rank=local_rank, world_size=ntasks,
                      local_size=local, scheduler="slurm", origin=origin)


def rendezvous_from_env(env: Optional[Mapping[str, str]] = None, *, scontrol: Optional[str] = "auto") -> Rendezvous:
    """The launch described by the environment.

    ``LAUNCH_MODE`` (``auto`` by default) picks the source: ``slurm`` (SLURM's variables; ``auto`` when
    this runs in a SLURM step of more than one task), ``node`` (``NNODES`` / ``NODE_RANK`` /
    ``MASTER_ADDR`` / ``MASTER_PORT``, or Kubernetes operators' ``PET_*`` / ``JOB_COMPLETION_INDEX``;
    ``auto`` when ``NNODES``, ``NODE_RANK`` or ``PET_NNODES`` is set), ``deepspeed`` (none of these:
    single node or a DeepSpeed hostfile). Raises :class:`RendezvousError` naming the variable."""
    env = os.environ if env is None else env
    mode = env.get("LAUNCH_MODE", "auto").strip() or "auto"
    if mode not in LAUNCH_MODES:
        raise RendezvousError(f"LAUNCH_MODE={mode!r}: expected one of {', '.join(LAUNCH_MODES)}")
    if mode == "auto":
        slurm_step = env.get("SLURM_JOB_ID") and env.get("SLURM_PROCID") and \
            int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1) > 1
        if slurm_step:
            mode = "slurm"
        elif any(env.get(k, "").strip() for k in ("NNODES", "NODE_RANK", "PET_NNODES")):
            mode = "node"
        else:
            return Rendezvous("deepspeed")
    if mode == "deepspeed":
        return Rendezvous("deepspeed")
    return _from_slurm_env(env, scontrol=scontrol) if mode == "slurm" else _from_node_env(env)


# --- the node watchdog -----------------------------------------------------------------------

def _key(*parts) -> str:
    return "/".join((_KEY, *map(str, parts)))


def _ranks_of(node: int, nproc: int) -> str:
    first = node * nproc
    return f"rank {first}" if nproc == 1 else f"ranks {first}-{first + nproc - 1}"


class NodeWatchdog:
    """Heartbeats of the node launchers through the job's TCP store, in a thread of each launcher (a
    store call never blocks the launcher's own loop).

    Every launcher increments ``hb/<node>`` each ``interval`` s and reads every node's counter and
    ``done/<node>`` (0 while it runs, its exit status + 1 once its ranks ended) in one ``multi_get``, and
    the job's ``abort`` message: three requests per node and beat. A node whose counter stops moving
    for ``timeout`` s (after it moved once: nodes start at different times) and that is not done is
    lost: published as ``abort``, first writer wins. A launcher that cannot reach the store (a closed
    connection: node 0's launcher, which holds it, is gone) or gets no answer for ``timeout`` s has
    lost node 0."""

    def __init__(self, store, *, node: int, nnodes: int, nproc: int, master: str, timeout: float,
                 interval: float = 1.0) -> None:
        self.store = store.clone()  # its own connection: the launcher's thread uses the original
        self.node, self.nnodes, self.nproc, self.master = node, nnodes, nproc, master
        self.timeout, self.interval = timeout, interval
        self.last_ok = time.monotonic()
        self.error: Optional[str] = None
        self.remote_abort: Optional[str] = None
        self.hosts: dict[int, str] = {}
        self._seen: dict[int, tuple[int, float]] = {}
        self._done: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds_adaptive-node-watchdog", daemon=True)

    def start(self) -> "NodeWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def name(self, node: int) -> str:
        """'node K (host, ranks a-b)'."""
        return f"node {node} ({self.hosts.get(node, '?')}, {_ranks_of(node, self.nproc)})"

    def _run(self) -> None:
        try:
            for k in range(self.nnodes):  # every key exists before the first multi_get (which would wait)
                self.store.add(_key("hb", k), 0)
                self.store.add(_key("done", k), 0)
        except Exception as exc:  # noqa: BLE001 - see below
            self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        while not self._stop.is_set():
            try:
                self.store.add(_key("hb", self.node), 1)
                self._check_peers()
                if self.store.check([_key("abort")]):
                    self.remote_abort = self.store.get(_key("abort")).decode()
                self.last_ok = time.monotonic()
                self.error = None
            except Exception as exc:  # noqa: BLE001 - a closed or refused connection: node 0 is gone
                self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self._stop.wait(self.interval)

    def _check_peers(self) -> None:
        now = time.monotonic()
        n = self.nnodes
        values = [int(v) for v in self.store.multi_get([_key("hb", k) for k in range(n)] +
                                                       [_key("done", k) for k in range(n)])]
        for k in range(n):
            beats, done = values[k], values[n + k]
            if k == self.node or k in self._done:
                continue
            if done:
                self._done.add(k)
                continue
            if beats and k not in self.hosts and self.store.check([_key("host", k)]):
                self.hosts[k] = self.store.get(_key("host", k)).decode()
            last = self._seen.get(k)
            if last is None or beats != last[0]:
                self._seen[k] = (beats, now)
            elif beats > 0 and now - last[1] > self.timeout:
                self.store.compare_set(_key("abort"), "", f"{self.name(k)} stopped responding: no heartbeat from "
                                       f"its launcher for {now - last[1]:.0f} s (node timeout {self.timeout:g} s); "
                                       "the node died or is cut off")

    def silent_nodes(self, seconds: float) -> list[int]:
        """Nodes not done whose heartbeat has not moved for ``seconds`` (after it moved once)."""
        now = time.monotonic()
        return [k for k, (beats, t) in sorted(list(self._seen.items()))
                if k not in self._done and beats > 0 and now - t > seconds]

    def abort_message(self) -> Optional[str]:
        """Why the job must end: another launcher's message, or node 0 lost (None while all is well)."""
        if self.remote_abort:
            return self.remote_abort
        lost = time.monotonic() - self.last_ok
        if self.node != 0 and (self.error and lost > min(5.0, self.timeout) or lost > self.timeout):
            why = self.error or f"no answer for {lost:.0f} s"
            return (f"lost node 0 ({self.master}, {_ranks_of(0, self.nproc)}; its launcher holds the job's "
                    f"rendezvous store): {why}")
        return None


# --- the per-node launcher -------------------------------------------------------------------

def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


class NodeLauncher:
    """Starts ``nproc`` ranks of ``script`` on node ``node_rank`` of ``nnodes`` and watches them and the
    other nodes (see the module doc). :meth:`run` returns the node's exit status."""

    FAILURE_GRACE = 3.0
    """Seconds a rank's non-zero exit waits before this node reports it: a root cause elsewhere (a rank
    killed by a signal, a lost node) is reported instead of the collective errors it caused here."""
    KILL_GRACE = 3.0
    """Seconds the ranks get to end on their own once the job is aborted, before SIGKILL."""

    def __init__(self, script: list[str], *, nnodes: int, node_rank: int, nproc: int, master_addr: str,
                 master_port: int, node_timeout: float = DEFAULT_NODE_TIMEOUT, connect_timeout: float = 900.0,
                 python: str = sys.executable, log: Optional[Callable[[str], None]] = None) -> None:
        self.script, self.python = script, python
        self.nnodes, self.node, self.nproc = nnodes, node_rank, nproc
        self.master_addr, self.master_port = master_addr, master_port
        self.node_timeout, self.connect_timeout = node_timeout, connect_timeout
        self.log = log or (lambda msg: print(f"ds_adaptive node {node_rank}: {msg}", file=sys.stderr, flush=True))
        self.procs: list[subprocess.Popen] = []
        self.signals: list[int] = []
        self.host = socket.gethostname()
        self.store = None

    def rank_env(self, local_rank: int, base: Mapping[str, str]) -> dict:
        """What DeepSpeed's per-node launcher sets (plus torchrun's names), and the agent-store switch:
        every rank, rank 0 too, is a client of node 0's launcher's store."""
        env = dict(base)
        env.update(RANK=str(self.node * self.nproc + local_rank), LOCAL_RANK=str(local_rank),
                   WORLD_SIZE=str(self.nnodes * self.nproc), LOCAL_SIZE=str(self.nproc),
                   LOCAL_WORLD_SIZE=str(self.nproc), CROSS_RANK=str(self.node), CROSS_SIZE=str(self.nnodes),
                   GROUP_RANK=str(self.node), NODE_RANK=str(self.node), NNODES=str(self.nnodes),
                   MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port),
                   TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
        return env

    def _connect(self):
        """Node 0 opens the store on MASTER_PORT, the others connect to it (waiting for node 0 to start)."""
        from datetime import timedelta

        from torch.distributed import TCPStore

        timeout = timedelta(seconds=self.connect_timeout)
        try:
            if self.node == 0:
                return TCPStore(self.master_addr, self.master_port, is_master=True, wait_for_workers=False,
                                timeout=timeout)
            return TCPStore(self.master_addr, self.master_port, is_master=False, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - torch raises DistNetworkError / DistStoreError / RuntimeError
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if self.node == 0:
                raise RendezvousError(f"cannot open the job's rendezvous store on port {self.master_port} of this "
                                      f"node ({first}): is the port taken (another job)? Pick another MASTER_PORT "
                                      "on every node") from None
            raise RendezvousError(f"cannot reach node 0's rendezvous store at {self.master_addr}:{self.master_port} "
                                  f"within {self.connect_timeout:g} s ({first}): is node 0 running, MASTER_ADDR "
                                  "reachable from this node and the port open?") from None

    def _on_signal(self, signum, _frame) -> None:
        self.signals.append(signum)

    def _handle_signals(self, handled: int) -> int:
        """Under ds_adaptive/supervise.py (train_wan.sh) the supervisor forwards stop signals to the ranks
        itself and this launcher only outlives them; alone, it forwards the first one to its ranks."""
        under_supervisor = bool(os.environ.get("DS_ADAPTIVE_SUPERVISOR_PID"))
        while handled < len(self.signals):
            signum = self.signals[handled]
            handled += 1
            if under_supervisor or handled > 1:
                continue
            for p in self.procs:
                if p.poll() is None:
                    p.send_signal(signum)
            self.log(f"{signal.Signals(signum).name}: forwarded to this node's ranks; they stop after the step "
                     "every rank agrees on")
        return handled

    def run(self) -> int:
        base_env = dict(os.environ)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # a closed store connection is our message, not c10d's
        self.store = self._connect()  # a stop signal meanwhile ends this process (default action): nothing to save
        self.store.set(_key("host", self.node), self.host)
        dog = NodeWatchdog(self.store, node=self.node, nnodes=self.nnodes, nproc=self.nproc,
                           master=f"{self.master_addr}:{self.master_port}", timeout=self.node_timeout).start()
        for s in STOP_SIGNALS:
            signal.signal(s, self._on_signal)
        for local in range(self.nproc):
            self.procs.append(subprocess.Popen([self.python, "-u", *self.script], env=self.rank_env(local, base_env)))
        self.log(f"{self.host}: started {_ranks_of(self.node, self.nproc)} of {self.nnodes * self.nproc} (pids "
                 f"{', '.join(str(p.pid) for p in self.procs)}); rendezvous {self.master_addr}:{self.master_port}")
        try:
            aborted, own_status = self._watch(dog)
        finally:
            self._kill_ranks()
        codes = [p.returncode for p in self.procs]
        if aborted:  # the failed rank's status on its node, EXIT_PEER_FAILED on the others
            code = own_status if own_status is not None else EXIT_PEER_FAILED
        else:
            code = 75 if 75 in codes else 0
        self._mark_done(code)
        if self.node == 0:
            missing = self._wait_for_peers(min(10.0, self.node_timeout) if aborted else self.node_timeout,
                                           skip=dog.silent_nodes(2.5 * dog.interval))
            if missing and not aborted:
                self.log(f"node(s) {', '.join(map(str, missing))} did not report their end within "
                         f"{self.node_timeout:g} s")
        dog.stop()
        return code

    def _watch(self, dog: NodeWatchdog) -> tuple[Optional[str], Optional[int]]:
        """Until every local rank has exited. Returns the message that ended the job (None: a normal end)
        and, when a rank of this node was its cause, that rank's exit status."""
        handled, failed_at, own_status = 0, None, None
        while True:
            handled = self._handle_signals(handled)
            codes = [p.poll() for p in self.procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0, 75)]
            aborted = dog.abort_message()
            if aborted:
                break
            if bad:
                failed_at = failed_at or time.monotonic()
                i, c = min(bad, key=lambda ic: (ic[1] >= 0, ic[0]))  # a signal death first: the likely root cause
                if c < 0 or time.monotonic() - failed_at > self.FAILURE_GRACE:
                    mine = self._rank_failure(dog, i, c)
                    aborted = self._publish(dog, mine)
                    own_status = _status(c) if aborted == mine else None
                    break
            elif all(c is not None for c in codes):
                return None, None
            time.sleep(0.2)
        alive = [i for i, p in enumerate(self.procs) if p.poll() is None]
        ranks = [self.node * self.nproc + i for i in alive]
        self.log(f"{aborted}; ending the job" + (f": stopping this node's rank(s) {', '.join(map(str, ranks))}"
                                                 if ranks else ""))
        deadline = time.monotonic() + self.KILL_GRACE
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.1)
        return aborted, own_status

    def _rank_failure(self, dog: NodeWatchdog, local: int, code: int) -> str:
        msg = (f"node {self.node} ({self.host}) rank {self.node * self.nproc + local} (local rank {local}, pid "
               f"{self.procs[local].pid}) {_describe_exit(code)}")
        silent = dog.silent_nodes(2.5 * dog.interval) if code > 0 else []
        if silent:  # its collectives broke because a node vanished: name that node first
            return (f"{', '.join(dog.name(k) for k in silent)} stopped responding (no heartbeat for "
                    f"{2.5 * dog.interval:g}+ s) and {msg}")
        return msg

    def _publish(self, dog: NodeWatchdog, message: str) -> str:
        """The job's abort message: ours, unless another launcher's came first."""
        if dog.error is not None:
            return message
        try:
            return self.store.compare_set(_key("abort"), "", message).decode()
        except Exception:  # noqa: BLE001 - the store is gone
            return message

    def _mark_done(self, code: int) -> None:
        try:
            self.store.add(_key("done", self.node), code + 1)
        except Exception:  # noqa: BLE001 - node 0 is gone; nobody waits for this node
            pass

    def _wait_for_peers(self, timeout: float, skip: list[int]) -> list[int]:
        """Node 0 holds the store until every node (but the silent ones in ``skip``) said it is done, or
        ``timeout`` s; returns those that did not."""
        deadline = time.monotonic() + timeout
        missing = [k for k in range(1, self.nnodes) if k not in skip]
        while missing and time.monotonic() < deadline:
            missing = [k for k in missing if not self.store.add(_key("done", k), 0)]
            if missing:
                time.sleep(0.2)
        return missing

    def _kill_ranks(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


# --- command line ----------------------------------------------------------------------------

def _launch(argv: list[str]) -> int:
    if "--" not in argv:
        print("multinode launch: give the training script after '--'", file=sys.stderr)
        return 2
    i = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m ds_adaptive.multinode launch",
                                 usage="%(prog)s --nnodes N --node-rank R --nproc-per-node P --master-addr A "
                                       "--master-port PORT [--node-timeout S] -- SCRIPT [ARGS ...]")
    ap.add_argument("--nnodes", type=int, required=True, help="nodes of the job")
    ap.add_argument("--node-rank", type=int, required=True, help="this node's index, 0..nnodes-1")
    ap.add_argument("--nproc-per-node", type=int, required=True, help="ranks on each node (GPUs)")
    ap.add_argument("--master-addr", required=True, help="node 0's address, reachable from every node")
    ap.add_argument("--master-port", type=int, required=True, help="node 0's rendezvous port (its launcher's store)")
    ap.add_argument("--node-timeout", type=float, default=float(os.environ.get("NODE_TIMEOUT") or DEFAULT_NODE_TIMEOUT),
                    help="seconds without a heartbeat before a node counts as lost (default: $NODE_TIMEOUT, else "
                         f"{DEFAULT_NODE_TIMEOUT:g})")
    ap.add_argument("--connect-timeout", type=float, default=900.0,
                    help="seconds a node waits for node 0's store at start-up (default 900)")
    args = ap.parse_args(argv[:i])
    script = argv[i + 1:]
    if not script:
        ap.error("no training script after '--'")
    problems = [msg for ok, msg in (
        (args.nnodes >= 1, f"--nnodes must be >= 1, got {args.nnodes}"),
        (0 <= args.node_rank < args.nnodes, f"--node-rank must be 0..{args.nnodes - 1}, got {args.node_rank}"),
        (args.nproc_per_node >= 1, f"--nproc-per-node must be >= 1, got {args.nproc_per_node}"),
        (1 <= args.master_port <= 65535, f"--master-port must be a TCP port, got {args.master_port}"),
        (args.node_timeout > 0, f"--node-timeout must be > 0, got {args.node_timeout}")) if not ok]
    if problems:
        ap.error(problems[0])
    launcher = NodeLauncher(script, nnodes=args.nnodes, node_rank=args.node_rank, nproc=args.nproc_per_node,
                            master_addr=args.master_addr, master_port=args.master_port,
                            node_timeout=args.node_timeout, connect_timeout=args.connect_timeout)
    try:
        return launcher.run()
    except RendezvousError as exc:
        launcher.log(f"error: {exc}")
        return 1


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["env"]:
        try:
            rdzv = rendezvous_from_env()
        except RendezvousError as exc:
            print(f"train_wan.sh: {exc}", file=sys.stderr)
            return 2
        print(rdzv.shell(), end="")
        if rdzv.mode != "deepspeed":
            print(f"train_wan.sh: {rdzv.scheduler}: {rdzv.describe()}", file=sys.stderr)
        return 0
    if argv[:1] == ["launch"]:
        return _launch(argv[1:])
    print("usage: python -m ds_adaptive.multinode env | launch ... -- SCRIPT [ARGS]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
