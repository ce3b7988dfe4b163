"""Where a node or a task sits in a multi-node job, from SLURM's or Kubernetes' variables (or NNODES / NODE_RANK).

    rdzv = rendezvous_from_env()      # LAUNCH_MODE, SLURM_*, NNODES / NODE_RANK / MASTER_*, PET_*, JOB_COMPLETION_INDEX
    print(rdzv.shell())               # what `python -m ds_adaptive.launch.multinode env` prints for launch/train_wan.sh

Bad variables raise :class:`RendezvousError`, one line naming the variable, the value and the fix.
Standard library only.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from itertools import product
from typing import Mapping, Optional

__all__ = ["Rendezvous", "RendezvousError", "expand_hostlist", "slurm_hostnames", "tasks_on_node", "slurm_port",
           "rendezvous_from_env", "DEFAULT_PORT", "SLURM_PORT_BASE", "SLURM_PORT_SPAN", "ENV_REPEAT_SIGNAL",
           "LAUNCH_MODES"]

DEFAULT_PORT = 29500
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000
"""Under SLURM, ``MASTER_PORT`` defaults to ``SLURM_PORT_BASE + SLURM_JOB_ID % SLURM_PORT_SPAN``: the same on every
node of a job without talking, different for jobs that share a node, below the kernel's ephemeral ports."""
ENV_REPEAT_SIGNAL = "DS_ADAPTIVE_REPEAT_SIGNAL"
"""``ignore``: a repeated stop signal does not kill (the scheduler signals every process, and again at its
deadline; it kills on its own). Read by ``ds_adaptive/launch/supervise.py`` and ``ds_adaptive/training/preempt.py``."""
LAUNCH_MODES = ("auto", "deepspeed", "node", "slurm")


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
